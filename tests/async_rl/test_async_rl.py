"""Asynchronous RL (cod_fast.async_rl): the staleness rule, its config checks, and runs under
torchrun with one trainer and one rollout worker (two gloo processes on the CPU)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cod_fast.async_rl.staleness import broadcasts, next_broadcast, ready_after, weights_version
from cod_fast.config import ConfigError
from cod_fast.config.io import load_config
from cod_fast.distributed.comm_check import check
from cod_fast.run.checkpoint import latest_checkpoint, read_model_state
from tests.rollout.test_vllm_engine import requires_vllm
from tests.train.test_trainer import FAST, metrics


def _worker_takes(first: int, last: int, k: int, n: int) -> tuple[list[int], list[int]]:
    """What a worker does under the rule: the version it samples each batch with, and every
    broadcast it receives, in order (as cod_fast.async_rl.worker.RolloutWorker.run)."""
    version, used, taken = first, [], [first]
    for batch in range(first, last + 1):
        while version < weights_version(batch, k, n, first):
            version = next_broadcast(version, n)
            taken.append(version)
        used.append(version)
    return used, taken


def _random_rules(seed: int, count: int = 50):
    """(K, N <= K + 1, the first version, the last batch) at random."""
    rng = random.Random(seed)
    for _ in range(count):
        k = rng.randint(0, 6)
        n = rng.randint(1, k + 1)
        first = rng.randint(0, 9)
        yield k, n, first, first + rng.randint(0, 30)


@pytest.mark.parametrize("seed", range(6))
def test_the_rule_bounds_staleness_and_the_worker_takes_exactly_the_broadcasts(seed):
    """For random K, N <= K + 1 and start versions: no batch is sampled with weights more than
    K versions old or newer than the batch (which the trainer could not have made yet); a
    worker that takes broadcasts until it holds V(b) lands on V(b) exactly, and the broadcasts
    it takes are exactly those the trainer makes (so no broadcast waits forever, none is
    missing)."""
    for k, n, first, last in _random_rules(seed):
        used, taken = _worker_takes(first, last, k, n)
        for batch, version in zip(range(first, last + 1), used, strict=True):
            assert version == weights_version(batch, k, n, first)
            assert batch - k <= version <= batch, (k, n, first, batch, version)
            assert version == first or version % n == 0
        made = [first] + [v for v in range(first + 1, last + 1) if broadcasts(v, last, k, n, first)]
        assert taken == made, (k, n, first, last)
        assert used == sorted(used)


@pytest.mark.parametrize("seed", range(4))
def test_the_workers_wait_for_a_broadcast_right_after_the_batch_ready_after_names(seed):
    """Trainer 0 sends a version only once every worker waits for it: `ready_after(v)` is the
    batch just before the first one sampled with v (so it has arrived when the workers wait),
    for every version the trainer broadcasts, the one they start from included."""
    for k, n, first, last in _random_rules(seed):
        _, taken = _worker_takes(first, last, k, n)
        for version in taken:
            first_use = next(
                b for b in range(first, last + 1) if weights_version(b, k, n, first) == version
            )
            assert ready_after(version, k, n, first) == first_use - 1, (k, n, first, version)


def test_zero_staleness_samples_every_batch_with_the_current_weights():
    assert [weights_version(b, 0, 1) for b in range(6)] == list(range(6))
    assert [weights_version(b, 2, 1) for b in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [weights_version(b, 3, 2) for b in range(8)] == [0, 0, 0, 0, 2, 2, 4, 4]


def test_config_refuses_staleness_without_workers_and_a_sync_interval_past_the_bound():
    with pytest.raises(ConfigError, match=r"runtime\.rollout_ranks"):
        load_config("tiny-cpu", overrides=["train.max_staleness=2"])
    with pytest.raises(ConfigError, match="sync_interval"):
        load_config(
            "tiny-cpu",
            overrides=["train.max_staleness=1", "train.sync_interval=3", "runtime.rollout_ranks=1"],
        )
    cfg = load_config(
        "tiny-cpu",
        overrides=["train.max_staleness=3", "train.sync_interval=4", "runtime.rollout_ranks=1"],
    )
    assert (cfg.train.max_staleness, cfg.train.sync_interval) == (3, 4)


SHORT = [*FAST, "train.steps=4", "runtime.checkpoint_every=0"]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _command(run_dir, overrides, ranks: int) -> list[str]:
    """`cod-fast train` of the tiny-cpu preset at SHORT's size under torchrun; `--flags` pass
    as they are, the rest as --set."""
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    args += ["--standalone", "-m", "cod_fast.cli", "train", "--preset", "tiny-cpu"]
    for override in [*SHORT, f"runtime.run_dir={run_dir}", *overrides]:
        args += [override] if override.startswith("--") else ["--set", override]
    return args


def _train(
    run_dir, *overrides: str, ranks: int = 2, trace: Path | None = None
) -> subprocess.CompletedProcess:
    """The run; with `trace`, every process records its torch.distributed traffic there."""
    args = _command(run_dir, overrides, ranks)
    env = ENV if trace is None else {**ENV, "COD_FAST_COMM_TRACE": str(trace)}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def _signal_worker(
    run_dir, overrides: list[str], after_steps: int, sig: int, ranks: int = 2
) -> tuple[int, str]:
    """Start a run of `ranks` processes, send `sig` to its rollout worker of RANK 1 once
    `after_steps` steps are logged, and wait for the run to end: (torchrun's exit code, its
    output)."""
    out = subprocess.PIPE
    args = _command(run_dir, overrides, ranks)
    proc = subprocess.Popen(args, stdout=out, stderr=out, env=ENV, start_new_session=True)
    deadline = time.monotonic() + 200
    log = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= after_steps:
            break
        time.sleep(0.2)
    pid = _worker_pid(run_dir)
    assert pid is not None
    os.kill(pid, sig)
    if sig == signal.SIGSTOP:  # once the trainer is gone, let the stopped worker take the
        trainer = rank_pid(run_dir, 0)  # SIGTERM torchrun sends (else it waits 30 s to kill)
        while trainer is not None and Path(f"/proc/{trainer}").exists():
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        os.kill(pid, signal.SIGCONT)
    try:
        stdout, stderr = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:  # leave no process behind, then fail
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, (stdout + stderr).decode()


WAITS = {"rollout_wait_s", "worker_sample_s"}
"""The asynchronous runs' own timings (metrics() leaves out the step's)."""


def _untimed(run_dir) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in WAITS} for row in metrics(run_dir)]


def _said(result: subprocess.CompletedProcess) -> str:
    return (result.stdout + result.stderr)[-4000:]


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return read_model_state(latest_checkpoint(run_dir))


@pytest.mark.slow
def test_zero_staleness_through_rollout_workers_equals_the_synchronous_run(tmp_path):
    """K = 0 through the asynchronous machinery (a trainer and a rollout worker, batches and
    weights over gloo) is the synchronous one-process run bit for bit: every logged metric and
    the final weights."""
    sync = _train(tmp_path / "sync", ranks=1)
    assert sync.returncode == 0, _said(sync)
    split = _train(tmp_path / "async", "runtime.rollout_ranks=1")
    assert split.returncode == 0, _said(split)
    got = metrics(tmp_path / "async")
    assert [r["staleness"] for r in got if r["phase"] == "rl"] == [0, 0, 0, 0]
    for r in got[2:]:  # the sampler gap again under the batch's staleness
        assert r["staleness0/sampler_gap_mean"] == r["sampler_gap_mean"]
    untimed = [
        {k: v for k, v in r.items() if not k.startswith(("staleness", "weights_version"))}
        for r in _untimed(tmp_path / "async")
    ]
    assert untimed == metrics(tmp_path / "sync")
    want, have = _weights(tmp_path / "sync"), _weights(tmp_path / "async")
    assert want.keys() == have.keys()
    for name in want:
        assert torch.equal(want[name], have[name]), name


@pytest.mark.slow
def test_bounded_staleness_never_lags_more_than_k_and_keeps_the_rule(tmp_path):
    """K = 2, sync interval 2: each RL step logs the version its batch was sampled with, which
    is the rule's V(b) (never more than 2 behind), and the run trains to its end."""
    result = _train(
        tmp_path / "run",
        "runtime.rollout_ranks=1",
        "train.max_staleness=2",
        "train.sync_interval=2",
        "train.steps=6",
    )
    assert result.returncode == 0, _said(result)
    rl = [r for r in metrics(tmp_path / "run") if r["phase"] == "rl"]
    assert [r["phase_step"] for r in rl] == [1, 2, 3, 4, 5, 6]
    versions = [r["weights_version"] for r in rl]
    assert versions == [weights_version(b, 2, 2) for b in range(6)] == [0, 0, 0, 2, 2, 4]
    assert [r["staleness"] for r in rl] == [b - v for b, v in enumerate(versions)]
    assert max(r["staleness"] for r in rl) == 2
    assert all(r["loss"] is not None for r in rl)


