"""What plugin authors meet: `cod-fast envs check` on environments that break the CoD contract
only in play (hints that do not read back, a hidden rule drawn per task), typed constructor
options from the config and the command line, and a registry the tests keep to themselves.

`DigitEnv` is the plugin of these tests: the pack's hidden rule is a digit, a task is guessing
it (`guess N`; the right guess scores 1, less 0.05 per earlier try), and its explorer trusts
the digit its hints state, or tries 0, 1, 2, ... without one. It passes every check; each
broken variant below changes one thing."""

from __future__ import annotations

import importlib.metadata
import re
import statistics
from pathlib import Path
from typing import Literal

import pytest
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.config import ConfigError, RolloutConfig
from cod_fast.config.io import apply_overrides, load_config
from cod_fast.envs import (
    ENTRY_POINT_GROUP,
    environment_problem,
    known_environments,
    make_env,
    make_envs,
    register,
)
from cod_fast.envs.base import Agent, Environment, StepOutcome, Task, play_pack, rng_for, too_long
from cod_fast.envs.check import LATE, TASKS, run_checks
from cod_fast.envs.packs import pack_seeds

runner = CliRunner()
GUESS = re.compile(r"\s*guess\s+(\d)\s*", re.IGNORECASE)
ENTRY = re.compile(r"(digit|parity)=(\w+)")


class _DigitTask(Task):
    max_steps = 10

    def __init__(self, pack_seed: int, task_index: int, digit: int):
        super().__init__(pack_seed, task_index)
        self.digit, self.tries, self.found = digit, 0, False

    def prompt(self) -> str:
        return "Guess the pack's digit (0-9, the same in every task of a pack): `guess N`."

    def reset(self) -> str:
        self.tries, self.found = 0, False
        return "guess"

    def step(self, action: str) -> StepOutcome:
        match = None if too_long(action) else GUESS.fullmatch(action)
        if match is None:
            return StepOutcome("Malformed: reply `guess N`.", done=True, valid=False)
        self.tries += 1
        self.found = int(match[1]) == self.digit
        done = self.found or self.tries == self.max_steps
        return StepOutcome("right" if self.found else "wrong", done=done)

    @property
    def reward(self) -> float:
        return 1.0 - 0.05 * (self.tries - 1) if self.found else 0.0

    def feedback(self) -> str:
        return f"the digit was {self.digit}"


class _DigitExplorer(Agent):
    """Trusts the digit its hints state; without one, tries 0, 1, 2, ... in turn."""

    def start(self, task: Task, hints: str | None) -> None:
        known = dict(ENTRY.findall(hints or "")).get("digit")
        self.order = [int(known)] * 10 if known is not None else list(range(10))

    def act(self, observation: str) -> str:
        return f"guess {self.order.pop(0)}"

    def write_hints(self, task: Task, old_hints: str | None) -> str | None:
        digit = int(task.feedback()[-1])
        return f"digit={digit} parity={'odd' if digit % 2 else 'even'}"


class _DigitSolver(Agent):
    def start(self, task: Task, hints: str | None) -> None:
        assert isinstance(task, _DigitTask)
        self.digit = task.digit

    def act(self, observation: str) -> str:
        return f"guess {self.digit}"


class DigitEnv(Environment):
    name = "digit"
    description = "Guess the pack's digit."
    reward_range = (0.0, 1.0)

    def task(self, pack_seed: int, task_index: int) -> Task:
        return _DigitTask(pack_seed, task_index, rng_for("digit", pack_seed).randrange(10))

    def solver(self) -> Agent:
        return _DigitSolver()

    def explorer(self) -> Agent:
        return _DigitExplorer()

    def hint_truth(self, pack_seed: int) -> dict[str, str]:
        digit = rng_for("digit", pack_seed).randrange(10)
        return {"digit": str(digit), "parity": "odd" if digit % 2 else "even"}

    def hint_entries(self, hints: str | None) -> dict[str, str]:
        return dict(ENTRY.findall(hints or ""))

    def render_hints(self, entries: dict[str, str]) -> str:
        return " ".join(f"{name}={value}" for name, value in entries.items())


class _DropsEntries(DigitEnv):
    def render_hints(self, entries: dict[str, str]) -> str:
        """Only the first entry: the others are lost on the way to the next task."""
        return " ".join(f"{name}={value}" for name, value in list(entries.items())[:1])


