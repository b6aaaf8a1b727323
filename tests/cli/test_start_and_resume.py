"""Where a run's config starts (a config for the user's own model starts from a GPU preset
sized for it, never the tiny CPU run's), and `--resume RUN`, which continues a run with its own
config however it was started."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import yaml
from transformers import Qwen3Config
from typer.testing import CliRunner

import cod_fast.train.trainer as trainer_module
from cod_fast.cli.app import app
from cod_fast.config import ConfigError
from cod_fast.config.io import load_config
from cod_fast.config.presets import GPU_PRESETS, PRESETS
from cod_fast.model.shapes import model_shape
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.run.checkpoint import latest_checkpoint, read_model_state
from cod_fast.train.memory_plan import check_fits, plan_memory
from tests.special_files import cli_error
from tests.train.test_trainer import FAST, metrics

runner = CliRunner()


def _config_file(tmp_path, data: dict) -> str:
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _shown(result) -> dict:
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.stdout)


@pytest.mark.parametrize(
    ("model", "preset"),
    [
        ("Qwen/Qwen3-0.6B", "qwen3-0.6b"),
        ("Qwen/Qwen3-1.7B", "qwen3-1.7b"),
        ("Qwen/Qwen3-8B", "qwen3-8b"),
    ],
)
def test_a_config_naming_its_own_model_starts_from_the_preset_sized_for_it(tmp_path, model, preset):
    """A YAML that sets only model.name_or_path gets the GPU preset nearest its size (one note
    line saying which), not the tiny CPU run's response cap, learning rate and folder."""
    path = _config_file(tmp_path, {"model": {"name_or_path": model}})
    result = runner.invoke(app, ["config", "show", "--config", path])
    shown = _shown(result)
    assert f"starting from preset {preset}" in result.stderr
    expected = PRESETS[preset]()
    assert shown["model"]["name_or_path"] == model
    assert shown["rollout"]["max_response_tokens"] == expected.rollout.max_response_tokens
    assert shown["train"]["lr"] == expected.train.lr != PRESETS["tiny-cpu"]().train.lr
    assert shown["runtime"]["device"] == "cuda"
    assert shown["train"]["warm_start_steps"] == 0


def test_a_model_folder_is_sized_from_its_config_json(tmp_path):
    """A local folder's config.json sets the choice (counted on the meta device, no weights):
    an 8B-like shape gets qwen3-8b, a small one qwen3-0.6b; a folder that is no model folder is
    refused in one line naming model.name_or_path, as the preflight would."""
    for hidden, layers, preset in ((4096, 36, "qwen3-8b"), (256, 4, "qwen3-0.6b")):
        folder = tmp_path / f"m{hidden}"
        Qwen3Config(
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
        ).save_pretrained(folder)
        char_tokenizer(CHATML).save_pretrained(folder)  # a model folder: config and tokenizer
        path = _config_file(tmp_path, {"model": {"name_or_path": str(folder)}})
        result = runner.invoke(app, ["config", "show", "--config", path])
        _shown(result)
        assert f"starting from preset {preset}" in result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    path = _config_file(tmp_path, {"model": {"name_or_path": str(empty)}})
    line = cli_error(runner.invoke(app, ["config", "show", "--config", path]))
    assert line.startswith(f"error: model.name_or_path: {empty}: a folder without config.json")


def test_an_explicit_preset_is_kept_and_no_chooser_refuses_in_one_line(tmp_path):
    path = _config_file(tmp_path, {"model": {"name_or_path": "Qwen/Qwen3-1.7B"}})
    result = runner.invoke(app, ["config", "show", "--preset", "tiny-cpu", "--config", path])
    assert _shown(result)["rollout"]["max_response_tokens"] == 24
    assert "starting from preset" not in result.stderr
    with pytest.raises(ConfigError) as refused:
        load_config(path=path)
    assert refused.value.key == "preset" and "\n" not in str(refused.value)
    assert all(name in str(refused.value) for name in GPU_PRESETS)
    overridden = runner.invoke(app, ["config", "show", "--set", "model.name_or_path=Qwen/Qwen3-8B"])
    assert _shown(overridden)["train"]["token_budget"] == PRESETS["qwen3-8b"]().train.token_budget


