"""`cod-fast plan` with sequence parallelism (cod_fast/cli/plan.py): the degree, the longest
sequence a micro-batch holds, the largest token budget a GPU, and the refusals, at the
Qwen3-32B shape on a node of 8 x 80 GiB (the plan reads only the model's config: no weights)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.config import ModelConfig
from cod_fast.model.shapes import model_shape

runner = CliRunner()
QWEN3_32B = ["--preset", "qwen3-8b", "--set", "model.name_or_path=Qwen/Qwen3-32B"]
SIXTEEN_BIT = ["--set", "train.master_dtype=model"]


def _plan(*args: str):
    return runner.invoke(app, ["plan", *QWEN3_32B, *SIXTEEN_BIT, "--gpus", "8", *args])


def test_plan_takes_sequence_parallel_from_set_and_reports_the_longest_sequence():
    """`--set train.sequence_parallel=4` reaches the plan: the JSON names the degree and a
    longest sequence of 4 x train.token_budget, and the step holds the SP terms, the all-to-all
    buffers sized from the model's heads (64 query, 8 key/value, 128 wide, bf16)."""
    result = _plan(
        "--set", "train.sequence_parallel=4", "--set", "train.token_budget=6656", "--json"
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert (out["sequence_parallel"], out["longest_sequence"]) == (4, 4 * 6656)
    terms = {t["name"]: t["bytes"] for t in out["phases"]["training step"]["terms"]}
    shape = model_shape(ModelConfig(name_or_path="Qwen/Qwen3-32B"))
    width = (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim * 2
    assert terms["all-to-all buffers"] == 6656 * width
    assert "micro-batches of up to 26,624 tokens over 4 GPUs" in out["notes"][0]


def test_plan_shows_the_degree_and_what_a_gpus_largest_budget_holds():
    """The table's title names the degree; below it the longest sequence, and the largest
    token budget is a GPU's, with the sequences it allows over the group (x 4)."""
    result = _plan(
        "--set", "train.sequence_parallel=4", "--set", "train.token_budget=6656",
        "--gpu-memory", "141",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich wraps long lines
    assert "sequence parallel over 4" in text
    assert (
        "longest sequence: 26,624 tokens (train.token_budget x train.sequence_parallel=4)" in text
    )
    budget = int(text.split("largest that fits: train.token_budget=")[1].split(" ")[0])
    assert f"={budget} a GPU (now 6656): sequences of up to {4 * budget:,} tokens" in text


def test_plan_without_sequence_parallel_says_nothing_of_it():
    """The default degree 1: the longest sequence is the token budget, and no note of it."""
    result = _plan("--set", "train.token_budget=26624", "--json")
    out = json.loads(result.output)
    assert (out["sequence_parallel"], out["longest_sequence"]) == (1, 26624)
    assert not any("sequence_parallel" in n for n in out["notes"])


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--gpus", "3", "--set", "train.sequence_parallel=2"], "does not divide the 3 trainer"),
        (
            ["--set", "model.name_or_path=Qwen/Qwen3-14B", "--set", "train.sequence_parallel=16"],
            "does not divide the 40 attention heads of Qwen/Qwen3-14B",
        ),
    ],
    ids=["gpus", "heads"],
)
def test_plan_refuses_a_degree_that_does_not_divide(args, said):
    """One error line on train.sequence_parallel (not on --gpus), exit 2."""
    gpus = [] if "--gpus" in args else ["--gpus", "16"]
    result = runner.invoke(app, ["plan", *QWEN3_32B, *gpus, *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: train.sequence_parallel: got "), result.stderr
    assert said in result.stderr and result.stderr.count("\n") == 1