class _RulePerTask(DigitEnv):
    def task(self, pack_seed: int, task_index: int) -> Task:
        """The digit drawn per task: hints about the previous task's mislead the next."""
        return _DigitTask(
            pack_seed, task_index, rng_for("digit", pack_seed, task_index).randrange(10)
        )


def _statuses(cls: type[Environment], packs: int = 8) -> dict[str, str]:
    register("digit_under_check")(cls)
    return {r.name: r.line() for r in run_checks("digit_under_check", "tiny", packs)}


def test_the_digit_plugin_passes_every_check():
    """The tests' plugin is sound: all seven checks ok, so a failure of a variant below is the
    one thing that variant changes."""
    lines = _statuses(DigitEnv)
    assert list(lines) == [
        *("class", "settings", "determinism", "fuzz", "solver", "explorer", "hints")
    ]
    assert all(" ok: " in line for line in lines.values()), lines
    assert "-> 1.00 (train)" in lines["explorer"]


def test_hints_that_do_not_read_back_fail_the_check():
    """An environment whose `render_hints` drops entries fails the hints check, in one line that
    names the entries lost and the fix, while every other check passes; `envs check` exits 1."""
    lines = _statuses(_DropsEntries)
    failed = {name: line for name, line in lines.items() if "FAILED" in line}
    assert list(failed) == ["hints"], lines
    assert (
        "lost: ['parity']" in failed["hints"] and "the form hint_entries reads" in failed["hints"]
    )
    assert "\n" not in failed["hints"]
    result = runner.invoke(app, ["envs", "check", "digit_under_check", "--packs", "2"])
    assert result.exit_code == 1 and "hints        FAILED" in result.output, result.output


def test_a_rule_drawn_per_task_fails_the_explorer_check():
    """An environment that draws its hidden rule per task, not per pack: the explorer, hints
    carried, falls from its first position's reward to a fraction of it, and the check fails in
    one line with both means (those the scripted play gives) naming the cause and the fix."""
    env = _RulePerTask(setting="train", size="tiny")
    results = [play_pack(env, env.explorer(), seed, TASKS) for seed in pack_seeds("check", 8)]
    first = statistics.fmean(r.rewards[0] for r in results)
    late = statistics.fmean(statistics.fmean(r.rewards[LATE:]) for r in results)
    assert first > 0.4 and late < 0.2  # the premise of this test: hints mislead
    line = _statuses(_RulePerTask)["explorer"]
    assert "FAILED" in line and "\n" not in line
    assert f"falls from {first:.2f} at position 0 to {late:.2f} at positions 2-3" in line, line
    assert "the hidden rule changes within a pack: draw it once per pack seed" in line
    assert "_RulePerTask.task()" in line


def test_the_built_in_environments_pass_the_new_checks():
    """Every built-in explorer does no worse late in a pack than first, and every built-in with
    hint entries reads them back (the whole check of each: tests/envs/test_envs_registry.py)."""
    from cod_fast.envs import ENVIRONMENTS, env_class
    from cod_fast.envs.check import check_explorer, check_hints

    for name in ENVIRONMENTS:
        cls = env_class(name)
        assert check_explorer(cls, "tiny", 4).startswith("mean reward at position 0 -> 2-3")
        if cls.has_hint_entries():
            assert "read back" in check_hints(cls, "tiny", 2)


# Typed options: the config takes scalars, the constructor gets them as it annotates them.


class _Optioned(DigitEnv):
    def __init__(
        self,
        setting: Literal["train", "eval"] = "train",
        size: Literal["tiny", "full"] = "full",
        tries: int = 1,
        fast: bool = False,
        scale: float = 1.0,
        label: str = "x",
        limit: int | None = 5,
        cases: Path | None = None,
        raw=None,
    ):
        super().__init__(setting, size)
        self.tries, self.fast, self.scale, self.label = tries, fast, scale, label
        self.limit, self.cases, self.raw = limit, cases, raw


@pytest.fixture
def optioned():
    register("optioned")(_Optioned)
    return "optioned"


def test_yaml_and_set_options_reach_the_constructor_as_its_types(optioned, tmp_path):
    """`tries: 3` in a YAML config (and in an entry of rollout.envs) reaches an int parameter as
    3; `--set rollout.env_options={tries: 3}` and `{tries: '3'}` both give the int 3."""
    path = tmp_path / "run.yaml"
    path.write_text(f"rollout:\n  env: {optioned}\n  env_options:\n    tries: 3\n    fast: true\n")
    (env,) = make_envs(load_config(path=str(path)).rollout.environments)
    assert (env.tries, env.fast) == (3, True) and type(env.tries) is int
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(
        f"rollout:\n  env: null\n  envs:\n    - name: {optioned}\n      options: {{tries: 3}}\n"
    )
    assert make_envs(load_config(path=str(mixed)).rollout.environments)[0].tries == 3
    for given in ("3", "'3'"):
        cfg = load_config(overrides=[f"rollout.env={optioned}"])
        cfg = apply_overrides(cfg, [f"rollout.env_options={{tries: {given}}}"])
        (env,) = make_envs(cfg.rollout.environments)
        assert env.tries == 3 and type(env.tries) is int, given


