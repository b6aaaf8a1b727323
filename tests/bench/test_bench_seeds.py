"""Whole preset runs over seeds (bench/seeds.py) at toy size: the summary is the seeds' own
evaluations, paired per seed. The rewards of a toy run mean nothing; the arithmetic does."""

from __future__ import annotations

import csv
import json
import statistics

import pytest

from cod_fast.bench import seeds as seeds_bench
from cod_fast.bench.rl_effect import evaluations
from tests.train.test_trainer import FAST

pytestmark = pytest.mark.slow


def test_each_seed_is_a_whole_run_and_the_parts_are_paired(tmp_path, capsys):
    toy = [o for o in FAST if not o.startswith("runtime.checkpoint_every")]
    argv = ["--preset", "tiny-cpu", "--seeds", "3,4", "--out", str(tmp_path)]
    summary = seeds_bench.main([*argv, *(a for o in toy for a in ("--set", o))])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(
        json.dumps(summary)
    )
    runs = [evaluations(tmp_path / "runs" / f"tiny-cpu-seed{s}") for s in (3, 4)]
    assert [sorted(r) for r in runs] == [sorted(seeds_bench.LABELS)] * 2
    assert runs[0]["end"]["step"] == 4  # 2 warm-start + 2 RL steps: the whole run
    result = summary["presets"]["tiny-cpu"]
    assert result["seeds"] == [3, 4]
    rl = [r["end"]["cod_gain"] - r["after warm start"]["cod_gain"] for r in runs]
    assert result["rl_adds"] == pytest.approx([statistics.fmean(rl), statistics.stdev(rl)])
    last = [r["end"]["mean_reward"][-1] for r in runs]
    assert result["end"]["by_position"][-1][0] == pytest.approx(statistics.fmean(last))
    # A finished run is read back, not rerun.
    mtime = (tmp_path / "runs" / "tiny-cpu-seed3" / "eval.jsonl").stat().st_mtime_ns
    again = seeds_bench.main([*argv, *(a for o in toy for a in ("--set", o))])
    assert (tmp_path / "runs" / "tiny-cpu-seed3" / "eval.jsonl").stat().st_mtime_ns == mtime
    assert again["presets"] == summary["presets"] | {"tiny-cpu": result | {"wall_s": None}}
    with (tmp_path / "seeds.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["evaluation"] for r in rows] == [*seeds_bench.LABELS] * 2
