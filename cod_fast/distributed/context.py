"""This process's place in a run of several ranks: process group, device mesh, collectives.

Under torchrun (WORLD_SIZE > 1) `init_distributed` joins the process group (NCCL on CUDA, gloo on
the CPU) and builds the mesh FSDP2 shards over (cod_fast.distributed.fsdp): 1-D ("shard",), or 2-D
("replicate", "shard") for HSDP. With rollout workers the trainers get a group and a mesh of
their own, and the collectives here run over it. Every rank calls the collectives; in one plain
process (no process group) they return at once, with no communication.
"""

from __future__ import annotations

import atexit
import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cod_fast.config import ConfigError
from cod_fast.distributed import comm_trace
from cod_fast.ops.sequence_parallel import SequenceGroup

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
    sequence_group: SequenceGroup | None = None
    """Ulysses sequence parallelism (train.sequence_parallel > 1): this trainer's group of
    consecutive trainer ranks that run each micro-batch together; None: off."""

    @property
    def sequence_parallel(self) -> int:
        """Ranks per sequence-parallel group (1: off)."""
        return 1 if self.sequence_group is None else self.sequence_group.size

    @property
    def data_rank(self) -> int:
        """This trainer's data-parallel rank: the ranks of a sequence-parallel group share one
        (they train the same micro-batches)."""
        return self.rank // self.sequence_parallel

    @property
    def data_world(self) -> int:
        """Data-parallel ranks: the trainers over the sequence-parallel degree."""
        return self.world_size // self.sequence_parallel

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
    sequence_parallel: int = 1,
) -> DistContext:
    """This process's place in the run: under torchrun join the process group and build the
    mesh; otherwise one process, with no process group unless `one_rank_mesh` asks for a mesh
    of one rank (a process group of one over an in-memory store: no port, no network), which
    mixed precision shards over. `timeout_s` bounds every collective's wait (torch's default
    when None). With `rollout_ranks` R > 0 the last R ranks are rollout workers: the trainers'
    context has a group and a mesh of the first ranks only (every rank takes part in making
    them, as torch requires), a worker's has role `rollout`. With `sequence_parallel` N > 1
    every N consecutive trainer ranks form a sequence-parallel group (`sequence_group`)."""
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
        check_sequence_parallel(sequence_parallel, 1, 1)
        return DistContext(rank=0, world_size=1, local_rank=0, device=dev, mesh=None)
    trainers = world_size - rollout_ranks
    shape, names = mesh_layout(trainers, hsdp_replicate)
    check_sequence_parallel(sequence_parallel, shape[-1], trainers)
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
    sequence_group = _sequence_group(rank, trainers, sequence_parallel)
    if not rollout_ranks:
        mesh = init_device_mesh(dev.type, shape, mesh_dim_names=names)
        return DistContext(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            device=dev,
            mesh=mesh,
            sequence_group=sequence_group,
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
        sequence_group=sequence_group,
    )


def check_sequence_parallel(size: int, shard_ranks: int, trainers: int) -> None:
    """A ConfigError unless `size` ranks per sequence-parallel group tile the trainers, inside
    each FSDP shard group of `shard_ranks` (HSDP's replicas hold whole groups)."""
    if size > 1 and shard_ranks % size:
        where = f"{trainers} trainer rank(s)"
        if shard_ranks != trainers:
            where += f" in replicas of {shard_ranks} (runtime.hsdp_replicate)"
        raise ConfigError(
            "train.sequence_parallel",
            f"got {size}, which does not divide the {where}; set it to a divisor of "
            f"{shard_ranks}, or launch a multiple of {size} trainer ranks under torchrun",
        )


def _sequence_group(rank: int, trainers: int, size: int) -> SequenceGroup | None:
    """This rank's group of `size` consecutive trainer ranks (None for size 1 or a rollout
    worker). Every rank makes every group, as torch.distributed.new_group requires."""
    if size == 1:
        return None
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, trainers, size)]
    if rank >= trainers:
        return None
    return SequenceGroup(groups[rank // size], rank % size, size)


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
