"""The checker of NCCL's rules (cod_fast.distributed.comm_check) and the recorder behind it
(cod_fast.distributed.comm_trace): each rule on small traces written by hand (flagged when broken, silent
when kept), the three defects of an asynchronous run with two trainers recorded from the code
before they were fixed (commit eb02691), and the recorder on a real process group.

The split rule modelled is torch 2.14.0's (torch/distributed/distributed_c10d.py
`_new_process_group_helper`: a rank outside a new group performs a no-color ncclCommSplit of a
device-bound default communicator; a member splits it when the group is NCCL, not when it is
gloo; device_mesh.py `_init_one_process_group`: one split_group call per mesh dimension)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cod_fast.distributed.comm_check import check, check_trace, split_calls

DATA = Path(__file__).parents[1] / "fixtures" / "comm_traces"


def group(index, ranks, rank, backend="default", via="new_group", **extra):
    return {
        "e": "group",
        "id": index,
        "ranks": ranks,
        "backend": backend,
        "via": via,
        "member": rank in ranks,
        "site": f"test.py:{index}",
        **extra,
    }


def op(name, group_index, shapes=((4,),), *, work, is_async=False, internal=False, **extra):
    return {
        "e": "op",
        "kind": "p2p" if "send" in name or "recv" in name else "collective",
        "op": name,
        "group": group_index,
        "shapes": [list(s) for s in shapes],
        "async": is_async,
        "work": work,
        "thread": "MainThread",
        "site": "cod_fast/x.py:1",
        "internal": internal,
        **extra,
    }


def world(ranks: int, *made: tuple) -> dict[int, list[dict]]:
    """Each rank's trace: the default group, then groups (ranks, backend) made in order."""
    trace = {}
    for rank in range(ranks):
        events = [group(0, list(range(ranks)), rank, via="init")]
        for i, (members, backend) in enumerate(made, start=1):
            events.append(group(i, members, rank, backend))
        trace[rank] = events
    return trace


def rules(found) -> list[str]:
    return [v.rule for v in found]


def test_a_gloo_group_that_leaves_out_a_rank_unbalances_the_split_calls():
    """Three ranks: an NCCL group of ranks 0-1 splits once on every rank (members join, rank 2
    takes part); a gloo group of ranks 0 and 2 splits only on rank 1, its non-member: flagged,
    naming that group. The same gloo group over every rank splits nowhere: clean."""
    bad = world(3, ([0, 1], "default"), ([0, 2], "gloo"))
    assert [split_calls(bad[r]) for r in range(3)] == [
        [("color", 1)],
        [("color", 1), ("nocolor", 2)],
        [("nocolor", 1)],
    ]
    found = check_trace(bad)
    assert rules(found) == ["split"]
    assert "rank 0: 1, rank 1: 2, rank 2: 1" in found[0].text
    assert (
        "group 2 (ranks [0, 2], gloo" in found[0].text
        and "split by ranks [1] only" in found[0].text
    )
    assert check_trace(world(3, ([0, 1], "default"), ([0, 1, 2], "gloo"))) == []


def test_one_member_gloo_groups_on_every_rank_balance():
    """vLLM's per-rank gloo groups ([0], [1], [2], one after another): each rank is outside two
    of them, so every rank makes two no-color splits: balanced, not flagged."""
    assert check_trace(world(3, ([0], "gloo"), ([1], "gloo"), ([2], "gloo"))) == []


def test_members_of_a_group_splitting_at_different_positions_are_flagged():
    """Equal counts are not enough: gloo groups [0] and [1] around NCCL group [0, 1] give both
    ranks two splits, but rank 0 joins [0, 1] in its first and rank 1 in its second, so each
    would end in a communicator of one."""
    trace = world(2, ([0], "gloo"), ([0, 1], "default"), ([1], "gloo"))
    assert [split_calls(trace[r]) for r in (0, 1)] == [
        [("color", 2), ("nocolor", 3)],
        [("nocolor", 1), ("color", 2)],
    ]
    found = check_trace(trace)
    assert rules(found) == ["split"] and "ncclCommSplit #0: ranks [0] join group 2" in found[0].text


