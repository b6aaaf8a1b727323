"""`cod-fast eval` (which samples with the torch sampler) on a tiny random Qwen3 saved and
loaded through from_pretrained; the sampler's own tests are in test_torch_sampler.py."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cod_fast.cli import app
from cod_fast.tokenizer import CHATML, char_tokenizer
from tests.rollout_helpers import save_tiny_qwen3


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Qwen3 with random weights and a character tokenizer, saved like a real model."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), char_tokenizer(CHATML))


def test_eval_command_writes_json_and_plot(tiny_model_dir, tmp_path):
    """`cod-fast eval` runs the model over eval packs (in-domain, cross-domain, Ralph) and
    writes per-position rewards, the CoD gain and a PNG."""
    out = tmp_path / "eval"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--env",
            "frozenlake",
            "--size",
            "tiny",
            "--packs",
            "2",
            "--tasks",
            "2",
            "--max-response-tokens",
            "6",
            "--ralph",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "eval.json").read_text())
    rows = report["results"]["frozenlake"]
    assert set(rows) == {"cod", "ralph_sample", "ralph_full"}
    assert len(rows["cod"]["mean_reward"]) == 2 and "cod_gain" in rows["cod"]
    assert rows["ralph_full"]["num_packs"] == 4  # each of 2 packs expands into K = 2 packs
    assert (out / "eval.png").read_bytes()[:4] == b"\x89PNG"
