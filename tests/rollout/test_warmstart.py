"""Warm-start demonstrations with hint noise and hint dropout (cod_fast.rollout.scripted.ScriptedDriver)."""

from __future__ import annotations

import pytest

from cod_fast.config import ConfigError
from cod_fast.config.io import apply_overrides
from cod_fast.config.presets import PRESETS
from cod_fast.envs import make_env
from cod_fast.envs.base import Agent, Task
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings
from cod_fast.rollout.scripted import ScriptedDriver, demonstrations

PACKS = 24


def _setup():
    cfg = PRESETS["tiny-cpu"]()
    settings = DriverSettings.from_config(cfg)
    # Character tokens: lift the caps so that no hint is cut.
    settings = settings.with_rollout(max_response_tokens=2**17, max_hint_tokens=2**17)
    env = make_env(cfg.rollout.env, "train", cfg.rollout.env_size)
    packs = make_packs(pack_seeds("warm", PACKS, 7), cfg.rollout.tasks_per_pack)
    return env, ChatFormat(char_tokenizer(CHATML)), settings, packs


class _NamesItsPack(Agent):
    """The explorer's moves, with hints that name the pack they were written for."""

    def __init__(self, env):
        self.inner = env.explorer()

    def start(self, task: Task, hints: str | None) -> None:
        self.inner.start(task, hints)

    def act(self, observation: str) -> str:
        return self.inner.act(observation)

    def write_hints(self, task: Task, old_hints: str | None) -> str:
        return f"pack {task.pack_seed}"


def _written(env, chat, settings, packs, noise):
    driver = ScriptedDriver(env, chat, settings, lambda: _NamesItsPack(env), hint_noise=noise)
    rollouts = driver.run(packs, group_size=1)
    return {
        (r.pack_id, e.task_index): e.info["hints"]
        for r in rollouts
        for e in r.episodes
        if e.kind == "update"
    }, {r.pack_id: spec.pack_seed for r, spec in zip(rollouts, packs, strict=True)}


def test_no_noise_is_the_plain_explorer():
    env, chat, settings, packs = _setup()
    plain = demonstrations(env, chat, settings, packs[:6])
    quiet = demonstrations(env, chat, settings, packs[:6], hint_noise=0.0)
    ids = [[t.response_ids for e in r.episodes for t in e.turns] for r in plain]
    assert ids == [[t.response_ids for e in r.episodes for t in e.turns] for r in quiet]


@pytest.mark.parametrize("noise", [0.0, 0.5, 1.0])
def test_a_swapped_update_writes_another_packs_hints(noise):
    env, chat, settings, packs = _setup()
    written, seed_of = _written(env, chat, settings, packs, noise)
    own = {key: f"pack {seed_of[key[0]]}" for key in written}
    swapped = [key for key in written if written[key] != own[key]]
    assert all(written[key] in own.values() for key in swapped)  # another pack's hints
    fraction = len(swapped) / len(written)
    if noise == 0.0:
        assert swapped == []
    elif noise == 1.0:  # all but the updates before any other pack wrote
        assert fraction > 0.9
    else:  # 72 draws of a fair coin: 0.5 +- 3.5 standard deviations
        assert 0.29 < fraction < 0.71, fraction
    # Which updates are swapped is drawn from (pack seed, position) alone: the same packs in
    # another order swap the same ones, except where no other pack had written yet.
    again, _ = _written(env, chat, settings, packs[::-1], noise)
    differ = [key for key in written if (written[key] != own[key]) != (again[key] != own[key])]
    assert len(differ) <= 2, differ


def test_the_next_task_reads_what_was_written():
    env, chat, settings, packs = _setup()
    driver = ScriptedDriver(env, chat, settings, hint_noise=1.0)
    for rollout in driver.run(packs[:8], group_size=1):
        episodes = rollout.episodes
        for update, solve in zip(episodes[1::2], episodes[2::2], strict=True):
            prompt = chat.decode(solve.turns[0].prompt_ids)
            assert f"Hints: {update.info['hints']}" in prompt


def test_hint_noise_outside_zero_to_one_is_refused():
    base = PRESETS["tiny-cpu"]()
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ConfigError, match="warm_start_hint_noise"):
            apply_overrides(base, [f"train.warm_start_hint_noise={bad}"])


@pytest.mark.parametrize("dropout", [0.0, 0.5, 1.0])
def test_hint_dropout_leaves_entries_open_and_never_writes_a_wrong_one(dropout):
    """`hint_dropout` p: every entry the written hints state is one the explorer's own hints
    stated (never wrong, against the pack's true mapping too), about a fraction p of the known
    entries is left open, and the next task's prompt shows what was written."""
    env, chat, settings, packs = _setup()
    own = demonstrations(env, chat, settings, packs)
    dropped = ScriptedDriver(env, chat, settings, hint_dropout=dropout).run(packs, group_size=1)
    known = kept = 0
    for plain, thinned, spec in zip(own, dropped, packs, strict=True):
        truth = env.hint_truth(spec.pack_seed)
        updates = [e for e in thinned.episodes if e.kind == "update"]
        first = next(e for e in plain.episodes if e.kind == "update")
        for update in updates:
            written = env.hint_entries(update.info["hints"])
            assert all(truth[name] == value for name, value in written.items())
        # The first update episode sees the same task in both runs: its entries are comparable.
        stated, written = (env.hint_entries(e.info["hints"]) for e in (first, updates[0]))
        assert written.items() <= stated.items()
        known, kept = known + len(stated), kept + len(written)
        for update, solve in zip(thinned.episodes[1::2], thinned.episodes[2::2], strict=True):
            assert f"Hints: {update.info['hints']}" in chat.decode(solve.turns[0].prompt_ids)
    assert known > 20
    if dropout == 0.0:
        assert kept == known
    elif dropout == 1.0:
        assert kept == 0
    else:  # binomial draws, 0.5 +- about 4 standard deviations
        assert 0.5 - 2 / known**0.5 < 1 - kept / known < 0.5 + 2 / known**0.5, (kept, known)


def test_hint_dropout_needs_an_environment_with_a_hint_format():
    """An environment that declares no hint format cannot drop entries: one error naming the
    key and the environment. Out-of-range probabilities are config errors."""
    cfg = PRESETS["tiny-cpu"]()
    settings = DriverSettings.from_config(cfg)
    env = make_env("frozenlake", "train", "tiny")
    env.has_hint_entries = lambda: False  # as an environment without the hooks answers
    with pytest.raises(ValueError, match=r"warm_start_hint_dropout=0\.5: environment frozenlake"):
        ScriptedDriver(env, ChatFormat(char_tokenizer(CHATML)), settings, hint_dropout=0.5)
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ConfigError, match="warm_start_hint_dropout"):
            apply_overrides(cfg, [f"train.warm_start_hint_dropout={bad}"])
