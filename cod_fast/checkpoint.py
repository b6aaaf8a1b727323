"""Atomic checkpoints and bit-for-bit resume (model in safetensors, optimizer, RNG, step, data).

A checkpoint is written into a hidden temporary folder, fsynced and renamed into place, and the
`latest` pointer is replaced atomically after it, so an interruption at any moment leaves the
previous checkpoint intact and loadable. The caller passes full (gathered) states, so one format
serves one process and many (cod_fast.distributed gathers FSDP2 shards); per-rank state (random
number generators, the sampler's generator) travels as one entry per rank. Restoring the RNG
sets every generator the run uses (python, numpy, torch CPU and CUDA), so a resumed run on the
CPU continues exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LATEST = "latest"


@dataclass
class Checkpoint:
    path: Path
    step: int
    extra: dict[str, Any]


def rng_state() -> dict[str, Any]:
    """This process's random number generator states."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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
    `keep` > 0 deletes all but the newest `keep` checkpoints afterwards.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    tmp = root / f".step-{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # safetensors wants contiguous tensors that share no storage; the caller's state already
    # holds each tied weight once.
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in model_state.items()},
        tmp / "model.safetensors",
    )
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(rank_states or [rng_state()], tmp / "ranks.pt")
    (tmp / "meta.json").write_text(json.dumps({"step": step, "extra": extra or {}}))
    for file in tmp.iterdir():
        _fsync(file)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    pointer.replace(root / LATEST)
    _fsync(root)
    if keep > 0:
        for old in sorted(root.glob("step-*"))[:-keep]:
            shutil.rmtree(old)
    return final


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The checkpoint `latest` points at, or None when the run has none yet."""
    root = Path(run_dir) / "checkpoints"
    if not (root / LATEST).exists():
        return None
    path = root / (root / LATEST).read_text().strip()
    meta = json.loads((path / "meta.json").read_text())
    return Checkpoint(path=path, step=meta["step"], extra=meta["extra"])


def read_model_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    return load_file(ckpt.path / "model.safetensors")


def read_optimizer_state(ckpt: Checkpoint) -> dict[str, Any]:
    return torch.load(ckpt.path / "optimizer.pt", weights_only=False)


def read_rank_states(ckpt: Checkpoint) -> list[dict[str, Any]]:
    return torch.load(ckpt.path / "ranks.pt", weights_only=False)
