"""Writing into a folder someone else may have made: nothing is written through a symbolic link.

A run directory can come from another person (`cod-fast train --resume` on a colleague's run),
and an export folder or its neighbours from anyone: their entries are input, and a link among
them must not make cod-fast write, truncate or delete outside the folder. The folder itself, as
the user names it, may be a link (the user chose it); what lies inside it may not. Where cod-fast
would write into, create or append to an entry that is a link, these helpers raise LinkError
(one line naming the entry, where it points and the fix) before anything is written; where it
clears an entry out of the way, a link is removed itself, never what it points to.

The open calls carry `O_NOFOLLOW`, and temporary files `O_EXCL` too, so a link that appears
between a check and the write is refused by the kernel rather than followed. A rename replaces
a link at its destination, never the link's target: that is why an atomic write is safe where
the final name is a link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from cod_fast.common.errors import CodFastError


class LinkError(OSError, CodFastError):
    """An entry cod-fast would write through is a symbolic link; the message names it, where it
    points and the fix."""


def _refuse(path: Path) -> None:
    try:
        target = os.readlink(path)
    except OSError:  # gone again since the check
        target = "?"
    raise LinkError(
        f"{path} is a symbolic link (to {target}); cod-fast writes nothing through a link in a "
        f"folder it was given: remove the link (rm {shlex.quote(str(path))}) or write to a new "
        "folder (runtime.run_dir, --out)"
    )


def _refuse_link(path: Path) -> None:
    if os.path.islink(path):
        _refuse(path)


def check_inside(root: str | Path, path: str | Path) -> None:
    """Refuse when `path`, or a folder between `root` and it, is a symbolic link (`root` itself
    may be one). Entries are looked at with lstat; nothing below a missing one exists yet."""
    entry = Path(root)
    for part in Path(path).relative_to(root).parts:
        entry = entry / part
        try:
            mode = os.lstat(entry).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return
        if stat.S_ISLNK(mode):
            _refuse(entry)


def check_entries(folder: str | Path) -> None:
    """Refuse when an entry directly in `folder` is a symbolic link: the check a writer makes
    once, before its first write, so that a link is named at the start rather than when the
    first file behind it is written."""
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.is_symlink():
                _refuse(Path(folder) / entry.name)


def make_folder(root: str | Path, path: str | Path) -> Path:
    """`path` as a real folder below `root`, made with its parents where missing."""
    check_inside(root, path)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def remove(path: str | Path) -> None:
    """Remove `path`, whatever it is: a link itself (never what it points to), a folder with
    what it holds (links in it removed, not followed), a file; nothing when it is absent."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def fresh_folder(path: str | Path) -> Path:
    """A new empty folder at `path` (its parents made where missing), in place of a stale one a
    killed write left; a link there is refused."""
    path = Path(path)
    _refuse_link(path)
    remove(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()  # fails, never follows, if anything took the place since
    return path


def open_fd(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """`os.open` that refuses a link at `path` instead of following it (`O_NOFOLLOW`)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EEXIST):
            _refuse_link(Path(path))
        raise


def open_append(path: str | Path) -> TextIO:
    """`path` opened to append text (created if missing); a link there is refused."""
    return os.fdopen(open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")


def temp_path(path: str | Path) -> Path:
    """Where an atomic write of `path` puts its temporary file."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


@contextlib.contextmanager
def _temp_file(path: Path) -> Iterator[tuple[Path, int]]:
    """A new empty temporary file beside `path` (hidden: `.NAME.tmp`) and its descriptor (a
    stale one a killed write left is removed first, a link there refused); renamed over `path`
    once the block ends, removed if it fails."""
    tmp = temp_path(path)
    _refuse_link(tmp)
    remove(tmp)
    fd = open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        yield tmp, fd
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """A new empty file for a writer that takes a file name (safetensors, torch.save); once the
    block ends it replaces `path` in one rename, so a reader sees the old file or the new one."""
    with _temp_file(Path(path)) as (tmp, fd):
        os.close(fd)
        yield tmp


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` through a temporary file renamed into place."""
    with _temp_file(Path(path)) as (_, fd), os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
