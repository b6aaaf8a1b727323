"""Paths that name no regular file, for the tests of bounded reads: `/dev/zero`, which reads
for ever, and a named pipe (FIFO) that no one writes, whose opening for reading blocks until a
writer comes; a full disk, made real for one `cod-fast` command (`on_a_full_disk`); and the one
`error:` line a refused command prints (`cli_error`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

DEV_ZERO = "/dev/zero"


@contextlib.contextmanager
def lonely_fifo(folder: Path, seconds: float = 10.0) -> Iterator[Path]:
    """A FIFO in `folder` with no writer. Should a reader block opening it (the bug these tests
    guard against), a writer opens and closes it after `seconds`, so the reader sees an empty
    file and the test fails instead of hanging."""
    path = folder / "pipe"
    os.mkfifo(path)

    def release() -> None:
        with contextlib.suppress(OSError):  # no reader is waiting: nothing to release
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    timer = threading.Timer(seconds, release)
    timer.start()
    try:
        yield path
    finally:
        timer.cancel()


# The process may not grow a file past the limit (root included), and SIGXFSZ is ignored, so a
# write fails with EFBIG ("File too large") as it would with ENOSPC on a full disk.
_FULL_DISK = """
import resource, signal, sys
from cod_fast.cli.app import app
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.argv = ["cod-fast", *sys.argv[2:]]
app()
"""


def on_a_full_disk(args: list[str], limit: int) -> str:
    """Run `cod-fast ARGS` in a process that may write no file past `limit` bytes; it must exit
    with 2 and one `error:` line and no traceback. Returns that line."""
    result = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(limit), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 2, result.stderr
    return _error_line(result.stderr)


def cli_error(result) -> str:
    """The one `error:` line a command run through typer's CliRunner printed as it was refused
    (exit code 2, no traceback), after what it printed on its way (`eval` says which model it
    loads)."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return _error_line(result.stderr)


def _error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]