@pytest.mark.slow
def test_a_run_that_never_reaches_rl_ends_its_workers_cleanly(tmp_path):
    """A warm start alone (train.steps=0) with a rollout worker: the trainer tells the worker
    there is nothing to sample, and both processes end with exit code 0."""
    result = _train(tmp_path / "run", "train.steps=0", "runtime.rollout_ranks=1")
    assert result.returncode == 0, _said(result)
    assert all(r["phase"] == "warm_start" for r in metrics(tmp_path / "run"))


@pytest.mark.slow
def test_more_rollout_ranks_than_processes_is_one_line(tmp_path):
    result = _train(tmp_path / "run", "runtime.rollout_ranks=2")
    assert result.returncode != 0
    said = result.stdout + result.stderr
    assert "runtime.rollout_ranks" in said and "fewer rollout ranks than processes" in said
    # torchrun's agent prints its own traceback when a rank fails; none of cod-fast's frames.
    assert "error: runtime.rollout_ranks" in said and "cod_fast/" not in said, _said(result)


def _worker_pid(run_dir) -> int | None:
    """The rollout worker (RANK=1) of the torchrun training into `run_dir`."""
    return rank_pid(run_dir, 1)


def rank_pid(run_dir, rank: int) -> int | None:
    """The process of RANK `rank` of the torchrun training into `run_dir`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        mine = f"RANK={rank}".encode() in environ and str(run_dir).encode() in cmdline
        if mine and b"torch.distributed.run" not in cmdline:  # a rank, not its launcher
            return int(entry)
    return None


@pytest.mark.slow
def test_a_killed_worker_stops_the_run_with_a_checkpoint_and_resume_matches_the_straight_run(
    tmp_path,
):
    """SIGKILL to the rollout worker mid-run: torchrun stops the trainer, which checkpoints the
    steps it trained; `--resume` regenerates the batches in flight (the worker's sampler stream
    continues from the last batch trained on) and, at K = 0, ends with the uninterrupted run's
    metrics and weights bit for bit; no step is logged or trained twice."""
    # 2 warm-start steps and 9 RL steps: the kill after step 4 lands while 7 steps (a second
    # or more) are still to run, however fast this machine is.
    steps = ["train.steps=9", "runtime.checkpoint_every=1", "runtime.rollout_ranks=1"]
    straight = _train(tmp_path / "straight", *steps)
    assert straight.returncode == 0, _said(straight)
    run = tmp_path / "killed"
    code, said = _signal_worker(run, steps, 4, signal.SIGKILL)
    assert code != 0
    logged = [r["step"] for r in metrics(run)]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) < 11, said[-3000:]
    assert latest_checkpoint(run).step == len(logged)
    resumed = _train(run, *steps, "--resume")
    assert resumed.returncode == 0, _said(resumed)
    assert [r["step"] for r in metrics(run)] == list(range(1, 12))
    assert _untimed(run) == _untimed(tmp_path / "straight")
    want, have = _weights(tmp_path / "straight"), _weights(run)
    for name in want:
        assert torch.equal(want[name], have[name]), name


@pytest.mark.slow
@requires_vllm
def test_a_vllm_rollout_worker_samples_with_the_weights_it_was_sent(tmp_path):
    """The worker's sampler can be the vLLM engine (the CPU engine here): its engine starts from
    a folder the worker writes itself (transformers writes nothing on a global rank other than
    0), then takes every broadcast; at staleness 0 its log-probs equal the trainer's to float
    rounding, as in a synchronous vLLM run, after a warm start has moved the weights. The
    engines' own process groups (every rank starts one) keep NCCL's rules (cod_fast.distributed.comm_check)."""
    vllm = ["model.num_heads=1", "rollout.sampler=vllm", "rollout.vllm_eager=true"]
    trace = tmp_path / "trace"
    result = _train(
        tmp_path / "run", *vllm, "train.steps=2", "runtime.rollout_ranks=1", trace=trace
    )
    assert result.returncode == 0, _said(result)
    assert check(trace) == []
    rl = [r for r in metrics(tmp_path / "run") if r["phase"] == "rl"]
    assert [r["staleness"] for r in rl] == [0, 0]
    for r in rl:
        assert r["sampler_gap_mean"] < 1e-5 and r["sampler_gap_max"] < 1e-4
    assert (tmp_path / "run" / "sampler-model-rollout" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_hung_worker_stops_the_run_with_one_line_and_a_checkpoint(tmp_path):
    """SIGSTOP to the rollout worker (it hangs): after runtime.rollout_timeout_s (10 s) the trainer
    checkpoints every step it trained and stops with one line naming the rank it waited for;
    torchrun then ends the worker (continued once the trainer is gone, so that it takes
    torchrun's SIGTERM instead of waiting out torchrun's 30 s before a SIGKILL)."""
    run = tmp_path / "run"
    steps = ["train.steps=400", "runtime.checkpoint_every=5", "runtime.rollout_timeout_s=10"]
    code, said = _signal_worker(run, [*steps, "runtime.rollout_ranks=1"], 6, signal.SIGSTOP)
    assert code != 0
    logged = [r["step"] for r in metrics(run)]
    assert len(logged) < 402 and latest_checkpoint(run).step == logged[-1], said[-3000:]
    # Stopped while sampling, the trainer waits for its batch; stopped while it waits for
    # weights, for it to take them: either way one line naming the rank and the wait.
    lines = [x for x in said.splitlines() if x.startswith("error: ") and "rank(s) [1]" in x]
    assert len(lines) == 1, said[-3000:]
    assert (
        f"no batch {logged[-1] - 2} from rollout rank(s) [1] within 10 s" in lines[0]
        or "did not take the weights they wait for within 10 s" in lines[0]
    ), lines[0]


FAILING_LAKE = """
import os

