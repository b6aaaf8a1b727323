"""Count what code asks of the device: dispatched aten ops, host syncs, host-to-device copies.

On a GPU every dispatched op is (at least) one kernel launch, every host sync stalls the CPU until
the device catches up, and every pageable host-to-device copy is a blocking transfer. A
`DispatchCounter` sees all three as torch dispatches them, on any device, so the counts measured
on a CPU are the launch-overhead proxy of the same code on CUDA (where the code takes the same
branches).

    with DispatchCounter() as count:
        loss.backward()
    count.total, count.syncs, count.h2d

Host syncs are the ops that need a value on the host to proceed: reading a scalar (`int(t)`,
`t.item()`, `bool(t)`, which dispatch `_local_scalar_dense`) and ops whose output shape depends on
the data (`nonzero`, `unique`, boolean-mask indexing, ...). `tensor.tolist()` on a CPU tensor
dispatches nothing (it reads memory directly), so a CPU count misses it; on CUDA it is a copy to
the host.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",  # int(t), float(t), bool(t), t.item()
        "aten.nonzero",
        "aten.nonzero_static",
        "aten._unique",
        "aten._unique2",
        "aten.unique_dim",
        "aten.unique_consecutive",
        "aten.masked_select",
        "aten.bincount",  # sizes its output from the largest value
        "aten.histc",
        "aten.repeat_interleave",  # without output_size it sizes the output from the data
        "aten.equal",
        "aten.is_nonzero",
        "aten.allclose",
    }
)
"""Ops that make the host wait for the device (on CUDA) before the next op can be issued."""

NO_KERNEL_OPS = frozenset(
    {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.lift_fresh", "aten.set_"}
)
"""Allocations and bookkeeping that launch no kernel (views are recognised by their schema)."""

_COPIES = frozenset({"aten._to_copy", "aten.copy_", "aten._copy_from"})
_MASK_INDEXING = frozenset({"aten.index", "aten.index_put", "aten.index_put_"})
"""Indexing ops that sync when an index is a boolean mask (it becomes positions via nonzero)."""


class DispatchCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active (`ops`: name -> count), those that launch a
    kernel on a GPU (`kernels`: not views such as detach or transpose, which autograd also
    dispatches, nor bare allocations), the host syncs among them (`syncs`: names, in order) and
    the copies from the CPU to another device (`h2d`)."""

    def __init__(self, host_tensors: tuple[torch.Tensor, ...] = ()):
        super().__init__()
        # Tensors that stay on the host when the rest is on a GPU (AdamW's step counts): reading
        # one is no device sync, though on a CPU nothing tells it from one that would be.
        self.host = {t.untyped_storage().data_ptr() for t in host_tensors}
        self.ops: Counter[str] = Counter()
        self.kernels: Counter[str] = Counter()
        self.syncs: list[str] = []
        self.h2d = 0

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def launches(self) -> int:
        return sum(self.kernels.values())

    def _on_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"aten.{func.overloadpacket.__name__}"
        self.ops[name] += 1
        if not (func.is_view or name in NO_KERNEL_OPS):
            self.kernels[name] += 1
        syncs = name in SYNC_OPS or (name in _MASK_INDEXING and _has_mask(args))
        if syncs and not (name == "aten._local_scalar_dense" and self._on_host(args[0])):
            self.syncs.append(name)
        out = func(*args, **kwargs)
        if name in _COPIES:
            self.h2d += _host_to_device(name, args, kwargs, out)
        return out


def _host_to_device(name: str, args, kwargs, out) -> int:
    """1 when a copy op moved data from the CPU to another device."""
    if name == "aten.copy_":  # copy_(dst, src)
        dst, src = args[0], args[1]
    else:  # _to_copy(src, ..., device=) and _copy_from(src, dst)
        src = args[0]
        dst = out if isinstance(out, torch.Tensor) else args[1]
    if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
        return 0
    return int(src.device.type == "cpu" and dst.device.type != "cpu")


def _has_mask(args) -> bool:
    """Whether an indexing op's index list holds a boolean (or uint8) mask."""
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )
