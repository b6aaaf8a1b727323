"""The RL-effect experiment (bench/rl_effect.py) at toy size: one warm start, both arms from it
over two seeds, evaluated alike. The rewards of a toy run mean nothing; the plumbing does."""

from __future__ import annotations

import csv
import json

import pytest

from cod_fast.bench import rl_effect
from tests.test_trainer import FAST

pytestmark = pytest.mark.slow


def test_arms_start_from_one_checkpoint_and_are_evaluated_alike(tmp_path, capsys):
    """Both arms of a seed start from the shared checkpoint and are evaluated with the same CoD
    protocol and eval seed, so their "before" rows are identical; the task-by-task arm trained
    without update episodes; the summary, JSON, CSV and plot agree."""
    toy = [o for o in FAST if not o.startswith(("train.", "runtime.checkpoint_every"))]
    argv = ["--warm-steps", "2", "--rl-steps", "1", "--seeds", "0,1", "--out", str(tmp_path)]
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
    for arm in rl_effect.ARMS:
        assert summary["arms"][arm]["seeds"] == [0, 1]
        assert len(summary["arms"][arm]["after_by_position"]) == 4
    with (tmp_path / "rl_effect.csv").open() as f:
        assert [r["arm"] for r in csv.DictReader(f)] == list(rl_effect.ARMS)
    assert (tmp_path / "rl_effect.png").read_bytes()[:4] == b"\x89PNG"