from cod_fast.envs.frozenlake import FrozenLakeEnv


class FailingLake(FrozenLakeEnv):
    '''FrozenLake whose tasks fail to start in the rollout worker (RANK 1) after 40 of them.'''

    calls = 0

    def task(self, pack_seed, task_index):
        FailingLake.calls += 1
        if os.environ.get("RANK") == "1" and FailingLake.calls > 40:
            raise RuntimeError("simulated sampler failure")
        return super().task(pack_seed, task_index)
"""


@pytest.mark.slow
def test_a_worker_whose_sampling_raises_stops_the_run_in_one_line_each(tmp_path):
    """The rollout worker's driver raises in its third batch (an environment whose tasks fail
    to start, which the driver does not catch): the worker sends the error and stops; the
    trainer stops after the two batches it trained, with a checkpoint of them; each process
    says so in one line, the trainer's naming the worker, the batch and the cause."""
    env_file = tmp_path / "failing_lake.py"
    env_file.write_text(FAILING_LAKE)
    run = tmp_path / "run"
    overrides = [f"rollout.env={env_file}:FailingLake", "runtime.rollout_ranks=1"]
    result = _train(run, *overrides, "train.steps=6", "runtime.checkpoint_every=1")
    said = _said(result)
    assert result.returncode != 0, said
    trainer = [x for x in said.splitlines() if "rollout worker 0 failed on batch 2" in x]
    assert len(trainer) == 1 and "simulated sampler failure" in trainer[0], said
    worker = [x for x in said.splitlines() if x.startswith("error: rollout worker 0:")]
    assert len(worker) == 1 and "simulated sampler failure" in worker[0], said
    rl_steps = [r["phase_step"] for r in metrics(run) if r["phase"] == "rl"]
    assert rl_steps == [1, 2] and latest_checkpoint(run).step == metrics(run)[-1]["step"], said


