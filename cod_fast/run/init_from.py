"""Starting a run from given weights (`train.init_from`, `cod-fast train --init-from PATH`).

PATH is a run directory (the weights of its latest checkpoint, and its tokenizer) or a Hugging
Face model folder in safetensors (what `cod-fast export` writes). Only the weights come from
PATH: the new run has its own fresh optimizer, seeds, pack stream and run directory, so several
arms (CoD RL, task-by-task RL, other seeds) can start from exactly the same checkpoint. Weights
are read from safetensors only, never from a pickle, and must be finite (cod_fast.run.checkpoint
refuses a damaged file with one line).
"""

from __future__ import annotations

from pathlib import Path

import torch

from cod_fast.config import clipped
from cod_fast.run.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    read_model_state,
    read_weights,
)


def _is_run_dir(path: Path) -> bool:
    return (path / "checkpoints").is_dir()


def check_source(path: str) -> str | None:
    """Why `path` cannot be a start (None when it can)."""
    source = Path(path)
    try:
        if _is_run_dir(source):
            found = latest_checkpoint(source)
            return None if found else f"{path} is a run directory without checkpoints"
        if source.is_dir() and list(source.glob("*.safetensors")):
            return None
    except CheckpointError as exc:  # a torn meta.json, a linked folder: its own words
        return str(exc)
    except OSError as exc:  # a name too long for the file system, a folder it may not read
        return f"{clipped(path)} cannot be read ({exc.strerror})"
    return (
        f"{clipped(path)} is neither a run directory with a checkpoint nor a model folder "
        "with *.safetensors weights (export a run with `cod-fast export`)"
    )


def initial_weights(path: str) -> dict[str, torch.Tensor]:
    """The weights at `path`, by their Hugging Face names."""
    source = Path(path)
    if _is_run_dir(source):
        ckpt = latest_checkpoint(source)
        if ckpt is None:
            raise FileNotFoundError(check_source(path))
        return read_model_state(ckpt)
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(check_source(path))
    fix = f"write {path} again (`cod-fast export RUN_DIR --out {path}`, or a fresh copy)"
    weights: dict[str, torch.Tensor] = {}
    for file in files:  # one file, or the shards of a large model
        weights.update(read_weights(file, fix))
    return weights


def tokenizer_folder(path: str) -> Path:
    """Where the tokenizer of the weights at `path` lies: a run's `tokenizer/`, else PATH."""
    source = Path(path)
    return source / "tokenizer" if _is_run_dir(source) else source
