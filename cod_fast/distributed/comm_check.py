"""Check a run's recorded torch.distributed traffic (cod_fast.distributed.comm_trace) against the rules NCCL
imposes on a GPU run, so that a topology tried on the CPU over gloo (which forgives all of them)
is known not to hang on GPUs (docs/gpu.md, "Tested topologies, and NCCL's rules checked on the
CPU").

`check(folder)` reads every `rank-R.jsonl` and returns one `Violation` per broken rule:
- `groups`: the ranks made different groups, or made them in a different order;
- `split`: group creation is unbalanced under torch's split rule for a default group bound to a
  device (init_process_group(device_id=...), as cod-fast does on CUDA). The rule modelled is
  torch 2.14.0's, torch/distributed/distributed_c10d.py `_new_process_group_helper`: every rank
  that is NOT a member of a new group performs a no-color `ncclCommSplit` on the default
  communicator; a member splits it too when the new group is NCCL (`_create_nccl_process_group`
  passes `split_from`), but not when the group is gloo (`_create_gloo_process_group` ignores
  it); a device mesh dimension is one `split_group` call on every rank (device_mesh.py
  `_init_one_process_group`). `ncclCommSplit` is collective over the parent, so every rank must
  make the same sequence of splits, or the ranks that make one more block in it;
- `sequence`: the members of a group issued different collectives at the same position (op,
  shapes, root), so they would pair up wrongly;
- `missing`: a collective ran on a group that contains a rank that never joins it (that rank's
  sequence on the group ends first), so the others wait until the group's timeout;
- `p2p`: sends and receives between two ranks of a group do not match in number;
- `pending`: work started without waiting (`async_op=True`, by code outside torch) on a group
  that is NCCL on a GPU was still pending when the same rank used another such group,
  synchronised the device, or ended. torch documents that async work must be synchronised with
  `work.wait()` before another process group is used; a device synchronisation waits for the
  pending work itself, so the rank stalls until its peers join.
Groups asked for with backend gloo are CPU groups on a GPU run too: only `pending` skips them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Violation:
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.text}"


def read_trace(folder: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's events, in the order the rank recorded them (a last line that a killed
    process left half written is dropped)."""
    trace = {}
    for path in sorted(Path(folder).glob("rank-*.jsonl")):
        rank = int(path.stem.removeprefix("rank-"))
        lines = path.read_text().splitlines()
        if lines and not lines[-1].endswith("}"):
            lines.pop()
        trace[rank] = [json.loads(line) for line in lines if line.strip()]
    if not trace:
        raise ValueError(
            f"{folder} holds no rank-*.jsonl: was COD_FAST_COMM_TRACE set for the run?"
        )
    return trace


def check(folder: str | Path, complete: bool = True) -> list[Violation]:
    return check_trace(read_trace(folder), complete)


def check_trace(trace: dict[int, list[dict[str, Any]]], complete: bool = True) -> list[Violation]:
    """Every broken rule of `trace`. `complete=False` for a run that was killed: its ranks
    stopped at different points, so calls some ranks made last (`missing`, `p2p`, `pending` at
    the end) are not held against the others."""
    groups = _groups(trace)
    found = _group_agreement(trace, complete)
    if found:  # the rest assumes one list of groups
        return found
    found += _splits(trace, groups, complete)
    found += _sequences(trace, groups, complete)
    if complete:
        found += _point_to_point(trace)
    found += _pending(trace, groups, complete)
    return found


def _made(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["e"] == "group"]


def _groups(trace) -> dict[int, dict[str, Any]]:
    """Group index -> its creation (as rank 0, or the lowest rank, recorded it)."""
    return {g["id"]: g for g in _made(trace[min(trace)])}


def _label(group: dict[str, Any]) -> str:
    ranks = group["ranks"]
    gloo = ", gloo" if group["backend"] == "gloo" else ""
    return f"group {group['id']} (ranks {ranks}{gloo}, made at {group.get('site', 'init')})"


