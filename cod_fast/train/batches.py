"""Where an RL step's rollouts come from: the trainer asks its batch source for batch b.

`LocalBatches` is the synchronous source: this rank's share of the step's packs rolled out
now, with the weights the step trains, then gathered so that every rank holds the whole batch.
`cod_fast.async_rl.RemoteBatches` takes the same batches from rollout workers that sample ahead
with weights at most `train.max_staleness` steps old (docs/async.md). The trainer calls the
same methods of either (`BatchSource`), and nothing else differs between the two loops.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cod_fast.data.records import Rollout
from cod_fast.distributed.context import DistContext, gather_objects
from cod_fast.envs.packs import PackSpec, draw_env, make_packs, pack_seeds

if TYPE_CHECKING:
    from collections.abc import Callable

    from cod_fast.config import Config
    from cod_fast.model.policy import Policy
    from cod_fast.rollout.driver import RolloutDriver


@dataclass
class Batch:
    """One RL step's rollouts, sorted by (pack, member), with what the source measured."""

    rollouts: list[Rollout]
    metrics: dict[str, Any] = field(default_factory=dict)
    """Logged with the step: the batch's staleness and waits (asynchronous sources)."""
    replayed: list[Rollout] = field(default_factory=list)
    """Earlier batches trained again with this one (cod_fast.train.replay); not in its metrics."""


class BatchSource(Protocol):
    """What the trainer asks of a batch source."""

    def next(self, rl_step: int, policy: Policy, stop: Callable[[], bool]) -> Batch: ...

    def trained(self, version: int, policy: Policy) -> None: ...

    def state(self) -> Any: ...

    def load_state(self, state: Any) -> None: ...

    def close(self) -> None: ...


def mixed_packs(cfg: Config, packs: list[PackSpec], split: str, start: int) -> list[PackSpec]:
    """Each pack given its environment, drawn by weight from the split and the pack's index in
    the run (so a resumed run draws the same)."""
    mix = cfg.rollout.environments
    names, weights = [e.name for e in mix], [e.weight for e in mix]
    return [
        dataclasses.replace(spec, env=draw_env(names, weights, split, cfg.train.seed, start + i))
        for i, spec in enumerate(packs)
    ]


def rl_packs(cfg: Config, rl_step: int) -> list[PackSpec]:
    """Every pack of RL step `rl_step` (0-based): seeds from the step, so a resumed run and a
    rollout worker see the same ones. A process samples its share `[i::n]`, so every member of
    a pack is rolled out by one process."""
    rollout = cfg.rollout
    start = rl_step * rollout.packs_per_step
    seeds = pack_seeds("train", rollout.packs_per_step, cfg.train.seed, start=start)
    packs = make_packs(seeds, rollout.tasks_per_pack, rollout.strategy)
    return mixed_packs(cfg, packs, "train", start)


def sort_rollouts(rollouts: list[Rollout]) -> list[Rollout]:
    """The batch order every source gives: by pack, then member."""
    return sorted(rollouts, key=lambda r: (r.pack_id, r.member))


class LocalBatches:
    """Rollouts sampled in the step itself by this rank's driver (today's colocated loop)."""

    def __init__(self, cfg: Config, driver: RolloutDriver, ctx: DistContext):
        self.cfg, self.driver, self.ctx = cfg, driver, ctx

    def next(self, rl_step: int, policy: Policy, stop: Callable[[], bool]) -> Batch:
        """Batch `rl_step`, sampled now with the policy's current weights (`stop`, a signal
        flag, matters to sources that wait)."""
        mine = rl_packs(self.cfg, rl_step)[self.ctx.rank :: self.ctx.world_size]
        rollouts = self.driver.run(
            mine, self.cfg.rollout.group_size, keyed=self.cfg.rollout.keyed_sampling
        )
        return Batch(
            sort_rollouts([r for part in gather_objects(rollouts, self.ctx) for r in part])
        )

    def trained(self, version: int, policy: Policy) -> None:
        """The policy now has `version` RL updates; the sampler shares or gets them already."""

    def state(self) -> Any:
        """What a checkpoint keeps of the source (nothing: the sampler is checkpointed)."""
        return None

    def load_state(self, state: Any) -> None:
        """Take back `state()` from a checkpoint."""

    def close(self) -> None:
        """Nothing to free."""
