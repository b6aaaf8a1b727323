"""The optimizer's full state out of the shards and back in, checked before it is loaded.

Like the model's (cod_fast.distributed.fsdp), the optimizer's state leaves the trainer full and
unsharded, keyed by the Hugging Face parameter names (torch.distributed's format, in one process
too), so a state saved by N ranks resumes on M. Loading broadcasts it over the trainers' group
one tensor at a time and shards it like the parameters. A checkpoint in rank shards
(cod_fast.run.sharded) takes each rank's own rows instead (`optimizer_shards`,
`load_optimizer_shards`), with no communication. A state read from a file may hold
anything: it is checked against the optimizer (its groups, hyperparameters and slots, AdamW's
within their domain) on the main rank, and refused on every rank, before anything is loaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from cod_fast.distributed.context import DistContext, broadcast_object
from cod_fast.distributed.fsdp import Shard, reshard, shard_of
from cod_fast.model.policy import Policy

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _own_copy(obj: Any, device: torch.device) -> Any:
    """`obj` with copies of the tensors that may still be shared with an optimizer: all of them
    on a CPU run (moving to the CPU copies nothing), scalars (AdamW's step, kept on the CPU and
    updated in place) on any device. torch's optimizer state_dict and load_state_dict share
    such tensors, so a state would change as training goes on, or change the caller's dict."""
    if isinstance(obj, torch.Tensor):
        if device.type == "cpu" or obj.numel() == 1:
            return obj.detach().to("cpu", copy=True)
        return obj
    if isinstance(obj, dict):
        return {k: _own_copy(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_own_copy(v, device) for v in obj)
    return obj


def optimizer_state(
    policy: Policy, optimizer: torch.optim.Optimizer, ctx: DistContext
) -> dict[str, Any]:
    """The optimizer's full state keyed by Hugging Face parameter names (torch.distributed's
    format in one process too, so N ranks resume on M), CPU copies on the main rank, {} on the
    others. A never-stepped optimizer stays fresh and saves an empty "state"."""
    reshard(policy)
    fresh = not optimizer.state
    state = get_optimizer_state_dict(policy.model, optimizer, options=_FULL)
    if fresh:
        # torch initialises an empty optimizer with a zero-lr step (AdamW's step count 1);
        # undo it, so saving changes nothing and a resumed run gets a fresh optimizer too.
        optimizer.state.clear()
        state["state"] = {}
    return _own_copy(state, ctx.device) if ctx.is_main else {}


def _optimizer_mismatch(model: torch.nn.Module, optimizer, state: Any) -> str | None:
    """Why an optimizer state (read from a file: anything) does not fit `optimizer` over
    `model`'s parameters, or None: its groups name this optimizer's parameters, and hold each
    hyperparameter they have as the kind of value this optimizer's has (a float, a pair of
    floats, a flag), AdamW's within their domain (`_DOMAINS`); every parameter's entry holds
    the same slots, each a scalar or a finite floating tensor of the parameter's shape, none of
    `_NOT_NEGATIVE` below 0."""
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    expected = [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    groups = state.get("param_groups") if isinstance(state, dict) else None
    slots = state.get("state") if isinstance(state, dict) else None
    if not (
        isinstance(groups, list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        and isinstance(slots, dict)
    ):
        return "the optimizer checkpoint holds no `state` and `param_groups` of an optimizer"
    got = [[n if isinstance(n, str) else repr(n)[:40] for n in g["params"]] for g in groups]
    stray = sorted(str(n)[:80] for n in set(slots) - set(params))
    if got != expected or stray:
        foreign = sorted({n for g in got for n in g} - set(params))
        return (
            "the optimizer checkpoint does not fit this model and optimizer: parameter groups "
            f"of {[len(g) for g in got]} parameters, this optimizer has "
            f"{[len(g) for g in expected]}; names this model does not have: "
            f"{sorted({*foreign, *stray})}"
        )
    for saved, live in zip(groups, optimizer.param_groups, strict=True):
        # Flags torch fills in where a state lacks them (older versions); numbers it does not.
        needed = [k for k, v in live.items() if _is_number(v) or isinstance(v, tuple)]
        if lacking := [k for k in needed if k not in saved]:
            return f"the optimizer checkpoint's parameter group has no {lacking[0]}"
        for key, value in saved.items():
            if key in _HOW or key not in live or key == "params":
                continue
            if not _same_kind(value, live[key]):
                return (
                    f"the optimizer checkpoint's hyperparameter {key} is not a {_kind(live[key])}"
                )
            if key in _DOMAINS and not _DOMAINS[key][0](value):
                shown = repr(value)[:60]
                return f"the optimizer checkpoint's {key} is {shown}, not {_DOMAINS[key][1]}"
    if not all(isinstance(entry, dict) for entry in slots.values()):
        return "the optimizer checkpoint's state of a parameter is not a dict of slots"
    first = next(iter(slots.values()), {})
    for name, entry in slots.items():
        if entry.keys() != first.keys():
            return f"the optimizer checkpoint's state of {name} holds other slots than the rest"
        shape = params[name].shape
        for key, value in entry.items():
            tensor = isinstance(value, torch.Tensor)
            if not (_is_number(value) or (tensor and (value.dim() == 0 or value.shape == shape))):
                return (
                    f"the optimizer checkpoint's {key} of {name} is neither a scalar nor a "
                    f"tensor of the parameter's shape {tuple(shape)}"
                )
            if (problem := slot_problem(name, key, value)) is not None:
                return problem
    return None


def slot_problem(name: str, key: str, value: Any) -> str | None:
    """Why the value of slot `key` of parameter `name` (a scalar, or a tensor or rows of one) is
    not one AdamW takes, or None: a tensor must hold finite floats, and a slot of
    `_NOT_NEGATIVE` no negative value. A meta tensor (a tensor read later, in rows) is checked
    for its dtype alone; its rows are checked as they are read."""
    tensor = isinstance(value, torch.Tensor)
    if tensor and not value.is_floating_point():
        return f"the optimizer checkpoint's {key} of {name} is not all finite floats"
    if tensor and value.is_meta:
        return None
    if tensor and not bool(torch.isfinite(value).all()):
        return f"the optimizer checkpoint's {key} of {name} is not all finite floats"
    if key in _NOT_NEGATIVE and (bool((value < 0).any()) if tensor else value < 0):
        return (
            f"the optimizer checkpoint's {key} of {name} holds a negative value, "
            f"which {_NOT_NEGATIVE[key]} never is"
        )
    return None


_HOW = ("foreach", "fused", "capturable", "differentiable")
"""Flags of how this process's optimizer computes its step, not of what it computes: a state
saved under FSDP2 (`fused` None) resumes in one process (fused AdamW: `fused` True) and back,
each optimizer keeping its own flags (`_load`)."""
_DOMAINS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lr": (lambda v: v >= 0, "a learning rate of 0 or more"),
    "betas": (lambda v: all(0 <= b < 1 for b in v), "a pair of decays each in [0, 1)"),
    "eps": (lambda v: v > 0, "more than 0 (AdamW divides by the root of a sum with it)"),
    "weight_decay": (lambda v: v >= 0, "0 or more"),
}
"""AdamW's hyperparameters, and the values of their kind that AdamW takes: with another (a
finite one too) the first step turns the weights NaN or makes them grow without bound."""
_NOT_NEGATIVE = {
    "step": "a count of steps",
    "exp_avg_sq": "a mean of squares",
    "max_exp_avg_sq": "a maximum of squares",
}
"""AdamW's slots that cannot be negative: the first step takes the square root of the second
moments (a negative one makes every weight NaN) and divides by 1 - beta ** step."""


def _is_number(value: Any) -> bool:
    """A finite float, or an int (not a bool) that fits 64 bits."""
    if isinstance(value, float):
        return math.isfinite(value)
    return type(value) is int and abs(value) < 2**63


def _same_kind(value: Any, like: Any) -> bool:
    """Whether a hyperparameter read back is the kind of value this optimizer holds: a number
    for a number, a tuple of as many numbers for a tuple (Adam's betas), else the same type."""
    if _is_number(like):
        return _is_number(value)
    if isinstance(like, tuple):
        return isinstance(value, tuple) and len(value) == len(like) and all(map(_is_number, value))
    return type(value) is type(like)


def _kind(value: Any) -> str:
    if _is_number(value):
        return "number"
    if isinstance(value, tuple):
        return f"tuple of {len(value)} numbers"
    return type(value).__name__


def _optimizer_skeleton(state: dict[str, Any]) -> dict[str, Any]:
    """What every rank needs of a full optimizer state before its tensors: the hyperparameters,
    and per parameter each entry as a plain value (scalars: AdamW's step) or the (shape, dtype)
    of a tensor that follows by broadcast."""
    slots = {
        name: {
            key: (tuple(v.shape), v.dtype)
            if isinstance(v, torch.Tensor) and v.dim() > 0
            else (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
            for key, v in entries.items()
        }
        for name, entries in state["state"].items()
    }
    return {"state": slots, "param_groups": state["param_groups"]}


def load_optimizer_state(
    policy: Policy, optimizer: torch.optim.Optimizer, state: dict[str, Any], ctx: DistContext
) -> None:
    """The inverse of optimizer_state: a full state on the main rank (others may pass {}),
    broadcast over the trainers' group one tensor at a time and sharded like the parameters, so
    no rank holds more than one full tensor of it at once. ValueError on every rank when it
    does not fit.

    Not torch's set_optimizer_state_dict(broadcast_from_rank0=True): that broadcasts over the
    default group (torch 2.14 `_broadcast_state_dict(pg=None)`), which holds the rollout workers
    of an asynchronous run too, and they never join it."""
    reshard(policy)
    check = skeleton = None
    if ctx.is_main:
        check = _optimizer_mismatch(policy.model, optimizer, state)
        skeleton = _optimizer_skeleton(state) if check is None else None
    problem, skeleton = broadcast_object((check, skeleton), ctx)
    if problem is not None:
        raise ValueError(problem)
    params = dict(policy.model.named_parameters())
    loaded: dict[str, dict[str, Any]] = {}
    for name, entries in skeleton["state"].items():
        param, slots = params[name], {}
        for key, spec in entries.items():
            if not isinstance(spec, tuple):
                slots[key] = spec
                continue
            shape, dtype = spec
            if ctx.is_main:  # a copy: the caller's state must not change as training goes on
                full = state["state"][name][key].to(device=ctx.device, dtype=dtype, copy=True)
            else:
                full = torch.empty(shape, dtype=dtype, device=ctx.device)
            if ctx.distributed:
                dist.broadcast(full, src=0, group=ctx.group)
            if isinstance(param, DTensor) and tuple(param.shape) == shape:
                # This rank's shard, a copy (torch 2.13 and 2.14 clone it): `full` is freed.
                full = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                )
            slots[key] = full
        loaded[name] = slots
    _load(optimizer, loaded, skeleton["param_groups"])


def _load(
    optimizer: torch.optim.Optimizer, loaded: dict[str, dict[str, Any]], groups: list[dict]
) -> None:
    """Give `optimizer` the slots `loaded` (per parameter name, this rank's tensors) and the
    hyperparameters of `groups` (parameters by name, checked to be this optimizer's); the
    flags of how it computes (`_HOW`) stay its own."""
    groups = [
        {**saved, **{k: v for k, v in live.items() if k in _HOW}}
        for saved, live in zip(groups, optimizer.param_groups, strict=True)
    ]
    if not loaded:  # saved before any step: hyperparameters only, and a fresh optimizer
        optimizer.state.clear()
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        return
    # torch's own format: parameters numbered in param_groups order (names checked above).
    index = {name: i for i, name in enumerate(n for g in groups for n in g["params"])}
    optimizer.load_state_dict(
        {
            "state": {index[name]: slots for name, slots in loaded.items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
        }
    )


# --- this rank's rows, for checkpoints in rank shards -------------------------------------------


def optimizer_shards(
    policy: Policy, optimizer: torch.optim.Optimizer, ctx: DistContext
) -> tuple[dict[str, Any], dict[tuple[str, str], Shard]]:
    """The optimizer's state as a checkpoint in rank shards holds it, with no communication:
    its plain part (`param_groups` by parameter name, and every parameter's scalar slots such
    as AdamW's step, as copies: the same on every rank), and this rank's Shard of every tensor
    slot (AdamW's moments, sharded like their parameter), keyed (parameter name, slot)."""
    reshard(policy)
    names = {id(p): n for n, p in policy.model.named_parameters()}
    cpu = torch.device("cpu")
    groups = [
        {**{k: _own_copy(v, cpu) for k, v in g.items() if k != "params"}, "params": []}
        for g in optimizer.param_groups
    ]
    scalars: dict[str, dict[str, Any]] = {}
    tensors: dict[tuple[str, str], Shard] = {}
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        for param in group["params"]:
            name = names[id(param)]
            saved["params"].append(name)
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tensors[name, key] = shard_of(value, ctx)
                else:
                    scalars.setdefault(name, {})[key] = _own_copy(value, cpu)
    return {"state": scalars, "param_groups": groups}, tensors


_SCALAR_DTYPES = {
    str(t).removeprefix("torch."): t for t in (torch.float32, torch.float64, torch.int64)
}
"""The dtypes of the optimizer's scalar tensors (AdamW's step: float32, float64 under a float64
default dtype)."""


def plain_to_json(plain: Any) -> Any:
    """The plain part of optimizer_shards as JSON values: JSON has no tuples (AdamW's betas)
    nor tensors (its step), so a 0-dim tensor becomes {"tensor": value, "dtype": name}, and
    plain_from_json makes every list but a group's `params` a tuple again."""
    if isinstance(plain, torch.Tensor) and plain.dim() == 0:
        dtype = str(plain.dtype).removeprefix("torch.")
        if dtype not in _SCALAR_DTYPES:
            raise ValueError(f"an optimizer scalar of dtype {dtype} has no JSON form")
        return {"tensor": plain.item(), "dtype": dtype}
    if isinstance(plain, dict):
        return {k: plain_to_json(v) for k, v in plain.items()}
    if isinstance(plain, list | tuple):
        return [plain_to_json(v) for v in plain]
    if plain is None or isinstance(plain, bool | int | float | str):
        return plain
    raise ValueError(f"an optimizer value of type {type(plain).__name__} has no JSON form")


def plain_from_json(data: Any) -> dict[str, Any]:
    """plain_to_json's inverse, for JSON read from a file: ValueError for a shape it never
    writes. Whether the values fit the optimizer is check_optimizer_shapes's to say."""
    groups, state = (
        (data.get(k) for k in ("param_groups", "state")) if isinstance(data, dict) else (None, None)
    )
    if not (
        isinstance(groups, list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        and isinstance(state, dict)
        and all(isinstance(slots, dict) for slots in state.values())
    ):
        raise ValueError("it holds no `state` and `param_groups` of an optimizer")

    def decode(value: Any) -> Any:
        if isinstance(value, dict) and value.keys() == {"tensor", "dtype"}:
            number, dtype = value["tensor"], value["dtype"]
            if not (_is_number(number) and dtype in _SCALAR_DTYPES):
                raise ValueError(
                    f"it holds a scalar tensor of {repr(number)[:40]}, {repr(dtype)[:40]}"
                )
            return torch.tensor(number, dtype=_SCALAR_DTYPES[dtype])
        if isinstance(value, dict):
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return tuple(decode(v) for v in value)
        return value

    return {
        "state": {name: decode(slots) for name, slots in state.items()},
        "param_groups": [
            {k: (v if k == "params" else decode(v)) for k, v in g.items()} for g in groups
        ],
    }


def check_optimizer_shapes(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    plain: dict[str, Any],
    tensors: dict[tuple[str, str], tuple[tuple[int, ...], torch.dtype]],
) -> None:
    """ValueError, as load_optimizer_state's, when a plain part (optimizer_shards's, read back)
    and tensor slots of these full shapes and dtypes do not fit `optimizer` over the policy; the
    slots' values are checked as their rows are read (`slot_problem`). Every rank that gets the
    same arguments decides alike."""
    state = {name: dict(slots) for name, slots in plain["state"].items()}
    for (name, key), (shape, dtype) in tensors.items():
        state.setdefault(name, {})[key] = torch.empty(shape, dtype=dtype, device="meta")
    full = {"state": state, "param_groups": plain["param_groups"]}
    if (problem := _optimizer_mismatch(policy.model, optimizer, full)) is not None:
        raise ValueError(problem)


def load_optimizer_shards(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    plain: dict[str, Any],
    rows: dict[tuple[str, str], torch.Tensor],
    ctx: DistContext,
) -> None:
    """The inverse of optimizer_shards: the plain part and this rank's rows of every tensor slot
    (read from a checkpoint and checked: check_optimizer_shapes, `slot_problem`) into
    `optimizer`, each slot laid out like its parameter, with no communication."""
    reshard(policy)
    params = dict(policy.model.named_parameters())
    loaded = {name: dict(slots) for name, slots in plain["state"].items()}
    with torch.no_grad():
        for (name, key), local in rows.items():
            slot = torch.empty_like(params[name])  # the parameter's layout, DTensor or not
            mine = shard_of(slot, ctx).local
            mine.copy_(local.reshape(mine.shape))
            loaded.setdefault(name, {})[key] = slot
    _load(optimizer, loaded, plain["param_groups"])
