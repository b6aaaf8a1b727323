"""Several ranks as one trainer: process group and device mesh, FSDP2 sharding, full states.

Under torchrun (WORLD_SIZE > 1) `init_distributed` joins the process group (NCCL on CUDA, gloo on
the CPU) and builds the mesh FSDP2 shards over: 1-D ("shard",), or 2-D ("replicate", "shard")
for HSDP. `shard_policy` wraps every decoder layer and then the `Policy` itself as the root, so
the embeddings, final norm and LM head (tied or not) form the root group that `Policy.forward`
gathers while the fused loss uses the LM head.

Everything that leaves the trainer (sampler weight pushes, checkpoints, the KL reference) is a
full, unsharded state under the Hugging Face parameter names, so one format serves one process
and many, and a checkpoint written by N ranks resumes on M. The gathers are collectives: every
rank calls these functions, only the main rank keeps the result. In one plain process (no
process group) every function works unchanged, with no communication.
"""

from __future__ import annotations

import atexit
import gc
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from cod_fast import comm_trace
from cod_fast.config import ConfigError
from cod_fast.policy import Policy

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class DistContext:
    """Where this process sits in the run; `init_distributed` makes it."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None
    """The FSDP mesh: ("shard",) or ("replicate", "shard"); None in one process, except a
    mixed-precision one (a one-rank mesh: FSDP2 keeps its float32 master weights)."""
    group: dist.ProcessGroup | None = None
    """The group the collectives below run over: the trainer ranks when the run has rollout
    workers (`rank` and `world_size` are then within it; trainers are the first ranks, so a
    trainer's rank is its global rank); None: every process (the default group)."""
    role: str = "trainer"
    """`trainer`, or `rollout` for a rollout worker (cod_fast.async_rl)."""
    rollout_ranks: int = 0
    """The run's rollout workers, the last global ranks (runtime.rollout_ranks)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Several ranks: the collectives below communicate."""
        return self.world_size > 1

    @property
    def sharded(self) -> bool:
        """The policy is an FSDP2 module (several ranks, or one rank in mixed precision): its
        parameters are DTensors, so a sampler cannot share them."""
        return self.mesh is not None


def resolve_device(device: str) -> torch.device:
    """The device `runtime.device` names on this machine (auto: CUDA when there is one)."""
    if device not in DEVICES:
        raise ConfigError("runtime.device", f"got {device!r}; expected one of {DEVICES}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "runtime.device",
            "got 'cuda', but no CUDA device is available; set runtime.device to 'cpu' or 'auto'",
        )
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if use_cuda else "cpu")


