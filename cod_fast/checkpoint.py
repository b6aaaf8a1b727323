"""Atomic checkpoints and bit-for-bit resume (model in safetensors, optimizer, RNG, step, data).

A checkpoint is written into a hidden temporary folder, fsynced, completed by its `meta.json`
(written last) and renamed into place; the `latest` pointer is replaced atomically after it. An
interruption at any moment leaves a loadable checkpoint: rewriting a step that already has one
first moves the old folder aside, and `latest_checkpoint` takes the new folder, or else the
old one, from where they lie when a kill fell between the two renames. The next save moves such
a folder into its place and removes what is left. The caller passes full (gathered) states, so one format serves one process and
many (cod_fast.distributed gathers FSDP2 shards); per-rank state (random number generators, the
sampler's generator) travels as one entry per rank. Restoring the RNG sets every generator the
run uses (python, numpy, torch CPU and CUDA), so a resumed run on the CPU continues exactly as
the uninterrupted one would have.

Nothing in a run directory is trusted to run code: the `.pt` files hold tensors and plain data
only and load with `torch.load(weights_only=True)`, the model is safetensors, the rest JSON, and
`latest` must name a checkpoint folder of the run (no path elsewhere). Nothing outside the run
directory is read or deleted through it: a step folder, a file in one, or `latest` that is a
symbolic link is refused wherever it points (inside the run too: one rule, no path resolving),
and rotation (`keep`) passes such links by. The run directory itself and its `checkpoints`
folder may be links (to a larger disk, say).

A damaged checkpoint is refused with one line naming the file and the damage (missing; cut
short of the size `meta.json` records for it; unreadable; a torn `meta.json`; model weights
that are NaN or infinite), and the newest older intact checkpoint of the run to use instead.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

LATEST = "latest"
META = "meta.json"
FILES = ("model.safetensors", "optimizer.pt", "ranks.pt")
"""What a checkpoint folder holds besides its meta.json."""
_NAME = re.compile(r"step-\d{7}")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written (disk full, read-only) or read safely."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    extra: dict[str, Any]
    sizes: dict[str, int] = field(default_factory=dict)
    """Each file's size when it was written (empty for checkpoints of older versions)."""


