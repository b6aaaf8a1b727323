"""Checkpoints in rank shards under FSDP2, gloo ranks on the CPU standing in for NCCL: `Trainer`
runs of a tiny model whose shards are uneven (334 embedding rows over 3 and 4 ranks) and empty
(6 rows of each q/k norm over 4), saved by 4 ranks and taken back by 2, by 3 and by one process;
the same world size resuming bit for bit; a rank that fails mid-write; each rank's host memory.

Each job is `_job` on every rank (torch.multiprocessing, spawned), writing what the test checks
to out/rank{r}.pt."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from cod_fast.distributed.fsdp import model_shards, model_state
from cod_fast.distributed.optim_state import optimizer_shards, optimizer_state
from cod_fast.run import sharded
from cod_fast.run.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    read_model_state,
    read_optimizer_state,
)
from cod_fast.run.sharded import INDEX, rank_file, read_index
from cod_fast.train.trainer import Trainer
from tests.dist_worker import spawn_ranks, start_rank
from tests.run.test_sharded_checkpoint import assert_same
from tests.train.test_trainer import TIMING, config

pytestmark = pytest.mark.slow  # runs, processes or benchmarks: seconds each

JOB_TIMEOUT_S = 420
MODEL = (
    "model.hidden_size=24",  # 4 heads of 6: q_norm's 6 rows are 2, 2, 2, 0 over 4 ranks
    "model.num_heads=4",
    "rollout.packs_per_step=4",
    "train.warm_start_steps=1",
    "train.steps=2",
)
STEPS = 3


def _counted(counts: dict[str, int]) -> None:
    """Count in `counts` the bytes every save brings to the host (sharded.host_rows) and the
    full tensors it gathers (DTensor.full_tensor)."""
    host, gather = sharded.host_rows, DTensor.full_tensor

    def host_rows(tensor):
        rows = host(tensor)
        counts["host"] += rows.numel() * rows.element_size()
        return rows

    def full_tensor(self, *args, **kwargs):
        counts["gathers"] += 1
        return gather(self, *args, **kwargs)

    sharded.host_rows = host_rows
    DTensor.full_tensor = full_tensor


def _fail_on_rank(rank: int) -> None:
    """Rank `rank` runs out of disk halfway through its optimizer file."""
    write = sharded.write_tensors

    def write_tensors(path, tensors):
        if path.name == rank_file("optim", rank):
            path.write_bytes(b"half a file")
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(path, tensors)

    sharded.write_tensors = write_tensors


def _save_and_fail(trainer: Trainer, run_dir: Path, got: dict) -> None:
    """Rewrite the last checkpoint counting what each rank brings to the host, then a save in
    which rank 2 fails mid-write."""
    ctx, counts = trainer.ctx, {"host": 0, "gathers": 0}
    _counted(counts)
    trainer.checkpointer.save(trainer.step, trainer.optimizer)
    shards = [
        *model_shards(trainer.policy, ctx).values(),
        *optimizer_shards(trainer.policy, trainer.optimizer, ctx)[1].values(),
    ]
    got["own_bytes"] = sum(s.local.numel() * s.local.element_size() for s in shards if s.writes)
    got["counts"] = dict(counts)
    _fail_on_rank(2)
    try:
        trainer.checkpointer.save(trainer.step + 1, trainer.optimizer)
    except CheckpointError as exc:
        got["failed"] = str(exc)
    if ctx.is_main:
        got["left"] = sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def _job(
    rank: int, world: int, port: int, run_dir: str, out: str, role: str, settings: tuple
) -> None:
    """One rank of a job: `write` (train, then _save_and_fail), `load` (take back the latest
    checkpoint), `straight`, `stop` (after step 2) or `resume` (to the end)."""
    start_rank(rank, world, port)
    trainer = Trainer(config(run_dir, *settings))
    got: dict = {}
    if role == "load":
        trainer._restore_or_start(resume=True)
    elif role == "stop":

        def stop_after_2(record):
            trainer.stop_requested = record["step"] == 2

        trainer.run(on_step=stop_after_2)
    else:
        trainer.run(resume=role == "resume")
    if role == "write":
        _save_and_fail(trainer, Path(run_dir), got)
    got["model"] = model_state(trainer.policy, trainer.ctx)
    got["optim"] = optimizer_state(trainer.policy, trainer.optimizer, trainer.ctx)
    torch.save(got, Path(out) / f"rank{rank}.pt")


def _run_job(
    world: int, run_dir: Path, out: Path, role: str, settings: tuple = MODEL
) -> list[dict]:
    """Every rank's results of one job; a rank's traceback fails the test."""
    out.mkdir(parents=True, exist_ok=True)
    args = (str(run_dir), str(out), role, settings)
    return spawn_ranks(_job, world, args, out, JOB_TIMEOUT_S, f"{world}-rank {role}")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A run trained and checkpointed by 4 ranks, then a failed save of the next step."""
    base = tmp_path_factory.mktemp("four")
    return base / "run", _run_job(4, base / "run", base / "out", "write")