@pytest.mark.slow
def test_a_run_that_lost_one_of_two_workers_resumes_with_one(tmp_path):
    """Two rollout workers (ranks 1 and 2 of 3), the first killed mid-run: the run stops with a
    checkpoint; `--resume` with runtime.rollout_ranks=1 (two processes) samples every batch
    with the one worker left (new sampler streams) and trains to the end, each step logged
    once, in order."""
    run = tmp_path / "run"
    steps = ["train.steps=10", "runtime.checkpoint_every=1"]
    code, said = _signal_worker(
        run, [*steps, "runtime.rollout_ranks=2"], 4, signal.SIGKILL, ranks=3
    )
    assert code != 0
    logged = [r["step"] for r in metrics(run)]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) < 12, said[-3000:]
    resumed = _train(run, *steps, "runtime.rollout_ranks=1", "--resume", ranks=2)
    assert resumed.returncode == 0, _said(resumed)
    assert [r["step"] for r in metrics(run)] == list(range(1, 13))


def _pushes(tmp_path, rollout_ranks: int) -> list[int]:
    """The steps at which a one-process Trainer pushed weights into its (train) sampler, made
    to hold its own copy, with a context of `rollout_ranks` rollout workers (the batches are
    still its own: only the trainer's treatment of its samplers is looked at)."""
    import dataclasses

    from cod_fast.distributed.context import DistContext
    from cod_fast.train.trainer import Trainer
    from tests.train.test_trainer import config

    cfg = config(tmp_path / f"run{rollout_ranks}", "train.steps=4", "runtime.eval_every=2")
    ctx = DistContext(
        rank=0,
        world_size=1,
        local_rank=0,
        device=torch.device("cpu"),
        mesh=None,
        rollout_ranks=rollout_ranks,
    )
    trainer = Trainer(cfg, ctx)
    trainer.samplers = dataclasses.replace(trainer.samplers, owns_weights=True)
    pushed, push = [], trainer.sampler.push_weights

    def counted(named):
        pushed.append(trainer.step)
        return push(named)

    trainer.sampler.push_weights = counted
    trainer.run()
    trainer.close()
    return pushed


@pytest.mark.slow
def test_trainers_beside_rollout_workers_push_weights_only_for_evaluations(tmp_path):
    """A trainer that samples its own batches pushes the new weights into a sampler holding its
    own copy after every step from the warm start's end on; a trainer beside rollout workers
    only evaluates with its sampler, so it pushes only before the evaluations that need new
    weights (at start, after the warm start, at RL step 2 and at the end), never per step."""
    assert _pushes(tmp_path, 0) == [0, 2, 3, 4, 5, 6]
    assert _pushes(tmp_path, 1) == [0, 2, 4, 6]
