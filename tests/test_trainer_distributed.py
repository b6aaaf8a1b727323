"""`cod-fast train` under torchrun: two gloo ranks on the CPU (FSDP2), against one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cod_fast.checkpoint import Checkpoint, latest_checkpoint, read_model_state
from cod_fast.trainer import Trainer
from tests.test_trainer import FAST, config

pytestmark = pytest.mark.slow  # runs, processes or benchmarks: seconds each


def torchrun_train(run_dir, *overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    args += ["--standalone", "-m", "cod_fast.cli", "train"]  # standalone: a free local port
    args += ["--preset", "tiny-cpu"]
    for override in [*FAST, f"runtime.run_dir={run_dir}", *overrides]:
        args += ["--set", override]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def test_two_ranks_warm_start_equals_one_process(tmp_path):
    """The warm start is deterministic, so 2 FSDP2 ranks (each packing its share, the step's
    denominator global) end with the parameters of 1 process within fp32 tolerance; the RL
    steps after it run across both ranks, and only rank 0 writes the run directory."""
    two = tmp_path / "two"
    result = torchrun_train(two, "train.warm_start_steps=3", "train.steps=1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one = Trainer(config(tmp_path / "one", "train.warm_start_steps=3", "train.steps=0"))
    one.run()
    ckpt = latest_checkpoint(two)
    assert ckpt.step == 4 and ckpt.extra["world_size"] == 2
    warm = read_model_state(Checkpoint(path=ckpt.path.parent / "step-0000003", step=3, extra={}))
    for name, param in one.policy.model.named_parameters():
        torch.testing.assert_close(
            warm[name], param.detach(), atol=2e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
    lines = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in lines] == ["warm_start"] * 3 + ["rl"]
    assert lines[-1]["sample_s"] > 0 and lines[-1]["tokens"] > 0
