"""Smoke test of the kernel benchmark (bench/kernels.py) on its `tiny` case: seconds, not a measurement."""

from __future__ import annotations

import csv
import json
import math

import pytest

from cod_fast.bench import kernels
from cod_fast.ops.dispatch import is_available

pytestmark = pytest.mark.slow  # runs, processes or benchmarks: seconds each


def _cpp_available() -> bool:
    try:
        return is_available("cpp")
    except ImportError:  # the C++ row-kernel module is absent from this checkout
        return False


def test_tiny_run_prints_json_last_and_appends_csv(tmp_path, capsys):
    """The last stdout line is one JSON object with every contender's timings, the contenders'
    losses agree (same inputs, same loss), and each result is appended to kernels.csv."""
    contenders = ["eager", "torch"] + (["cpp"] if _cpp_available() else [])
    argv = ["--cases", "tiny", "--impls", ",".join(contenders), "--reps", "2", "--warmup", "0"]
    kernels.main([*argv, "--out", str(tmp_path)])

    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("timestamp", "commit", "machine", "torch", "ceiling", "settings", "results"):
        assert key in summary, key
    assert summary["ceiling"]["min"] > 0
    rows = summary["results"]
    assert [r["contender"] for r in rows] == contenders
    for r in rows:
        assert r["status"] == "ok", r
        assert r["case"] == "tiny" and (r["H"], r["V"]) == (32, 128)
        assert 0 < r["p20_s"] <= r["median_s"] <= r["p80_s"]
        assert r["ceiling_gflops"] > 0 and r["frac_ceiling"] > 0 and r["speedup_vs_eager"] > 0
        assert math.isclose(r["loss"], rows[0]["loss"], rel_tol=1e-3, abs_tol=1e-5), r
    # eager computes every packed position; the cod-fast impls only the trainable ones
    assert rows[0]["rows_computed"] == 64 and rows[1]["rows_computed"] == rows[1]["N"] < 64

    with (tmp_path / "kernels.csv").open() as f:
        written = list(csv.DictReader(f))
    assert [w["contender"] for w in written] == contenders
    assert all(float(w["median_s"]) > 0 and w["note"] == "ok" for w in written)
    assert set(kernels.CSV_COLUMNS) == set(written[0])
    assert json.loads((tmp_path / "kernels.json").read_text())["results"][0]["contender"] == "eager"


def test_cli_forwards_only_the_given_options(monkeypatch):
    """`cod-fast bench kernels` passes the options it was given, and no others, to main()."""
    from typer.testing import CliRunner

    from cod_fast.cli.app import app

    seen = []
    monkeypatch.setattr(kernels, "main", seen.append)
    args = ["bench", "kernels", "--cases", "tiny", "--reps", "2", "--scale", "0.5"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen == [["--cases", "tiny", "--reps", "2", "--scale", "0.5"]]


def test_env_benchmark_smoke(tmp_path):
    """bench.envs measures every environment's step rate and the driver's per-call overhead,
    prints JSON last and appends CSV rows."""
    from cod_fast.bench import envs as bench_envs
    from cod_fast.envs import ENVIRONMENTS

    result = bench_envs.main(
        ["--packs", "2", "--tasks", "2", "--group", "2", "--size", "tiny", "--out", str(tmp_path)]
    )
    assert [row["env"] for row in result["envs"]] == list(ENVIRONMENTS)
    assert all(row["steps"] > 0 and row["steps_per_s"] > 0 for row in result["envs"])
    assert result["driver"]["calls"] >= 1 and result["driver"]["overhead_ms_per_call"] > 0
    assert len((tmp_path / "envs.csv").read_text().splitlines()) == len(ENVIRONMENTS) + 1