def _group_agreement(trace, complete: bool) -> list[Violation]:
    want = [(g["ranks"], g["backend"]) for g in _made(trace[min(trace)])]
    found = []
    for rank, events in trace.items():
        have = [(g["ranks"], g["backend"]) for g in _made(events)]
        shorter = min(len(have), len(want))
        if have != want and (complete or have[:shorter] != want[:shorter]):
            pairs = zip(have, want, strict=False)
            at = next((i for i, (a, b) in enumerate(pairs) if a != b), shorter)
            found.append(
                Violation(
                    "groups",
                    f"rank {rank} made groups {have[at : at + 2]} at position {at} where rank "
                    f"{min(trace)} made {want[at : at + 2]}: every rank must make the same groups in "
                    "the same order",
                )
            )
    return found


def split_calls(events: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The ncclCommSplit calls this rank would make on a device-bound default communicator
    (module docstring), in order: ("color", group index) joins the new group's communicator,
    ("nocolor", group index) only takes part in the split."""
    calls: list[tuple[str, Any]] = []
    mesh_calls: dict[int, int] = {}
    for group in _made(events):
        if group["via"] == "init":
            continue
        if group["via"] == "mesh":  # one split_group call per mesh dimension, on every rank
            at = mesh_calls.setdefault(group["mesh_dim"], len(calls))
            if at == len(calls):
                calls.append(("nocolor", group["id"]))
            if group["member"]:
                calls[at] = ("color", group["id"])
        elif not group["member"]:
            calls.append(("nocolor", group["id"]))
        elif group["backend"] != "gloo":
            calls.append(("color", group["id"]))
    return calls


def _splits(trace, groups, complete: bool) -> list[Violation]:
    calls = {rank: split_calls(events) for rank, events in trace.items()}
    counts = {rank: len(c) for rank, c in calls.items()}
    if not complete:  # compare what every rank got to
        calls = {rank: c[: min(counts.values())] for rank, c in calls.items()}
    elif len(set(counts.values())) > 1:
        shown = ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items()))
        return [
            Violation(
                "split",
                f"unbalanced ncclCommSplit calls on the default communicator under a "
                f"device-bound default group (torch 2.14 rule): {shown}{_first_unbalanced(calls, groups)}",
            )
        ]
    found = []
    for position in range(len(next(iter(calls.values())))):
        colors: dict[Any, set[int]] = defaultdict(set)
        for rank, ranks_calls in calls.items():
            kind, index = ranks_calls[position]
            if kind == "color":
                colors[index].add(rank)
        for index, ranks in sorted(colors.items()):
            members = {r for r in groups[index]["ranks"] if r in calls}
            if ranks != members:
                late = sorted(members - ranks)
                found.append(
                    Violation(
                        "split",
                        f"ncclCommSplit #{position}: ranks {sorted(ranks)} join {_label(groups[index])} "
                        f"while its members {late} split for another group there",
                    )
                )
                return found
    return found


def _first_unbalanced(calls, groups) -> str:
    """The first group whose making splits the default communicator on some ranks only."""
    by_group: dict[Any, set[int]] = defaultdict(set)
    for rank, ranks_calls in calls.items():
        for _, index in ranks_calls:
            by_group[index].add(rank)
    for index in sorted(groups):
        splitting = by_group.get(index, set())
        if splitting and splitting != set(calls) and groups[index]["via"] != "mesh":
            return f"; first unbalanced: {_label(groups[index])}, split by ranks {sorted(splitting)} only"
    return ""


def _signature(event: dict[str, Any]) -> tuple:
    root = event.get("src", event.get("root", event.get("group_src")))
    return event["op"], json.dumps(event["shapes"]), root


def _describe(event: dict[str, Any]) -> str:
    return f"{event['op']} {event['shapes']} at {event['site']}"


def _collectives(events: Iterable[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    out = defaultdict(list)
    for e in events:
        if e["e"] == "op" and e["kind"] == "collective":
            out[e["group"]].append(e)
    return out


def _sequences(trace, groups, complete: bool) -> list[Violation]:
    per_rank = {rank: _collectives(events) for rank, events in trace.items()}
    found = []
    for index, group in sorted(groups.items()):
        members = [r for r in group["ranks"] if r in per_rank]
        runs = {r: per_rank[r].get(index, []) for r in members}
        if not any(runs.values()):
            continue
        length = max(len(seq) for seq in runs.values())
        for position in range(length):
            at = {r: seq[position] if position < len(seq) else None for r, seq in runs.items()}
            absent = sorted(r for r, e in at.items() if e is None)
            present = {r: e for r, e in at.items() if e is not None}
            if absent and not complete:
                break
            if absent:
                first = present[min(present)]
                found.append(
                    Violation(
                        "missing",
                        f"collective #{position} on {_label(group)}: {_describe(first)} by ranks "
                        f"{sorted(present)}; ranks {absent} never join it",
                    )
                )
                break
            if len({_signature(e) for e in present.values()}) > 1:
                shown = "; ".join(f"rank {r}: {_describe(e)}" for r, e in sorted(present.items()))
                found.append(
                    Violation(
                        "sequence", f"collective #{position} on {_label(group)} differs: {shown}"
                    )
                )
                break
    return found


def _point_to_point(trace) -> list[Violation]:
    sends, recvs = defaultdict(int), defaultdict(int)
    for rank, events in trace.items():
        for e in events:
            if e["e"] != "op" or e["kind"] != "p2p":
                continue
            peer = e.get("dst", e.get("src", e.get("root")))
            if e["op"] in ("send", "isend", "send_object_list"):
                sends[(e["group"], rank, peer)] += 1
            else:
                recvs[(e["group"], peer, rank)] += 1
    found = []
    for key in sorted(set(sends) | set(recvs), key=str):
        if sends[key] != recvs[key]:
            group, src, dst = key
            found.append(
                Violation(
                    "p2p",
                    f"group {group}: {sends[key]} sends from rank {src} to rank {dst}, "
                    f"{recvs[key]} receives of them",
                )
            )
    return found


def _pending(trace, groups, complete: bool) -> list[Violation]:
    gpu_groups = {i for i, g in groups.items() if g["backend"] != "gloo"}
    found = []
    for rank, events in sorted(trace.items()):
        pending: dict[int, dict[str, Any]] = {}
        for e in events:
            if e["e"] == "wait":
                pending.pop(e["work"], None)
                continue
            used = e if e["e"] == "sync" or (e["e"] == "op" and e["group"] in gpu_groups) else None
            if used is not None:
                stale = [
                    p
                    for p in pending.values()
                    if used["e"] == "sync" or p["group"] != used["group"]
                ]
                if stale:
                    first = stale[0]
                    what = (
                        f"synchronised the device ({used['what']} at {used['site']})"
                        if used["e"] == "sync"
                        else f"used group {used['group']} ({_describe(used)})"
                    )
                    found.append(
                        Violation(
                            "pending",
                            f"rank {rank} {what} while {len(stale)} async call(s) on group "
                            f"{first['group']} were pending (first: {_describe(first)}); wait "
                            "for them first",
                        )
                    )
                    break
            mine = e["e"] == "op" and e.get("async") and not e.get("internal")
            if mine and "work" in e and e["group"] in gpu_groups:
                pending[e["work"]] = e
        else:
            if pending and complete:
                first = next(iter(pending.values()))
                found.append(
                    Violation(
                        "pending",
                        f"rank {rank} ended with {len(pending)} async call(s) on group "
                        f"{first['group']} never waited for (first: {_describe(first)})",
                    )
                )
    return found


def main(argv: list[str] | None = None) -> int:
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m cod_fast.distributed.comm_check TRACE_DIR", file=sys.stderr)
        return 2
    found = check(args[0])
    for violation in found:
        print(violation)
    print(f"{len(found)} violation(s)")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
