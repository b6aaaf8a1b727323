"""Model folders that cannot work, refused before any weights exist (cod_fast.model.loading.load_model_files)
by every command that loads one: `eval --model`, `rollout --model`, `eval --matrix` and `train`
with `model.name_or_path`, each with one line, exit code 2 and no traceback."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from typer.testing import CliRunner

import cod_fast.eval.matrix
import cod_fast.train.trainer
from cod_fast.cli.app import app
from cod_fast.config import ModelConfig
from cod_fast.config.io import load_config
from cod_fast.eval.matrix import evaluate_matrix
from cod_fast.model.loading import ModelFolderError, load_policy
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.train.preflight import preflight
from tests.rollout_helpers import save_tiny_qwen3

runner = CliRunner()
CHAR_TOKENS = len(char_tokenizer(CHATML))
"""The tiny model's vocabulary: one token per printable character and three special tokens."""


def larger_tokenizer(extra: int):
    """The character tokenizer with `extra` added tokens after its own ids."""
    tokenizer = char_tokenizer(CHATML)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(extra)])
    return tokenizer


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch, tmp_path):
    """No CUDA device, in a fresh folder: what is refused does not depend on the machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    """A 2-layer Qwen3 with the character tokenizer, saved as a real model folder."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("good"), char_tokenizer(CHATML))


@pytest.fixture
def no_weights(monkeypatch):
    """Refusals come before any weights: building them (or the Trainer) fails the test."""

    def build(*args, **kwargs):
        raise AssertionError("weights were built before the model folder was refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", build)
    monkeypatch.setattr(cod_fast.train.trainer, "Trainer", build)


def _edited(good, tmp_path, fields: dict | None = None, tokenizer=None):
    """A copy of `good` with `fields` written into its config.json, or `tokenizer` saved over
    its own."""
    folder = tmp_path / "model"
    shutil.copytree(good, folder)
    if fields:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | fields))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


BAD_FOLDERS = {
    "negative size": ({"hidden_size": -5}, None, "config.json has hidden_size=-5; expected a"),
    "absurd sizes": (
        {"hidden_size": 10**9, "intermediate_size": 10**9},
        None,
        "parameters (embedding + layers, from vocab_size, hidden_size, intermediate_size and "
        "num_hidden_layers) take",
    ),
    "vocabulary below the tokenizer": (
        {"vocab_size": 50},
        None,
        f"its tokenizer has {CHAR_TOKENS} tokens, but config.json has vocab_size=50",
    ),
    "tokenizer far above the vocabulary": (
        None,
        larger_tokenizer(5000),
        f"its tokenizer has {CHAR_TOKENS + 5000} tokens, but config.json has vocab_size="
        f"{CHAR_TOKENS}",
    ),
    "layers transformers refuses": ({"num_hidden_layers": -1}, None, "config.json does not load"),
}


@pytest.fixture(params=BAD_FOLDERS.values(), ids=BAD_FOLDERS.keys())
def bad_model(request, good_model, tmp_path, no_weights):
    """(folder, what its refusal says) for each bad folder; building weights fails the test."""
    fields, tokenizer, problem = request.param
    return _edited(good_model, tmp_path, fields, tokenizer), problem


def test_load_policy_refuses_a_bad_model_folder_before_building_weights(bad_model):
    """load_policy raises ModelFolderError (a ValueError) naming the folder and the problem,
    before any weights are built."""
    folder, problem = bad_model
    with pytest.raises(ModelFolderError, match=f"^{folder}: ") as caught:
        load_policy(ModelConfig(name_or_path=str(folder)))
    assert problem in str(caught.value) and "\n" not in str(caught.value)


PLAY = ["--env", "frozenlake", "--size", "tiny", "--tasks", "2", "--max-response-tokens", "2"]


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "--packs", "1", *PLAY],
        ["rollout", "--packs", "1", *PLAY],
        ["eval", "--matrix", "--env", "frozenlake", "--strategy", "cod", "--packs", "1"],
    ],
    ids=["eval", "rollout", "eval --matrix"],
)
def test_commands_refuse_a_bad_model_folder_in_one_line(bad_model, command):
    """`eval --model`, `rollout --model` and `eval --matrix --model` exit 2 with one line naming
    the folder and the problem, no traceback, before any weights are built (the progress lines
    of the stages before it may precede it on stderr)."""
    folder, problem = bad_model
    result = runner.invoke(app, [*command, "--model", str(folder)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {folder}: ") and problem in errors[0]
    assert result.stderr.splitlines()[-1] == errors[0] and "Traceback" not in result.output


def test_train_refuses_a_bad_model_folder_in_the_preflight(bad_model):
    """`train` with model.name_or_path naming a bad folder exits 2 with one line naming the
    field, the folder and the problem, before the Trainer is built."""
    folder, problem = bad_model
    sets = ["model.tokenizer=char", f"model.name_or_path={folder}"]
    args = [x for s in sets for x in ("--set", s)]
    result = runner.invoke(app, ["train", "--preset", "tiny-cpu", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: model.name_or_path: {folder}: ")
    assert problem in result.stderr and result.stderr.count("\n") == 1
    # Without a preset, choosing one reads the folder's size first: one line too.
    chosen = runner.invoke(app, ["train", *args])
    assert chosen.exit_code == 2, chosen.output
    errors = [line for line in chosen.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in chosen.output, chosen.output


def test_matrix_refuses_a_bad_last_model_before_the_first_one_plays(
    good_model, tmp_path, monkeypatch
):
    """evaluate_matrix checks every model folder first: a bad second model is refused before
    the first one is evaluated (which would take minutes at real sizes)."""
    bad = _edited(good_model, tmp_path, {"vocab_size": 50})

    def evaluate(*args, **kwargs):
        raise AssertionError("a model was evaluated before every folder was checked")

    monkeypatch.setattr(cod_fast.eval.matrix, "evaluate", evaluate)
    with pytest.raises(ModelFolderError, match="vocab_size=50"):
        evaluate_matrix([good_model, bad], ["frozenlake"], ["cod"], packs=1)


def test_a_vocabulary_larger_than_the_tokenizer_is_accepted(tmp_path):
    """Padded embeddings (config.json's vocab_size above the tokenizer's size, as Qwen's and
    many released models have) are normal: the folder loads, and the preflight passes it."""
    folder = save_tiny_qwen3(tmp_path / "padded", larger_tokenizer(25))
    char_tokenizer(CHATML).save_pretrained(folder)
    model, tokenizer = load_policy(ModelConfig(name_or_path=str(folder)))
    assert model.config.vocab_size == len(tokenizer) + 25
    sets = ["model.tokenizer=char", f"model.name_or_path={folder}"]
    preflight(load_config("tiny-cpu", overrides=sets))
