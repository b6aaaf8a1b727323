"""A per-rank record of a run's torch.distributed traffic, for checking it against NCCL's rules
on the CPU (cod_fast.distributed.comm_check; docs/gpu.md, "Tested topologies, and NCCL's rules checked on
the CPU").

`COD_FAST_COMM_TRACE=DIR` turns it on: `install()` (called by init_distributed before the
process group exists) wraps torch.distributed so that every process appends one JSON line per
event to `DIR/rank-R.jsonl` (R its global rank):
- `group`: a process group made (the default one, `new_group`, or one subgroup of a device
  mesh dimension), with its global ranks, the backend asked for (`default` or `gloo`), and
  whether this rank is a member;
- `op`: a collective or point-to-point call (torch.distributed's and the functional ones DTensor
  uses), with its group, shapes, root or peer, whether it was started without waiting
  (`async_op`), the first calling frame outside torch (`site`) and whether torch itself made
  the call (`internal`: FSDP2's own collectives);
- `wait`: `Work.wait()` on such a call;
- `sync`: a device-wide synchronisation (torch.cuda.synchronize or empty_cache, or a place that
  synchronises the device on a GPU: `device_sync`).
Only the outermost call is recorded (broadcast_object_list's own broadcasts are not). Without
the variable nothing is wrapped and `device_sync` does nothing.

It replaces torch.distributed's functions in their modules (and `Work.wait`, DeviceMesh's group
maker, torch.cuda's synchronisations) because that is the one place that sees the calls torch
makes itself (FSDP2's gathers, DTensor's functional collectives) at no cost per tensor op, as a
dispatch mode would have. It is a debugging tool, on only when asked for.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ENV = "COD_FAST_COMM_TRACE"
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "scatter",
    "scatter_object_list",
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "send_object_list", "recv_object_list")
FUNCTIONAL = (
    "all_reduce",
    "all_gather_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
    "broadcast",
)
"""torch.distributed._functional_collectives, which DTensor calls (full_tensor, redistribute)."""
ROOTS = ("src", "dst", "group_src", "group_dst")
TORCH_DIR = str(Path(torch.__file__).parent)


class _Recorder:
    def __init__(self, folder: Path):
        self.folder = folder
        self.file = None
        self.lock = threading.Lock()
        self.local = threading.local()
        self.groups: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        """Each group's index (not holding it: a group outliving the run aborts the process)."""
        self.names: dict[str, int] = {}
        self.made = 0
        self.works = 0
        self.mesh_dims = 0
        self.early: list[dict[str, Any]] = []
        """Events before the default group gives the rank (the file's name)."""
        self.work_ids: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        """Each recorded Work's number (Work takes no attributes of its own)."""

    def write(self, event: dict[str, Any]) -> None:
        with self.lock:
            if self.file is None:  # the rank is known once the default group exists
                if not dist.is_initialized():
                    self.early.append(event)
                    return
                self.folder.mkdir(parents=True, exist_ok=True)
                path = self.folder / f"rank-{dist.get_rank()}.jsonl"
                self.file = path.open("a", buffering=1)
                for early in self.early:
                    self.file.write(json.dumps(early) + "\n")
                self.early.clear()
            self.file.write(json.dumps(event) + "\n")

    @property
    def depth(self) -> int:
        return getattr(self.local, "depth", 0)

    def group_index(self, group: Any) -> int | str:
        if group is None or group is dist.GroupMember.WORLD:
            group = dist.distributed_c10d._get_default_group()
        if isinstance(group, str):
            return self.names.get(group, group)
        if isinstance(group, tuple):  # (DeviceMesh, dim), as funcol takes it
            return self.group_index(group[0].get_group(group[1]))
        if hasattr(group, "get_group") and not isinstance(group, dist.ProcessGroup):
            return self.group_index(group.get_group())
        if isinstance(group, list):
            return f"ranks {group}"
        known = self.groups.get(group)
        return known if known is not None else f"unknown {getattr(group, 'group_name', '?')}"

    def add_group(self, group: Any, ranks: list[int], backend: str, via: str, **extra) -> None:
        index = self.made
        self.made += 1
        member = isinstance(group, dist.ProcessGroup)
        if member:
            self.groups[group] = index
            self.names[group.group_name] = index
        event = {"e": "group", "id": index, "ranks": ranks, "backend": backend, "via": via}
        self.write({**event, "member": member, **extra})


_recorder: _Recorder | None = None


