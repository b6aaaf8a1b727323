"""Error-budget assertions for the kernel tests (the eager references are cod_fast.ops.eager)."""

from __future__ import annotations

import torch


def report_mismatch(name, got, want, atol, rtol):
    """assert_close that says how many elements are off and where the first ones are."""
    got, want = got.detach().double(), want.detach().double()
    bad = ~torch.isclose(got, want, atol=atol, rtol=rtol)
    if bad.any():
        first = bad.nonzero()[:5].tolist()
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{bad.numel()} elements off (atol={atol:.2e}, "
            f"rtol={rtol:.2e}); max abs err {float((got - want).abs().max()):.3e}; first bad "
            f"indices {first}: got {[float(got[tuple(i)]) for i in first]}, "
            f"want {[float(want[tuple(i)]) for i in first]}"
        )


def assert_within_budget(name, fast, eager, truth, slack=1e-6, scale=None):
    """Error budget: `fast` may be no further from float64 `truth` than `eager` (the eager torch
    computation in the same dtype) is, times 2, plus `slack` relative to `scale` (default: the
    largest |truth|)."""
    if scale is None:
        scale = float(truth.detach().abs().max()) if truth.numel() else 1.0
    diff = (eager.detach().double() - truth.detach()).abs()
    budget = 2 * float(diff.max()) if diff.numel() else 0.0
    report_mismatch(name, fast, truth, atol=budget + slack * max(scale, 1.0), rtol=0.0)