def test_four_ranks_write_their_own_shards_and_nothing_whole(written):
    """Each rank's files hold its chunk rows (the index: 4 pieces of the embedding, 84, 84,
    84, 82 rows; q_norm's 2, 2, 2 and none for rank 3), and a save brings to each rank's host
    exactly its own rows of the float32 masters and AdamW moments (its shard, about a quarter
    of the whole) and gathers no full tensor."""
    run, ranks = written
    ckpt = latest_checkpoint(run)
    assert ckpt.sharded and ckpt.step == STEPS and ckpt.extra["world_size"] == 4
    index = read_index(ckpt.path / INDEX, ckpt.sizes)
    assert index.world_size == 4
    embed = index.model["model.embed_tokens.weight"]
    assert [(r, b - a) for r, a, b in embed.pieces] == [(0, 84), (1, 84), (2, 84), (3, 82)]
    norm = index.model["model.layers.0.self_attn.q_norm.weight"]
    assert [r for r, _, _ in norm.pieces] == [0, 1, 2]
    assert index.optim["model.embed_tokens.weight", "exp_avg_sq"].pieces == embed.pieces
    whole = sum(t.numel() * t.element_size() for t in ranks[0]["model"].values())
    for r, rank in enumerate(ranks):
        assert rank["counts"]["gathers"] == 0, r
        assert rank["counts"]["host"] == rank["own_bytes"], r
        assert 3 * whole / 4 * 0.9 < rank["own_bytes"] < 3 * whole / 4 * 1.1, r  # model + 2 moments


def test_a_rank_failing_mid_write_fails_the_save_everywhere_and_keeps_the_last(written):
    """Rank 2 runs out of disk halfway through its file: every rank raises CheckpointError
    with the one line naming rank 2 and the cause, the half-written folder is gone, and the
    previous checkpoint is still the latest, whole (the loads below read it)."""
    run, ranks = written
    for rank in ranks:
        said = rank["failed"]
        assert "\n" not in said and said.startswith("rank 2: could not write the checkpoint")
        assert "No space left on device" in said
    assert ranks[0]["left"] == ["latest", *(f"step-000000{s}" for s in range(1, STEPS + 1))]
    assert latest_checkpoint(run).step == STEPS


@pytest.mark.parametrize("world", [2, 3])
def test_other_world_sizes_load_the_same_weights_and_optimizer(written, tmp_path, world):
    """2 and 3 ranks resuming the 4-rank checkpoint (each reading its own rows) hold,
    gathered, exactly its model and AdamW state."""
    run, four = written
    ranks = _run_job(world, run, tmp_path, "load")
    assert_same(ranks[0]["model"], four[0]["model"])
    assert_same(ranks[0]["optim"], four[0]["optim"])


def test_one_process_gathers_the_four_rank_checkpoint(written):
    """One process (no torchrun) reads the 4-rank checkpoint whole, as export does, and a
    Trainer resuming it in one process holds exactly the 4 ranks' model and AdamW state (its
    fused AdamW keeps its own `fused` flag: how it steps, not what)."""
    run, four = written
    ckpt = latest_checkpoint(run)
    assert_same(read_model_state(ckpt), four[0]["model"])
    assert_same(read_optimizer_state(ckpt), four[0]["optim"])
    trainer = Trainer(config(run, *MODEL))
    try:
        trainer._restore_or_start(resume=True)
        assert_same(model_state(trainer.policy, trainer.ctx), four[0]["model"])
        got = optimizer_state(trainer.policy, trainer.optimizer, trainer.ctx)
        assert_same(got["state"], four[0]["optim"]["state"])
        assert [g.pop("fused") for g in got["param_groups"]] == [True]
        want = [
            {k: v for k, v in g.items() if k != "fused"} for g in four[0]["optim"]["param_groups"]
        ]
        assert_same(got["param_groups"], want)
    finally:
        trainer.close()


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in lines]


def test_two_ranks_resume_bit_for_bit_in_mixed_precision(tmp_path):
    """2 ranks in mixed precision (bf16 compute, float32 masters), stopped after step 2 and
    resumed from their rank shards, end with the uninterrupted run's weights, optimizer and
    logged metrics bit for bit; the shards hold the float32 masters."""
    mixed = (*MODEL, "model.dtype=bfloat16")
    straight = _run_job(2, tmp_path / "a", tmp_path / "out-a", "straight", mixed)
    _run_job(2, tmp_path / "b", tmp_path / "out-b", "stop", mixed)
    stopped = latest_checkpoint(tmp_path / "b")
    assert stopped.step == 2 and stopped.sharded
    index = read_index(stopped.path / INDEX, stopped.sizes)
    assert {e.dtype for e in index.model.values()} == {torch.float32}
    assert stopped.extra["compute_dtype"] == "bfloat16"
    resumed = _run_job(2, tmp_path / "b", tmp_path / "out-c", "resume", mixed)
    assert_same(resumed[0]["model"], straight[0]["model"])
    assert_same(resumed[0]["optim"], straight[0]["optim"])
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b")


def test_whole_format_under_torchrun_is_written_by_the_main_rank(tmp_path):
    """runtime.checkpoint_format=whole (a run directory on the first node's own disk): 2 ranks
    gather to the main rank, which writes the one-process format, and it holds the ranks'
    final weights."""
    whole = (*MODEL, "runtime.checkpoint_format=whole")
    ranks = _run_job(2, tmp_path / "run", tmp_path / "out", "straight", whole)
    ckpt = latest_checkpoint(tmp_path / "run")
    assert not ckpt.sharded and (ckpt.path / "model.safetensors").is_file()
    assert not list(ckpt.path.glob("model-rank*"))
    assert_same(read_model_state(ckpt), ranks[0]["model"])
    assert_same(read_optimizer_state(ckpt), ranks[0]["optim"])
