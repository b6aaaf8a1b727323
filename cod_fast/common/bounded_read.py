"""Files that cod-fast reads from the user's options, read within a size cap.

A path may name something that is not a file: `/dev/zero` reads for ever, and a named pipe
(FIFO) blocks until some writer opens it. `read_bounded` opens without blocking, refuses
anything but a regular file before it reads a byte, and reads at most the cap plus one byte,
so a file over the cap is refused without being read whole. Each caller turns the refusal into
its own one-line error (a ConfigError naming the field or the file, a CasesError).
"""

from __future__ import annotations

import os
import stat

from cod_fast.common.errors import CodFastError

_KINDS = {
    stat.S_ISDIR: "a folder",
    stat.S_ISFIFO: "a named pipe",
    stat.S_ISCHR: "a character device such as /dev/zero",
    stat.S_ISBLK: "a block device",
    stat.S_ISSOCK: "a socket",
}


class ReadRefused(ValueError, CodFastError):
    """A path that is not a regular file, or a file over the cap; the message says which (not
    the path, nor the fix: the caller's error adds them)."""


def read_bounded(path: str | os.PathLike, cap: int) -> bytes:
    """The bytes of the regular file at `path`, if it holds at most `cap` of them.

    ReadRefused for anything else; OSError as opening or reading raises it (no such file, no
    permission)."""
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS.items() if test(mode)), "not a file")
            raise ReadRefused(f"{kind}, not a regular file")
        if os.fstat(fd).st_size > cap:  # refused unread; the read below bounds a growing file
            raise ReadRefused(f"more than {cap} bytes")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(cap + 1)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise ReadRefused(f"more than {cap} bytes")
    return data
