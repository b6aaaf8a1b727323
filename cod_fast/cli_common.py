"""Helpers every `cod-fast` command shares: how bad input ends a command."""

from __future__ import annotations

import typer
from rich.console import Console


def fail(message: str) -> None:
    """One red line on stderr, then exit code 2 (bad input, never a bug)."""
    Console(stderr=True).print(
        f"error: {message}", style="red", markup=False, highlight=False, soft_wrap=True
    )
    raise typer.Exit(2)


def bad_model_input() -> tuple[type[Exception], ...]:
    """What a bad model folder, run directory, name or value raises: one red line, no traceback."""
    from cod_fast.checkpoint import CheckpointError

    return (ValueError, OSError, CheckpointError)