def test_text_options_convert_by_annotation(optioned):
    """Text (the command line's `--option`) converts to each parameter's annotated type; an
    unannotated parameter gets the value as given."""
    env = make_env(
        optioned,
        options={
            "tries": " 3 ",
            "fast": "TRUE",
            "scale": "0.5",
            "label": "7",
            "limit": "null",
            "cases": "c.jsonl",
            "raw": "3",
        },
    )
    assert (env.tries, env.fast, env.scale, env.label) == (3, True, 0.5, "7")
    assert (env.limit, env.cases, env.raw) == (None, Path("c.jsonl"), "3")
    env = make_env(optioned, options={"fast": "false", "scale": 2, "label": 7, "limit": 4})
    assert (env.fast, env.scale, env.label, env.limit) == (False, 2.0, "7", 4)
    assert type(env.scale) is float
    result = runner.invoke(app, ["envs", "solve", optioned, "--packs", "1", "--option", "tries=3"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("tries", "three", "int"),
        ("tries", "9" * 5000, "int"),
        ("tries", 2.5, "int"),
        ("tries", True, "int"),
        ("fast", "maybe", "bool"),
        ("scale", "nan", "float"),
        ("scale", "1e999", "float"),
        ("limit", "x", "int | None"),
        ("label", None, "str"),
    ],
)
def test_a_value_that_does_not_convert_is_one_line(optioned, option, value, expected):
    """A value the parameter's type cannot take is one line naming the environment, the option,
    the type and the value (clipped)."""
    with pytest.raises(ValueError) as info:
        make_env(optioned, options={option: value})
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    assert message.startswith(f"environment {optioned}: option {option!r} takes {expected}; got ")
    assert repr(value)[:20] in message


def test_the_config_takes_scalar_options_and_refuses_nested_ones_in_one_line():
    """rollout.env_options and rollout.envs[].options take a string, a number, a bool or null;
    a nested mapping or a list, or a number that is not finite, is refused in one line naming
    its key."""
    cfg = RolloutConfig(env_options={"a": "x", "b": 3, "c": 0.5, "d": True, "e": None})
    assert cfg.env_options == {"a": "x", "b": 3, "c": 0.5, "d": True, "e": None}
    for value, says in [({"deeper": 1}, "expected a string or"), ([1], "expected a string or")]:
        with pytest.raises(ConfigError) as info:
            RolloutConfig(env_options={"tries": value})
        assert str(info.value).startswith(f"env_options.tries: got {value!r}; {says}")
    with pytest.raises(ConfigError, match=r"^env_options.tries: got inf; expected a finite"):
        RolloutConfig(env_options={"tries": float("inf")})
    nested = ["rollout.env=null", "rollout.envs=[{name: frozenlake, options: {a: {b: 1}}}]"]
    with pytest.raises(ConfigError) as info:
        apply_overrides(load_config(), nested)
    assert str(info.value).startswith("rollout.envs[0].options.a: got {'b': 1}")
    assert "\n" not in str(info.value)


# The tests' registry: the built-ins and what each test registers, whatever is installed.


def test_an_installed_plugin_is_invisible_to_the_isolated_registry(monkeypatch, request):
    """With a plugin installed (an entry point in cod_fast.environments), the registry these
    tests use (tests/envs/conftest.py) knows only the built-ins and what the test registers,
    while the product's discovery sees the plugin."""
    plugin = importlib.metadata.EntryPoint("installed_demo", "demo_pkg:Env", ENTRY_POINT_GROUP)

    def entry_points(**selection):
        return [plugin] if selection.get("group") == ENTRY_POINT_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    register("mine")(DigitEnv)
    assert known_environments()[-1] == "mine" and "installed_demo" not in known_environments()
    assert environment_problem("installed_demo").startswith("unknown environment")
    request.getfixturevalue("installed_plugins")
    assert known_environments()[-2:] == ["mine", "installed_demo"]
    assert environment_problem("installed_demo") is None
