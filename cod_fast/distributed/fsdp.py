"""The policy sharded by FSDP2, and its full model state out of the shards and back in.

`shard_policy` wraps every decoder layer and then the `Policy` itself as the root, so the
embeddings, final norm and LM head (tied or not) form the root group that `Policy.forward`
gathers while the fused loss uses the LM head.

What leaves the trainer whole (sampler weight pushes, the KL reference, a one-process
checkpoint) is a full, unsharded state under the Hugging Face parameter names, so one format
serves one process and many (the optimizer's too: cod_fast.distributed.optim_state). The gathers
are collectives: every rank calls these functions, only the main rank keeps the result. In one
plain process (no process group) every function works unchanged, with no communication.

A checkpoint under torchrun is written in rank shards instead (cod_fast.run.sharded): each rank
saves and loads its own rows of every tensor (`model_shards`: FSDP2 shards dim 0 by the chunk
rule of `chunk_rows`), so no rank ever holds a full state, and a checkpoint written by N ranks
resumes on M.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from cod_fast.distributed.context import DistContext, broadcast_object
from cod_fast.model.policy import Policy
from cod_fast.model.shapes import decoder_layers


def shard_policy(
    policy: Policy,
    ctx: DistContext,
    *,
    reshard_after_forward: bool = True,
    compute_dtype: torch.dtype | None = None,
    frozen: bool = False,
) -> Policy:
    """FSDP2 over ctx.mesh: one group per decoder layer, the rest in the root (the Policy);
    gradients are summed over ranks. No mesh: the policy unchanged.

    `compute_dtype` other than the parameters' dtype is mixed precision: the sharded float32
    parameters stay the master weights the optimizer updates, each forward gathers them cast
    to `compute_dtype`, and gradients are reduced (and accumulated over micro-batches) in
    float32. Otherwise the model's own dtype is used throughout.

    `reshard_after_forward` applies to the layers. The root of a policy that trains keeps
    torch's default: it stays gathered after its forward, since training's backward needs it at
    once (torch/distributed/fsdp/_fully_shard/_fsdp_state.py, FSDPState._lazy_init, clears the
    root's post-forward mesh when `reshard_after_forward` was left unset); after a no-grad
    forward it stays gathered until the next backward (the state functions here reshard first).
    A `frozen` policy (the KL reference, held in the compute dtype) never runs backward, so its
    root would stay gathered for the rest of the run: its root is given
    `reshard_after_forward=True` explicitly, which torch keeps for a root (_fully_shard.py:
    only an unset value is "auto"), and it reshards after every forward like the layers. It is
    sharded only over several ranks: a one-rank mesh exists for mixed precision's float32
    masters, and a frozen policy has none.
    """
    if not ctx.sharded or (frozen and not ctx.distributed):
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
    for layer in decoder_layers(policy.model):
        fully_shard(
            layer, mesh=ctx.mesh, reshard_after_forward=reshard_after_forward, mp_policy=layers
        )
    # None: torch's default for a root, gathered after its forward (see the docstring).
    root_reshard = True if frozen else None
    fully_shard(policy, mesh=ctx.mesh, reshard_after_forward=root_reshard, mp_policy=root)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            # Each rank's loss already carries the step's global denominator, so the rank
            # losses add up to the batch loss and the gradients must be summed. FSDP's default
            # averages them over the data-parallel ranks (right for a per-rank mean loss).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM, no PREMUL_SUM op
    return policy


def reshard(policy: torch.nn.Module) -> None:
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
    reshard(policy)
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
    reshard(policy)
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
    reshard(policy)
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


# --- this rank's rows, for checkpoints in rank shards -------------------------------------------


def chunk_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """The rows [start, stop) of dim 0 that chunk `index` of `parts` holds, as FSDP2 shards a
    parameter: torch.chunk's chunks of ceil(rows / parts) rows, then empty ones up to `parts`
    (torch/distributed/fsdp/_fully_shard/_fsdp_common.py, `_chunk_with_empty`, called by
    `FSDPParam._init_sharded_param` in _fsdp_param.py), so the last chunk may be short and the
    ones after it empty."""
    size = -(-rows // parts)
    start = min(index * size, rows)
    return start, min(start + size, rows)


def overlaps(
    pieces: list[tuple[int, int, int]], start: int, stop: int
) -> list[tuple[int, slice, slice]]:
    """What a rank that holds rows [start, stop) reads of a tensor saved in `pieces` (rank,
    first, last): (rank, its rows within that rank's piece, where they go among its own rows)
    for every piece that overlaps them, in the pieces' order."""
    reads = []
    for rank, first, last in pieces:
        low, high = max(first, start), min(last, stop)
        if low < high:
            reads.append((rank, slice(low - first, high - first), slice(low - start, high - start)))
    return reads


@dataclass
class Shard:
    """This rank's rows [start, stop) of dim 0 of a tensor of the full `shape` (a 0-dim tensor
    counts as one row), held by `local`: a DTensor's local tensor, or the whole tensor where it
    is not sharded (a buffer). `writes`: whether this rank saves them, so each row is saved
    once (HSDP's first replica; the main rank for a whole tensor)."""

    local: torch.Tensor
    shape: tuple[int, ...]
    start: int
    stop: int
    writes: bool


def _dtensor_rows(tensor: DTensor) -> tuple[int, int, bool]:
    """(start, stop, writes) of this rank's part of `tensor`: each Shard(0) placement splits
    the rows it gets by the chunk rule in mesh-dimension order (DTensor's own order:
    torch/distributed/tensor/_utils.py, compute_local_shape_and_global_offset), and a replica
    other than the first along a Replicate dimension does not write."""
    start, stop, writes = 0, tensor.shape[0] if tensor.dim() else 1, True
    for dim, placement in enumerate(tensor.placements):
        coordinate = tensor.device_mesh.get_local_rank(dim)
        if placement.is_shard(0):
            first, last = chunk_rows(stop - start, tensor.device_mesh.size(dim), coordinate)
            start, stop = start + first, start + last
        elif placement.is_replicate():
            writes = writes and coordinate == 0
        else:
            raise ValueError(f"a placement {placement} is not FSDP2's (dim-0 shards, replicas)")
    held = tensor.to_local().shape[0] if tensor.dim() else 1
    if held != stop - start:
        raise ValueError(
            f"this rank holds {held} rows of a tensor of shape {tuple(tensor.shape)}, not the "
            f"{stop - start} the chunk rule gives: a sharding other than FSDP2's"
        )
    return start, stop, writes


def shard_of(tensor: torch.Tensor, ctx: DistContext) -> Shard:
    """This rank's Shard of a parameter, a buffer or an optimizer slot shaped like one."""
    shape = tuple(tensor.shape)
    if isinstance(tensor, DTensor):
        start, stop, writes = _dtensor_rows(tensor)
        with torch.no_grad():  # the local tensor itself, not an autograd view of it
            return Shard(tensor.to_local(), shape, start, stop, writes)
    return Shard(tensor.detach(), shape, 0, shape[0] if shape else 1, ctx.is_main)


def model_shards(policy: Policy, ctx: DistContext) -> dict[str, Shard]:
    """This rank's Shard of every tensor of the model state (model_state's names), with no
    communication: what a checkpoint in rank shards writes, and where loading it copies."""
    reshard(policy)
    return {name: shard_of(t, ctx) for name, t in _expected_tensors(policy.model).items()}


def check_model_shapes(policy: Policy, shapes: dict[str, tuple[int, ...]]) -> None:
    """ValueError, as load_model_state's, when tensors of these names and full shapes do not
    fit the model (keys or shapes). Every rank that gets the same `shapes` decides alike."""
    stand_ins = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    if (problem := _state_mismatch(policy.model, stand_ins)) is not None:
        raise ValueError(problem)


def load_model_shards(policy: Policy, rows: dict[str, torch.Tensor], ctx: DistContext) -> None:
    """Copy each tensor's rows for this rank (as model_shards gives them, read from a
    checkpoint, on any device) into the policy in place, with no communication. The caller has
    checked names and shapes (check_model_shapes)."""
    with torch.no_grad():
        for name, shard in model_shards(policy, ctx).items():
            shard.local.copy_(rows[name].reshape(shard.local.shape))
