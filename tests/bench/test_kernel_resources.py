"""The Triton kernels compile for Hopper on this CPU machine (bench/kernel_resources.py), within
the resources a block may have; the row kernels keep their registers (no spills)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from cod_fast.bench import kernel_resources

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
]


def test_every_kernel_compiles_for_sm90(tmp_path):
    """Every kernel at its launcher's CUDA configuration compiles to sm_90 machine code (in a
    process without TRITON_INTERPRET, which would make the kernels interpreted ones), needs no
    more shared memory than a Hopper block may have, and the bf16 log-prob GEMM uses wgmma.
    The row kernels (one row a program, tiles in registers) must not spill: a spill there would
    cost a round trip to local memory for every tile of every row."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "cod_fast.bench.kernel_resources", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "kernel_resources.json").read_text())
    rows = {row["kernel"]: row for row in summary["kernels"]}
    assert set(rows) == {case.name for case in kernel_resources.cases()}
    for name, row in rows.items():
        assert row["arch"] == "sm_90"
        assert 0 <= row["shared_bytes"] <= kernel_resources.MAX_SHARED_BYTES, name
        assert 0 < row["registers"] <= 255, name
        if name.startswith("rows_"):
            assert row["spill_store_bytes"] == 0, row
    assert rows["linear_lse_fwd_bf16"]["wgmma"]
    # Storing dz as bf16 over the logits (a convert and a barrier a tile) costs no registers:
    # 46 against 48 for the backward, 64 against 64 for the ppo/k3 head (Triton 3.9, sm_90).
    for narrow, wide in (
        ("rows_backward_bf16dz", "rows_backward"),
        ("rows_fused_ppo_klk3_bf16dz", "rows_fused_ppo_klk3"),
    ):
        assert rows[narrow]["registers"] <= rows[wide]["registers"] + 8, (rows[narrow], rows[wide])


def test_interpreter_is_refused():
    """Under TRITON_INTERPRET=1 nothing would be compiled: the tool says so instead of
    reporting interpreter objects."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "cod_fast.bench.kernel_resources", "--kernels", "rows_forward"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "TRITON_INTERPRET" in result.stderr
