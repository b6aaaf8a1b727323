"""Tested in the shapes users run: `cod-fast train` of a tiny model under torchrun on this CPU,
gloo standing in for NCCL and the loopback address for nodes, in every topology of
docs/gpu.md's matrix: several FSDP2 trainers (packs that divide unevenly among three), HSDP,
trainers beside one or two rollout workers, two nodes of two processes each, and sequence
parallelism (pairs of trainers splitting each micro-batch) inside HSDP and beside a worker.

Each topology: a run with a checkpoint after every step; SIGKILL to one rank once three steps
are logged (torchrun then ends the others); `--resume` to the end. Then every step is logged
once, in order, and, at staleness 0, the metrics and final weights equal the one-process run's:
keyed sampling (rollout.keyed_sampling) gives every rank layout the same rollouts, and what is
left is float rounding from FSDP2 summing gradients over ranks in another order (compared within
the tolerances below; measured 2026-12-06 on 2, 2x2 and 2+2 processes: weights within 2e-9 of
the one-process run's, every integer metric equal; without keyed sampling the same runs
differed in 8 integer metrics and by up to 48% in others). Every process records its torch.distributed traffic
(COD_FAST_COMM_TRACE) and cod_fast.distributed.comm_check reports no violation of NCCL's rules, on the killed
run (up to where its ranks stopped) and on the resumed run.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cod_fast.distributed.comm_check import check
from cod_fast.run.checkpoint import latest_checkpoint, read_model_state
from tests.async_rl.test_async_rl import rank_pid
from tests.dist_worker import free_port
from tests.train.test_trainer import FAST, TIMING

pytestmark = pytest.mark.slow

SETTINGS = [
    *(s for s in FAST if not s.startswith(("rollout.packs_per_step", "train.steps"))),
    "rollout.packs_per_step=4",  # three trainers: 2 + 1 + 1 packs
    "rollout.eval_packs=3",
    "train.steps=4",
]
STEPS = 2 + 4
KILL_AFTER = 3
ASYNC_KEYS = ("staleness", "weights_version", "rollout_wait_s", "worker_sample_s")
RTOL, ATOL = 1e-4, 1e-6
"""Metrics and weights against the one-process run (float32; FSDP2 sums in another order)."""


def _env(trace: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "COD_FAST_COMM_TRACE": str(trace)}


def _commands(run_dir: Path, nodes: int, per_node: int, extra: list[str]) -> list[list[str]]:
    """One torchrun launcher per node; one node is --standalone, more meet on the loopback
    address as separate launchers would on separate machines."""
    train = ["-m", "cod_fast.cli", "train", "--preset", "tiny-cpu"]
    for override in [*SETTINGS, f"runtime.run_dir={run_dir}", *extra]:
        train += [override] if override.startswith("--") else ["--set", override]
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(per_node)]
    if nodes == 1:
        return [[*run, "--standalone", *train]]
    port = str(free_port())
    meet = ["--nnodes", str(nodes), "--master_addr", "127.0.0.1", "--master_port", port]
    return [[*run, *meet, "--node_rank", str(node), *train] for node in range(nodes)]


def _start(commands: list[list[str]], trace: Path) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            c,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_env(trace),
            start_new_session=True,
        )
        for c in commands
    ]


def _finish(procs: list[subprocess.Popen], timeout: float = 300) -> tuple[list[int], str]:
    said = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # leave no process behind, then fail
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise
        said.append(out.decode(errors="replace"))
    return [p.returncode for p in procs], "\n".join(said)


def _logged(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines]


def _kill_after(run_dir: Path, procs: list[subprocess.Popen], rank: int, steps: int) -> None:
    deadline = time.monotonic() + 240
    while len(_logged(run_dir)) < steps:
        assert time.monotonic() < deadline, "the run logged too few steps"
        assert all(p.poll() is None for p in procs), "the run ended before the kill"
        time.sleep(0.1)
    pid = rank_pid(run_dir, rank)
    assert pid is not None, f"no process of rank {rank}"
    os.kill(pid, signal.SIGKILL)


def _comparable(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k not in TIMING and not k.startswith(ASYNC_KEYS)}
        for r in rows
    ]


def _assert_close_rows(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for mine, theirs in zip(got, want, strict=True):
        assert mine.keys() == theirs.keys(), mine["step"]
        for key, value in theirs.items():
            have = mine[key]
            if isinstance(value, float) and isinstance(have, float):
                assert math.isclose(have, value, rel_tol=RTOL, abs_tol=ATOL), (
                    mine["step"],
                    key,
                    have,
                    value,
                )
            else:
                assert have == value, (mine["step"], key, have, value)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The reference: the same run in one process, uninterrupted."""
    base = tmp_path_factory.mktemp("one")
    codes, said = _finish(_start(_commands(base / "run", 1, 1, []), base / "trace"))
    assert codes == [0], said[-4000:]
    return base / "run"


