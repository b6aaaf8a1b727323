"""Terminal (docs/concepts.md section 6): determinism, the hidden dialect, settings, scoring,
scripted agents, action parsing, and a shell that never leaves memory."""

from __future__ import annotations

import builtins
import os
import shutil
import subprocess

import pytest

from cod_fast.envs.base import play_pack
from cod_fast.envs.terminal import (
    DIALECTS,
    PARTIAL_SCALE,
    TerminalEnv,
    TerminalExplorer,
    TerminalTask,
    plan,
)

CONFIGS = [("train", "full"), ("eval", "full"), ("train", "tiny"), ("eval", "tiny")]
K = 4
PROBES = ["ls", "dir", "uname", "pwd", "cd docs", "mkdir a/b", "cat notes.txt", "rm -r docs"]


def seed_with(env: TerminalEnv, dialect: str) -> int:
    return next(seed for seed in range(1000) if env.rule(seed)[0] == dialect)


def run_script(task: TerminalTask, commands: list[str]) -> list[tuple[str, bool, float]]:
    out = [(task.reset(), False, task.reward)]
    for command in commands:
        o = task.step(f"<answer>{command}</answer>")
        out.append((o.observation, o.done, task.reward))
    return out


def position_means(env: TerminalEnv, packs: range, use_hints: bool) -> list[float]:
    totals = [0.0] * K
    for seed in packs:
        rewards = play_pack(env, env.explorer(), seed, K, use_hints=use_hints).rewards
        totals = [t + r for t, r in zip(totals, rewards, strict=True)]
    return [t / len(packs) for t in totals]


@pytest.mark.parametrize("setting,size", CONFIGS)
def test_deterministic(setting, size):
    """Same (pack_seed, task_index) -> same prompt, observations and rewards, in a fresh env."""
    for seed in (0, 5, 999):
        a, b = TerminalEnv(setting, size).task(seed, 1), TerminalEnv(setting, size).task(seed, 1)
        assert a.prompt() == b.prompt()
        commands = [*PROBES, *plan(a.conditions, "linux")]
        a.max_steps = b.max_steps = 100  # play the whole script
        assert run_script(a, commands) == run_script(b, commands)
        assert run_script(a, commands) == run_script(b, commands)  # reset() restores the tree


@pytest.mark.parametrize("setting,size", CONFIGS)
def test_dialect_shared_in_pack_and_differs_across_packs(setting, size):
    """Every task of a pack has the pack's dialect and user; over packs all three dialects
    appear; the goal differs between the tasks of a pack."""
    env = TerminalEnv(setting, size)
    rules = []
    for seed in range(30):
        tasks = [env.task(seed, k) for k in range(K)]
        assert {(t.dialect, t.user) for t in tasks} == {env.rule(seed)}
        assert len({tuple(t.conditions) for t in tasks}) > 1
        rules.append(env.rule(seed))
    assert {d for d, _ in rules} == set(DIALECTS)
    assert len(set(rules)) > 5


def test_train_and_eval_differ():
    """Eval has more goal conditions, deeper folders and a tighter budget than train; tiny has
    1-2 conditions over a handful of files."""

    def stats(setting, size):
        env = TerminalEnv(setting, size)
        tasks = [env.task(seed, k) for seed in range(40) for k in range(2)]
        counts = {len(t.conditions) for t in tasks}
        slack = {t.max_steps - t.min_steps for t in tasks}
        depth = max(len(c.path) - (c.kind != "mkdir") for t in tasks for c in t.conditions)
        return counts, slack, depth

    assert stats("train", "full") == ({2, 3}, {3}, 2)
    assert stats("eval", "full") == ({3, 4}, {1}, 3)
    counts, _, depth = stats("train", "tiny")
    assert counts == {1, 2} and depth == 1
    tiny = TerminalEnv("train", "tiny").task(0, 0)
    assert len(tiny.prompt()) < 120 and tiny.reset() == "ready"


