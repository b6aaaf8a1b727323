"""The `cod-fast` command line (cod_fast/cli/app.py), driven through typer's CliRunner."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.config import Config
from cod_fast.config.io import from_dict, load_config

runner = CliRunner()


def test_help_lists_the_commands():
    """`--help` exits 0 and lists info, config and train."""
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    assert all(command in result.output for command in ("info", "config", "train"))


def test_no_arguments_shows_help():
    """Running with no command prints the help instead of doing anything."""
    result = runner.invoke(app, [])
    assert "Usage" in result.output and "train" in result.output


def test_info_reports_versions_and_kernels():
    """`info` exits 0 and reports torch, the chosen kernel implementation and the extras."""
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    for expected in ("torch", "kernel impl chosen", "extra vllm", "extra flash_attn"):
        assert expected in result.output


def test_config_show_applies_set_and_prints_loadable_yaml():
    """`config show --preset tiny-cpu --set ...` prints the resolved config as YAML."""
    args = ["config", "show", "--preset", "tiny-cpu", "--set", "algo.loss.eps_high=0.3"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "eps_high: 0.3" in result.output
    expected = load_config("tiny-cpu", overrides=["algo.loss.eps_high=0.3"])
    assert from_dict(Config, yaml.safe_load(result.stdout)) == expected


def test_config_show_reads_a_config_file(tmp_path):
    """`--config FILE` is merged over the preset before the --set overrides."""
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny-cpu-tbt\ntrain:\n  steps: 3\n")
    result = runner.invoke(app, ["config", "show", "--config", str(path), "--set", "train.seed=9"])
    assert result.exit_code == 0, result.output
    cfg = from_dict(Config, yaml.safe_load(result.stdout))
    assert (cfg.algo.algorithm, cfg.train.steps, cfg.train.seed) == ("task_by_task", 3, 9)


def test_bad_set_exits_2_with_a_one_line_error_naming_the_field():
    """A ConfigError is one `error:` line on stderr naming the field, exit code 2, no traceback."""
    result = runner.invoke(app, ["config", "show", "--set", "algo.loss.eps_low=2"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: algo.loss.eps_low")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output


def test_a_deprecated_key_is_one_warning_line_and_still_applies():
    """`--set algo.loss.temperature=...` (a key replaced by rollout.temperature) prints one
    `warning:` line on stderr naming the new key and sets it."""
    result = runner.invoke(app, ["config", "show", "--set", "algo.loss.temperature=0.9"])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("warning: algo.loss.temperature is deprecated")
    assert result.stderr.count("\n") == 1 and "write rollout.temperature" in result.stderr
    assert from_dict(Config, yaml.safe_load(result.stdout)).rollout.temperature == 0.9


def test_bad_preset_and_missing_equals_exit_2():
    """An unknown preset and an override without '=' are clean errors too."""
    for args in (["--preset", "nope"], ["--set", "train.steps"]):
        result = runner.invoke(app, ["config", "show", *args])
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("error:")


def test_train_bad_config_exits_2():
    """`train` shares the error handling of `config show`."""
    result = runner.invoke(app, ["train", "--set", "rollout.group_size=1"])
    assert result.exit_code == 2
    assert "rollout.group_size" in result.stderr


REFUSED = {
    "bad --set": (["config", "show", "--set", "algo.loss.eps_low=2"], "in load_config"),
    "export of no run": (["export", "no-such-run", "--out", "model"], "in export_model"),
}
"""Refused commands, and a function on the way to each one's error (its traceback names it)."""


@pytest.mark.parametrize("refused", REFUSED.values(), ids=REFUSED.keys())
@pytest.mark.parametrize("switch", ["COD_FAST_TRACEBACK=1", "--traceback"])
def test_the_traceback_switch_shows_where_a_refusal_was_raised(
    refused, switch, tmp_path, monkeypatch
):
    """Without the switch a refusal is its one `error:` line; with `COD_FAST_TRACEBACK=1` or
    `--traceback` the same line follows the error's traceback (naming the functions it was
    raised through), and the exit code stays 2."""
    args, frame = refused
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COD_FAST_TRACEBACK", raising=False)
    plain = runner.invoke(app, args)
    assert plain.exit_code == 2, plain.output
    assert plain.stderr.startswith("error: ") and plain.stderr.count("\n") == 1
    assert "Traceback" not in plain.output

    # setenv first: the switch sets the variable, and the test's end restores it
    monkeypatch.setenv("COD_FAST_TRACEBACK", "1" if switch.startswith("COD") else "0")
    shown = runner.invoke(app, ["--traceback", *args] if switch == "--traceback" else args)
    assert shown.exit_code == 2, shown.output
    assert shown.stderr.startswith("Traceback (most recent call last):"), shown.stderr
    assert frame in shown.stderr
    assert shown.stderr.endswith(plain.stderr)
    assert not (tmp_path / "model").exists()
