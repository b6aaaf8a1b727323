"""`cod-fast bench profile` (bench/profile_step.py) and `cod-fast bench decode` (bench/decode.py)
on the CPU, tiny: they run, write their rows and files, and their arithmetic holds."""

from __future__ import annotations

import csv
import gzip
import json

import pytest
from typer.testing import CliRunner

from cod_fast.bench.profile_step import busy_share
from cod_fast.cli.app import app


def _csv(path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_profile_writes_a_row_a_table_and_a_trace_per_contender(tmp_path):
    args = ["bench", "profile", "--tiny", "--device", "cpu", "--steps", "1", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = _csv(tmp_path / "profile.csv")
    assert [r["contender"] for r in rows] == ["fused", "logits+eager"]
    assert all(float(r["step_ms"]) > 0 and r["top_host"] for r in rows)
    assert all(r["device_busy"] == "" for r in rows)  # no device activity on a CPU
    for name in ("fused", "logits_eager"):
        assert "Self CPU" in (tmp_path / f"profile_{name}.txt").read_text()
        trace = json.loads(gzip.decompress((tmp_path / f"profile_{name}.json.gz").read_bytes()))
        assert trace["traceEvents"]


def test_busy_share_is_the_union_of_the_intervals():
    assert busy_share([(0, 2), (1, 3), (5, 6)], span=10) == pytest.approx(0.4)
    assert busy_share([(4, 5), (0, 1)], span=5) == pytest.approx(0.4)
    assert busy_share([(0, 4), (1, 2)], span=8) == pytest.approx(0.5)
    assert busy_share([], span=3) is None


@pytest.mark.slow
def test_decode_bench_times_both_cpu_paths_on_every_batch(tmp_path):
    args = ["bench", "decode", "--tiny", "--device", "cpu", "--batches", "3,9"]
    args += ["--new-tokens", "4", "--prompt", "6", "--reps", "1", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = _csv(tmp_path / "decode.csv")
    assert [(r["contender"], r["batch"]) for r in rows] == [
        ("compacting", "3"),
        ("static", "3"),
        ("compacting", "9"),
        ("static", "9"),
    ]
    assert all(float(r["prefill_ms"]) > 0 for r in rows)
    summary = json.loads(result.output.strip().splitlines()[-1])
    decode_paths = [r["decode_steps"] for r in summary["rows"]]
    assert decode_paths == ["compacting (static_shapes=False)", "static shapes"] * 2
    for row in summary["rows"][::2]:
        assert row["speedup"] == pytest.approx(1.0)
