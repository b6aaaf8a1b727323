"""Priority replay (cod_fast.train.replay): which batches a step replays, against a reference written
from the rule; the pool through a checkpoint; and training runs with replay on."""

from __future__ import annotations

import io
import random

import pytest
import torch

from cod_fast.config import ConfigError, TrainConfig
from cod_fast.config.io import load_config
from cod_fast.data.records import Episode, Rollout, Turn
from cod_fast.train.batches import Batch
from cod_fast.train.replay import PACK_ID_STRIDE, ReplayBatches, replay_noise
from cod_fast.train.trainer import Trainer
from tests.train.test_trainer import FAST, metrics, parameters

VOCAB = 64
"""Token ids of the test rollouts stay below this."""


def _rollouts(step: int, packs: int = 2, group: int = 2) -> list[Rollout]:
    turn = Turn(prompt_ids=[1, step], response_ids=[2, 3], response_logprobs=[-0.5, -0.25])
    return [
        Rollout(
            pack_id=p,
            member=g,
            episodes=[
                Episode(
                    pack_id=p,
                    member=g,
                    kind="solve",
                    task_index=0,
                    turns=[turn],
                    reward=float(step),
                    advantage=0.5,
                    info={"task": step},
                )
            ],
        )
        for p in range(packs)
        for g in range(group)
    ]


class StaleSource:
    """Batch b sampled `stale(b)` versions ago; its rollouts' rewards name the batch."""

    def __init__(self, stale):
        self.stale, self.trained_versions = stale, []

    def next(self, rl_step, policy, stop):
        return Batch(_rollouts(rl_step), {"staleness": self.stale(rl_step)})

    def trained(self, version, policy):
        self.trained_versions.append(version)

    def state(self):
        return {"inner": "kept"}

    def load_state(self, state):
        self.loaded = state

    def close(self):
        pass


def _reference_picks(train: TrainConfig, stale, steps: int) -> list[list[int]]:
    """The rule, written out: per step, the batches replayed (by batch index)."""
    pool: list[list[int]] = []  # [batch, version, uses]
    picks = []
    for step in range(steps):
        pool = [
            p for p in pool if p[2] < train.replay_use_limit and step - p[1] <= train.replay_max_age
        ]
        noise = replay_noise(train.seed, step, train.replay_sigma, len(pool))
        scored = [(p[1] - train.replay_decay * p[2] + noise[i], -i) for i, p in enumerate(pool)]
        best = sorted(range(len(pool)), key=lambda i: scored[i], reverse=True)[
            : train.replay_batches
        ]
        for i in best:
            pool[i][2] += 1
        picks.append([pool[i][0] for i in best])
        pool.append([step, step - stale(step), 1])
    return picks


@pytest.mark.parametrize("seed", range(8))
def test_replayed_batches_follow_the_priority_rule(seed):
    """For random replay settings and staleness: each step replays the batches the rule picks
    (highest version - decay x uses + sigma z, ties to the older batch, none at its use limit
    or past the age bound, never the step's own batch), as copies with pack ids above every
    fresh one, no advantages, and the original episodes untouched; the metrics count them."""
    rng = random.Random(seed)
    train = TrainConfig(
        seed=rng.randint(0, 99),
        replay_batches=rng.randint(1, 3),
        replay_use_limit=rng.randint(2, 4),
        replay_decay=rng.choice([0.0, 0.5, 1.0, 3.0]),
        replay_sigma=rng.choice([0.0, 0.7, 2.0]),
        replay_max_age=rng.randint(0, 5),
    )
    lag = rng.randint(0, 2)
    stale = lambda b: min(b, lag)  # noqa: E731
    source = ReplayBatches(StaleSource(stale), train, VOCAB)
    want = _reference_picks(train, stale, 12)
    for step in range(12):
        batch = source.next(step, None, lambda: False)
        assert [r.task_rewards[0] for r in batch.rollouts] == [float(step)] * 4
        replayed = [int(r.task_rewards[0]) for r in batch.replayed[::4]]
        assert replayed == want[step], (train, step)
        assert batch.metrics["replayed_batches"] == len(want[step])
        ids = [r.pack_id for r in batch.replayed]
        assert len(set(ids)) == len(ids) // 2 and min(ids, default=PACK_ID_STRIDE) >= PACK_ID_STRIDE
        assert all(e.advantage is None for r in batch.replayed for e in r.episodes)
        assert all(e.advantage == 0.5 for r in batch.rollouts for e in r.episodes)
        assert step not in replayed


