"""The RL-effect experiment (bench/rl_effect.py) at toy size: one warm start, both arms from it
over two seeds, evaluated alike. The rewards of a toy run mean nothing; the plumbing does."""

from __future__ import annotations

import csv
import json

import pytest

from cod_fast.bench import rl_effect
from tests.train.test_trainer import FAST

pytestmark = pytest.mark.slow


def test_arms_start_from_one_checkpoint_and_are_evaluated_alike(tmp_path, capsys):
    """Both arms of a seed start from the shared checkpoint and are evaluated with the same CoD
    protocol and eval seed, so their "before" rows are identical; the task-by-task arm trained
    without update episodes; the summary, JSON, CSV and plot agree."""
    toy = [o for o in FAST if not o.startswith(("train.", "runtime.checkpoint_every"))]
    argv = ["--warm-steps", "2", "--rl-steps", "1", "--seeds", "0,1", "--out", str(tmp_path)]
    argv += ["--eval-packs", "3", "--warm-set", "train.warm_start_packs=3"]
    summary = rl_effect.main([*argv, *(a for o in toy for a in ("--set", o))])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(
        json.dumps(summary)
    )
    runs = tmp_path / "runs"
    for seed in (0, 1):
        before = [
            json.loads((runs / f"{arm}-seed{seed}" / "eval.jsonl").read_text().splitlines()[0])
            for arm in rl_effect.ARMS
        ]
        assert before[0] == before[1]
        tbt = [
            json.loads(line)
            for line in (runs / f"task_by_task-seed{seed}" / "metrics.jsonl").open()
        ]
        assert tbt and all("hint_valid_frac" not in r for r in tbt)
    warm = json.loads((runs / "warm" / "metrics.jsonl").open().readline())
    assert warm["phase"] == "warm_start"
    assert "warm_start_packs: 3" in (runs / "warm" / "config.yaml").read_text()
    assert "warm_start_packs: 3" not in (runs / "cod-seed0" / "config.yaml").read_text()
    paired = summary["paired"]
    for key in ("gain_after", "gain_change"):
        want = [
            summary_gain(runs, "cod", seed, key) - summary_gain(runs, "task_by_task", seed, key)
            for seed in (0, 1)
        ]
        assert paired[key]["per_seed"] == pytest.approx(want, abs=1e-12)
    for arm in rl_effect.ARMS:
        assert summary["arms"][arm]["eval_packs"] == 3
        assert summary["arms"][arm]["seeds"] == [0, 1]
        assert len(summary["arms"][arm]["after_by_position"]) == 4
    with (tmp_path / "rl_effect.csv").open() as f:
        assert [r["arm"] for r in csv.DictReader(f)] == [*rl_effect.ARMS, "cod - task_by_task"]
    assert (tmp_path / "rl_effect.png").read_bytes()[:4] == b"\x89PNG"


def summary_gain(runs, arm: str, seed: int, key: str) -> float:
    """An arm's CoD gain after RL (`gain_after`) or its change (`gain_change`), read back from
    the run's own eval.jsonl."""
    rows = [json.loads(line) for line in (runs / f"{arm}-seed{seed}" / "eval.jsonl").open()]
    by_label = {r["label"]: r["cod_gain"] for r in rows}
    return by_label["end"] - (by_label["start"] if key == "gain_change" else 0.0)