@pytest.mark.parametrize("setting", ["train", "eval"])
def test_tiny_answers_and_outputs_are_short(setting):
    """Tiny: every solver and explorer answer fits a 32-character response, outputs stay under
    40 characters, and the hint is at most 16 characters."""
    env = TerminalEnv(setting, "tiny")
    for seed in range(60):
        for k in range(K):
            task = env.task(seed, k)
            for dialect in DIALECTS:
                assert all(
                    len(f"<answer>{c}</answer>") <= 32 for c in plan(task.conditions, dialect)
                )
        result = play_pack(env, env.explorer(), seed, K)
        assert all(len(h) <= 16 for h in result.hints)
        task = env.task(seed, 0)
        outputs = run_script(
            task, ["uname", "frob", "ls", "dir", *plan(task.conditions, "windows")]
        )
        assert all(len(o) < 40 for o, _, _ in outputs)


@pytest.mark.parametrize("setting,size", CONFIGS)
def test_solver_finishes_early(setting, size):
    """The solver knows the dialect and types one command per condition: reward 1 everywhere
    (50 packs)."""
    env = TerminalEnv(setting, size)
    rewards = [r for seed in range(50) for r in play_pack(env, env.solver(), seed, K).rewards]
    assert sum(rewards) / len(rewards) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("setting,size", CONFIGS)
def test_explorer_shows_the_cod_effect(setting, size):
    """Measured: with hints 0.5 at position 0 (the `uname` probe makes it late) then 1.0; without
    hints 0.5 everywhere. Margins: gain >= 0.4 with hints, |gap| <= 0.05 without."""
    env = TerminalEnv(setting, size)
    with_hints = position_means(env, range(150), use_hints=True)
    without = position_means(env, range(150), use_hints=False)
    assert with_hints[-1] - with_hints[0] >= 0.4, with_hints
    assert max(abs(r - without[0]) for r in without) <= 0.05, without


def test_explorer_hint_round_trip_and_recovery():
    """The hint is `dialect: <name>` (at most 16 characters) and parses back; a wrong hint is
    corrected from the first error message and the goal still completes."""
    env = TerminalEnv("train", "tiny")
    for dialect in DIALECTS:
        seed = seed_with(env, dialect)
        result = play_pack(env, env.explorer(), seed, K)
        assert result.hints[-1] == f"dialect: {dialect}" and len(result.hints[-1]) <= 16
        wrong = next(d for d in DIALECTS if d != dialect)
        # A goal with more than folders to make (`mkdir` is the same word in every shell).
        k = next(
            k for k in range(20) if any(c.kind != "mkdir" for c in env.task(seed, k).conditions)
        )
        explorer, task = TerminalExplorer(), env.task(seed, k)
        explorer.start(task, f"dialect: {wrong}")
        observation = task.reset()
        for _ in range(task.max_steps):
            outcome = task.step(explorer.act(observation))
            observation = outcome.observation
            if outcome.done:
                break
        assert task.success and explorer.dialect == dialect


def test_dialects_differ_visibly():
    """Unknown commands get each shell's own error; Linux and macOS differ in uname, the file
    opener, home and error wording; Windows refuses `/` in paths."""
    env = TerminalEnv("train", "full")
    seen = {}
    for dialect in DIALECTS:
        task = env.task(seed_with(env, dialect), 0)
        task.max_steps = 100
        seen[dialect] = [
            o for o, _, _ in run_script(task, ["frob", "uname", "pwd", "ls", "open x"])
        ]
    assert seen["windows"][1].startswith("'frob' is not recognized")
    assert seen["linux"][1] == "bash: frob: command not found"
    assert seen["macos"][1] == "zsh: command not found: frob"
    assert seen["linux"][2:4] == ["Linux", f"/home/{env.task(seed_with(env, 'linux'), 0).user}"]
    assert seen["macos"][2] == "Darwin" and seen["macos"][3].startswith("/Users/")
    assert "does not exist" in seen["macos"][5] and "command not found" in seen["linux"][5]
    task = env.task(seed_with(env, "windows"), 0)
    task.reset()
    assert task.step("<answer>mkdir a/b</answer>").observation.startswith("The syntax")
    assert task.step("<answer>MKDIR a\\b</answer>").observation == "(no output)"
    assert task.shell.get([*task.shell.home, "a", "b"]) == {}
    for dialect in ("linux", "macos"):
        task = env.task(seed_with(env, dialect), 0)
        task.reset()
        assert "No such file" in task.step("<answer>mkdir a/b</answer>").observation
        task.step("<answer>mkdir -p a/b</answer>")
        assert task.shell.get([*task.shell.home, "a", "b"]) == {}


