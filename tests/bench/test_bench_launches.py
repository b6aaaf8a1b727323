"""`cod-fast bench launches` (bench/launches.py): the counts it writes, and its `--check`. The
targets themselves are the benchmark's to report, not asserted here."""

from __future__ import annotations

import csv
import json

import pytest
from typer.testing import CliRunner

from cod_fast.bench import launches
from cod_fast.cli.app import app

COLUMNS = (
    "case",
    "contender",
    "aten_ops",
    "kernels",
    "host_syncs",
    "h2d_copies",
    "device",
    "tokens",
)
CASES = [("train_step", "fused"), ("train_step", "logits+eager"), ("loss", "fused")]
CASES += [("decode", "torch"), ("decode", "torch-static")]


def _run(tmp_path, *extra: str):
    args = ["bench", "launches", "--tokens", "128", "--prompts", "2", "--device", "cpu"]
    return CliRunner().invoke(app, [*args, "--out", str(tmp_path), *extra])


@pytest.mark.slow
def test_command_writes_positive_counts_that_repeat(tmp_path):
    """Two runs append one row per (case, contender) to launches.csv with every column; each
    case dispatches aten ops, every count is a whole number >= 0, and the second run's counts
    equal the first's (the counts are a property of the code, not of timing)."""
    for _ in range(2):
        result = _run(tmp_path)
        assert result.exit_code == 0, result.output
    with (tmp_path / "launches.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert set(COLUMNS) <= set(rows[0]), rows[0].keys()
    assert [(r["case"], r["contender"]) for r in rows] == CASES * 2
    counts = [tuple(int(r[k]) for k in ("kernels", "host_syncs", "h2d_copies")) for r in rows]
    assert all(ops > 0 and syncs >= 0 and h2d >= 0 for ops, syncs, h2d in counts), counts
    assert counts[: len(CASES)] == counts[len(CASES) :]
    assert all(r["device"] == "cpu" for r in rows)
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert [r["kernels"] for r in summary["rows"]] == [c[0] for c in counts[len(CASES) :]]


def _rows(loss_syncs: int, fused_ops: int, eager_ops: int = 100) -> list[dict]:
    base = {"h2d_copies": 0, "device": "cpu", "sync_ops": ""}
    return [
        base | {"case": "train_step", "contender": "fused", "kernels": fused_ops, "host_syncs": 3},
        base
        | {"case": "train_step", "contender": "logits+eager", "kernels": eager_ops}
        | {"host_syncs": 5},
        base | {"case": "loss", "contender": "fused", "kernels": 10, "host_syncs": loss_syncs},
        base | {"case": "decode", "contender": "torch", "kernels": 7, "host_syncs": 0},
    ]


@pytest.mark.parametrize(
    ("loss_syncs", "fused_ops", "missed"),
    [(0, 100, ()), (2, 90, ("host syncs",)), (0, 101, ("kernel ops",)), (1, 101, ("syncs", "ops"))],
)
def test_check_exits_1_naming_each_missed_target(
    tmp_path, monkeypatch, loss_syncs, fused_ops, missed
):
    """--check exits 1 when the fused loss syncs or the fused step launches more kernel ops
    than the eager one, with a message naming each miss; it exits 0 when both are met (fewer
    or equal ops, no sync), and without --check a miss is only reported."""
    monkeypatch.setattr(launches, "measure", lambda *a: _rows(loss_syncs, fused_ops))
    checked = _run(tmp_path, "--check")
    assert checked.exit_code == (1 if missed else 0), checked.output
    for word in missed:
        assert word in checked.output.split("launch targets missed")[-1], checked.output
    assert _run(tmp_path).exit_code == 0
