"""The environment registry and the `cod-fast envs` commands, over every environment."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cod_fast.cli import app
from cod_fast.config import EnvName
from cod_fast.envs import ENVIRONMENTS, make_env
from cod_fast.envs.base import play_pack
from cod_fast.envs.packs import make_packs, pack_seeds


def test_registry_matches_the_config_choices():
    """Every environment the config accepts is registered, and nothing else."""
    import typing

    assert set(typing.get_args(EnvName)) == set(ENVIRONMENTS)


@pytest.mark.parametrize("name", list(ENVIRONMENTS))
@pytest.mark.parametrize("size", ["tiny", "full"])
def test_every_environment_plays_a_pack(name, size):
    """Each environment builds by name (its `name` matches), and its scripted solver and explorer
    play a 3-task eval pack to the end with rewards in [-1, 1]."""
    env = make_env(name, "eval", size)
    assert env.name == name
    for agent in (env.solver(), env.explorer()):
        result = play_pack(env, agent, pack_seeds("registry", 1)[0], 3)
        assert len(result.rewards) == 3
        assert all(-1.0 <= r <= 1.0 for r in result.rewards)


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
