"""`cod-fast eval` (which samples with the torch sampler) on a tiny random Qwen3 saved and
loaded through from_pretrained; the sampler's own tests are in test_torch_sampler.py."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.model.tokenizer import CHATML, char_tokenizer
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


@pytest.mark.slow
def test_exported_run_evaluates_exactly_as_its_last_eval_row(tmp_path):
    """Train (a short warm start that reaches non-zero rewards, two RL steps), export, then
    `cod-fast eval --model DIR` with no other flag: the run's own env, size, eval setting, eval
    packs, prompt style, caps, temperature and seed, so eval.json equals the run's final
    eval.jsonl row exactly. A flag overrides one setting and says so."""
    from cod_fast.run.export import RUN_CONFIG

    run, hf, out = tmp_path / "run", tmp_path / "hf", tmp_path / "eval"
    sets = [
        "model.num_layers=2",
        "rollout.eval_packs=16",
        "rollout.packs_per_step=2",
        "rollout.group_size=2",
        "train.warm_start_steps=100",
        "train.warm_start_warmup=10",
        "train.steps=2",
        f"runtime.run_dir={run}",
    ]
    runner = CliRunner()
    trained = runner.invoke(app, ["train", *(a for s in sets for a in ("--set", s))])
    assert trained.exit_code == 0, trained.output
    assert runner.invoke(app, ["export", str(run), "--out", str(hf)]).exit_code == 0
    assert (hf / RUN_CONFIG).exists()

    result = runner.invoke(app, ["eval", "--model", str(hf), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "overriding" not in result.output
    last = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    assert last["label"] == "end" and max(last["mean_reward"]) > 0  # something to reproduce
    got = json.loads((out / "eval.json").read_text())
    assert (got["setting"], got["size"], got["packs"]) == ("train", "tiny", 16)
    assert got["results"]["frozenlake"]["cod"] == {
        k: last[k] for k in got["results"]["frozenlake"]["cod"]
    }

    other = runner.invoke(app, ["eval", "--model", str(hf), "--setting", "eval", "--out", str(out)])
    assert other.exit_code == 0, other.output
    assert "overriding the run's setting='train' with 'eval'" in other.output


@pytest.mark.slow
def test_rollout_command_shows_what_the_model_writes_and_reads(tiny_model_dir):
    """`cod-fast rollout --json` prints one object per pack: solve and update episodes in the
    order they ran, the task rewards of the solve episodes, and each later task's context holds
    the hint line made of what the update episode before it parsed. Without --json the same
    packs print as panels."""
    from cod_fast.rollout.hints import context_line

    args = ["rollout", "--model", str(tiny_model_dir), "--env", "frozenlake", "--size", "tiny"]
    args += ["--packs", "2", "--tasks", "3", "--max-response-tokens", "8"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert len(records) == 2
    for record in records:
        episodes = record["episodes"]
        assert [(e["kind"], e["task"]) for e in episodes] == [
            ("solve", 0), ("update", 0), ("solve", 1), ("update", 1), ("solve", 2)
        ]  # fmt: skip
        assert record["task_rewards"] == [e["reward"] for e in episodes if e["kind"] == "solve"]
        for update, solve in zip(episodes[1::2], episodes[2::2], strict=True):
            line = context_line(update["info"]["hints"], first_task=False)
            assert line in solve["turns"][0]["context"]
    shown = CliRunner().invoke(app, args)
    assert shown.exit_code == 0 and "hints carried forward" in shown.stdout
