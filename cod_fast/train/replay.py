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
import functools
import math
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import TYPE_CHECKING, Any, Literal, Union

import numpy as np

from cod_fast.common.values import described, is_count
from cod_fast.data.records import Rollout
from cod_fast.envs.base import derive_seed
from cod_fast.train.batches import Batch, BatchSource

if TYPE_CHECKING:
    from cod_fast.config import TrainConfig
    from cod_fast.model.policy import Policy

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
    """A `BatchSource` that adds replayed batches to another source's fresh ones; `vocab_size`,
    the model's, bounds the token ids a pool read back from a checkpoint may hold."""

    def __init__(self, inner: BatchSource, train: TrainConfig, vocab_size: int):
        self.inner, self.train, self.vocab_size = inner, train, vocab_size
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
        """Take back `state()`. A state that is not one (a damaged or edited checkpoint) is a
        ValueError naming the entry and what is wrong, before the pool changes: every field of
        every pooled batch is checked against its declared type (`_from_plain`), each token id
        against the vocabulary, and the judge's flag (the one info field a step reads)."""
        state = {} if state is None else state
        if not isinstance(state, dict):
            raise ValueError(f"the replay state is {described(state)}, not a dict")
        pool = _from_plain(list[Pooled], state.get("pool", []), "the replay pool")
        for i, pooled in enumerate(pool):
            for episode in (e for r in pooled.rollouts for e in r.episodes):
                if not isinstance(episode.info.get("malformed", False), bool):
                    raise ValueError(
                        f"the replay pool[{i}] holds episode {episode.key}, whose judge's flag "
                        "(info.malformed) is not true or false"
                    )
                if any(
                    max(t.prompt_ids + t.response_ids, default=0) >= self.vocab_size
                    for t in episode.turns
                ):
                    raise ValueError(
                        f"the replay pool[{i}] holds episode {episode.key}, whose token ids go "
                        f"past the model's vocabulary of {self.vocab_size}"
                    )
        self.inner.load_state(state.get("inner"))
        self.pool = pool

    def close(self) -> None:
        self.inner.close()


def _plain(rollout: Rollout) -> dict[str, Any]:
    return dataclasses.asdict(rollout)


_SCALARS: dict[Any, tuple[Callable[[Any], bool], str]] = {
    int: (is_count, "a non-negative integer"),
    float: (lambda v: type(v) in (int, float) and math.isfinite(v), "a finite number"),
    str: (lambda v: isinstance(v, str), "a string"),
}
"""The field types of the records, what a value of each must be, and how a message says so
(every integer of a rollout, from token ids to pack ids, counts something)."""


def _from_plain(hint: Any, value: Any, where: str) -> Any:
    """`value`, plain data read from a checkpoint, as the type `hint` declares (a records
    dataclass from the dict `dataclasses.asdict` made of it, a list of them, a number, ...).
    Each field is checked against its declared type, and each dataclass against its own rules
    (`__post_init__`), so a damaged or edited file is a ValueError naming the entry (`where`)
    rather than a TypeError in the step that would use it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALARS:
        fits, what = _SCALARS[hint]
        if not fits(value):
            raise ValueError(f"{where} is {described(value)}, not {what}")
        return value
    if origin is Literal:
        if not (isinstance(value, str) and value in args):
            raise ValueError(f"{where} is {described(value)}, not one of {', '.join(args)}")
        return value
    if origin in (Union, types.UnionType):  # `X | None`
        if value is None and type(None) in args:
            return None
        (kind,) = (a for a in args if a is not type(None))
        return _from_plain(kind, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where} is {described(value)}, not a list")
        (item,) = args
        if item in _SCALARS and all(map(_SCALARS[item][0], value)):  # token ids: one fast pass
            return list(value)
        return [_from_plain(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:  # `info`: free-form diagnostics, by name
        if not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
            raise ValueError(f"{where} is {described(value)}, not a dict of named values")
        return dict(value)
    if not isinstance(value, dict):
        raise ValueError(f"{where} is {described(value)}, not the fields of a {hint.__name__}")
    hints, needed = _declared(hint)
    if missing := sorted(needed - value.keys()):
        raise ValueError(f"{where} has no {missing[0]}, which a {hint.__name__} needs")
    if unknown := [str(k) for k in value if k not in hints]:
        raise ValueError(f"{where} has a field {unknown[0][:40]!r} that a {hint.__name__} has not")
    fields = {k: _from_plain(hints[k], v, f"{where}.{k}") for k, v in value.items()}
    try:
        return hint(**fields)
    except ValueError as exc:  # the record's own rules (one log-prob per token, ...)
        raise ValueError(f"{where}: {exc}") from None


@functools.cache
def _declared(cls: type) -> tuple[dict[str, Any], set[str]]:
    """A dataclass's field types, and the fields without a default."""
    fields = dataclasses.fields(cls)
    needed = {f.name for f in fields if MISSING is f.default and MISSING is f.default_factory}
    return typing.get_type_hints(cls), needed