def test_a_mesh_dimension_is_one_split_on_every_rank():
    """Mesh subgroups (made as one new_group each on the CPU) count as one split_group call per
    dimension on GPUs: members join their subgroup, the others take part. Balanced."""
    trace = {}
    for rank in range(3):
        events = [group(0, [0, 1, 2], rank, via="init")]
        events.append(group(1, [0, 1], rank, via="mesh", mesh_dim=1))
        trace[rank] = events
    assert [split_calls(trace[r]) for r in range(3)] == [
        [("color", 1)],
        [("color", 1)],
        [("nocolor", 1)],
    ]
    assert check_trace(trace) == []


def test_groups_made_in_another_order_are_flagged():
    trace = world(2, ([0, 1], "default"), ([0, 1], "gloo"))
    trace[1][1], trace[1][2] = trace[1][2], trace[1][1]
    found = check_trace(trace)
    assert rules(found) == ["groups"] and found[0].text.startswith("rank 1 made groups")


def test_collectives_must_match_in_order_op_shape_and_root():
    """The members of a group pair their collectives by position: a different op, shape or
    root at the same position is flagged; the same sequence is clean."""
    good = world(2, ([0, 1], "default"))
    for rank in (0, 1):
        good[rank] += [op("all_reduce", 1, work=1), op("broadcast", 1, work=2, src=0)]
    assert check_trace(good) == []
    for change in ({"op": "all_gather_single"}, {"shapes": [[5]]}, {"src": 1}):
        bad = {rank: [dict(e) for e in events] for rank, events in good.items()}
        bad[1][-1].update(change)
        found = check_trace(bad)
        assert rules(found) == ["sequence"], change
        assert "collective #1 on group 1" in found[0].text


def test_a_collective_a_member_never_joins_is_flagged():
    """Trainers broadcasting over the default group while the worker (rank 2) never joins: the
    defect of resuming an asynchronous run (torch's broadcast_from_rank0 over WORLD)."""
    trace = world(3)
    trace[0].append(op("broadcast_object_list", 0, (), work=1, src=0))
    trace[1].append(op("broadcast_object_list", 0, (), work=1, src=0))
    found = check_trace(trace)
    assert rules(found) == ["missing"] and "ranks [2] never join it" in found[0].text


def test_sends_and_receives_must_match():
    trace = world(2)
    trace[1].append(op("send_object_list", 0, (), work=1, dst=0))
    assert rules(check_trace(trace)) == ["p2p"]
    trace[0].append(op("recv_object_list", 0, (), work=1, src=1))
    assert check_trace(trace) == []


def pending_trace(*after: dict) -> dict[int, list[dict]]:
    """Rank 0 starts a broadcast on group 1 without waiting, then does `after`; rank 1 mirrors
    its collectives."""
    trace = world(2, ([0, 1], "default"), ([0, 1], "default"), ([0, 1], "gloo"))
    for rank in (0, 1):
        trace[rank].append(op("broadcast", 1, work=1, is_async=True, src=0))
        trace[rank] += [dict(e) for e in after if e["e"] == "op"]
    trace[0] += [e for e in after if e["e"] != "op"]
    return trace


