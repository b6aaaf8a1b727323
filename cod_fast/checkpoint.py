"""Atomic checkpoints and bit-for-bit resume (model in safetensors, optimizer, RNG, step, data).

A checkpoint is written into a hidden temporary folder and renamed into place, and the `latest`
pointer is replaced atomically after it, so an interruption at any moment leaves the previous
checkpoint intact and loadable. Restoring sets the model and optimizer states and every random
number generator the run uses (python, numpy, torch CPU and CUDA), so a resumed run on the CPU
continues exactly as the uninterrupted one would have.
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
from safetensors.torch import load_model, save_model

LATEST = "latest"


@dataclass
class Checkpoint:
    path: Path
    step: int
    extra: dict[str, Any]


def _rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint `step` under run_dir/checkpoints and point `latest` at it."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    tmp = root / f".step-{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))  # handles tied embeddings
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "meta.json").write_text(json.dumps({"step": step, "extra": extra or {}}))
    for file in tmp.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    pointer.replace(root / LATEST)
    _fsync_dir(root)
    return final


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The checkpoint `latest` points at, or None when the run has none yet."""
    root = Path(run_dir) / "checkpoints"
    if not (root / LATEST).exists():
        return None
    path = root / (root / LATEST).read_text().strip()
    meta = json.loads((path / "meta.json").read_text())
    return Checkpoint(path=path, step=meta["step"], extra=meta["extra"])


def restore_checkpoint(
    ckpt: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Load model, optimizer and RNG states in place."""
    missing, unexpected = load_model(model, str(ckpt.path / "model.safetensors"))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {ckpt.path} does not fit this model: missing {missing}, "
            f"unexpected {unexpected}; resume with the config it was written with"
        )
    optimizer.load_state_dict(torch.load(ckpt.path / "optimizer.pt", weights_only=False))
    _set_rng_state(torch.load(ckpt.path / "rng.pt", weights_only=False))
