"""The CPU thread policy: importing cod_fast shortens how long OpenMP's idle workers spin
(GOMP_SPINCOUNT=10000, read by libgomp when it loads) unless the user chose a policy or a spin
count, and `runtime.threads` sets torch's threads for the run (cod_fast.distributed.threads)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cod_fast.train.trainer as trainer_module
from cod_fast.config import ConfigError, RuntimeConfig
from cod_fast.config.io import load_config
from tests.train.test_trainer import FAST

TORCH_LIB = Path(importlib.util.find_spec("torch").submodule_search_locations[0]) / "lib"
LIBGOMP = TORCH_LIB / "libgomp.so.1"
POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
CASES = [
    ({}, "10000"),  # cod-fast's default
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"),  # the user's policy (libgomp/env.c)
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "0"),
    ({"GOMP_SPINCOUNT": "5000"}, "5000"),  # the user's spin count
]
"""(what the user set, the spin count libgomp must load with)."""


def child(code: str, user: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -c code` with only the user's wait-policy variables `user` and libgomp's
    settings printed to stderr as it loads (OMP_DISPLAY_ENV=VERBOSE)."""
    env = {k: v for k, v in os.environ.items() if k not in POLICY_VARIABLES}
    env |= {"OMP_NUM_THREADS": "1", "OMP_DISPLAY_ENV": "VERBOSE", **user}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def runtime_settings(stderr: str) -> dict[str, str]:
    """The OpenMP runtime's settings as OMP_DISPLAY_ENV prints them (`NAME = 'value'`); the
    last copy where several runtimes printed."""
    return dict(re.findall(r"^\s*(?:\[[^]]*\]\s*)?(\w+)\s*=\s*'([^']*)'", stderr, re.MULTILINE))


def check_spin(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode == 0, proc.stderr
    assert runtime_settings(proc.stderr).get("GOMP_SPINCOUNT") == expected, proc.stderr


@pytest.mark.skipif(not LIBGOMP.exists(), reason="torch here ships no libgomp")
@pytest.mark.parametrize(("user", "expected"), CASES)
def test_importing_cod_fast_sets_the_spin_libgomp_reads(user, expected):
    """After `import cod_fast`, torch's libgomp loads with a spin count of 10000 where the user
    set neither a policy nor a spin count, and with the user's own where they did."""
    code = f"import ctypes, cod_fast\nctypes.CDLL({str(LIBGOMP)!r})\n"
    check_spin(child(code, user), expected)


@pytest.mark.skipif(not LIBGOMP.exists(), reason="torch here ships no libgomp")
def test_without_cod_fast_libgomp_spins_its_own_default():
    """The control: libgomp loaded without cod_fast spins 300000 times (libgomp/env.c)."""
    check_spin(child(f"import ctypes\nctypes.CDLL({str(LIBGOMP)!r})\n", {}), "300000")


@pytest.mark.slow
@pytest.mark.skipif(not LIBGOMP.exists(), reason="torch here ships no libgomp")
@pytest.mark.parametrize(("user", "expected"), CASES[:2])
def test_torch_imported_after_cod_fast_runs_with_the_policy(user, expected):
    """`import cod_fast, torch`: torch's OpenMP (libgomp, libtorch_cpu.so's) runs a parallel op
    with the spin count cod_fast chose, or the user's."""
    code = "import cod_fast, torch\ntorch.ones(1 << 16).sum()\n"
    check_spin(child(code, user), expected)


@pytest.mark.slow
def test_runtime_threads_sets_torchs_thread_count():
    """`runtime.threads=2` gives the process two threads where it started with one; null
    leaves the count as it was."""
    code = (
        "import json, torch\n"
        "from cod_fast.config import RuntimeConfig\n"
        "from cod_fast.distributed.threads import apply_threads\n"
        "start = torch.get_num_threads()\n"
        "default = apply_threads(RuntimeConfig().threads)\n"
        "two = apply_threads(RuntimeConfig(threads=2).threads)\n"
        "print(json.dumps([start, default, two, torch.get_num_threads()]))"
    )
    proc = child(code, {})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == [1, 1, 2, 2]


@pytest.mark.parametrize("threads", [0, -3])
def test_threads_below_one_are_refused_in_one_line(threads):
    """A thread count below 1 is refused by the config, naming the key and what it accepts."""
    with pytest.raises(ConfigError, match=r"^threads: got -?\d+; expected an integer >= 1"):
        RuntimeConfig(threads=threads)
    with pytest.raises(ConfigError) as refused:
        load_config("tiny-cpu", overrides=[f"runtime.threads={threads}"])
    assert refused.value.key == "runtime.threads"
    assert "\n" not in str(refused.value)


def test_threads_default_to_torchs_choice():
    assert RuntimeConfig().threads is None
    assert load_config("tiny-cpu", overrides=["runtime.threads=3"]).runtime.threads == 3


def test_the_trainer_applies_the_runs_thread_count(tmp_path, monkeypatch):
    """Building a Trainer applies `runtime.threads` before the run computes anything."""
    seen = []
    monkeypatch.setattr(trainer_module, "apply_threads", seen.append)
    overrides = [*FAST, f"runtime.run_dir={tmp_path}", "runtime.threads=1"]
    trainer_module.Trainer(load_config("tiny-cpu", overrides=overrides))
    assert seen == [1]
