"""Terminal's hint hooks (cod_fast.envs.terminal): the dialect as the one hint entry, read and
written in the explorer's format, and what a transcript shows, replayed the explorer's way."""

from __future__ import annotations

import pytest

from cod_fast.data.diagnostics import hint_check
from cod_fast.envs.packs import pack_seeds
from cod_fast.envs.terminal import DIALECTS, TerminalEnv, dialect_of
from tests.data.test_diagnostics import COMBOS, _explorer_transcripts

SEEDS = pack_seeds("terminal-hints", 16)


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_the_truth_is_the_dialect_the_shell_answers_in(size, setting):
    """hint_truth names the dialect whose answer to `uname` the pack's shell gives."""
    env = TerminalEnv(setting, size)
    seen = set()
    for seed in SEEDS:
        truth = env.hint_truth(seed)
        assert list(truth) == ["dialect"] and truth["dialect"] in DIALECTS
        task = env.task(seed, 0)
        task.reset()
        outcome = task.step("<answer>uname</answer>")
        assert dialect_of(outcome.observation) == truth["dialect"], (seed, outcome.observation)
        seen.add(truth["dialect"])
    assert seen == set(DIALECTS)


def test_hint_entries_read_the_explorer_format_and_render_back():
    env = TerminalEnv("train", "tiny")
    assert env.hint_entries(None) == {} and env.hint_entries("") == {}
    assert env.hint_entries("Dialect:  MacOS, then dialect: linux") == {"dialect": "macos"}
    assert env.hint_entries("dialect: ? (probe with uname)") == {}
    assert env.hint_entries("dialect: dos") == {}
    assert env.hint_entries("dialect:" + " " * 200_000 + "x") == {}
    assert env.render_hints({}) == "dialect: ?" and env.hint_entries("dialect: ?") == {}
    for dialect in DIALECTS:
        entries = {"dialect": dialect}
        assert env.hint_entries(env.render_hints(entries)) == entries


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_knowable_entries_of_an_explorer_transcript_are_its_hints(size, setting):
    """Folded over the explorer's own transcripts, knowable_entries gives what the explorer
    writes after each task: the right dialect from the first task on (it probes with uname),
    so its hints score correct against the truth."""
    env = TerminalEnv(setting, size)
    for seed in SEEDS[:8]:
        played, written = _explorer_transcripts(env, seed, 3)
        truth = env.hint_truth(seed)
        knowable: dict[str, str] = {}
        for k, (task, steps, feedback) in enumerate(played):
            knowable = env.knowable_entries(knowable, task, steps, feedback)
            assert env.render_hints(knowable) == written[k], (seed, k)
            check = hint_check(truth, env.hint_entries(written[k]), knowable)
            assert check["correct"] == 1 and check["wrong"] == 0, (seed, k)


def test_knowable_entries_come_from_outputs_not_from_the_first_observation_or_old_belief():
    """A belief stands until an output names another dialect; the task's opening text (the
    first observation, before any command) teaches nothing."""
    env = TerminalEnv("train", "tiny")
    task = env.task(SEEDS[0], 0)
    opening = "zsh: an opening text that looks like macOS"
    assert env.knowable_entries({}, task, [(opening, "<answer>x</answer>")], "") == {}
    outputs = [(opening, "a"), ("ok", "b"), ("bash: y: command not found", "c"), ("ok", "d")]
    assert env.knowable_entries({"dialect": "windows"}, task, outputs[:2], "") == {
        "dialect": "windows"
    }
    assert env.knowable_entries({"dialect": "windows"}, task, outputs, "") == {"dialect": "linux"}
