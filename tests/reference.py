"""Eager references for the kernel tests: materialised logits, SPEC.md section 4 term by term.

Written independently of cod_fast.ops (loops over segments, full [N, V] logits) so the tests
compare two implementations, not one with itself. Works in any float dtype: float64 is the ground
truth, float32 is "eager torch in the same dtype" that sets the error budget.
"""

from __future__ import annotations

import torch


def eager_logprobs(hidden, weight, targets, temperature=1.0, dtype=torch.float64):
    logits = (hidden.to(dtype) @ weight.to(dtype).T) / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    logp = log_p.gather(1, targets[:, None].long()).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logp, entropy


def eager_policy_loss(
    hidden,
    weight,
    targets,
    advantages,
    segment_ids,
    cfg,
    *,
    old=None,
    roll=None,
    ref=None,
    teach=None,
    denominator=None,
    dtype=torch.float64,
):
    """The loss of SPEC.md section 4, one segment at a time."""
    logp, entropy = eager_logprobs(hidden, weight, targets, cfg.temperature, dtype)

    def cast(t):
        return None if t is None else t.to(dtype)

    adv, old, roll, ref, teach = map(cast, (advantages, old, roll, ref, teach))
    bypass = old is None
    if old is None:
        old = roll if roll is not None else logp.detach()
    segments = sorted(set(segment_ids.tolist()))
    total = logp.new_zeros(())
    for s in segments:
        idx = (segment_ids == s).nonzero().squeeze(1)
        lp, a = logp[idx], adv[idx]
        if cfg.ratio_level == "token":
            ratio = torch.exp(lp - old[idx])
        else:
            ratio = torch.exp((lp - old[idx]).mean()).expand(len(idx))
        if cfg.policy == "ppo":
            clipped = torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)
            term = -torch.minimum(ratio * a, clipped * a)
        elif cfg.policy in ("rec_one_side", "rec_one_side_is"):
            r = ratio.detach()
            keep = torch.tensor(
                [
                    (ai >= 0 and ri <= 1 + cfg.eps_high) or (ai < 0 and ri >= 1 - cfg.eps_low)
                    for ai, ri in zip(a.tolist(), r.tolist(), strict=True)
                ],
                dtype=dtype,
            )
            term = -a * (lp if cfg.policy == "rec_one_side" else ratio) * keep
        else:
            term = -(cfg.opd_coef * (teach[idx] - lp.detach())) * lp
        if cfg.rollout_correction != "none" and not bypass:
            lr = (old[idx] - roll[idx]).detach()
            if cfg.rollout_correction == "tis":
                term = term * torch.clamp(torch.exp(lr), max=cfg.tis_cap)
            else:
                r = (
                    torch.exp(lr)
                    if cfg.rollout_correction == "mis_token"
                    else torch.exp(lr.mean()).expand(len(idx))
                )
                term = term * ((r >= cfg.mis_low) & (r <= cfg.mis_high)).to(dtype)
        if cfg.kl is not None and cfg.beta > 0:
            d = lp - ref[idx]
            k = {"k1": d, "k2": d**2 / 2, "k3": torch.exp(-d) + d - 1}[cfg.kl]
            term = term + cfg.beta * k
        term = term - cfg.entropy_coef * entropy[idx]
        total = total + (term.mean() if cfg.agg == "seq-mean-token-mean" else term.sum())
    if denominator is None:
        n_seg = len(segments)
        denominator = {
            "token-mean": len(targets),
            "seq-mean-token-mean": n_seg,
            "seq-mean-token-sum": n_seg,
            "seq-mean-token-sum-norm": n_seg * cfg.max_response_len,
        }[cfg.agg]
    return total / max(denominator, 1), logp


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


def assert_within_budget(name, fast, eager, truth, slack=1e-6):
    """Error budget: `fast` may be no further from float64 `truth` than `eager` (the eager torch
    computation in the same dtype) is, times 2, plus `slack` (relative to truth's scale)."""
    scale = float(truth.detach().abs().max()) if truth.numel() else 1.0
    diff = (eager.detach().double() - truth.detach()).abs()
    budget = 2 * float(diff.max()) if diff.numel() else 0.0
    report_mismatch(name, fast, truth, atol=budget + slack * max(scale, 1.0), rtol=0.0)