def _rollout_ranks(extra: list[str]) -> int:
    return next((int(x.split("=")[1]) for x in extra if x.startswith("runtime.rollout_ranks")), 0)


TOPOLOGIES = {
    "2 trainers": (1, 2, [], 1),
    "3 trainers, uneven packs": (1, 3, [], 2),
    "HSDP 2x2": (1, 4, ["runtime.hsdp_replicate=2"], 3),
    "2 trainers + 1 worker": (1, 3, ["runtime.rollout_ranks=1"], 1),
    "2 trainers + 2 workers": (1, 4, ["runtime.rollout_ranks=2"], 3),
    "2 nodes x 2: 3 trainers + 1 worker": (2, 2, ["runtime.rollout_ranks=1"], 2),
    "sequence-parallel pairs in HSDP 2x2, recomputing activations": (
        1,
        4,
        [
            "train.sequence_parallel=2",
            "runtime.hsdp_replicate=2",
            "model.gradient_checkpointing=true",  # the backward repeats the all-to-alls
        ],
        2,
    ),
    "a sequence-parallel pair + 1 worker": (
        1,
        3,
        ["train.sequence_parallel=2", "runtime.rollout_ranks=1"],
        1,
    ),
}
"""name: (nodes, processes per node, settings, the rank killed)."""


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_a_topology_resumes_after_a_kill_and_matches_one_process(name, tmp_path, one_process):
    nodes, per_node, extra, victim = TOPOLOGIES[name]
    run = tmp_path / "run"
    procs = _start(_commands(run, nodes, per_node, extra), tmp_path / "trace-killed")
    _kill_after(run, procs, victim, KILL_AFTER)
    codes, said = _finish(procs)
    assert any(codes), said[-4000:]
    logged = [r["step"] for r in _logged(run)]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) < STEPS, said[-3000:]
    assert check(tmp_path / "trace-killed", complete=False) == []

    procs = _start(
        _commands(run, nodes, per_node, [*extra, "--resume"]), tmp_path / "trace-resumed"
    )
    codes, said = _finish(procs)
    assert codes == [0] * nodes, said[-4000:]
    violations = check(tmp_path / "trace-resumed")
    assert violations == [], "\n".join(map(str, violations))
    if "sequence_parallel" in " ".join(extra):  # attention's all-to-alls ran on every trainer
        for rank in range(nodes * per_node - _rollout_ranks(extra)):
            trace = (tmp_path / "trace-resumed" / f"rank-{rank}.jsonl").read_text()
            assert '"op": "all_to_all_single"' in trace, rank

    rows = _logged(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once, in order
    if "rollout_ranks" in " ".join(extra):
        assert [r["staleness"] for r in rows if r["phase"] == "rl"] == [0] * (STEPS - 2)
    _assert_close_rows(_comparable(rows), _comparable(_logged(one_process)))
    want, have = (
        read_model_state(latest_checkpoint(one_process)),
        read_model_state(latest_checkpoint(run)),
    )
    assert latest_checkpoint(run).step == STEPS and want.keys() == have.keys()
    for key in want:
        torch.testing.assert_close(
            have[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}"
        )
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["label"] for e in evals] == ["start", "after warm start", "end"]
    want_evals = [json.loads(x) for x in (one_process / "eval.jsonl").read_text().splitlines()]
    assert evals == want_evals  # three eval packs split over the ranks, keyed: the same summary
