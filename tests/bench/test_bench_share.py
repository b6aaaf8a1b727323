"""The shared-prefix benchmark (bench/share.py): a small smoke run, whose timings mean nothing
and are only checked to exist; its token counts are checked against the packing itself."""

from __future__ import annotations

import csv
import json

import pytest

from cod_fast.bench import share as bench
from cod_fast.data.packing import pack_microbatches
from cod_fast.data.prefix_tree import unique_tokens


def test_cli_forwards_the_options_and_each_model(monkeypatch):
    """`cod-fast bench share` passes the options it was given, and each --model, to main()."""
    from typer.testing import CliRunner

    from cod_fast.cli.app import app

    seen = []
    monkeypatch.setattr(bench, "main", seen.append)
    args = ["bench", "share", "--envs", "terminal", "--reps", "2"]
    args += ["--model", "terminal=/a", "--model", "pde=/b"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen == [
        ["--envs", "terminal", "--reps", "2", "--model", "terminal=/a", "--model", "pde=/b"]
    ]


@pytest.mark.slow
def test_share_rows_land_in_json_and_csv_with_the_packings_token_counts(tmp_path, capsys):
    argv = ["--envs", "terminal", "--packs", "1", "--group", "3", "--reps", "1"]
    bench.main([*argv, "--out", str(tmp_path)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = summary["rows"]
    assert [(r["env"], r["source"]) for r in rows] == [
        ("terminal", "scripted"),
        ("terminal", "policy"),
    ]
    for row in rows:
        assert row["shared_tokens"] < row["flat_tokens"]  # every episode begins with the same text
        assert row["factor"] == pytest.approx(row["flat_tokens"] / row["shared_tokens"])
        assert row["flat_s"] > 0 and row["shared_s"] > 0
        assert row["loss_diff"] < 1e-4  # the same first step in both layouts (float32 model)
    # The scripted batch is deterministic: its counts are those of the packing itself.
    cfg = bench._config("terminal")
    sequences = bench.scripted_sequences(cfg)
    (flat,) = pack_microbatches(sequences, cfg.train.token_budget)
    (tree,) = pack_microbatches(sequences, cfg.train.token_budget, share_prefix=True)
    assert (
        rows[0]["flat_tokens"]
        == sum(len(s) for s in sequences)
        == sum(mb.num_tokens for mb in flat)
    )
    assert rows[0]["shared_tokens"] == sum(mb.num_tokens for mb in tree)
    assert rows[0]["shared_tokens"] >= unique_tokens([s.tokens for s in sequences])
    with (tmp_path / "share.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2
