"""The asynchronous-RL benchmark (bench/async_rl.py) at toy size: its arms, the ideal it
derives from the one-core run, and its outputs. Its timings at this size mean nothing."""

from __future__ import annotations

import csv
import json

import pytest

from cod_fast.bench import async_rl
from tests.train.test_trainer import FAST

pytestmark = pytest.mark.slow


def test_arms_and_the_ideal_come_from_the_runs_themselves(tmp_path, capsys):
    toy = [o for o in FAST if not o.startswith(("train.", "runtime."))]
    argv = ["--models", "tiny", "--staleness", "1", "--warm-steps", "2", "--rl-steps", "4"]
    argv += ["--out", str(tmp_path), *(a for o in toy for a in ("--set", o))]
    summary = async_rl.main(argv)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(
        json.dumps(summary)
    )
    rows = {r["arm"]: r for r in summary["rows"]}
    assert list(rows) == ["one core (S + T)", "K=0, 2 threads", "K=1, 2 processes"]
    runs = tmp_path / "runs"
    one = [json.loads(line) for line in (runs / "tiny-one-core" / "metrics.jsonl").open()]
    kept = [r for r in one if r["phase"] == "rl"][async_rl.SKIP :]
    sample = sum(r["sample_s"] for r in kept) / len(kept)
    step = sum(r["step_s"] for r in kept) / len(kept)
    first = rows["one core (S + T)"]
    assert first["sample_s"] == pytest.approx(sample)
    assert first["train_s"] == pytest.approx(step - sample)
    assert first["ideal"] == pytest.approx(step / max(sample, step - sample))
    assert first["speedup"] == pytest.approx(1.0)
    assert rows["K=1, 2 processes"]["staleness"] == 1.0
    k1_rows = [json.loads(line) for line in (runs / "tiny-k1" / "metrics.jsonl").open()]
    kept = k1_rows[async_rl.SKIP :]
    k1 = rows["K=1, 2 processes"]
    assert k1["sample_s"] == pytest.approx(sum(r["worker_sample_s"] for r in kept) / len(kept))
    assert k1["of_pipeline"] == pytest.approx(max(k1["sample_s"], k1["train_s"]) / k1["step_s"])
    assert rows["K=0, 2 threads"]["staleness"] is None
    k1 = [json.loads(line) for line in (runs / "tiny-k1" / "metrics.jsonl").open()]
    assert [r["weights_version"] for r in k1] == [0, 0, 1, 2]
    assert "init_from" in (runs / "tiny-k1" / "config.yaml").read_text()
    with (tmp_path / "async.csv").open() as f:
        assert [r["arm"] for r in csv.DictReader(f)] == list(rows)


def test_learning_arms_start_from_one_checkpoint_and_are_paired(tmp_path, capsys):
    """K=0 and K=1 arms per seed from one warm start, evaluated alike before RL (so their
    "before" rows are identical); the async arm logs its staleness; the paired difference is
    the per-seed difference of the changes."""
    toy = [o for o in FAST if not o.startswith(("train.", "runtime."))]
    argv = ["--models", "", "--learn-seeds", "1", "--learn-warm-steps", "2"]
    argv += ["--learn-steps", "3", "--learn-staleness", "1", "--eval-packs", "2"]
    argv += ["--out", str(tmp_path), *(a for o in toy for a in ("--set", o))]
    summary = async_rl.main(argv)
    capsys.readouterr()
    learning = summary["learning"]
    assert list(learning["arms"]) == ["K=0", "K=1"]
    runs = tmp_path / "runs"
    for seed in (1,):
        sync = [json.loads(line) for line in (runs / f"learn-K0-seed{seed}" / "eval.jsonl").open()]
        split = [json.loads(line) for line in (runs / f"learn-K1-seed{seed}" / "eval.jsonl").open()]
        assert sync[0] == split[0]
        steps = [
            json.loads(line) for line in (runs / f"learn-K1-seed{seed}" / "metrics.jsonl").open()
        ]
        assert [r["staleness"] for r in steps] == [0, 1, 1]
    change = {
        arm: [a["cod_gain"] - b["cod_gain"] for a, b in pairs]
        for arm, pairs in (
            (name, [(evals(runs, name, s, -1), evals(runs, name, s, 0)) for s in (1,)])
            for name in ("K0", "K1")
        )
    }
    want = [k1 - k0 for k1, k0 in zip(change["K1"], change["K0"], strict=True)]
    assert learning["paired"]["gain_change"]["per_seed"] == pytest.approx(want, abs=1e-12)
    assert (tmp_path / "async_learning.csv").exists()


def evals(runs, name: str, seed: int, index: int) -> dict:
    lines = (runs / f"learn-{name}-seed{seed}" / "eval.jsonl").read_text().splitlines()
    return json.loads(lines[index])
