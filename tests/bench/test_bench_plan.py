"""`cod-fast bench plan` (bench/plan.py) on the CPU: the memory plan of a tiny training step
and of two rollouts against their live peaks, written where the other benchmarks write."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cod_fast.cli.app import app


@pytest.mark.slow  # 1-2 s: left to the full suite
def test_bench_plan_measures_every_case_within_its_tolerance(tmp_path):
    args = ["bench", "plan", "--shape", "tiny", "--device", "cpu", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, "--check"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "plan.json").read_text())
    cases = [row["case"] for row in summary["rows"]]
    assert cases == ["training step (tiny)", "sampling (compacting)", "sampling (static)"]
    for row in summary["rows"]:
        assert row["measured_mib"] > 0 and abs(row["ratio"] - 1) <= 0.15, row
    assert summary["targets_missed"] == []
    assert (tmp_path / "plan.csv").read_text().count("\n") == 4  # header + 3 rows
