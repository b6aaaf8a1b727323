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
`latest` must name a checkpoint folder of the run (no path elsewhere).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

LATEST = "latest"
META = "meta.json"
_NAME = re.compile(r"step-\d{7}")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written (disk full, read-only) or read safely."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    extra: dict[str, Any]


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
        for file in tmp.iterdir():
            _fsync(file)
        (tmp / META).write_text(json.dumps({"step": step, "extra": extra or {}}))
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
        for old in sorted(root.glob("step-*"))[:-keep]:
            shutil.rmtree(old)
    return final


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
    meta = json.loads((path / META).read_text())
    return Checkpoint(path=path, step=meta["step"], extra=meta["extra"])


def read_model_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    return load_file(ckpt.path / "model.safetensors")


def read_optimizer_state(ckpt: Checkpoint) -> dict[str, Any]:
    return _load_plain(ckpt.path / "optimizer.pt")


def read_rank_states(ckpt: Checkpoint) -> list[dict[str, Any]]:
    return _load_plain(ckpt.path / "ranks.pt")


def _load_plain(path: Path) -> Any:
    """A `.pt` file of tensors and plain data; anything else (code a pickle would run) is
    refused, never executed."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0][:200]
        raise CheckpointError(
            f"{path} holds more than tensors and plain data, so it was not loaded ({first}); "
            "it was not written by this version of cod-fast, or was changed since: resume only "
            "from checkpoints you wrote"
        ) from None
