"""Eager baselines: materialised [N, V] logits and docs/concepts.md section 4 written term by term.

What a plain PyTorch user would write: full logits, log_softmax, gather, and the loss one segment
at a time, differentiated by autograd. The tests use it (in float64) as ground truth and (in the
operands' dtype) to set the error budget; the benchmarks use it as the "eager torch" baseline.
It is written independently of the rest of cod_fast.ops, so tests compare two implementations.
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
    entropy_coef=None,
    dtype=torch.float64,
    with_magnitude=False,
):
    """The loss of docs/concepts.md section 4, one segment at a time: (loss, logp).

    ``entropy_coef`` [N] weighs each token's entropy bonus instead of ``cfg.entropy_coef``.

    ``with_magnitude`` adds a third value, the same aggregation over |per-token terms|: the
    scale that float rounding of the loss is relative to when terms cancel.
    """
    logp, entropy = eager_logprobs(hidden, weight, targets, cfg.temperature, dtype)

    def cast(t):
        return None if t is None else t.to(dtype)

    adv, old, roll, ref, teach, alpha = map(cast, (advantages, old, roll, ref, teach, entropy_coef))
    bypass = old is None
    if old is None:
        old = roll if roll is not None else logp.detach()
    segments = sorted(set(segment_ids.tolist()))
    total = logp.new_zeros(())
    magnitude = 0.0
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
        term = term - (cfg.entropy_coef if alpha is None else alpha[idx]) * entropy[idx]
        mean = cfg.agg == "seq-mean-token-mean"
        total = total + (term.mean() if mean else term.sum())
        magnitude += float(term.detach().abs().mean() if mean else term.detach().abs().sum())
    if denominator is None:
        n_seg = len(segments)
        denominator = {
            "token-mean": len(targets),
            "seq-mean-token-mean": n_seg,
            "seq-mean-token-sum": n_seg,
            "seq-mean-token-sum-norm": n_seg * cfg.max_response_len,
        }[cfg.agg]
    loss = total / max(denominator, 1)
    return (loss, logp, magnitude / max(denominator, 1)) if with_magnitude else (loss, logp)