@pytest.mark.parametrize(
    ("model", "says"),
    [("Qwen/Qwen3-32B", "no preset is sized for a model that large"), ("nobody/nothing", "size")],
)
def test_a_model_no_preset_fits_or_whose_size_is_unknown_is_refused_in_one_line(
    tmp_path, model, says
):
    path = _config_file(tmp_path, {"model": {"name_or_path": model}})
    line = cli_error(runner.invoke(app, ["config", "show", "--config", path]))
    assert says in line and "--preset" in line


@pytest.mark.parametrize("preset", list(GPU_PRESETS))
def test_every_gpu_preset_fits_a_node_of_80_gib_gpus_by_the_memory_plan(preset):
    cfg = PRESETS[preset]()
    shape = model_shape(cfg.model)
    plan = plan_memory(cfg, shape, gpus=8, memory=80 * 2**30, sampler="vllm")
    check_fits(plan)  # raises naming the phase that does not fit


def _stop_after(monkeypatch, step: int) -> None:
    """SIGTERM this process once the run has finished `step` (a preemption)."""
    warm, rl = trainer_module.Trainer._warm_step, trainer_module.Trainer._rl_step

    def wrap(original):
        def stepped(self):
            record = original(self)
            if self.step == step and not self.stop_requested:
                os.kill(os.getpid(), signal.SIGTERM)
            return record

        return stepped

    monkeypatch.setattr(trainer_module.Trainer, "_warm_step", wrap(warm))
    monkeypatch.setattr(trainer_module.Trainer, "_rl_step", wrap(rl))


def _weights(run) -> dict[str, torch.Tensor]:
    return read_model_state(latest_checkpoint(run))


