"""The CoD advantage of docs/concepts.md section 3 against float64 hand computations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cod_fast.algo.advantages import (
    cod_returns,
    group_advantages,
    red_weight,
    task_by_task_advantages,
)


def loop_returns(r, h, style="mean", window=None, gamma=None):
    """docs/concepts.md section 3 written as loops over python floats."""

    def reduce(x):
        if style == "mean":
            return sum(x) / len(x)
        if style == "window":
            return sum(x[:window]) / len(x[:window])
        w = [gamma**j for j in range(len(x))]
        return sum(wj * xj for wj, xj in zip(w, x, strict=True)) / sum(w)

    solve = [[reduce(row[k:]) for k in range(len(row))] for row in r]
    update = [
        [reduce([hr[k], *row[k + 1 :]]) for k in range(len(hr))]
        for row, hr in zip(r, h, strict=True)
    ]
    return torch.tensor(solve, dtype=torch.float64), torch.tensor(update, dtype=torch.float64)


def test_cod_returns_worked_example():
    """Mean style: R^s_k = mean(r_k..r_{K-1}), R^u_k = mean(h_k, r_{k+1}..r_{K-1})."""
    r = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    h = torch.tensor([[0.0, -0.1]], dtype=torch.float64)
    solve, update = cod_returns(r, h)
    torch.testing.assert_close(solve, torch.tensor([[2 / 3, 1 / 2, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(update, torch.tensor([[1 / 3, 0.45]], dtype=torch.float64))


def test_cod_returns_window_and_discount_examples():
    """window(2) averages at most two entries; discounted(0.5) weights 1, 1/2, 1/4."""
    r = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    h = torch.tensor([[-0.1, 0.0]], dtype=torch.float64)
    solve, update = cod_returns(r, h, style="window", window=2)
    torch.testing.assert_close(solve, torch.tensor([[0.5, 0.5, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(update, torch.tensor([[-0.05, 0.5]], dtype=torch.float64))
    solve, _ = cod_returns(r, h, style="discounted", gamma=0.5)
    torch.testing.assert_close(solve[0, 0], torch.tensor((1 + 0.25) / 1.75, dtype=torch.float64))


@settings(max_examples=60, deadline=None)
@given(
    group=st.integers(1, 5),
    tasks=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
    style=st.sampled_from(["mean", "window", "discounted"]),
    window=st.integers(1, 8),
    gamma=st.floats(0.05, 1.0),
)
def test_cod_returns_match_loops(group, tasks, seed, style, window, gamma):
    """Every return style equals the loop form of docs/concepts.md section 3 on random rewards."""
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(group, tasks, generator=g, dtype=torch.float64)
    h = -0.1 * (torch.rand(group, tasks - 1, generator=g, dtype=torch.float64) < 0.3)
    solve, update = cod_returns(r, h, style=style, window=window, gamma=gamma)
    ref_solve, ref_update = loop_returns(r.tolist(), h.tolist(), style, window, gamma)
    torch.testing.assert_close(solve, ref_solve.reshape(group, tasks))
    torch.testing.assert_close(update, ref_update.reshape(group, tasks - 1))


def test_cod_returns_bad_shapes_and_styles():
    """Wrong hint shape, missing window or gamma: a ValueError naming the problem."""
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="hint_rewards"):
        cod_returns(r, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="window"):
        cod_returns(r, torch.zeros(2, 2), style="window")
    with pytest.raises(ValueError, match="gamma"):
        cod_returns(r, torch.zeros(2, 2), style="discounted", gamma=1.5)


@pytest.mark.parametrize("std_norm", [False, True])
def test_group_advantages_match_loops(std_norm):
    """A = R - mean_G(R), divided by (population std + 1e-6) when std_norm."""
    returns = torch.rand(6, 4, dtype=torch.float64)
    adv = group_advantages(returns, std_norm=std_norm)
    for k in range(returns.shape[1]):
        col = returns[:, k].tolist()
        mean = sum(col) / len(col)
        std = math.sqrt(sum((x - mean) ** 2 for x in col) / len(col))
        for g, x in enumerate(col):
            want = (x - mean) / (std + 1e-6) if std_norm else x - mean
            assert adv[g, k].item() == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_task_by_task_is_grpo_per_task():
    """Task-by-task: (r_k - mean_G r_k) / (std_G r_k + 1e-6); an all-equal group gives zeros."""
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    adv = task_by_task_advantages(r)
    # mean 0.5, population std 0.5
    want = torch.tensor([0.5, -0.5, 0.5, -0.5], dtype=torch.float64) / (0.5 + 1e-6)
    torch.testing.assert_close(adv[:, 0], want, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(adv[:, 1]) == 0


def test_red_weight_unchanged_when_nonnegative():
    """sum A L >= 0: advantages come back unchanged and tau is None."""
    a = torch.tensor([1.0, -0.5, 0.2], dtype=torch.float64)
    lengths = torch.tensor([3, 4, 1])
    out, tau = red_weight(a, lengths)
    assert tau is None
    torch.testing.assert_close(out, a)


def test_red_weight_worked_example():
    """A = (1, -1), L = (1, 3): f(tau) >= 0 iff tau <= 2 / ln 3, so tau lands just below it."""
    a = torch.tensor([1.0, -1.0], dtype=torch.float64)
    out, tau = red_weight(a, torch.tensor([1, 3]))
    bound = 2 / math.log(3)
    assert bound - 0.05 <= tau <= bound
    torch.testing.assert_close(out, a * torch.exp(a / tau))


def test_red_weight_floor():
    """If even f(0.8) < 0 the floor tau = 0.8 is used."""
    a = torch.tensor([0.1, -1.0], dtype=torch.float64)
    out, tau = red_weight(a, torch.tensor([1, 100]))
    assert tau == 0.8
    torch.testing.assert_close(out, a * torch.exp(a / 0.8))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(2, 40), seed=st.integers(0, 2**31 - 1))
def test_red_weight_property(n, seed):
    """After RED-weight the token-weighted mean advantage is >= 0 (whenever f(0.8) >= 0), and
    tau is the largest such value up to the bisection tolerance."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, 50, (n,), generator=g)
    out, tau = red_weight(a, lengths)

    def f(t):
        return float((a * torch.exp(a / t) * lengths).sum())

    if tau is None:
        assert float((a * lengths).sum()) >= 0
        return
    assert 0.8 <= tau <= 100
    if f(0.8) >= 0:
        assert float((out * lengths).sum()) >= -1e-9
        assert tau >= 100 - 0.05 or f(tau + 0.05) < 0
    else:
        assert tau == 0.8
