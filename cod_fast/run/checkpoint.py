"""Atomic checkpoints and bit-for-bit resume (model in safetensors, optimizer, RNG, step, data).

A checkpoint is written into a hidden temporary folder, fsynced, completed by its `meta.json`
(written last) and renamed into place; the `latest` pointer is replaced atomically after it. An
interruption at any moment leaves a loadable checkpoint: rewriting a step that already has one
first moves the old folder aside, and `latest_checkpoint` takes the new folder, or else the
old one, from where they lie when a kill fell between the two renames. The next save moves such
a folder into its place and removes what is left. One process writes full states
(`save_checkpoint`); under torchrun every rank writes its shards (cod_fast.run.sharded) between
`begin_checkpoint` and the main rank's `finish_checkpoint`. Either loads at any world size
(`read_model_state` gathers shards whole). Per-rank state (random number generators, the
sampler's generator) travels as one entry per rank. Restoring the RNG sets every generator the
run uses (python, numpy, torch CPU and CUDA), so a resumed run on the CPU continues exactly as
the uninterrupted one would have.

Nothing in a run directory is trusted to run code: the `.pt` files hold tensors and plain data
only and load with `torch.load(weights_only=True)`, the model is safetensors, the rest JSON, and
`latest` must name a checkpoint folder of the run (no path elsewhere). Nothing outside the run
directory is read or deleted through it: a step folder, a file in one, or `latest` that is a
symbolic link is refused wherever it points (inside the run too: one rule, no path resolving),
and rotation (`keep`) passes such links by. Nothing is written through one either: a save
refuses a `checkpoints` folder, a temporary folder or file that is a link (cod_fast.common.safe_write).
The run directory itself may be a link (to a larger disk, say).

A damaged checkpoint is refused with one line naming the file and the damage (missing; cut
short of the size `meta.json` records for it; unreadable; a torn `meta.json`; model weights
that are NaN or infinite), and the newest older intact checkpoint of the run to use instead.
So is one whose files read but do not hold what their readers take, since a run directory may
come from someone else: a `meta.json` field of another type, or a state its owner refuses as
it takes it back (`restoring`: weights that do not fit the model, an optimizer state that does
not fit the optimizer, a generator state no generator takes, a replay pool of other records).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from cod_fast.common.errors import CodFastError
from cod_fast.common.rng import rng_state
from cod_fast.common.safe_write import LinkError, fresh_folder, make_folder, remove, write_atomic
from cod_fast.common.values import described, first_words, is_count, write_cause
from cod_fast.run.sharded import (
    INDEX,
    PLAIN,
    RANK_FILE,
    Damage,
    check_stored,
    gather_model,
    gather_optimizer,
    load_weights,
    read_index,
    read_json,
    read_plain,
    unseen,
    write_shared_files,
)

MAX_META_BYTES = 2**24
"""The largest meta.json read: the run's config and a step's metrics take a few KB."""
LATEST = "latest"
META = "meta.json"
FILES = ("model.safetensors", "optimizer.pt", "ranks.pt")
"""What a checkpoint folder holds besides its meta.json."""
SHARDED_FILES = (INDEX, PLAIN, "ranks.pt")
"""What a checkpoint in rank shards holds besides its meta.json and the rank files."""
_NAME = re.compile(r"step-\d{7}")


class CheckpointError(RuntimeError, CodFastError):
    """A checkpoint cannot be written (disk full, read-only) or read safely."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    extra: dict[str, Any]
    sizes: dict[str, int] = field(default_factory=dict)
    """Each file's size when it was written (empty for checkpoints of older versions)."""
    sharded: bool = False
    """In rank shards (cod_fast.run.sharded), as a run under torchrun writes it."""

    @property
    def model_file(self) -> str:
        """The file that says what the model state holds (named by `restoring`)."""
        return INDEX if self.sharded else "model.safetensors"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    *,
    rank_states: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
    keep: int = 0,
) -> Path:
    """Write checkpoint `step` under run_dir/checkpoints and point `latest` at it.

    `rank_states[r]` is rank r's own state (RNG, sampler); `extra` is JSON (data position, phase).
    `keep` > 0 deletes all but the newest `keep` checkpoints afterwards. A write that fails (disk
    full, read-only) raises CheckpointError naming the folder and the cause; the checkpoints
    already there stay as they were.
    """
    tmp = begin_checkpoint(run_dir, step)
    try:
        # safetensors wants contiguous tensors that share no storage; the caller's state
        # already holds each tied weight once.
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in model_state.items()},
            tmp / "model.safetensors",
        )
        torch.save(optimizer_state, tmp / "optimizer.pt")
    except (OSError, RuntimeError, SafetensorError) as exc:
        abandon_checkpoint(tmp)
        raise CheckpointError(write_failure(tmp.parent, step, exc)) from exc
    return finish_checkpoint(run_dir, step, tmp, rank_states=rank_states, extra=extra, keep=keep)