def test_reward_early_late_and_partial():
    """1 when every condition holds within the minimal number of commands; a late finish gets
    PARTIAL_SCALE; an unfinished goal PARTIAL_SCALE x the fraction done."""
    env = TerminalEnv("train", "full")
    seed = next(s for s in range(200) if len(env.task(s, 0).conditions) == 2)
    task = env.task(seed, 0)
    commands = plan(task.conditions, task.dialect)
    run_script(task, commands)
    assert task.reward == 1.0 and task.success
    run_script(task, ["cd .", *commands])
    assert task.reward == PARTIAL_SCALE and task.success
    run_script(task, [commands[0], "cd .", "cd .", "cd ."])
    assert task.reward == PARTIAL_SCALE / 2 and not task.success
    assert "1 of 2" in task.feedback()


@pytest.mark.parametrize("size", ["full", "tiny"])
@pytest.mark.parametrize(
    "junk",
    [
        "",
        "ls",
        "<answer></answer>",
        "<answer>   </answer>",
        "<answer>ls\nrm notes.txt</answer>",
        "<answer>ls; rm -r /</answer>",
        "<answer>cat a.txt | grep x</answer>",
        "<answer>echo hi > a.txt</answer>",
        "<answer>rm $(ls)</answer>",
        '<answer>cat "notes.txt</answer>',
        "<answer>" + "x" * 300 + "</answer>",
        "<answer>ls",
    ],
)
def test_malformed_action_ends_episode(size, junk):
    """Junk ends the episode: valid False, done, reward 0, feedback naming the expected format."""
    task = TerminalEnv("train", size).task(2, 0)
    task.reset()
    outcome = task.step(junk)
    assert outcome.done and not outcome.valid
    assert task.reward == 0.0
    assert "<answer>" in outcome.observation and "<answer>" in task.feedback()


def test_shell_never_touches_the_real_system(monkeypatch):
    """Destructive command lines only change the in-memory tree: the file system and process
    calls are poisoned and never reached."""

    def poisoned(*args, **kwargs):
        raise AssertionError("the simulated shell reached the real system")

    for module, name in [(os, "remove"), (os, "unlink"), (os, "rmdir"), (os, "mkdir"),
                         (os, "makedirs"), (os, "system"), (os, "chdir"), (os, "rename"),
                         (shutil, "rmtree"), (shutil, "copy"), (shutil, "move"),
                         (subprocess, "run"), (subprocess, "Popen"), (builtins, "open")]:  # fmt: skip
        monkeypatch.setattr(module, name, poisoned)
    env = TerminalEnv("eval", "full")
    for dialect in DIALECTS:
        task = env.task(seed_with(env, dialect), 0)
        task.max_steps = 100
        lines = ["rm -r /", "rm -r ~", "rm -r ..", "del C:\\Windows", "mkdir /tmp/x",
                 "cp /etc/passwd .", "type C:\\boot.ini", "xdg-open /etc", "start cmd", "ls /"]  # fmt: skip
        for observation, _, _ in run_script(task, lines + plan(task.conditions, dialect)):
            assert isinstance(observation, str)
        assert task.success  # the goal was still reachable inside the simulated tree
