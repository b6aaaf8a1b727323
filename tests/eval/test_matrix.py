"""The cross-domain matrix (`cod-fast eval --matrix`, cod_fast.eval.matrix) and the standard error of
the CoD gain it reports (cod_fast.data.metrics)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.config.io import dump_yaml, load_config
from cod_fast.data.metrics import summarize
from cod_fast.eval.evaluate import EvalPlan, eval_defaults, evaluate, run_eval_sampling
from cod_fast.eval.matrix import evaluate_matrix, model_labels
from cod_fast.model.loading import load_policy
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.torch_sampler import TorchSampler
from cod_fast.run.export import RUN_CONFIG, export_model, read_run_config
from tests.rollout_helpers import save_tiny_qwen3

ENVS = ("frozenlake", "grid_nav")
STRATEGIES = ("cod", "ralph_sample")


def save_run_model(path, seed: int, packs: int):
    """A tiny Qwen3 (seed `seed`) beside a run config, as `cod-fast export` leaves one: the run
    evaluates `packs` packs of 2 tasks, 3-token responses, and takes 1 off the reward of an
    episode with a cut response. The end-of-text embedding is scaled up so that some contexts
    end at once and others are cut: rewards then differ from pack to pack, and a cell mixed up
    with another would show."""
    save_tiny_qwen3(path, char_tokenizer(CHATML), seed=seed)
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][char_tokenizer(CHATML).eos_token_id] *= 30
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    overrides = [
        f"train.seed={seed}",
        f"rollout.eval_packs={packs}",
        "rollout.tasks_per_pack=2",
        "rollout.max_response_tokens=3",
        "rollout.length_penalty=1.0",
    ]
    (path / RUN_CONFIG).write_text(dump_yaml(load_config("tiny-cpu", overrides=overrides)))
    return path


@pytest.fixture(scope="module")
def run_models(tmp_path_factory):
    """Two models of two runs (different seeds and eval packs), in folders of the same name."""
    root = tmp_path_factory.mktemp("models")
    return [save_run_model(root / run / "model", seed, packs) for run, seed, packs in (
        ("a", 0, 5), ("b", 1, 4)
    )]  # fmt: skip


@pytest.fixture(scope="module")
def matrix_run(run_models, tmp_path_factory):
    """`cod-fast eval --matrix` of the two models on two environments and two strategies."""
    out = tmp_path_factory.mktemp("matrix")
    args = ["eval", "--matrix", *(a for m in run_models for a in ("--model", str(m)))]
    args += [a for e in ENVS for a in ("--env", e)]
    args += [a for s in STRATEGIES for a in ("--strategy", s)]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    return result, out


def run_evaluation(model, envs, strategies) -> dict:
    """What the run of `model` reports for these columns, without cod_fast.eval.matrix: its own
    eval packs, driver settings and sampler (cod_fast.eval.evaluate)."""
    cfg = read_run_config(model)
    run = eval_defaults(cfg)
    plan = EvalPlan(envs, strategies, run["setting"], run["size"], run["packs"], run["tasks"])
    policy, tokenizer = load_policy(dataclasses.replace(cfg.model, name_or_path=str(model)))
    sampler = TorchSampler(policy, tokenizer, **run_eval_sampling(cfg))
    return evaluate(sampler, ChatFormat(tokenizer), plan, run["settings"])["summaries"]


def test_gain_std_error_matches_float64_reference():
    """gain_std_error is the sample standard deviation (ddof 1) of each pack's last-minus-first
    reward over sqrt(n), as numpy and statistics compute it in float64; 0 for one pack, None
    for packs without positions; it is written by to_dict."""
    rng = np.random.default_rng(0)
    for packs, positions in ((2, 2), (7, 3), (33, 5)):
        rewards = rng.normal(0.3, 0.7, size=(packs, positions))
        gains = rewards[:, -1] - rewards[:, 0]
        want = np.std(gains, ddof=1) / np.sqrt(packs)
        summary = summarize(rewards.tolist())
        assert summary.gain_std_error == pytest.approx(want, rel=1e-12, abs=0)
        assert want == pytest.approx(statistics.stdev(gains) / packs**0.5, rel=1e-12)
        assert summary.to_dict()["gain_std_error"] == summary.gain_std_error
    assert summarize([[0.2, 0.9]]).gain_std_error == 0.0
    assert summarize([[], []]).gain_std_error is None
    assert summarize([]).gain_std_error is None


def test_model_labels_are_folder_names_told_apart_by_their_parents(tmp_path):
    """A model's label is its folder's name, with parent folders added only as far as needed to
    make two labels differ; the same model twice is refused."""
    assert model_labels([tmp_path / "a", tmp_path / "b"]) == ["a", "b"]
    assert model_labels([tmp_path / "x" / "m", tmp_path / "y" / "m"]) == ["x/m", "y/m"]
    with pytest.raises(ValueError, match="given twice"):
        model_labels([tmp_path / "a", tmp_path / "a"])


def test_bad_columns_are_refused_before_any_model_loads(tmp_path):
    """An unknown environment or strategy, a repeated column or an `env` flag fails at once,
    naming the bad value, with models that do not even exist."""
    missing = [tmp_path / "nothing"]
    with pytest.raises(ValueError, match="unknown environment 'lake'"):
        evaluate_matrix(missing, ["lake"])
    with pytest.raises(ValueError, match="unknown pack strategy"):
        evaluate_matrix(missing, ["frozenlake"], ["cod", "loop"])
    with pytest.raises(ValueError, match="distinct environment"):
        evaluate_matrix(missing, ["frozenlake", "frozenlake"])
    with pytest.raises(ValueError, match="columns"):
        evaluate_matrix(missing, ["frozenlake"], env="terminal")


def test_eval_with_several_models_needs_matrix(run_models):
    """`cod-fast eval` with two --model (or two --env) and no --matrix exits 2 with one line
    saying so, before loading anything; an unknown --strategy likewise."""
    two = ["eval", "--model", str(run_models[0]), "--model", str(run_models[1])]
    result = CliRunner().invoke(app, two)
    assert result.exit_code == 2 and "need --matrix" in result.output
    envs = ["eval", "--model", str(run_models[0]), "--env", "frozenlake", "--env", "terminal"]
    result = CliRunner().invoke(app, envs)
    assert result.exit_code == 2 and "need --matrix" in result.output
    bad = CliRunner().invoke(app, ["eval", "--model", str(run_models[0]), "--strategy", "loop"])
    assert bad.exit_code == 2 and "unknown --strategy ['loop']" in bad.output


@pytest.mark.slow
def test_matrix_command_writes_every_cell_and_a_heatmap(matrix_run):
    """`cod-fast eval --matrix` exits 0, prints a row per (model, env / strategy) and writes
    matrix.json with every cell (each model at its own pack count and settings, labels told
    apart by the parent folder) and matrix.png, a PNG image."""
    import matplotlib.image

    result, out = matrix_run
    assert result.exit_code == 0, result.output
    assert f"wrote {out / 'matrix.json'} and {out / 'matrix.png'}" in result.output
    assert "grid_nav / ralph_sample" in result.output and "a/model" in result.output
    matrix = json.loads((out / "matrix.json").read_text())
    assert [m["label"] for m in matrix["models"]] == ["a/model", "b/model"]
    assert [(m["packs"], m["seed"], m["size"]) for m in matrix["models"]] == [
        (5, 7_919, "tiny"), (4, 7_920, "tiny")
    ]  # fmt: skip
    assert matrix["envs"] == list(ENVS) and matrix["strategies"] == list(STRATEGIES)
    keys = [(c["model"], c["env"], c["strategy"]) for c in matrix["cells"]]
    assert keys == [(m, e, s) for m in ("a/model", "b/model") for e in ENVS for s in STRATEGIES]
    for cell in matrix["cells"]:
        assert cell["num_packs"] == (5 if cell["model"] == "a/model" else 4)
        assert len(cell["mean_reward"]) == 2 and cell["last_reward"] == cell["mean_reward"][-1]
        assert cell["last_reward_se"] == cell["std_error"][-1] and cell["cod_gain_se"] >= 0
    # Untrained models score each environment's failure reward; environments tell apart.
    assert len({tuple(c["mean_reward"]) for c in matrix["cells"]}) >= 2
    image = matplotlib.image.imread(out / "matrix.png")
    assert image.ndim == 3 and image.shape[1] > image.shape[0]  # two panels side by side
    assert not list(out.glob("*.tmp*"))


@pytest.mark.slow
def test_matrix_cells_are_what_each_run_reports(matrix_run, run_models):
    """Each cell equals, number for number, a plain `evaluate` of that one environment and
    strategy by that model with its run's own packs, fresh sampler and settings: the matrix
    adds nothing of its own, and no cell depends on the columns before it."""
    result, out = matrix_run
    assert result.exit_code == 0, result.output
    cells = json.loads((out / "matrix.json").read_text())["cells"]
    for label, model in zip(("a/model", "b/model"), run_models, strict=True):
        for cell in (c for c in cells if c["model"] == label):
            (env, strategy) = cell["env"], cell["strategy"]
            summary = run_evaluation(model, (env,), (strategy,))[env][strategy]
            assert cell["mean_reward"] == summary.mean_reward
            assert cell["std_error"] == summary.std_error
            assert cell["num_packs"] == summary.num_packs
            assert (cell["cod_gain"], cell["cod_gain_se"]) == (
                summary.cod_gain, summary.gain_std_error
            )  # fmt: skip


def test_flags_apply_to_every_model_and_a_plain_model_plays_the_defaults(run_models, tmp_path):
    """With --matrix a flag (here --packs, --tasks, --size, --max-response-tokens) applies to
    every model, a run's model saying which of its values it overrides; a Hugging Face folder
    without a run config plays the fixed defaults otherwise (seed 0)."""
    plain = save_tiny_qwen3(tmp_path / "plain", char_tokenizer(CHATML))
    args = ["eval", "--matrix", "--model", str(run_models[0]), "--model", str(plain)]
    args += ["--env", "alchemy", "--strategy", "cod", "--packs", "2", "--tasks", "3"]
    args += ["--size", "tiny", "--max-response-tokens", "2", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "overriding the run's packs=5 with 2" in result.output
    matrix = json.loads((tmp_path / "matrix.json").read_text())
    assert [(m["packs"], m["tasks"], m["seed"]) for m in matrix["models"]] == [
        (2, 3, 7_919), (2, 3, 0)
    ]  # fmt: skip
    assert [len(c["mean_reward"]) for c in matrix["cells"]] == [3, 3]


@pytest.mark.slow
def test_run_directory_plays_as_its_exported_model_and_its_own_evaluation(tmp_path, monkeypatch):
    """A run directory of `cod-fast train` as a model: exported on the fly to a temporary folder
    (removed once loaded), it gives the same cells as the folder `cod-fast export` writes of it,
    with the run's own eval packs, and its in-domain cell is the run's final evaluation row."""
    import cod_fast.eval.matrix
    from cod_fast.train.trainer import Trainer
    from tests.train.test_trainer import config  # the fastest trainer settings the tests share

    run, hf = tmp_path / "run", tmp_path / "hf"
    short = ["rollout.eval_packs=3", "rollout.tasks_per_pack=2", "train.warm_start_steps=1"]
    Trainer(config(run, "train.steps=0", *short)).run()
    export_model(run, hf)
    exports = []

    def spy(run_dir, out):
        exports.append((run_dir, Path(out)))
        return export_model(run_dir, out)

    monkeypatch.setattr(cod_fast.eval.matrix, "export_model", spy)
    env = eval_defaults(read_run_config(hf))["env"]
    matrix = evaluate_matrix([run, hf], [env], ["cod"])
    ((exported, folder),) = exports
    assert exported == run and not folder.exists()
    assert [(m["label"], m["packs"], m["size"]) for m in matrix["models"]] == [
        ("run", 3, "tiny"), ("hf", 3, "tiny")
    ]  # fmt: skip
    run_cell, hf_cell = ({k: v for k, v in c.items() if k != "model"} for c in matrix["cells"])
    assert run_cell == hf_cell
    last = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    assert last["mean_reward"] == run_cell["mean_reward"]
    assert last["std_error"] == run_cell["std_error"]
