"""The learning rate of every step (cod_fast.train.schedule): RL's warmup and decays against a
float64 formula, the warm start's and RL's constant rate against the trainer's formulas of
before the schedule, and the config's refusals of a schedule or an epoch count."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from cod_fast.config import ConfigError, TrainConfig
from cod_fast.config.io import load_config
from cod_fast.train.schedule import rl_lr, warm_start_lr

KINDS = ("constant", "cosine", "linear")


def reference_rl_lr(lr, warmup, steps, kind, floor, j) -> float:
    """RL step j's (from 1) learning rate in float64: lr x j / warmup over the warmup, then lr,
    or a half cosine or a line from lr at the first step after the warmup down to floor x lr
    one step past the last (j = steps + 1)."""
    lr, floor = np.float64(lr), np.float64(floor)
    if j <= warmup:
        return float(lr * np.float64(j) / np.float64(warmup))
    if kind == "constant":
        return float(lr)
    progress = np.float64(j - 1 - warmup) / np.float64(max(steps - warmup, 1))
    shape = (1 + np.cos(np.pi * progress)) / 2 if kind == "cosine" else 1 - progress
    return float(lr * (floor + (1 - floor) * shape))


def before_warm_start_lr(train: TrainConfig, step: int, warm_steps: int) -> float:
    """The trainer's warm-start formula before cod_fast.train.schedule (Trainer._warm_start_lr)."""
    peak = train.warm_start_lr * min(1.0, (step + 1) / max(train.warm_start_warmup, 1))
    if train.warm_start_schedule == "constant":
        return peak
    progress = min(step, warm_steps) / max(warm_steps, 1)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def before_rl_lr(train: TrainConfig, step: int, warm_steps: int) -> float:
    """The trainer's RL formula before cod_fast.train.schedule (Trainer._rl_lr)."""
    rl_step = step - warm_steps + 1
    return train.lr * min(1.0, rl_step / max(train.lr_warmup, 1))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("warm_steps", "warmup", "steps"), [(0, 0, 7), (3, 4, 13), (5, 2, 3), (0, 6, 4), (2, 0, 1)]
)
def test_rl_rate_matches_the_float64_formula(kind, warm_steps, warmup, steps):
    """Every RL step's rate is the float64 formula's within float rounding, for fresh rates and
    floors; the decay starts at lr on the first step after the warmup and is the floor one
    step past the last, never rising on the way."""
    rng = np.random.default_rng()
    lr = float(10 ** rng.uniform(-7, -3))
    floor = 0.0 if kind == "constant" else float(rng.choice([0.0, rng.uniform(0, 1)]))
    train = TrainConfig(lr=lr, lr_warmup=warmup, steps=steps, lr_schedule=kind, lr_min_ratio=floor)
    got = [rl_lr(train, warm_steps + j - 1, warm_steps) for j in range(1, steps + 2)]
    want = [reference_rl_lr(lr, warmup, steps, kind, floor, j) for j in range(1, steps + 2)]
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
    decay = got[warmup:]
    if decay:
        assert decay[0] == pytest.approx(lr, rel=1e-15)
        assert all(b <= a * (1 + 1e-15) for a, b in itertools.pairwise(decay))
    if kind != "constant" and steps > warmup:
        assert got[steps] == pytest.approx(floor * lr, rel=1e-12, abs=1e-300)


def test_cosine_and_linear_cross_halfway_at_the_middle_of_the_decay():
    """Halfway through the decay both are at (1 + floor) / 2 of lr, the shapes' one shared
    point besides their ends."""
    for kind in ("cosine", "linear"):
        train = TrainConfig(lr=2e-4, lr_warmup=2, steps=12, lr_schedule=kind, lr_min_ratio=0.2)
        halfway = 2 + 5  # RL step j = 8: progress (8 - 1 - 2) / 10
        assert rl_lr(train, halfway, 0) == pytest.approx(2e-4 * 0.6, rel=1e-13)


@pytest.mark.parametrize(
    "fields",
    [
        {"warm_start_schedule": "cosine", "warm_start_warmup": 100, "warm_start_lr": 4e-3},
        {"warm_start_schedule": "cosine", "warm_start_warmup": 0, "warm_start_lr": 1e-3},
        {"warm_start_schedule": "cosine", "warm_start_warmup": 7, "warm_start_lr": 3.3e-4},
        {"warm_start_schedule": "constant", "warm_start_warmup": 5, "warm_start_lr": 2e-3},
    ],
)
def test_warm_start_and_constant_rl_rates_are_those_of_before(fields):
    """The warm start's rates, and RL's with the constant schedule, equal the trainer's formulas
    of before exactly, at every step of a run of 40 warm-start and 9 RL steps."""
    warm_steps = 40
    train = TrainConfig(warm_start_steps=warm_steps, steps=9, lr=7e-6, lr_warmup=4, **fields)
    for step in range(warm_steps):
        assert warm_start_lr(train, step, warm_steps) == before_warm_start_lr(
            train, step, warm_steps
        )
    for step in range(warm_steps, warm_steps + 9):
        assert rl_lr(train, step, warm_steps) == before_rl_lr(train, step, warm_steps)


@pytest.mark.parametrize(
    ("overrides", "must_mention"),
    [
        (["train.lr_schedule=exponential"], ["train.lr_schedule", "'cosine'", "'linear'"]),
        (
            ["train.lr_schedule=cosine", "train.lr_min_ratio=1.5"],
            ["train.lr_min_ratio", "1.5", "[0, 1]"],
        ),
        (
            ["train.lr_schedule=linear", "train.lr_min_ratio=-0.1"],
            ["train.lr_min_ratio", "-0.1", "[0, 1]"],
        ),
        (["train.lr_min_ratio=0.1"], ["train.lr_min_ratio", "lr_schedule='constant'", "cosine"]),
        (["train.epochs=0"], ["train.epochs", "0", ">= 1"]),
        (["train.epochs=65"], ["train.epochs", "65", "at most 64"]),
        (["train.epochs=1.5"], ["train.epochs", "an integer"]),
    ],
)
def test_refusals_name_the_key_in_one_line(overrides, must_mention):
    """A schedule or epoch count the trainer cannot run is refused as it is set, in one line
    naming the key, the value and what is allowed."""
    with pytest.raises(ConfigError) as error:
        load_config("tiny-cpu", overrides=overrides)
    message = str(error.value)
    assert "\n" not in message
    missing = [m for m in must_mention if m not in message]
    assert not missing, f"{missing} not in {message!r}"


def test_accepted_settings_resolve():
    """A decay with a floor, and several epochs, are accepted as set."""
    cfg = load_config(
        "tiny-cpu",
        overrides=["train.lr_schedule=cosine", "train.lr_min_ratio=0.1", "train.epochs=3"],
    )
    assert (cfg.train.lr_schedule, cfg.train.lr_min_ratio, cfg.train.epochs) == ("cosine", 0.1, 3)
