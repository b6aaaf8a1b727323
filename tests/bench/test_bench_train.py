"""Smoke test of the trainer benchmark (bench/train.py) on its tiny sizes: seconds, not a
measurement, so no timing is asserted."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import subprocess
import sys

import pytest

from cod_fast.bench import harness, kernels, train


def test_default_step_batch_is_cod_shaped():
    """The default step holds ~16k packed tokens, 25-35% of them trainable, in 2-4
    micro-batches, with multi-turn (several segments per sequence) episodes."""
    _, denominator, stats = train.step_batch(train.StepShape())
    assert 14_000 <= stats["tokens"] <= 16_384, stats
    assert 0.25 <= stats["trainable"] / stats["tokens"] <= 0.35, stats
    assert 2 <= stats["micro_batches"] <= 4, stats
    assert stats["segments"] > stats["sequences"], stats
    assert denominator == stats["trainable"]  # token-mean over the whole step


@pytest.mark.slow
def test_tiny_run_prints_json_last_and_appends_csv(tmp_path, capsys, monkeypatch):
    """Both sections land in the last stdout line (one JSON object) and in their CSVs; the two
    contenders' first-step losses and gradient norms agree (same batch, same initial weights);
    prefix merging never adds tokens, and saves some wherever solve episodes are multi-turn."""
    # One thread per worker, two workers side by side: a smoke test's timings mean nothing, and
    # on a small shared machine two OpenMP threads per worker can straggle by 20x.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = ["--tiny", "--reps", "1", "--warmup", "0", "--packs", "1", "--jobs", "2"]
    train.main([*argv, "--out", str(tmp_path)])

    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("timestamp", "commit", "machine", "torch", "transformers", "step", "merge"):
        assert key in summary, key
    step = summary["step"]
    fused, eager = step["rows"]
    assert [fused["contender"], eager["contender"]] == list(train.CONTENDERS)
    for r in step["rows"]:
        assert r["status"] == "ok", r
        # tiny: the peak's growth may round to 0 (the allocator reuses the warm-up's memory)
        assert r["peak_mib"] >= 0 and r["tokens_per_s"] > 0 and r["ceiling_gflops"] > 0
        assert r["live_peak_mib"] >= 0
        assert r["tokens"] == step["batch"]["tokens"] and r["micro_batches"] >= 2
        assert r["others_cpu"] is None or 0 <= r["others_cpu"] <= 1, r
    assert step["losses_agree"] is True
    for key in ("loss0", "grad_norm0"):
        assert math.isclose(fused[key], eager[key], rel_tol=1e-4), (key, fused[key], eager[key])
    assert set(step["targets"]) == {"speed", "memory"}

    merge = {(r["env"], r["size"]): r for r in summary["merge"]}
    assert set(merge) == set(train.MERGE_ENVS)
    for r in merge.values():
        assert r["token_ratio"] >= 1 and r["attn_ratio"] >= 1, r
        assert (r["note"] == "") == (r["mean_solve_turns"] > 1), r
    assert merge["frozenlake", "full"]["token_ratio"] > 1

    with (tmp_path / "train_step.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["contender"] for r in rows] == list(train.CONTENDERS)
    assert all(float(r["median_s"]) > 0 and r["commit"] and r["torch"] for r in rows)
    with (tmp_path / "prefix_merge.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(train.MERGE_ENVS)
    assert json.loads((tmp_path / "train.json").read_text())["merge"] == summary["merge"]


# glibc's own accounting of the bytes it holds in mmap'd chunks (mallinfo2().hblkhd), around a
# 1 MiB tensor allocated after a 4 MiB one was freed (which raises glibc's adaptive mmap
# threshold past 1 MiB under its defaults).
_MAPPED_BLOCK = """
import ctypes, json, torch
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
x = torch.ones(1 << 20); del x
before = libc.mallinfo2().hblkhd
y = torch.ones(1 << 18)
during = libc.mallinfo2().hblkhd
del y
after = libc.mallinfo2().hblkhd
print(json.dumps({"mapped": during - before, "returned": during - after}))
"""


def _mapped_block(env: dict) -> dict:
    cmd = [sys.executable, "-c", _MAPPED_BLOCK]
    return json.loads(
        subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    )


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="LIVE_MALLOC is a glibc setting")
def test_live_malloc_gives_every_block_its_own_mapping():
    """Under LIVE_MALLOC (the live-peak workers' environment) a 1 MiB tensor is a mapping of
    its own, returned to the system when freed, so the peak resident set is the peak in use;
    under glibc's defaults the same tensor comes from the heap, which keeps what is freed."""
    live = _mapped_block(os.environ | kernels.LIVE_MALLOC)
    assert live["mapped"] >= 2**20 and live["returned"] == live["mapped"], live
    default_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    assert _mapped_block(default_env)["mapped"] == 0


def test_csv_written_before_a_column_was_added_is_rewritten_with_it(tmp_path):
    """Old rows keep their values under the new header; the new column is blank for them."""
    path = tmp_path / "t.csv"
    path.write_text("timestamp,commit,a\n1,c1,x\n")
    table = (("a", "a", ""), ("b", "b", ""))
    meta = dict.fromkeys(harness.META, "m")
    harness.append_csv(path, table, [{"a": "y", "b": "z"}], meta)
    harness.append_csv(path, table, [{"a": "u", "b": "v"}], meta)
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["commit"], r["a"], r["b"]) for r in rows] == [
        ("c1", "x", ""),
        ("m", "y", "z"),
        ("m", "u", "v"),
    ]


def test_cli_forwards_only_the_given_options(monkeypatch):
    """`cod-fast bench train` passes the options it was given, and no others, to main()."""
    from typer.testing import CliRunner

    from cod_fast.cli.app import app

    seen = []
    monkeypatch.setattr(train, "main", seen.append)
    args = ["bench", "train", "--sections", "merge", "--packs", "3", "--tiny"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen == [["--sections", "merge", "--packs", "3", "--tiny"]]
