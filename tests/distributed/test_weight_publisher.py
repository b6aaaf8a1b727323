"""The trainer's weight broadcasts (cod_fast.distributed.channel.WeightPublisher) when the
rollout worker that should take them is dead: the publish fails and leaves no broadcast pending,
so the trainer can checkpoint on its own group (NCCL's rule, checked on the recorded trace)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cod_fast.distributed import comm_trace
from cod_fast.distributed.channel import WeightPublisher
from cod_fast.distributed.comm_check import check_trace, read_trace
from tests.dist_worker import spawn_ranks, start_rank


def _rank(rank: int, world: int, port: int, out: str) -> None:
    start_rank(rank, world, port)
    os.environ[comm_trace.ENV] = str(Path(out) / "trace")
    comm_trace.install()
    dist.init_process_group("gloo")
    weights = dist.new_group([0, 1])
    own = dist.new_group([0])
    dist.barrier()
    if rank == 1:  # the worker dies before it takes the weights
        torch.save({}, Path(out) / "rank1.pt")
        os._exit(0)
    time.sleep(1.0)  # the worker's end closes the connection
    publisher = WeightPublisher(weights, torch.float32)
    sizes = [(3, 5), (7,), (2, 2, 2), (11,)]
    publisher.publish(((str(i), torch.randn(s)) for i, s in enumerate(sizes)), True, 0)
    error = None
    try:
        publisher.flush(arrived=0)
    except RuntimeError as exc:
        error = str(exc)
    total = torch.ones(1)
    dist.all_reduce(total, group=own)  # the checkpoint's collectives on the trainers' group
    torch.save({"error": error, "total": total.item()}, Path(out) / "rank0.pt")
    os._exit(0)  # the default group has a dead member: no orderly shutdown


@pytest.mark.slow  # two processes: ~8 s
def test_a_failed_publish_leaves_no_broadcast_pending(tmp_path):
    results = spawn_ranks(_rank, 2, (str(tmp_path),), tmp_path, 120, "weight publisher")
    assert results[0]["error"], "the broadcast to a dead worker did not fail"
    assert results[0]["total"] == 1.0
    trace = read_trace(tmp_path / "trace")
    broadcasts = [e for e in trace[0] if e["e"] == "op" and e.get("async")]
    assert len(broadcasts) == 4
    assert check_trace(trace, complete=False) == []
