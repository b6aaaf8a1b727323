"""Paths that name no regular file, for the tests of bounded reads: `/dev/zero`, which reads
for ever, and a named pipe (FIFO) that no one writes, whose opening for reading blocks until a
writer comes."""

from __future__ import annotations

import contextlib
import os
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
