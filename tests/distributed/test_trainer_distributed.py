"""`cod-fast train` under torchrun: two gloo ranks on the CPU (FSDP2), against one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cod_fast.distributed.fsdp import model_state
from cod_fast.run.checkpoint import latest_checkpoint, read_model_state
from cod_fast.train.trainer import Trainer
from tests.train.test_trainer import FAST, config

pytestmark = pytest.mark.slow  # runs, processes or benchmarks: seconds each


def torchrun_train(run_dir, *overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    args += ["--standalone", "-m", "cod_fast.cli", "train"]  # standalone: a free local port
    args += ["--preset", "tiny-cpu"]
    for override in [*FAST, f"runtime.run_dir={run_dir}", *overrides]:
        args += ["--set", override]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def failure(result: subprocess.CompletedProcess) -> str:
    """What a failed torchrun said: every rank's error lines, then the end of its output."""
    marks = ("error", "Error", "terminate", "Traceback", "[rank")
    lines = [x for x in (result.stdout + result.stderr).splitlines() if any(m in x for m in marks)]
    return "\n".join(lines[:60]) + "\n...\n" + result.stdout[-2000:] + result.stderr[-2000:]


def eval_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]


def test_a_short_process_group_timeout_outlasts_a_long_evaluation(tmp_path):
    """With runtime.dist_timeout_s=8 and evaluations that take one rank about twice that (240
    packs of the tiny-cpu model), a two-rank run finishes: each rank plays its half of the
    packs, so no rank waits in a collective while the other evaluates (with the whole
    evaluation on rank 0, rank 1's barrier timed out)."""
    tiny_cpu_model = (
        "model.hidden_size=96",
        "model.num_layers=3",
        "model.num_heads=4",
        "model.intermediate_size=256",
        "model.tokenizer=char",  # a BPE tokenizer would be trained on rank 0 alone
    )
    run = tmp_path / "run"
    result = torchrun_train(
        run,
        *tiny_cpu_model,
        "train.warm_start_steps=1",
        "train.steps=1",
        "rollout.eval_packs=240",
        "runtime.dist_timeout_s=8",
    )
    assert result.returncode == 0, failure(result)
    assert [r["label"] for r in eval_rows(run)] == ["start", "after warm start", "end"]


def test_two_ranks_in_mixed_precision_equal_one_process(tmp_path):
    """bf16 compute on float32 masters under 2 FSDP2 ranks (gradients reduced in float32) ends
    the warm start with the masters of a one-process mixed-precision run (its one-rank mesh) to
    well under what the steps moved them (measured: 4e-9 apart, 1.4e-4 moved); the checkpoint
    holds float32 masters and records the compute dtype."""
    mixed = ("model.dtype=bfloat16", "train.warm_start_steps=3", "train.steps=0")
    result = torchrun_train(tmp_path / "two", *mixed)
    assert result.returncode == 0, failure(result)
    one = Trainer(config(tmp_path / "one", *mixed))
    start = model_state(one.policy, one.ctx)
    one.run()
    want = model_state(one.policy, one.ctx)
    ckpt = latest_checkpoint(tmp_path / "two")
    assert ckpt.extra["compute_dtype"] == "bfloat16" and ckpt.extra["master_dtype"] == "float32"
    got = read_model_state(ckpt)
    moved = max((want[k] - start[k]).abs().max().item() for k in want)
    assert moved > 1e-5
    for name in want:
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], want[name], atol=1e-2 * moved, rtol=0)


def test_distill_under_torchrun_trains_teachers_then_the_student(tmp_path):
    """`cod-fast distill` on two ranks: both ranks take part in every teacher run and the
    student's, the main rank alone writes the shared tokenizer and each teacher's export, and
    the other rank waits for them (it once read a half-written export and failed)."""
    teachers = f"{{frozenlake: {tmp_path}/t/frozenlake, terminal: {tmp_path}/t/terminal}}"
    small = [*FAST[:4], "rollout.eval_packs=2", "train.warm_start_steps=1", "train.steps=1"]
    small += ["rollout.packs_per_step=2", "rollout.group_size=2", "train.warm_start_packs=2"]
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    args += ["--standalone", "-m", "cod_fast.cli", "distill"]
    args += ["--set", f"runtime.run_dir={tmp_path}/student", "--set", f"algo.teachers={teachers}"]
    for override in small:
        args += ["--set", override, "--teacher-set", override]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, failure(result)
    for name in ("frozenlake", "terminal"):
        assert (tmp_path / "t" / name / "config.json").exists()
        assert latest_checkpoint(tmp_path / "t" / f"{name}-run").extra["world_size"] == 2
    rows = [json.loads(x) for x in (tmp_path / "student" / "metrics.jsonl").open()]
    assert rows[-1]["phase"] == "rl" and "teacher_s" in rows[-1]