def test_the_pool_survives_a_checkpoint_as_plain_data():
    """`state()` is plain data that `torch.load(weights_only=True)` reads back (a checkpoint
    loads no objects); a source restored from it replays exactly what the uninterrupted one
    does, and hands the inner source its own state back."""
    train = TrainConfig(replay_batches=2, replay_use_limit=3, replay_sigma=1.0, replay_max_age=3)
    straight = ReplayBatches(StaleSource(lambda b: 0), train, VOCAB)
    cut = ReplayBatches(StaleSource(lambda b: 0), train, VOCAB)
    for step in range(5):
        straight.next(step, None, lambda: False)
        cut.next(step, None, lambda: False)
    buffer = io.BytesIO()
    torch.save(cut.state(), buffer)
    buffer.seek(0)
    restored = ReplayBatches(StaleSource(lambda b: 0), train, VOCAB)
    restored.load_state(torch.load(buffer, weights_only=True))
    assert restored.inner.loaded == {"inner": "kept"}
    for step in range(5, 10):
        a = straight.next(step, None, lambda: False)
        b = restored.next(step, None, lambda: False)
        assert a.replayed == b.replayed and a.metrics == b.metrics


def test_config_refuses_replay_that_could_never_replay():
    """replay_use_limit 1 with replay on is refused (a batch would leave the pool unreplayed);
    negative settings are refused."""
    with pytest.raises(ConfigError, match="replay_use_limit"):
        TrainConfig(replay_batches=1, replay_use_limit=1)
    for key in ("replay_batches", "replay_max_age", "replay_decay", "replay_sigma"):
        with pytest.raises(ConfigError, match=key):
            TrainConfig(**{key: -1})


@pytest.mark.slow
def test_a_run_with_replay_trains_more_and_resumes_bit_for_bit(tmp_path):
    """tiny-cpu at test size with one replayed batch per step: from the second RL step each step
    replays one batch (so it trains more tokens than the same step without replay, whose
    metrics carry no replay keys), and a run stopped after its first RL step and resumed ends
    with the same parameters and metrics as the uninterrupted one."""
    steps = ["train.steps=3"]
    replay = [*steps, "train.replay_batches=1"]

    def cfg(run, *extra):
        return load_config("tiny-cpu", overrides=[*FAST, f"runtime.run_dir={run}", *extra])

    Trainer(cfg(tmp_path / "plain", *steps)).run()
    straight = Trainer(cfg(tmp_path / "a", *replay))
    straight.run()
    plain = [r for r in metrics(tmp_path / "plain") if r["phase"] == "rl"]
    rl = [r for r in metrics(tmp_path / "a") if r["phase"] == "rl"]
    assert [r["replayed_batches"] for r in rl] == [0, 1, 1]
    assert "replayed_batches" not in plain[0]
    assert rl[0]["tokens"] == plain[0]["tokens"] and rl[1]["tokens"] > plain[1]["tokens"]

    first = Trainer(cfg(tmp_path / "b", *replay))

    def stop_after_first_rl(record):
        if record["phase"] == "rl":
            first.stop_requested = True

    first.run(on_step=stop_after_first_rl)
    resumed = Trainer(cfg(tmp_path / "b", *replay))
    resumed.run(resume=True)
    want, got = parameters(straight), parameters(resumed)
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert metrics(tmp_path / "a") == metrics(tmp_path / "b")
