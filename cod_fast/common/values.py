"""Values read back from files, checked and described: a count, a value shown in one line of an
error, the first words of an exception, and why a write failed."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch


def is_count(value: Any) -> bool:
    """A count or size read from a file: an int (not a bool) from 0 to 2**63."""
    return type(value) is int and 0 <= value < 2**63


def described(value: Any) -> str:
    """What a value read from a file is, for a message: short values as they are, the rest by
    their type (a tensor's repr runs over lines)."""
    if isinstance(value, int) and abs(value) >= 2**64:  # past 4300 digits repr() raises
        return f"an integer of {value.bit_length()} bits"
    if value is None or isinstance(value, bool | int | float | str):
        text = repr(value)
        return text if len(text) <= 40 else f"{text[:36]}..."
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"a tensor of dtype {dtype} and shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def first_words(exc: BaseException) -> str:
    """The first sentence of an error (torch's go on for lines), or its type when it is empty."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0].split(". ")[0][:200]


def write_cause(folder: Path, exc: BaseException) -> str:
    """Why a write into `folder` failed, with the free space there (a full disk reaches a
    writer as OSError, as RuntimeError from torch.save and as SafetensorError)."""
    try:
        free = f"{shutil.disk_usage(folder if folder.exists() else folder.parent).free / 2**20:.0f} MiB"
    except OSError:
        free = "unknown"
    cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_words(exc)
    return f"{cause} (free space there: {free})"