def begin_checkpoint(run_dir: str | Path, step: int) -> Path:
    """The empty temporary folder checkpoint `step` is written into, once what a killed save
    left is finished; CheckpointError naming the cause if it cannot be made."""
    root = Path(run_dir) / "checkpoints"
    tmp = _tmp(root / f"step-{step:07d}")
    try:
        make_folder(run_dir, root)  # nothing is written through a link (cod_fast.common.safe_write)
        _finish_half_moved(root)
        return fresh_folder(tmp)
    except OSError as exc:
        raise CheckpointError(write_failure(root, step, exc)) from exc


def abandon_checkpoint(tmp: Path) -> None:
    """Remove a temporary folder whose checkpoint failed (never following a link)."""
    shutil.rmtree(tmp, ignore_errors=True)


def finish_checkpoint(
    run_dir: str | Path,
    step: int,
    tmp: Path,
    *,
    rank_states: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
    keep: int = 0,
    shards: tuple[list[dict[str, Any]], int, dict[str, Any]] | None = None,
) -> Path:
    """Complete the checkpoint written into `tmp` (begin_checkpoint's) and put it in place.

    Writes ranks.pt, and for a checkpoint in rank shards (`shards`: the writing ranks' reports,
    the world size, the optimizer's plain part) index.json and optimizer.json; fsyncs every
    file, writes meta.json last with their sizes, renames the folder into place and points
    `latest` at it; `keep` as save_checkpoint. A failure removes `tmp` and raises
    CheckpointError; the checkpoints already there stay as they were."""
    root = Path(run_dir) / "checkpoints"
    final, meta = root / f"step-{step:07d}", {"step": step, "extra": extra or {}}
    try:
        torch.save(rank_states or [rng_state()], tmp / "ranks.pt")
        if shards is not None:
            write_shared_files(tmp, *shards)
            meta["format"] = "sharded"
        sizes = {}
        for file in tmp.iterdir():
            _fsync(file)
            sizes[file.name] = file.stat().st_size  # tells a truncated file from a corrupt one
        if shards is not None and (missing := unseen(tmp, sizes, shards[0])) is not None:
            raise FileNotFoundError(missing)
        (tmp / META).write_text(json.dumps({**meta, "sizes": sizes}))
        _fsync(tmp / META)  # last: a folder with its meta.json is complete
    # A full disk reaches here as OSError, as RuntimeError from torch.save and as
    # SafetensorError from safetensors.
    except (OSError, RuntimeError, SafetensorError) as exc:
        abandon_checkpoint(tmp)
        cause = str(exc) if type(exc) is FileNotFoundError and shards else None
        raise CheckpointError(cause or write_failure(root, step, exc)) from exc
    _publish(root, final, tmp, step, keep)
    return final


def _publish(root: Path, final: Path, tmp: Path, step: int, keep: int) -> None:
    """Rename the complete folder `tmp` into `final`'s place, point `latest` at it, rotate."""
    aside = _aside(final)
    if os.path.lexists(final):  # a rewrite of this step: the old folder stays loadable, aside
        remove(aside)
        final.rename(aside)
    tmp.rename(final)
    try:
        write_atomic(root / LATEST, final.name)
    except OSError as exc:
        raise CheckpointError(write_failure(root, step, exc)) from exc
    _fsync(root)
    for leftover in root.glob(".step-*"):  # this rewrite's old folder, or a killed save's
        shutil.rmtree(leftover, ignore_errors=True)
    if keep > 0:
        for old in _folders(root)[:-keep]:
            shutil.rmtree(old)


