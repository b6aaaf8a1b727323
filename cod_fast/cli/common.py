"""Helpers every `cod-fast` command shares: how bad input ends a command.

A refusal is one red line on stderr and exit code 2. With the traceback switch on (`cod-fast
--traceback`, or COD_FAST_TRACEBACK=1 in the environment), a refusal that an error caused shows
the error's full traceback before that line, with the same exit code: a bug that raises one of
the errors taken for bad input (a ValueError, say) is then found where it was raised.
"""

from __future__ import annotations

import os
import traceback
from typing import NoReturn

import typer
from rich.console import Console

TRACEBACK_ENV = "COD_FAST_TRACEBACK"
"""The traceback switch: `1` shows the traceback of every refusal an error caused."""


def show_tracebacks() -> None:
    """Turn the traceback switch on for this process and those it starts (`--traceback`)."""
    # The switch is the environment variable, so that the commands a command runs in processes
    # of their own (a benchmark's training runs) show their tracebacks too.
    os.environ[TRACEBACK_ENV] = "1"


def tracebacks_shown() -> bool:
    """Whether the traceback switch is on."""
    return os.environ.get(TRACEBACK_ENV, "0") == "1"


def _red_line(message: str) -> None:
    Console(stderr=True).print(
        f"error: {message}", style="red", markup=False, highlight=False, soft_wrap=True
    )


def fail(message: str) -> NoReturn:
    """One red line on stderr, then exit code 2 (bad input, never a bug)."""
    _red_line(message)
    raise typer.Exit(2)


def report(error: BaseException, message: str | None = None) -> None:
    """`error` as one red line on stderr (`message`, else the error's own), after its traceback
    when the switch is on."""
    if tracebacks_shown():
        traceback.print_exception(type(error), error, error.__traceback__)
    _red_line(str(error) if message is None else message)


def refuse(error: BaseException, message: str | None = None) -> NoReturn:
    """End the command that `error` refused: `report` it, then exit code 2."""
    report(error, message)
    raise typer.Exit(2)


def bad_model_input() -> tuple[type[Exception], ...]:
    """What a bad model folder, run directory, name or value raises, and an API model's endpoint
    that fails: one red line, no traceback."""
    from cod_fast.rollout.chat_endpoint import EndpointError
    from cod_fast.run.checkpoint import CheckpointError

    return (ValueError, OSError, CheckpointError, EndpointError)
