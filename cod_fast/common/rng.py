"""Random number generator state of a process, saved and restored: every generator a run uses
(python, numpy, torch CPU and CUDA), as tensors and plain data a checkpoint can hold. A state
read back from a file is checked before any generator takes it (a run directory may come from
someone else, docs/robustness.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cod_fast.common.values import described, first_words


def rng_state() -> dict[str, Any]:
    """This process's random number generator states, as tensors and plain data."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Any) -> None:
    """Set this process's generators to `state` (what rng_state returned). A state that is not
    one (a damaged or edited ranks.pt) is a ValueError saying what is wrong, raised before any
    generator is set: each part is checked for its type and size, then tried on a scratch
    generator of its kind (which knows best what it takes)."""
    if not isinstance(state, dict):
        raise ValueError(f"the random number generator state is {described(state)}, not a dict")
    python, numpy, cpu = state.get("python"), state.get("numpy"), state.get("torch")
    if not (isinstance(python, tuple) and len(python) == 3 and isinstance(python[2], float | None)):
        raise ValueError(
            f"the python generator state is {described(python)}, not a state of random's"
        )
    _tried("the python generator state", random.Random().setstate, python)
    keys = numpy.get("keys") if isinstance(numpy, dict) else None
    if not (
        isinstance(keys, torch.Tensor)
        and keys.dtype == torch.int64
        and keys.shape == (624,)
        and all(isinstance(numpy.get(k), t) for k, t in _NUMPY_FIELDS.items())
    ):
        raise ValueError("the numpy generator state is not an MT19937 state of 624 keys")
    numpy = (
        numpy["kind"],
        keys.numpy().astype(np.uint32),
        numpy["pos"],
        numpy["has_gauss"],
        numpy["cached_gaussian"],
    )
    _tried("the numpy generator state", np.random.RandomState().set_state, numpy)
    set_generator_state(torch.Generator(), cpu, "the torch generator state")
    cuda = state.get("cuda") if torch.cuda.is_available() else None
    if cuda is not None:
        if not (isinstance(cuda, list) and len(cuda) <= torch.cuda.device_count()):
            raise ValueError("the CUDA generator states are not a list of one per device")
        for i, device_state in enumerate(cuda):
            what = f"the CUDA generator state of device {i}"
            set_generator_state(torch.Generator(f"cuda:{i}"), device_state, what)
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


_NUMPY_FIELDS = {"kind": str, "pos": int, "has_gauss": int, "cached_gaussian": float}
"""rng_state's numpy entries besides its keys, and their types."""


def set_generator_state(generator: torch.Generator, state: Any, what: str) -> None:
    """`generator.set_state(state)` for a state read from a checkpoint, or ValueError naming
    `what` when it is not one: the size is checked before any value is read (a tensor can claim
    a billion elements over a storage of one)."""
    size = generator.get_state().numel()
    if not (
        isinstance(state, torch.Tensor)
        and state.dtype == torch.uint8
        and state.shape == (size,)
        and state.is_contiguous()
    ):
        raise ValueError(f"{what} is {described(state)}, not a uint8 tensor of {size} bytes")
    _tried(what, generator.set_state, state)


def _tried(what: str, setter: Callable[[Any], Any], value: Any) -> None:
    try:
        setter(value)
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise ValueError(f"{what} is not one ({first_words(exc)})") from None