def rng_state() -> dict[str, Any]:
    """This process's random number generator states, as tensors and plain data."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["kind"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:07d}"
    tmp, aside = _tmp(final), _aside(final)
    try:
        root.mkdir(parents=True, exist_ok=True)
        _finish_half_moved(root)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        # safetensors wants contiguous tensors that share no storage; the caller's state
        # already holds each tied weight once.
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in model_state.items()},
            tmp / "model.safetensors",
        )
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(rank_states or [rng_state()], tmp / "ranks.pt")
        sizes = {}
        for file in tmp.iterdir():
            _fsync(file)
            sizes[file.name] = file.stat().st_size  # tells a truncated file from a corrupt one
        (tmp / META).write_text(json.dumps({"step": step, "extra": extra or {}, "sizes": sizes}))
        _fsync(tmp / META)  # last: a folder with its meta.json is complete
    # A full disk reaches here as OSError, as RuntimeError from torch.save and as
    # SafetensorError from safetensors.
    except (OSError, RuntimeError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(_write_failure(root, step, exc)) from exc
    if final.exists():  # a rewrite of this step: the old folder stays loadable, aside
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
    tmp.rename(final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    pointer.replace(root / LATEST)
    _fsync(root)
    for leftover in root.glob(".step-*"):  # this rewrite's old folder, or a killed save's
        shutil.rmtree(leftover, ignore_errors=True)
    if keep > 0:
        for old in _folders(root)[:-keep]:
            shutil.rmtree(old)
    return final


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
        if not final.exists() and (found := _complete(final)) is not None:
            found.rename(final)


def _complete(final: Path) -> Path | None:
    """Where checkpoint `final` lies complete: in its place, else the newer folder a kill left
    beside it (the rewrite's), else the older one it moved aside; None if nowhere."""
    return next((p for p in (final, _tmp(final), _aside(final)) if (p / META).exists()), None)


def _tmp(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp")


def _aside(final: Path) -> Path:
    return final.with_name(f".{final.name}.old")


def _write_failure(root: Path, step: int, exc: BaseException) -> str:
    try:
        free = f"{shutil.disk_usage(root if root.exists() else root.parent).free / 2**20:.0f} MiB"
    except OSError:
        free = "unknown"
    cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return (
        f"could not write the checkpoint of step {step} in {root}: {cause} (free space there: "
        f"{free}); free disk space or set runtime.run_dir to a writable folder with room, then "
        "resume: the checkpoints already written are intact"
    )


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The checkpoint `latest` points at, or None when the run has none yet."""
    root = Path(run_dir) / "checkpoints"
    if not (root / LATEST).exists():
        return None
    _refuse_link(root / LATEST)
    name = (root / LATEST).read_text().strip()
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
        meta = _checked_meta(folder)
    except _Damage as exc:
        raise _damaged(folder.parent, step, exc) from None
    return Checkpoint(folder, meta["step"], meta["extra"], meta.get("sizes", {}))


def read_model_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The model's weights, every floating-point value finite."""
    return _read(ckpt, "model.safetensors", _load_weights)


def read_optimizer_state(ckpt: Checkpoint) -> dict[str, Any]:
    return _read(ckpt, "optimizer.pt", _load_plain)


def read_rank_states(ckpt: Checkpoint) -> list[dict[str, Any]]:
    return _read(ckpt, "ranks.pt", _load_plain)


def read_weights(path: Path, fix: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file outside a checkpoint (an exported model's), every
    floating-point value finite; else CheckpointError naming the file, the damage and `fix`."""
    try:
        return _load_weights(path)
    except _Damage as exc:
        raise CheckpointError(f"{exc}; {fix}") from None


class _Damage(Exception):
    """A damaged file, as `PATH is truncated (...)`; the caller adds what to do about it,
    which depends on where the file lies."""

    def __init__(self, path: Path, damage: str):
        super().__init__(f"{path} {damage}")


def _read(ckpt: Checkpoint, name: str, load: Callable[[Path], Any]) -> Any:
    """`load` of the checkpoint's file `name`; a damaged file is one CheckpointError naming it,
    the damage and the checkpoint to use instead."""
    path = ckpt.path / name
    try:
        _check_file(path, ckpt.sizes.get(name))  # again: it may have changed since the open
        return load(path)
    except _Damage as exc:
        raise _damaged(ckpt.path.parent, ckpt.step, exc) from None


def _checked_meta(folder: Path) -> dict[str, Any]:
    """`folder`'s meta.json, after checking that no file of the folder is a link, is missing,
    or is shorter than written (sizes are recorded from this version on)."""
    _refuse_link(folder)
    path = folder / META
    _refuse_link(path)
    try:
        meta = json.loads(path.read_text())
    except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError for binary junk
        raise _Damage(path, f"is not valid JSON ({_first_words(exc)})") from None
    if not (isinstance(meta, dict) and isinstance(meta.get("step"), int)):
        raise _Damage(path, "is valid JSON but holds no step number")
    if not isinstance(meta.get("extra"), dict):
        raise _Damage(path, "is valid JSON but holds no `extra` object")
    sizes = meta.get("sizes", {})
    for name in FILES:
        _check_file(folder / name, sizes.get(name))
    return meta


def _check_file(path: Path, written: int | None) -> None:
    """A checkpoint file must be a real file, at least the size written (when recorded): a
    copy or a disk that cut it short shows here, named as such, before any reader fails."""
    _refuse_link(path)
    if not path.is_file():
        raise _Damage(path, "is missing")
    size = path.stat().st_size
    if written is not None and size < written:
        raise _Damage(path, f"is truncated ({size:,} of the {written:,} bytes written)")


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = load_file(path)
    except (OSError, SafetensorError) as exc:
        raise _Damage(path, f"cannot be read ({_first_words(exc)})") from None
    # NaN weights load without complaint and fail much later (the sampler's multinomial draw
    # indexes out of range): refuse them here, before any compute.
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise _Damage(
                path,
                f"holds non-finite values in tensor {name} ({bad} of its {tensor.numel()} "
                "values are NaN or infinite)",
            )
    return state


def _load_plain(path: Path) -> Any:
    """A `.pt` file of tensors and plain data; anything else (code a pickle would run) is
    refused, never executed."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds more than tensors and plain data, so it was not loaded "
            f"({_first_words(exc)}); it was not written by this version of cod-fast, or was "
            "changed since: resume only from checkpoints you wrote"
        ) from None
    # A cut or overwritten zip archive: RuntimeError from torch's reader, EOFError when empty.
    except (OSError, RuntimeError, EOFError) as exc:
        raise _Damage(path, f"cannot be read ({_first_words(exc)})") from None


def _first_words(exc: BaseException) -> str:
    """The first sentence of an error (torch's go on for lines), or its type when it is empty."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0].split(". ")[0][:200]


def _damaged(root: Path, step: int, damage: _Damage) -> CheckpointError:
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
        _checked_meta(folder)
    except (_Damage, CheckpointError):
        return False
    return True


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise CheckpointError(
            f"{path} is a symbolic link (to {os.readlink(path)}); cod-fast reads checkpoints "
            "only from real folders and files of the run directory, so that nothing outside "
            "it is read: replace the link with a copy of what it points to"
        )