def mesh_layout(world_size: int, hsdp_replicate: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, dim names) of the FSDP mesh: plain FSDP, or HSDP's replicas of shard groups."""
    if hsdp_replicate < 1 or world_size % hsdp_replicate:
        raise ValueError(
            f"runtime.hsdp_replicate={hsdp_replicate} must be >= 1 and divide the world "
            f"size {world_size}"
        )
    if hsdp_replicate == 1:
        return (world_size,), ("shard",)
    return (hsdp_replicate, world_size // hsdp_replicate), ("replicate", "shard")


def init_distributed(
    device: str = "auto",
    hsdp_replicate: int = 1,
    *,
    timeout_s: float | None = None,
    one_rank_mesh: bool = False,
    rollout_ranks: int = 0,
) -> DistContext:
    """This process's place in the run: under torchrun join the process group and build the
    mesh; otherwise one process, with no process group unless `one_rank_mesh` asks for a mesh
    of one rank (a process group of one over an in-memory store: no port, no network), which
    mixed precision shards over. `timeout_s` bounds every collective's wait (torch's default
    when None). With `rollout_ranks` R > 0 the last R ranks are rollout workers: the trainers'
    context has a group and a mesh of the first ranks only (every rank takes part in making
    them, as torch requires), a worker's has role `rollout`."""
    dev = resolve_device(device)
    comm_trace.install()  # COD_FAST_COMM_TRACE: record this process's traffic (comm_check)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if rollout_ranks and world_size <= rollout_ranks:
        raise ConfigError(
            "runtime.rollout_ranks",
            f"got {rollout_ranks} with {world_size} process(es); expected fewer rollout ranks "
            "than processes: launch under torchrun with --nproc_per_node above it (trainers "
            "first, then rollout workers)",
        )
    if world_size == 1 and not one_rank_mesh:
        return DistContext(rank=0, world_size=1, local_rank=0, device=dev, mesh=None)
    trainers = world_size - rollout_ranks
    shape, names = mesh_layout(trainers, hsdp_replicate)
    rank, local_rank = 0, 0
    if world_size > 1:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        # Before the process group: NCCL binds each rank to the current device.
        dev = torch.device("cuda", local_rank if world_size > 1 else torch.cuda.current_device())
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        options: dict[str, Any] = {"device_id": dev if dev.type == "cuda" else None}
        if timeout_s is not None:
            options["timeout"] = timedelta(seconds=timeout_s)
        if world_size == 1:
            options.update(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", **options)
        atexit.register(_release_groups)
    if not rollout_ranks:
        mesh = init_device_mesh(dev.type, shape, mesh_dim_names=names)
        return DistContext(
            rank=rank, world_size=world_size, local_rank=local_rank, device=dev, mesh=mesh
        )
    group = dist.new_group(list(range(trainers)))
    mesh = None
    if trainers > 1 or one_rank_mesh:
        layout = torch.arange(trainers).reshape(shape)
        mesh = DeviceMesh(dev.type, layout, mesh_dim_names=names)
    if rank >= trainers:
        return DistContext(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            device=dev,
            mesh=None,
            role="rollout",
            rollout_ranks=rollout_ranks,
        )
    return DistContext(
        rank=rank,
        world_size=trainers,
        local_rank=local_rank,
        device=dev,
        mesh=mesh,
        group=group,
        rollout_ranks=rollout_ranks,
    )


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's block list (`layers` in Llama/Qwen, the one ModuleList child elsewhere)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        return decoder.layers
    lists = [m for m in decoder.children() if isinstance(m, torch.nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: its decoder "
            f"{type(decoder).__name__} has {len(lists)} ModuleList children, expected one"
        )
    return lists[0]


def shard_policy(
    policy: Policy,
    ctx: DistContext,
    *,
    reshard_after_forward: bool = True,
    compute_dtype: torch.dtype | None = None,
) -> Policy:
    """FSDP2 over ctx.mesh: one group per decoder layer, the rest in the root (the Policy);
    gradients are summed over ranks. No mesh: the policy unchanged.

    `compute_dtype` other than the parameters' dtype is mixed precision: the sharded float32
    parameters stay the master weights the optimizer updates, each forward gathers them cast
    to `compute_dtype`, and gradients are reduced (and accumulated over micro-batches) in
    float32. Otherwise the model's own dtype is used throughout.

    `reshard_after_forward` applies to the layers. The root keeps torch's default: it stays
    gathered after its forward, since training's backward needs it at once; after a no-grad
    forward it stays gathered until the next backward (the state functions here reshard first).
    """
    if not ctx.sharded:
        return policy
    dtype = next(policy.parameters()).dtype
    mixed = compute_dtype is not None and compute_dtype != dtype
    layers = root = MixedPrecisionPolicy()
    if mixed:
        layers = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        # The root's input is a MicroBatch whose advantages and log-probs must stay float32;
        # FSDP2 would cast every floating tensor in it (dataclasses included).
        root = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    for layer in _decoder_layers(policy.model):
        fully_shard(
            layer, mesh=ctx.mesh, reshard_after_forward=reshard_after_forward, mp_policy=layers
        )
    fully_shard(policy, mesh=ctx.mesh, mp_policy=root)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            # Each rank's loss already carries the step's global denominator, so the rank
            # losses add up to the batch loss and the gradients must be summed. FSDP's default
            # averages them over the data-parallel ranks (right for a per-rank mean loss).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM, no PREMUL_SUM op
    return policy


def _reshard(policy: torch.nn.Module) -> None:
    """Put every FSDP group back in its sharded state, so parameters are the DTensors that own
    the storage (after a no-grad forward the root still holds gathered copies)."""
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def full_parameters(policy: Policy) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) of every parameter, tied ones once, in named_parameters
    order, gathered one at a time. Under FSDP every rank must exhaust it (each gather is a
    collective); the tensors may share storage with the live parameters: read, don't write."""
    _reshard(policy)
    for name, param in policy.model.named_parameters():
        yield name, _gathered(param)  # no local name: the previous tensor is the consumer's alone


def _persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, buf


def _expected_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(_persistent_buffers(model))}


def model_state(policy: Policy, ctx: DistContext) -> dict[str, torch.Tensor]:
    """Full model state (parameters as in full_parameters, plus persistent buffers) as CPU
    copies on the main rank; {} on the others, which still take part in the gathers."""
    _reshard(policy)
    state = {}
    for name, tensor in _expected_tensors(policy.model).items():
        full = _gathered(tensor)
        if ctx.is_main:
            state[name] = full.to("cpu", copy=True)  # a copy even on the CPU: never an alias
    return state


def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Second names of tied parameters -> the name named_parameters() keeps."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _state_mismatch(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> str | None:
    """Why `state` does not fit `model`, or None."""
    expected = _expected_tensors(model)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [
        f"{k} {tuple(state[k].shape)} vs {tuple(t.shape)}"
        for k, t in expected.items()
        if k in state and tuple(state[k].shape) != tuple(t.shape)
    ]
    if not (missing or unexpected or wrong):
        return None
    aliases = _tied_aliases(model)
    unexpected = [
        f"{k} (tied to {aliases[k]}: a tied weight is kept once, under that name)"
        if k in aliases
        else k
        for k in unexpected
    ]
    parts = [
        f"{label}: {', '.join(items)}"
        for label, items in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("shape mismatches (checkpoint vs model)", wrong),
        )
        if items
    ]
    return "the checkpoint does not fit this model: " + "; ".join(parts)


