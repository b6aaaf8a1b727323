"""Distillation against mixed CoD RL over seeds (bench/distill.py) at toy size: every number of
the summary is the runs' own evaluations, paired per seed. Toy rewards mean nothing; the
arithmetic and the plumbing do."""

from __future__ import annotations

import json
import statistics

import pytest
from typer.testing import CliRunner

from cod_fast.bench import distill as distill_bench
from cod_fast.bench.distill import evaluations
from cod_fast.cli.app import app
from tests.train.test_trainer import FAST

pytestmark = pytest.mark.slow


def test_students_and_mixed_arms_share_their_start_and_are_paired(tmp_path, capsys, monkeypatch):
    """The teachers' gains are their runs' last evaluations, each mixed-CoD arm starts from its
    student's warm start (the same evaluation, number for number), the per-seed gains are the
    runs' own and their mean and spread are over the seeds; the last stdout line is the JSON.
    The `cod-fast` commands run in this process (a process each costs seconds of imports)."""

    def in_process(args, log, threads):
        result = CliRunner().invoke(app, args)
        log.write_text(result.output)
        assert result.exit_code == 0, result.output

    monkeypatch.setattr(distill_bench, "_cli", in_process)
    toy = [*FAST, "rollout.eval_packs=4"]
    argv = ["--seeds", "3,4", "--jobs", "1", "--out", str(tmp_path)]
    summary = distill_bench.main([*argv, *(a for o in toy for a in ("--set", o))])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(
        json.dumps(summary)
    )
    for env in ("frozenlake", "terminal"):
        teacher = evaluations(tmp_path / "teachers" / f"{env}-run")[("end", env)]
        result = summary["envs"][env]
        assert result["teacher"]["gain"] == teacher["cod_gain"]
        for seed in (3, 4):
            opd = evaluations(tmp_path / f"opd-s{seed}")
            mixed = evaluations(tmp_path / f"mixed-s{seed}")
            # The mixed arm starts from the student's warm start: the same weights, packs and
            # eval noise give the same evaluation.
            assert (
                mixed[("start", env)]["mean_reward"]
                == opd[("after warm start", env)]["mean_reward"]
            )
        ends = [evaluations(tmp_path / f"opd-s{s}")[("end", env)]["cod_gain"] for s in (3, 4)]
        assert result["opd"]["end_gain"] == pytest.approx(
            [statistics.fmean(ends), statistics.stdev(ends)]
        )
        assert result["opd"]["per_seed_end"] == ends
    assert 0 < summary["scoring"]["share"][0] < 1