def complete_checkpoints(run_dir: str | Path) -> list[str]:
    """The names of the run's complete checkpoint folders (a meta.json each), oldest first,
    whatever `latest` says."""
    root = Path(run_dir) / "checkpoints"
    return sorted(
        p.name for p in root.glob("step-*") if _NAME.fullmatch(p.name) and (p / META).is_file()
    )


def _folders(root: Path) -> list[Path]:
    """The run's checkpoint folders, oldest first; links are not the run's (module docstring)."""
    found = (p for p in root.glob("step-*") if _NAME.fullmatch(p.name))
    return sorted(p for p in found if p.is_dir() and not p.is_symlink())


def _finish_half_moved(root: Path) -> None:
    """Move a complete folder that a kill left beside its place (between the renames of a
    rewrite, or after a finished write) into its place, the newer one first."""
    for leftover in sorted(root.glob(".step-*")):
        final = root / leftover.name[1:].rsplit(".", 1)[0]
        found = None if os.path.lexists(final) else _complete(final)
        if found is not None and not found.is_symlink():  # a link is not the run's
            found.rename(final)


def _complete(final: Path) -> Path | None:
    """Where checkpoint `final` lies complete: in its place, else the newer folder a kill left
    beside it (the rewrite's), else the older one it moved aside; None if nowhere."""
    return next((p for p in (final, _tmp(final), _aside(final)) if (p / META).exists()), None)