@pytest.mark.slow  # three tiny runs: ~25 s
@pytest.mark.parametrize("started_from", ["preset", "config file"])
def test_resume_with_only_the_run_directory_equals_an_uninterrupted_run(
    tmp_path, monkeypatch, started_from
):
    """A run started from a preset and overrides, or from a config file, stopped by SIGTERM
    after step 3, then `cod-fast train --resume RUN` with nothing else: its metrics (timings
    aside) and weights equal the same run uninterrupted."""
    sets = [*FAST, "train.seed=5"]
    whole = tmp_path / "whole"
    args = ["train", "--preset", "tiny-cpu"]
    done = runner.invoke(
        app, [*args, *(a for s in [*sets, f"runtime.run_dir={whole}"] for a in ("--set", s))]
    )
    assert done.exit_code == 0, done.output
    run = tmp_path / "run"
    if started_from == "preset":
        start = [*args, *(a for s in [*sets, f"runtime.run_dir={run}"] for a in ("--set", s))]
    else:
        data: dict = {"preset": "tiny-cpu"}
        for override in [*sets, f"runtime.run_dir={run}"]:
            key, value = override.split("=", 1)
            *path, last = key.split(".")
            node = data
            for part in path:
                node = node.setdefault(part, {})
            node[last] = yaml.safe_load(value)
        start = ["train", "--config", _config_file(tmp_path, data)]
    _stop_after(monkeypatch, 3)
    stopped = runner.invoke(app, start)
    assert stopped.exit_code == 128 + signal.SIGTERM, stopped.output
    assert latest_checkpoint(run).step == 3
    monkeypatch.undo()
    resumed = runner.invoke(app, ["train", "--resume", str(run)])
    assert resumed.exit_code == 0, resumed.output
    assert metrics(run) == metrics(whole)
    ours, theirs = _weights(run), _weights(whole)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_resume_refuses_what_the_run_directory_names_but_the_user_did_not(tmp_path):
    """A run directory may come from anyone: its config's environment path is not imported,
    and its judge is not called, unless the user names them too; a run directory given
    without --resume and a run_dir other than RUN are refused in one line."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config("tiny-cpu", overrides=[f"runtime.run_dir={run}"])
    from cod_fast.config.io import dump_yaml

    text = dump_yaml(cfg).replace("env: frozenlake", "env: planted.py:Env")
    (run / "config.yaml").write_text(text)
    line = cli_error(runner.invoke(app, ["train", "--resume", str(run)]))
    assert "a path to code" in line and "--set rollout.env=planted.py:Env" in line
    judged = dump_yaml(cfg).replace("judge: rule", "judge: http://127.0.0.1:9/v1")
    (run / "config.yaml").write_text(judged)
    line = cli_error(runner.invoke(app, ["train", "--resume", str(run)]))
    assert "does not call" in line and "API key" in line
    line = cli_error(runner.invoke(app, ["train", str(run)]))
    assert "without --resume" in line
    other = ["train", "--resume", str(run), "--set", f"runtime.run_dir={tmp_path / 'x'}"]
    assert "writes only into its own folder" in cli_error(runner.invoke(app, other))


def test_stop_signals_checkpoint_twice_then_stop_at_once():
    """The first and second stop signals finish the step (and say so); the third stops at
    once."""
    heard: list[int] = []
    trainer = trainer_module.Trainer.__new__(trainer_module.Trainer)
    trainer.signals, trainer.stop_requested, trainer.stop_signal = 0, False, None
    trainer.on_signal = heard.append
    trainer._request_stop(signal.SIGINT, None)
    assert trainer.stop_requested and trainer.stop_signal == signal.SIGINT
    trainer._request_stop(signal.SIGTERM, None)
    assert heard == [1, 2] and trainer.stop_signal == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        trainer._request_stop(signal.SIGINT, None)


def test_init_from_a_folder_without_a_tokenizer_names_that_folder(tmp_path):
    """`--init-from` weights whose folder holds no tokenizer: the line names train.init_from
    and that folder, not the new run directory."""
    from safetensors.torch import save_file

    weights = tmp_path / "weights"
    weights.mkdir()
    save_file({"w": torch.zeros(2)}, str(weights / "model.safetensors"))
    sets = [*FAST, f"runtime.run_dir={tmp_path / 'new'}", "model.tokenizer=bpe"]
    args = ["train", "--init-from", str(weights), *(a for s in sets for a in ("--set", s))]
    line = cli_error(runner.invoke(app, args))
    assert line.startswith("error: train.init_from:") and str(weights) in line


@pytest.mark.slow  # one tiny run: a few seconds
def test_a_third_signal_stops_at_once_and_says_what_is_lost(tmp_path, monkeypatch):
    """Three SIGINTs after RL step 3 trained (before its checkpoint): the first two are said
    and would let the step finish; the third ends the run at once, exit 130, with one line
    saying the steps since the last checkpoint are lost; that checkpoint is intact."""
    run = tmp_path / "run"
    rl = trainer_module.Trainer._rl_step

    def three_signals(self):
        record = rl(self)
        if self.step == 3:
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGINT)
        return record

    monkeypatch.setattr(trainer_module.Trainer, "_rl_step", three_signals)
    sets = [*FAST, f"runtime.run_dir={run}"]
    result = runner.invoke(app, ["train", *(a for s in sets for a in ("--set", s))])
    assert result.exit_code == 128 + signal.SIGINT, result.output
    said = " ".join(result.stderr.split())
    assert "stopping: the step in progress finishes" in said and "still finishing" in said
    lost = "stopped at once, without a checkpoint: the 1 step(s) finished since the checkpoint"
    assert f"{lost} of step 2" in said
    assert latest_checkpoint(run).step == 2
