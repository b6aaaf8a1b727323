"""Asynchronous RL: rollout workers sample ahead while the trainers train (docs/async.md).

Under torchrun with `runtime.rollout_ranks=R`, the last R ranks run `RolloutWorker` (the
driver and sampler) and the others the usual `Trainer`, whose batch source is `RemoteBatches`
instead of its own driver; `train.max_staleness` bounds how old the weights of a batch may be.
`start_roles` makes this process's part.
"""

from __future__ import annotations

from cod_fast.async_rl.source import RemoteBatches
from cod_fast.async_rl.worker import RolloutWorker
from cod_fast.config import Config
from cod_fast.distributed.channel import RolloutWorkerError, make_groups
from cod_fast.distributed.context import init_distributed, resolve_device
from cod_fast.model.loading import master_dtype, resolve_dtype


def start_roles(cfg: Config):
    """This process's part of an asynchronous run: a `Trainer` fed by the workers, or a
    `RolloutWorker`."""
    from cod_fast.train.trainer import Trainer  # the trainer imports this package's source

    runtime = cfg.runtime
    device = resolve_device(runtime.device)
    compute = resolve_dtype(cfg.model, device)
    ctx = init_distributed(
        runtime.device,
        runtime.hsdp_replicate,
        timeout_s=runtime.dist_timeout_s,
        one_rank_mesh=master_dtype(cfg.model, cfg.train.master_dtype, device) != compute,
        rollout_ranks=runtime.rollout_ranks,
        sequence_parallel=cfg.train.sequence_parallel,
    )
    groups = make_groups(runtime.rollout_ranks, runtime.dist_timeout_s, runtime.rollout_timeout_s)
    if ctx.role == "rollout":
        return RolloutWorker(cfg, ctx, groups)
    return Trainer(cfg, ctx, batches=RemoteBatches(cfg, ctx, groups, compute))


__all__ = ["RemoteBatches", "RolloutWorker", "RolloutWorkerError", "start_roles"]