def test_async_work_pending_across_another_group_a_device_sync_or_the_end_is_flagged():
    """Rank 0's async broadcast on group 1 is still pending when it uses group 2, synchronises
    the device, or ends: flagged each time. Waited for first: clean. Another call on the same
    group, a gloo group (CPU tensors), or FSDP2's own async calls: not flagged."""
    other = op("all_reduce", 2, work=2)
    found = check_trace(pending_trace(other))
    assert rules(found) == ["pending", "pending"]  # both ranks issued the async call
    assert "used group 2" in found[0].text
    sync = {"e": "sync", "what": "torch.cuda.synchronize", "site": "x.py:1"}
    assert "synchronised the device" in check_trace(pending_trace(sync))[0].text
    assert "ended with 1 async call" in check_trace(pending_trace())[0].text
    waits = [{"e": "wait", "work": 1, "site": "x.py:2"}]
    trace = pending_trace(other)
    for rank in (0, 1):
        trace[rank].insert(-1, *waits)
    assert check_trace(trace) == []
    for harmless in (op("all_reduce", 1, work=2), op("all_reduce", 3, work=2)):
        trace = pending_trace(harmless, *waits)
        for rank in (0, 1):
            trace[rank].append(dict(waits[0]))
        assert check_trace(trace) == [], harmless
    internal = world(2, ([0, 1], "default"), ([0, 1], "default"))
    for rank in (0, 1):
        internal[rank] += [op("all_gather_single", 1, work=1, is_async=True, internal=True)]
        internal[rank] += [op("all_reduce", 2, work=2)]
    assert check_trace(internal) == []


@pytest.mark.parametrize(
    ("name", "want"),
    [
        (
            "eb02691-async-2x1-run",
            {"split": "group 5 (ranks [0, 2], gloo", "pending": "(functional.all_gather_single"},
        ),
        ("eb02691-async-2x1-resume", {"split": "rank 1: 5", "missing": "ranks [2] never join"}),
    ],
)
def test_the_defects_of_the_code_before_the_fixes_are_flagged(name, want):
    """Recorded from commit eb02691 (2 FSDP2 trainers + 1 rollout worker, tiny model, gloo;
    `COD_FAST_COMM_TRACE=DIR torchrun --nproc_per_node 3 -m cod_fast.cli train ...
    runtime.rollout_ranks=1 train.max_staleness=1`, then the same with --resume): the gloo
    batches group left trainer 1 out (split calls 4/5/4, as the issue traced), trainer 0's
    weight broadcasts were pending while FSDP2 gathered, and the resume's optimizer broadcast
    ran over the default group that the worker never joins."""
    found = check(DATA / name)
    assert sorted(rules(found)) == sorted(want)
    for violation in found:
        assert want[violation.rule] in violation.text, violation


RECORDED = """
import os, torch, torch.distributed as dist
from cod_fast.distributed import comm_trace
assert comm_trace.install()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.new_group([0], backend="gloo")
work = dist.broadcast(torch.ones(3, 2), src=0, async_op=True)
work.wait()
dist.broadcast_object_list([{"a": 1}], src=0)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
mesh = init_device_mesh("cpu", (1,))
distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]).full_tensor()
comm_trace.device_sync("a test")
"""


@pytest.mark.slow
def test_the_recorder_writes_groups_calls_waits_and_syncs(tmp_path):
    """In a process of its own (the recorder wraps torch.distributed for good): one line per
    group, per outermost call (broadcast_object_list's inner broadcasts are not recorded), per
    wait of a recorded async call, and per device synchronisation; the checker finds nothing
    wrong. (DTensor's functional collectives, which need two ranks, are in the recorded traces
    above.)"""
    env = {**os.environ, "COD_FAST_COMM_TRACE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", RECORDED], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    events = [json.loads(x) for x in (tmp_path / "rank-0.jsonl").read_text().splitlines()]
    kinds = [(e["e"], e.get("op") or e.get("backend") or e.get("what")) for e in events]
    assert kinds[:2] == [("group", "default"), ("group", "gloo")]
    ops = [e for e in events if e["e"] == "op"]
    # distribute_tensor scatters from rank 0 (one rank: full_tensor gathers nothing)
    assert [e["op"] for e in ops] == ["broadcast", "broadcast_object_list", "scatter"]
    assert ops[0]["async"] and ops[0]["shapes"] == [[3, 2]] and ops[0]["site"] == "<string>:7"
    waits = [e for e in events if e["e"] == "wait"]
    assert [w["work"] for w in waits] == [ops[0]["work"]]
    assert events[-1] == {"e": "sync", "what": "a test", "site": "<string>:14"}
    assert check(tmp_path) == []