def _site() -> str:
    """The first frame outside torch.distributed and this module: who made the call."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH_DIR) and name != __file__:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _shapes(args: tuple, kwargs: dict) -> list[list[int]]:
    out = []
    for value in [*args, *kwargs.values()]:
        items = value if isinstance(value, list | tuple) else [value]
        out += [list(t.shape) for t in items if isinstance(t, torch.Tensor)]
    return out


def _wrap_op(name: str, fn, kind: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        rec = _recorder
        if rec is None or rec.depth:
            return fn(*args, **kwargs)
        group = kwargs.get("group")
        if group is None:
            group = _positional(fn, args, ("group", "pg"))
        event: dict[str, Any] = {
            "e": "op",
            "kind": kind,
            "op": name,
            "group": rec.group_index(group),
            "shapes": [] if "object" in name else _shapes(args, kwargs),
            "async": bool(kwargs.get("async_op")) or name in ("isend", "irecv"),
            "thread": threading.current_thread().name,
            "site": _site(),
            # torch's own call (FSDP2's prefetching all-gathers, say), which orders its streams
            "internal": sys._getframe(1).f_code.co_filename.startswith(TORCH_DIR),
        }
        for key in ROOTS:
            if kwargs.get(key) is not None:
                event[key] = kwargs[key]
        root = _positional(fn, args, ("src", "dst"))
        if root is not None:
            event.setdefault("root", root)
        with rec.lock:
            rec.works += 1
            event["work"] = rec.works
        rec.write(event)  # before the call: a call that hangs or fails was still issued
        rec.local.depth = 1
        try:
            result = fn(*args, **kwargs)
        finally:
            rec.local.depth = 0
        if isinstance(result, dist.Work):
            rec.work_ids[result] = event["work"]
        return result

    return wrapper


def _parameters(fn) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


@functools.cache
def _parameter_index(fn, name: str) -> int | None:
    names = _parameters(fn)
    return names.index(name) if name in names else None


def _positional(fn, args: tuple, names: tuple[str, ...]) -> Any:
    """The first of the parameters `names` that the call passed by position, or None."""
    for name in names:
        index = _parameter_index(fn, name)
        if index is not None and index < len(args):
            return args[index]
    return None


def _wrap_wait(fn):
    @functools.wraps(fn)
    def wait(self, *args, **kwargs):
        rec = _recorder
        trace_id = rec.work_ids.get(self) if rec is not None else None
        if rec is not None and trace_id is not None:
            rec.write({"e": "wait", "work": trace_id, "site": _site()})
        return fn(self, *args, **kwargs)

    return wait


def _wrap_group_helper(fn):
    """distributed_c10d._new_group_with_tag: every new_group, DeviceMesh's too."""

    @functools.wraps(fn)
    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        group = fn(ranks, timeout, backend, *args, **kwargs)
        rec = _recorder
        if rec is not None:
            world = dist.get_world_size()
            members = sorted(ranks) if ranks else list(range(world))
            asked = "default" if backend is None else str(backend).lower()
            mesh = getattr(rec.local, "mesh_dim", None)
            via = "new_group" if mesh is None else "mesh"
            extra = {} if mesh is None else {"mesh_dim": mesh}
            rec.add_group(group, members, asked, via, **extra, site=_site())
        return group

    return new_group


def _wrap_mesh_dim(fn):
    """DeviceMesh._init_one_process_group: one mesh dimension, whose subgroups torch makes with
    one split_group call per rank when the default group is bound to a GPU, and with a new_group
    per subgroup otherwise (torch 2.13-2.14 device_mesh.py)."""

    @functools.wraps(fn)
    def init_dim(*args, **kwargs):
        rec = _recorder
        if rec is None:
            return fn(*args, **kwargs)
        rec.mesh_dims += 1
        rec.local.mesh_dim = rec.mesh_dims
        try:
            return fn(*args, **kwargs)
        finally:
            rec.local.mesh_dim = None

    return staticmethod(init_dim)


def _wrap_init(fn):
    @functools.wraps(fn)
    def init_process_group(*args, **kwargs):
        result = fn(*args, **kwargs)
        rec = _recorder
        if rec is not None:
            world = dist.get_world_size()
            default = dist.distributed_c10d._get_default_group()
            rec.add_group(default, list(range(world)), "default", "init")
        return result

    return init_process_group


def _wrap_sync(fn, what: str):
    @functools.wraps(fn)
    def sync(*args, **kwargs):
        device_sync(what)
        return fn(*args, **kwargs)

    return sync


def device_sync(what: str) -> None:
    """Note a device-wide synchronisation (a place that synchronises the GPU even where this
    run is on the CPU: vLLM's sleep and wake, a CUDA graph capture); nothing when not tracing."""
    if _recorder is not None:
        _recorder.write({"e": "sync", "what": what, "site": _site()})


def install() -> bool:
    """Wrap torch.distributed if COD_FAST_COMM_TRACE names a folder (once per process);
    whether the recorder is on."""
    global _recorder
    folder = os.environ.get(ENV)
    if not folder or _recorder is not None:
        return _recorder is not None
    _recorder = _Recorder(Path(folder))
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh

    for module in (dist, c10d):
        for kind, names in (("collective", COLLECTIVES), ("p2p", POINT_TO_POINT)):
            for name in names:
                original = getattr(c10d, name, None)
                if original is not None:
                    setattr(module, name, _wrap_op(name, original, kind))
        module.init_process_group = _wrap_init(c10d.init_process_group)
    for name in FUNCTIONAL:
        original = getattr(funcol, name, None)
        if original is not None:
            setattr(funcol, name, _wrap_op(f"functional.{name}", original, "collective"))
    c10d._new_group_with_tag = _wrap_group_helper(c10d._new_group_with_tag)
    DeviceMesh._init_one_process_group = _wrap_mesh_dim(DeviceMesh._init_one_process_group)
    dist.Work.wait = _wrap_wait(dist.Work.wait)
    torch.cuda.synchronize = _wrap_sync(torch.cuda.synchronize, "torch.cuda.synchronize")
    torch.cuda.empty_cache = _wrap_sync(torch.cuda.empty_cache, "torch.cuda.empty_cache")
    return True
