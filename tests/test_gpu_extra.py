"""`pip install -e ".[gpu]"` on a GPU node: every requirement of the `gpu` extra must install from
a wheel. One that has only a source archive whose build imports torch (flash-attn) fails pip at
"Getting requirements to build wheel", and nothing of the extra installs.

Each requirement is resolved by pip from the registry's metadata for CPython 3.12 on manylinux
x86_64 (a dry run without dependencies: nothing is downloaded beyond metadata, nothing built).
These tests need the package registry; they skip when it does not answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
GPU_NODE = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--platform",
    "manylinux_2_28_x86_64",
    "--implementation",
    "cp",
]
FLASH_ATTN_BUILD = "pip install flash-attn --no-build-isolation"


def gpu_extra() -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return pyproject["project"]["optional-dependencies"]["gpu"]


def pip(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args, "--retries", "1", "--timeout", "30"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def wheel_problem(requirement: str, folder: Path) -> str | None:
    """Why `requirement` would not install from a wheel on the GPU node, or None. Skips the test
    when the registry knows no release of the project at all (offline)."""
    name = Requirement(requirement).name
    if pip("index", "versions", name).returncode != 0:
        pytest.skip(f"the package registry did not answer for {name} (offline?)")
    run = pip(
        "install",
        "--dry-run",
        "--no-deps",
        "--ignore-installed",
        *GPU_NODE,
        "--target",
        str(folder),
        "--quiet",
        "--report",
        "-",
        requirement,
    )
    if run.returncode != 0:
        errors = [line for line in run.stderr.splitlines() if line.startswith("ERROR")]
        return f"{requirement}: {errors[-1] if errors else run.stderr[-300:]}"
    (chosen,) = json.loads(run.stdout)["install"]
    url = chosen["download_info"]["url"]
    return None if url.endswith(".whl") else f"{requirement}: resolves to {url}, not a wheel"


def test_every_gpu_requirement_installs_from_a_wheel(tmp_path):
    """Every requirement of the `gpu` extra (read from pyproject.toml) resolves to a binary
    wheel for CPython 3.12 on manylinux x86_64."""
    problems = [p for r in gpu_extra() if (p := wheel_problem(r, tmp_path)) is not None]
    assert not problems, problems


def test_flash_attn_has_no_wheel_so_readme_builds_it_outside_the_extra(tmp_path):
    """flash-attn (>= 2.7) has no such wheel: the check above reports it (so it can fail), the
    `gpu` extra leaves it out, and the README gives the command that builds it."""
    problem = wheel_problem("flash-attn>=2.7", tmp_path)
    assert problem is not None and "flash-attn" in problem, (
        "flash-attn now has a wheel for the GPU node; it may go back into the gpu extra"
    )
    names = {canonicalize_name(Requirement(r).name) for r in gpu_extra()}
    assert "flash-attn" not in names
    assert FLASH_ATTN_BUILD in (ROOT / "README.md").read_text()
