"""The environment registry and the `cod-fast envs` commands, over every environment."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.config import EnvEntry
from cod_fast.envs import ENVIRONMENTS, env_class, make_env
from cod_fast.envs.check import run_checks
from cod_fast.envs.packs import make_packs, pack_seeds


@pytest.mark.parametrize("name", list(ENVIRONMENTS))
@pytest.mark.parametrize("size", ["tiny", "full"])
def test_every_environment_passes_the_checks(name, size):
    """Each built-in environment builds by name (its `name` matches, the config accepts it) and
    passes every check of `cod-fast envs check`: declarations, both settings, determinism,
    hostile actions, rewards in range, its solver near the top of the range, its explorer
    through whole packs (no worse late in a pack than first) and, where it declares hint
    entries, their round trip through the hints it renders."""
    assert make_env(name, "eval", size).name == name
    assert EnvEntry(name=name).name == name
    cls = env_class(name)
    assert cls.has_solver() and cls.has_explorer()
    results = run_checks(name, size, packs=4)
    hints = "ok" if cls.has_hint_entries() else "skipped"
    expected = ["ok"] * 6 + [hints]
    assert [r.status for r in results] == expected, "\n".join(r.line() for r in results)


def test_unknown_environment_is_a_clear_error():
    """A misspelt name lists the environments."""
    with pytest.raises(ValueError, match="frozenlake"):
        make_env("frozenlak")


def test_pack_strategies():
    """cod: K different tasks; ralph_sample: task 0 K times; ralph_full: K packs of K copies."""
    seeds = pack_seeds("s", 2)
    assert [p.task_indices for p in make_packs(seeds, 3, "cod")] == [(0, 1, 2)] * 2
    assert [p.task_indices for p in make_packs(seeds, 3, "ralph_sample")] == [(0, 0, 0)] * 2
    full = make_packs(seeds, 3, "ralph_full")
    assert [p.task_indices for p in full] == [(k,) * 3 for k in range(3)] * 2
    assert [p.pack_id for p in full] == list(range(6))
    assert pack_seeds("eval", 3) == pack_seeds("eval", 3) != pack_seeds("train", 3)


def test_cli_envs_list_and_solve():
    """`envs list` names every environment; `envs solve` prints solver and explorer rows."""
    runner = CliRunner()
    listed = runner.invoke(app, ["envs", "list"])
    assert listed.exit_code == 0
    assert all(name in listed.output for name in ENVIRONMENTS)
    solved = runner.invoke(app, ["envs", "solve", "frozenlake", "--packs", "20", "--size", "tiny"])
    assert solved.exit_code == 0, solved.output
    assert "explorer, hints" in solved.output and "CoD gain" in solved.output
    bad = runner.invoke(app, ["envs", "solve", "nope"])
    assert bad.exit_code == 2


def test_cli_envs_play_reads_actions_and_hints():
    """`envs play` shows the task with its hints line and reads actions from the terminal."""
    actions = "\n".join(["Direction 1"] * 3 + ["1=up"] + ["Direction 2"] * 3) + "\n"
    result = CliRunner().invoke(app, ["envs", "play", "frozenlake", "--tasks", "2"], input=actions)
    assert result.exit_code == 0, result.output
    assert "Hints: null" in result.output and "Hints: 1=up" in result.output
    assert result.output.count("reward") == 2


def test_an_unknown_option_list_is_clipped_in_its_error():
    """100,000 options an environment does not take (a config from anywhere) make one short
    line, not a megabyte one."""
    options = {f"option{i}": "x" for i in range(100_000)}
    with pytest.raises(ValueError, match="takes no option 'option0'") as info:
        make_env("frozenlake", options=options)
    assert len(str(info.value)) < 400 and "\n" not in str(info.value)
