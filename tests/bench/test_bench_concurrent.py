"""The shared-cores benchmark (bench/concurrent.py): each run is a warm start and nothing else,
each policy's environment is what it names, the summary is the runs' own arithmetic, and a toy
run through `cod-fast bench concurrent` writes it. Its timings at toy size mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cod_fast.bench import concurrent_runs as concurrent
from cod_fast.cli.app import app
from cod_fast.config.io import load_config
from tests.distributed.test_threads import LIBGOMP, runtime_settings
from tests.train.test_trainer import FAST


def test_a_run_is_the_warm_start_alone(tmp_path):
    """The bench's settings win over `--set`: S warm-start steps, no RL, no evaluations."""
    cmd = concurrent.run_command(tmp_path / "r", 7, 2, ["train.steps=5", "rollout.eval_packs=4"])
    assert cmd[cmd.index("--preset") + 1] == concurrent.PRESET
    overrides = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    cfg = load_config(concurrent.PRESET, overrides=overrides)
    assert (cfg.train.steps, cfg.train.warm_start_steps, cfg.rollout.eval_packs) == (0, 7, 0)
    assert (cfg.runtime.threads, cfg.runtime.run_dir) == (2, str(tmp_path / "r"))
    assert "runtime.threads" not in " ".join(concurrent.run_command(tmp_path, 7, None, []))


def test_each_policy_gets_its_environment(monkeypatch):
    """`cod-fast` leaves OMP_WAIT_POLICY and GOMP_SPINCOUNT unset (cod-fast's default
    decides), the others set their policy and never inherit the bench's own spin count; without
    --threads the runs get torch's default thread count."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    envs = {p: concurrent.run_env(p, None) for p in concurrent.POLICIES}
    assert [e.get("OMP_WAIT_POLICY") for e in envs.values()] == [None, "PASSIVE", "ACTIVE", ""]
    assert not any("GOMP_SPINCOUNT" in e for e in envs.values())
    assert not any(k in e for e in envs.values() for k in concurrent.THREAD_VARIABLES)
    assert concurrent.run_env("active", 2)["OMP_NUM_THREADS"] == "1"


@pytest.mark.skipif(not LIBGOMP.exists(), reason="torch here ships no libgomp")
def test_an_empty_policy_is_libgomps_own_default():
    """OMP_WAIT_POLICY='' makes libgomp use the spin count it uses when the variable is unset:
    the `libgomp` policy is what runs got before cod-fast chose one."""
    counts = []
    for policy in ("", None):
        env = {
            k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
        }
        env |= {"OMP_DISPLAY_ENV": "VERBOSE"} | ({"OMP_WAIT_POLICY": policy} if policy else {})
        code = f"import ctypes; ctypes.CDLL({str(LIBGOMP)!r})"
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        counts.append(runtime_settings(proc.stderr)["GOMP_SPINCOUNT"])
    assert counts == ["300000", "300000"]


def test_the_summary_is_the_runs_arithmetic(tmp_path):
    """Serial is the runs' sum, concurrent the last exit, alone the serial median; the alone
    comparison is cod-fast's median over each other policy's."""
    runs = {"serial": {"wall_s": [10.0, 12.0, 11.0], "steps_s": [8.0, 9.0, 7.0]}}
    runs["concurrent"] = {"wall_s": [30.0, 33.0, 31.5], "steps_s": [25.0, 24.0, 26.0]}
    passive = concurrent.summarize(runs)
    assert (passive["serial_s"], passive["concurrent_s"], passive["alone_s"]) == (33, 33, 11)
    assert passive["ratio"] == pytest.approx(1.0)
    assert (passive["steps_alone_s"], passive["steps_concurrent_s"]) == (8.0, 25.0)
    slower = concurrent.summarize(runs | {"serial": {"wall_s": [10.4] * 3, "steps_s": [8.0] * 3}})
    faster = concurrent.summarize(runs | {"serial": {"wall_s": [9.0] * 3, "steps_s": [8.0] * 3}})
    against = concurrent.alone_against({"cod-fast": passive, "active": slower, "libgomp": faster})
    assert against["active"] == {"ratio": pytest.approx(11 / 10.4), "at_most_5pct_slower": False}
    assert against["libgomp"] == {"ratio": pytest.approx(11 / 9), "at_most_5pct_slower": False}
    same = concurrent.alone_against({"cod-fast": passive, "active": passive})
    assert same == {"active": {"ratio": 1.0, "at_most_5pct_slower": True}}
    meta = {"timestamp": "2026-12-06T10:00:00+00:00", "commit": "abc1234"}
    assert concurrent.default_out(meta) == Path("bench/results/20261206-abc1234-concurrent.json")


@pytest.mark.slow
def test_cod_fast_bench_concurrent_writes_its_json(tmp_path):
    toy = [o for o in FAST if o.startswith("model.") or o.startswith("train.warm_start_packs")]
    out = tmp_path / "concurrent.json"
    argv = ["bench", "concurrent", "--runs", "2", "--steps", "2", "--out", str(out)]
    result = CliRunner().invoke(app, [*argv, *(a for o in toy for a in ("--set", o))])
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert json.loads(result.output.strip().splitlines()[-1]) == summary
    assert list(summary["policies"]) == ["cod-fast"]
    passive = summary["policies"]["cod-fast"]
    assert passive["omp_wait_policy"] is None
    for phase in ("serial", "concurrent"):
        assert len(passive[phase]["wall_s"]) == 2
        pairs = zip(passive[phase]["steps_s"], passive[phase]["wall_s"], strict=True)
        assert all(0 < steps < wall for steps, wall in pairs)  # a run's steps are inside it
    assert passive["ratio"] == pytest.approx(
        max(passive["concurrent"]["wall_s"]) / sum(passive["serial"]["wall_s"])
    )
    assert summary["settings"] == {"runs": 2, "steps": 2, "threads": None, "set": toy}