def _tmp(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp")


def _aside(final: Path) -> Path:
    return final.with_name(f".{final.name}.old")


def write_failure(root: Path, step: int, exc: BaseException) -> str:
    """The line that says checkpoint `step` could not be written into `root` (a run's
    checkpoints folder), why, and what to do."""
    if isinstance(exc, LinkError):  # no disk at fault: the message names the link and the fix
        return str(exc)
    return (
        f"could not write the checkpoint of step {step} in {root}: {write_cause(root, exc)}; "
        "free disk space or set runtime.run_dir to a writable folder with room, then resume: "
        "the checkpoints already written are intact"
    )


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The checkpoint `latest` points at, or None when the run has none yet."""
    root = Path(run_dir) / "checkpoints"
    if not (root / LATEST).exists():
        return None
    _refuse_link(root / LATEST)
    try:  # a folder name's worth, whatever the file holds (binary junk, gigabytes)
        with open(root / LATEST, "rb") as f:
            name = f.read(64).decode(errors="replace").strip()
    except OSError as exc:  # a folder named `latest`, no permission
        raise CheckpointError(
            f"{root / LATEST} cannot be read ({first_words(exc)}); write the name of a "
            "checkpoint folder of the run (step-NNNNNNN) into it"
        ) from None
    if not _NAME.fullmatch(name):
        raise CheckpointError(
            f"{root / LATEST} names {name[:80]!r}, not a checkpoint folder of this run "
            "(step-NNNNNNN); the run directory was changed by hand or by something else"
        )
    path = _complete(root / name)
    if path is None:
        raise CheckpointError(
            f"{root / LATEST} points at {name}, which is missing or incomplete; resume from "
            "another checkpoint by writing its folder name into that file"
        )
    return _open(path, int(name.removeprefix("step-")))


def checkpoint_at(run_dir: str | Path, step: int) -> Checkpoint | None:
    """Checkpoint `step` of the run, or None when the run has no complete folder of it."""
    path = _complete(Path(run_dir) / "checkpoints" / f"step-{step:07d}")
    return None if path is None else _open(path, step)


def _open(folder: Path, step: int) -> Checkpoint:
    """The checkpoint in `folder` (complete: it has a meta.json), its files checked as far as
    a stat can, so that a damaged one is refused before anything is built or loaded."""
    try:
        meta = _checked_meta(folder, step)
    except Damage as exc:
        raise _damaged(folder.parent, step, exc) from None
    sharded = meta.get("format") == "sharded"
    return Checkpoint(folder, meta["step"], meta["extra"], meta.get("sizes", {}), sharded)


def read_model_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The model's weights, every floating-point value finite (gathered whole from rank
    shards: in one process, as export and a resume without torchrun read them)."""
    if ckpt.sharded:
        return _read(
            ckpt, INDEX, lambda path: gather_model(ckpt.path, read_index(path, ckpt.sizes))
        )
    return _read(ckpt, "model.safetensors", load_weights)


def read_optimizer_state(ckpt: Checkpoint) -> dict[str, Any]:
    """The optimizer's full state (gathered whole from rank shards)."""
    if ckpt.sharded:
        index = _read(ckpt, INDEX, lambda path: read_index(path, ckpt.sizes))
        return _read(ckpt, PLAIN, lambda path: gather_optimizer(ckpt.path, index, read_plain(path)))
    return _read(ckpt, "optimizer.pt", _load_plain)


def read_rank_states(ckpt: Checkpoint) -> list[dict[str, Any]]:
    """Every rank's state (a dict each). What is in them is their owners' to check, as they
    take them back (`restoring`)."""
    return _read(ckpt, "ranks.pt", _load_rank_states)


@contextmanager
def restoring(ckpt: Checkpoint, name: str) -> Iterator[None]:
    """A block that gives what was read from the checkpoint's file `name` back to its owners
    (the model, the optimizer, the generators, the sampler, the batch source). An owner raises
    ValueError, saying what is wrong, for a state that is not one of its own (a damaged or
    edited file); here that becomes the file's one CheckpointError line, as any damage does. So
    does a Damage that a read of the checkpoint's files raises in the block (a rank shard's)."""
    try:
        yield
    except Damage as damage:
        raise _damaged(ckpt.path.parent, ckpt.step, damage) from None
    except ValueError as exc:
        damage = Damage(ckpt.path / name, f"is damaged ({first_words(exc)})")
        raise _damaged(ckpt.path.parent, ckpt.step, damage) from None


def read_weights(path: Path, fix: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file outside a checkpoint (an exported model's), every
    floating-point value finite; else CheckpointError naming the file, the damage and `fix`."""
    try:
        return load_weights(path)
    except Damage as exc:
        raise CheckpointError(f"{exc}; {fix}") from None


def _read(ckpt: Checkpoint, name: str, load: Callable[[Path], Any]) -> Any:
    """`load` of the checkpoint's file `name`; a damaged file is one CheckpointError naming it,
    the damage and the checkpoint to use instead."""
    path = ckpt.path / name
    try:
        _check_file(path, ckpt.sizes.get(name))  # again: it may have changed since the open
        return load(path)
    except Damage as exc:
        raise _damaged(ckpt.path.parent, ckpt.step, exc) from None


def _checked_meta(folder: Path, step: int) -> dict[str, Any]:
    """`folder`'s meta.json (of checkpoint `step`), each field a reader takes of the type it
    takes, after checking that no file of the folder is a link, is missing, or is shorter than
    written (sizes are recorded from this version on)."""
    _refuse_link(folder)
    path = folder / META
    _refuse_link(path)
    meta = read_json(path, "a meta.json", MAX_META_BYTES)
    if not (isinstance(meta, dict) and type(meta.get("step")) is int):
        raise Damage(path, "is valid JSON but holds no step number")
    if meta["step"] != step:
        raise Damage(path, f"says step {meta['step']}, but lies in the folder of step {step}")
    extra = meta.get("extra")
    if not isinstance(extra, dict):
        raise Damage(path, "is valid JSON but holds no `extra` object")
    for key, (fits, what) in _EXTRA.items():
        if key in extra and not fits(extra[key]):
            raise Damage(path, f"holds an `extra.{key}` of {described(extra[key])}, not {what}")
    sizes, sharded = meta.get("sizes", {}), meta.get("format", "full")
    if sharded not in ("full", "sharded"):
        raise Damage(path, f"holds a `format` of {described(sharded)}, not full or sharded")
    if not (isinstance(sizes, dict) and all(map(is_count, sizes.values()))):
        raise Damage(path, "holds `sizes` that are not the byte counts of the folder's files")
    files = FILES
    if sharded == "sharded":  # its rank files are known by their sizes alone
        files = (*SHARDED_FILES, *sorted(n for n in sizes if RANK_FILE.fullmatch(n)))
        if not set(SHARDED_FILES) <= sizes.keys() or len(files) != len(sizes):
            raise Damage(path, "holds `sizes` of other files than a sharded checkpoint's")
    for name in files:
        _check_file(folder / name, sizes.get(name))
    return meta


_DTYPES = ("float32", "bfloat16", "float16")
_EXTRA: dict[str, tuple[Callable[[Any], bool], str]] = {
    "warm_start_steps": (is_count, "a step count"),
    "world_size": (lambda v: is_count(v) and v > 0, "a process count"),
    "compute_dtype": (lambda v: v in _DTYPES, f"one of {', '.join(_DTYPES)}"),
    "master_dtype": (lambda v: v in _DTYPES, f"one of {', '.join(_DTYPES)}"),
    "config": (lambda v: isinstance(v, dict), "an object of config fields"),
    "tokenizer": (lambda v: isinstance(v, str), "a tokenizer fingerprint"),
}
"""The fields of `extra` that cod-fast reads back (the trainer writes them), with what each
must be: a checkpoint of an older version may lack one, never hold another kind of value."""


def _check_file(path: Path, written: int | None) -> None:
    """A checkpoint file must be a real file, at least the size written (when recorded): a
    copy or a disk that cut it short shows here, named as such, before any reader fails."""
    _refuse_link(path)
    if not path.is_file():
        raise Damage(path, "is missing")
    size = path.stat().st_size
    if written is not None and size < written:
        raise Damage(path, f"is truncated ({size:,} of the {written:,} bytes written)")


def _load_plain(path: Path) -> Any:
    """A `.pt` file of tensors and plain data; anything else (code a pickle would run) is
    refused, never executed, and so is an archive that would inflate (`check_stored`)."""
    check_stored(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds more than tensors and plain data, so it was not loaded "
            f"({first_words(exc)}); it was not written by this version of cod-fast, or was "
            "changed since: resume only from checkpoints you wrote"
        ) from None
    # A cut or overwritten zip archive: RuntimeError from torch's reader, EOFError when empty;
    # flipped bytes in its pickle: whatever the unpickler meets (TypeError, KeyError, ...).
    except Exception as exc:
        raise Damage(path, f"cannot be read ({first_words(exc)})") from None


def _load_rank_states(path: Path) -> list[dict[str, Any]]:
    states = _load_plain(path)
    if not (isinstance(states, list) and states and all(isinstance(s, dict) for s in states)):
        raise Damage(path, f"is damaged (it holds {described(states)}, not a list of rank states)")
    return states


def _damaged(root: Path, step: int, damage: Damage) -> CheckpointError:
    """One line: the damage to checkpoint `step` (in `root`, a run's checkpoints folder), and
    the older checkpoint to use instead."""
    older = next((f for f in reversed(_folders(root)) if _intact(f, step)), None)
    if older is None:
        instead = (
            f"{root} holds no older intact checkpoint: restore the run directory from a copy, "
            "or start again in a new runtime.run_dir"
        )
    else:
        instead = (
            f"the newest older intact checkpoint is {older.name}: write `{older.name}` into "
            f"{root / LATEST} to resume from it (--resume, --init-from), or export it with "
            f"`cod-fast export {root.parent} --step {int(older.name.removeprefix('step-'))} "
            "--out DIR`"
        )
    return CheckpointError(f"{damage}; {instead}")


def _intact(folder: Path, before: int) -> bool:
    """Whether `folder` holds a complete checkpoint older than step `before` whose files pass
    what can be checked without loading them."""
    if int(folder.name.removeprefix("step-")) >= before or not (folder / META).exists():
        return False
    try:
        _checked_meta(folder, int(folder.name.removeprefix("step-")))
    except (Damage, CheckpointError):
        return False
    return True


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise CheckpointError(
            f"{path} is a symbolic link (to {os.readlink(path)}); cod-fast reads checkpoints "
            "only from real folders and files of the run directory, so that nothing outside "
            "it is read: replace the link with a copy of what it points to"
        )
