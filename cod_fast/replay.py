"""Priority replay over any batch source: Trinity-RFT's decay-limit randomisation (docs/async.md).

With `train.replay_batches=R > 0` every RL step trains on its fresh batch and on up to R earlier
batches from a pool, in the same optimizer step(s). Each pooled batch has the weights version it
was sampled with and a use count; its priority is

    version - replay_decay * uses + replay_sigma * z

(z standard normal), so fresher and less used batches come first, and the noise mixes the
order. The R highest are replayed; a batch leaves the pool once trained `replay_use_limit` times
(its fresh use included) or once its version is more than `replay_max_age` behind the step's.
Trinity-RFT replays so that a trainer faster than its explorer keeps learning; here the number
of replayed batches is fixed per step and z comes from the run's seed and the step, so a run
does not depend on timing and resumes bit for bit (the pool is checkpointed as plain data).

Replayed rollouts are copies with pack ids of their own (no group mixes with the fresh one) and
no advantages: the step assigns them afresh, and the loss's ratio against the sampler's log-probs
(or the recomputed ones) corrects for the policy having moved since. The step's reward metrics
describe the fresh batch alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cod_fast.batches import Batch, BatchSource
from cod_fast.envs.base import derive_seed
from cod_fast.records import Episode, Rollout, Turn

if TYPE_CHECKING:
    from collections.abc import Callable

    from cod_fast.config import TrainConfig
    from cod_fast.policy import Policy

PACK_ID_STRIDE = 1 << 20
"""Replay slot j's copies have pack ids pack_id + (j + 1) * stride: above every fresh pack id
(rollout.packs_per_step is at most 4096)."""


@dataclass
class Pooled:
    """One batch in the pool."""

    version: int
    """The weights version it was sampled with."""
    uses: int
    """How many times it has been trained."""
    rollouts: list[Rollout]


def priorities(pool: list[Pooled], decay: float, noise: np.ndarray) -> np.ndarray:
    """version - decay * uses + noise, per pooled batch."""
    version = np.array([p.version for p in pool], dtype=np.float64)
    uses = np.array([p.uses for p in pool], dtype=np.float64)
    return version - decay * uses + noise


def replay_noise(seed: int, rl_step: int, sigma: float, count: int) -> np.ndarray:
    """The priority noise of a step: sigma * z, z from the run's seed and the step alone."""
    if sigma == 0.0:
        return np.zeros(count)
    return sigma * np.random.default_rng(derive_seed("replay", seed, rl_step)).standard_normal(
        count
    )


def relabelled(rollouts: list[Rollout], slot: int) -> list[Rollout]:
    """Copies of a batch's rollouts for replay slot `slot`: pack ids moved out of the fresh
    range, advantages cleared (the step assigns them), token lists shared."""
    shift = (slot + 1) * PACK_ID_STRIDE
    return [
        Rollout(
            pack_id=r.pack_id + shift,
            member=r.member,
            env=r.env,
            episodes=[
                dataclasses.replace(e, pack_id=e.pack_id + shift, advantage=None, info=dict(e.info))
                for e in r.episodes
            ],
        )
        for r in rollouts
    ]


class ReplayBatches:
    """A `BatchSource` that adds replayed batches to another source's fresh ones."""

    def __init__(self, inner: BatchSource, train: TrainConfig):
        self.inner, self.train = inner, train
        self.pool: list[Pooled] = []

    def next(self, rl_step: int, policy: Policy, stop: Callable[[], bool]) -> Batch:
        batch = self.inner.next(rl_step, policy, stop)
        train = self.train
        self.pool = [
            p
            for p in self.pool
            if p.uses < train.replay_use_limit and rl_step - p.version <= train.replay_max_age
        ]
        noise = replay_noise(train.seed, rl_step, train.replay_sigma, len(self.pool))
        order = np.argsort(-priorities(self.pool, train.replay_decay, noise), kind="stable")
        picked = [self.pool[i] for i in order[: train.replay_batches]]
        for slot, pooled in enumerate(picked):
            pooled.uses += 1
            batch.replayed += relabelled(pooled.rollouts, slot)
        batch.metrics.update(
            replayed_batches=len(picked),
            replay_pool=len(self.pool),
            replay_age_mean=float(np.mean([rl_step - p.version for p in picked]))
            if picked
            else None,
        )
        version = rl_step - batch.metrics.get("staleness", 0)
        self.pool.append(Pooled(version, 1, batch.rollouts))
        return batch

    def trained(self, version: int, policy: Policy) -> None:
        self.inner.trained(version, policy)

    def state(self) -> Any:
        """The inner source's state and the pool, as plain data (a checkpoint loads no
        objects)."""
        pool = [
            {"version": p.version, "uses": p.uses, "rollouts": [_plain(r) for r in p.rollouts]}
            for p in self.pool
        ]
        return {"inner": self.inner.state(), "pool": pool}

    def load_state(self, state: Any) -> None:
        state = state or {}
        self.inner.load_state(state.get("inner"))
        self.pool = [
            Pooled(p["version"], p["uses"], [_rollout(r) for r in p["rollouts"]])
            for p in state.get("pool", [])
        ]

    def close(self) -> None:
        self.inner.close()


def _plain(rollout: Rollout) -> dict[str, Any]:
    return dataclasses.asdict(rollout)


def _rollout(data: dict[str, Any]) -> Rollout:
    episodes = [
        Episode(**{**e, "turns": [Turn(**t) for t in e["turns"]]}) for e in data["episodes"]
    ]
    return Rollout(**{**data, "episodes": episodes})
