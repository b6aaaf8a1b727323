"""The CoD advantage (docs/concepts.md section 3): returns, group baselines, adaptive re-weighting.

Shapes follow the group layout: dim 0 is the group member g (the same pack rolled out G times),
dim 1 the position in the pack. All functions are pure torch, work in any float dtype (float64
for tests) and return new tensors.
"""

from __future__ import annotations

from typing import Literal

import torch

ReturnStyle = Literal["mean", "window", "discounted"]

RED_TAU_LOW, RED_TAU_HIGH = 0.8, 100.0
RED_MAX_HALVINGS, RED_TOL = 20, 0.05
STD_EPS = 1e-6


def _return_weights(
    num_tasks: int, style: ReturnStyle, window: int | None, gamma: float | None, dtype: torch.dtype
) -> torch.Tensor:
    """Matrix M [K, K] with R_k = sum_j M[k, j] x_j, where x_j = r_j for j >= k (zero below).

    Row k holds the normalised weights w_{j-k} / sum_i w_i over the K - k entries that remain in
    the pack; `mean` is w = 1, `window(w)` keeps the first w entries, `discounted` is gamma^j.
    """
    offset = torch.arange(num_tasks).view(1, -1) - torch.arange(num_tasks).view(-1, 1)
    ahead = offset >= 0
    if style == "mean":
        w = ahead.to(dtype)
    elif style == "window":
        if window is None or window < 1:
            raise ValueError(f"style 'window' needs window >= 1, got {window!r}")
        w = (ahead & (offset < window)).to(dtype)
    elif style == "discounted":
        if gamma is None or not 0.0 < gamma <= 1.0:
            raise ValueError(f"style 'discounted' needs gamma in (0, 1], got {gamma!r}")
        w = torch.where(ahead, torch.tensor(gamma, dtype=dtype) ** offset.clamp(min=0).to(dtype), 0)
    else:
        raise ValueError(f"unknown return style {style!r}; choose 'mean', 'window' or 'discounted'")
    return w / w.sum(dim=1, keepdim=True)


def cod_returns(
    task_rewards: torch.Tensor,
    hint_rewards: torch.Tensor,
    style: ReturnStyle = "mean",
    window: int | None = None,
    gamma: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-episode returns of a CoD pack.

    task_rewards [G, K] (r_k), hint_rewards [G, K-1] (h_k) -> (solve_returns [G, K],
    update_returns [G, K-1]). Solve episode k sees x = (r_k, ..., r_{K-1}); update episode k sees
    the same sequence with its own hint reward h_k in place of r_k, so its return is the solve
    return with the first entry swapped.
    """
    if task_rewards.dim() != 2:
        raise ValueError(f"task_rewards must be [G, K], got shape {tuple(task_rewards.shape)}")
    group, num_tasks = task_rewards.shape
    if tuple(hint_rewards.shape) != (group, max(num_tasks - 1, 0)):
        raise ValueError(
            f"hint_rewards must be [G, K-1] = [{group}, {num_tasks - 1}], "
            f"got shape {tuple(hint_rewards.shape)}"
        )
    weights = _return_weights(num_tasks, style, window, gamma, task_rewards.dtype)
    solve = task_rewards @ weights.T
    first = weights.diagonal()[: num_tasks - 1]
    update = solve[:, : num_tasks - 1] + first * (hint_rewards - task_rewards[:, : num_tasks - 1])
    return solve, update


def group_advantages(returns: torch.Tensor, std_norm: bool = False) -> torch.Tensor:
    """A = R - mean_G(R) over dim 0, optionally divided by (population std_G(R) + 1e-6)."""
    centred = returns - returns.mean(dim=0, keepdim=True)
    if std_norm:
        centred = centred / (returns.std(dim=0, correction=0, keepdim=True) + STD_EPS)
    return centred


def task_by_task_advantages(task_rewards: torch.Tensor) -> torch.Tensor:
    """The ablation baseline: ordinary GRPO per task, (r_k - mean_G r_k) / (std_G r_k + 1e-6)."""
    return group_advantages(task_rewards, std_norm=True)


def red_weight(
    advantages: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, float | None]:
    """Adaptive re-weighting: keep the token-weighted mean advantage of a batch from going negative.

    advantages [M], lengths [M] (response tokens per experience). If sum A L >= 0 nothing changes
    and tau is None. Otherwise f(tau) = sum A exp(A / tau) L is decreasing in tau, so bisection
    finds the largest tau in [0.8, 100] with f(tau) >= 0 (keeping the low end, which always
    satisfies it); if even f(0.8) < 0, tau = 0.8. Returns (A exp(A / tau), tau).
    """
    if advantages.shape != lengths.shape or advantages.dim() != 1:
        raise ValueError(
            f"advantages and lengths must be matching 1-D tensors, got "
            f"{tuple(advantages.shape)} and {tuple(lengths.shape)}"
        )
    lengths = lengths.to(advantages.dtype)

    def f(tau: float) -> float:
        return float((advantages * torch.exp(advantages / tau) * lengths).sum())

    if float((advantages * lengths).sum()) >= 0:
        return advantages.clone(), None
    lo, hi = RED_TAU_LOW, RED_TAU_HIGH
    if f(lo) >= 0:
        for _ in range(RED_MAX_HALVINGS):
            if hi - lo < RED_TOL:
                break
            mid = 0.5 * (lo + hi)
            if f(mid) >= 0:
                lo = mid
            else:
                hi = mid
    return advantages * torch.exp(advantages / lo), lo
