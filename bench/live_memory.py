"""Live tensor bytes during a piece of work, counted on any device: what the memory plan
(cod_fast.train.memory_plan) is checked against on a machine without a GPU.

`LiveBytes` is a TorchDispatchMode: every tensor an operation returns has its storage counted
once, until the storage is freed (a weak reference's callback), so `peak` is the most bytes of
storage alive at once, as `torch.cuda.max_memory_allocated` reads it on a GPU without the
allocator's rounding. Tensors that exist before the mode starts (weights, optimizer state) are
counted by `track(...)`; views share their base's storage and count nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages; `peak` since the last `reset_peak()`."""

    def __init__(self):
        super().__init__()
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors made before the mode started (weights, gradients, optimizer state)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor)
        return out

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        ref = self._refs.get(key)
        if ref is not None and ref() is storage:
            return
        nbytes = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _, k=key, n=nbytes: self._free(k, n))
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _free(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.current -= nbytes


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of an optimizer's state (AdamW's moments and step counts)."""
    return [v for state in optimizer.state.values() for v in state.values()]