def load_model_state(policy: Policy, state: dict[str, torch.Tensor], ctx: DistContext) -> None:
    """Copy a full state (present on the main rank; others may pass {}) into the policy, in
    place, so tied parameters stay one parameter. Strict: ValueError on every rank when keys or
    shapes do not match, before anything is copied."""
    _reshard(policy)
    model = policy.model
    problem = broadcast_object(_state_mismatch(model, state) if ctx.is_main else None, ctx)
    if problem is not None:
        raise ValueError(problem)
    with torch.no_grad():
        for name, target in _expected_tensors(model).items():
            if ctx.is_main:
                full = state[name].to(device=ctx.device, dtype=target.dtype)
            else:
                full = torch.empty(target.shape, dtype=target.dtype, device=ctx.device)
            if ctx.distributed:
                # Everyone gets the full tensor, then keeps its own chunk (no further
                # communication, so any mesh, HSDP included, takes the same path).
                dist.broadcast(full, src=0, group=ctx.group)
            if isinstance(target, DTensor):
                full = distribute_tensor(
                    full, target.device_mesh, target.placements, src_data_rank=None
                )
            target.copy_(full)


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
    _reshard(policy)
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
            if key in live and key != "params" and not _same_kind(value, live[key]):
                return (
                    f"the optimizer checkpoint's hyperparameter {key} is not a {_kind(live[key])}"
                )
            if key in live and key in _DOMAINS and not _DOMAINS[key][0](value):
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
            if tensor and not (value.is_floating_point() and bool(torch.isfinite(value).all())):
                return f"the optimizer checkpoint's {key} of {name} is not all finite floats"
            if key in _NOT_NEGATIVE and (bool((value < 0).any()) if tensor else value < 0):
                return (
                    f"the optimizer checkpoint's {key} of {name} holds a negative value, "
                    f"which {_NOT_NEGATIVE[key]} never is"
                )
    return None


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
    _reshard(policy)
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
    if not loaded:  # saved before any step: hyperparameters only, and a fresh optimizer
        optimizer.state.clear()
        for group, saved in zip(optimizer.param_groups, skeleton["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        return
    # torch's own format: parameters numbered in param_groups order (names checked above).
    index = {
        name: i for i, name in enumerate(n for g in skeleton["param_groups"] for n in g["params"])
    }
    optimizer.load_state_dict(
        {
            "state": {index[name]: slots for name, slots in loaded.items()},
            "param_groups": [
                {**g, "params": [index[n] for n in g["params"]]} for g in skeleton["param_groups"]
            ],
        }
    )


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.group)
    return out


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    return box[0]


def all_reduce_max(x: int, ctx: DistContext) -> int:
    """The largest `x` over the ranks (a stop request on any rank stops them all)."""
    if not ctx.distributed:
        return int(x)
    value = torch.tensor([int(x)], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=ctx.group)
    return int(value)


def barrier(ctx: DistContext) -> None:
    """Wait until every rank is here (no-op in one process)."""
    if ctx.distributed:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        dist.barrier(group=ctx.group, device_ids=device_ids)


def shutdown(ctx: DistContext) -> None:
    """Leave the process group (when this run made one)."""
    if (ctx.sharded or ctx.rollout_ranks) and dist.is_initialized():
        dist.destroy_process_group()


def _release_groups() -> None:
    """At exit, before the interpreter is torn down: leave the process group if still in it,
    then free what holds its C++ objects (meshes, sharded parameters, FSDP states; reference
    cycles among them outlive the run's frames). A gloo group freed during interpreter
    finalization instead aborts the process now and then ("terminate called without an active
    exception", exit -6 under torchrun), after a run that ended well."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
