"""cod_fast.distributed.host_memory: freed host memory stays in the process (Linux with glibc)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
import numpy as np
from cod_fast.distributed.host_memory import keep_freed_memory
if sys.argv[1] == "on":
    assert keep_freed_memory()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
base = rss()
block = np.ones((16 << 20) // 8)  # 16 MiB, touched
grown = rss() - base
del block
print(grown >> 20, (rss() - base) >> 20)
"""


def _kept(mode: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    )
    grown, kept = out.stdout.split()
    return int(grown), int(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_block_stays_in_the_process_only_with_the_settings():
    """A touched 16 MiB block, freed: by default glibc returns it to the OS (its own mapping);
    with keep_freed_memory() it stays on the heap for the next allocation."""
    grown, kept = _kept("off")
    assert grown >= 15 and kept <= 1
    grown, kept = _kept("on")
    assert grown >= 15 and kept >= 15
