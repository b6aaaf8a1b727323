"""The runnable examples in examples/: each runs as its docstring says and uses only public names."""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MINIMAL_LOOP = EXAMPLES / "minimal_loop.py"
STEP_LINE = re.compile(r"step (\d+): reward (\S+) loss (\S+) grad_norm (\S+) tokens (\d+)")


@pytest.mark.slow
def test_minimal_loop_trains_steps_with_finite_numbers():
    """`python examples/minimal_loop.py 2` exits 0 and prints one line per step, in order, with
    a finite mean reward, loss and gradient norm and some trained tokens."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(MINIMAL_LOOP), "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=MINIMAL_LOOP.parent.parent,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [STEP_LINE.fullmatch(line) for line in result.stdout.splitlines()]
    assert all(steps), result.stdout
    assert [int(m[1]) for m in steps] == [1, 2]
    for m in steps:
        numbers = [float(m[i]) for i in (2, 3, 4)]
        assert all(math.isfinite(x) for x in numbers), m[0]
        assert int(m[5]) > 0, m[0]


def test_minimal_loop_imports_only_public_names():
    """The example reads as a user's script would: no module or name it imports starts with an
    underscore (private to the package)."""
    private = []
    for node in ast.walk(ast.parse(MINIMAL_LOOP.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            names = [node.module or "", *(alias.name for alias in node.names)]
        else:
            continue
        private += [n for n in names if any(part.startswith("_") for part in n.split("."))]
    assert private == [], private
