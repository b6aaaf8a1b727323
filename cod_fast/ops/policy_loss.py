"""The segment-masked GRPO-family policy loss over packed trainable tokens (SPEC.md section 4).

`policy_loss_from_logp` is the loss written in plain torch on per-token log-probs and
differentiated by autograd: the ratio (token or sequence level), the policy term (ppo,
rec_one_side, rec_one_side_is, opd), rollout correction (tis, mis), KL to the reference, the
entropy bonus and the aggregation. It is the `torch` implementation's head; the fused
implementations use the closed form of cod_fast.ops.loss_head instead.

Aggregation is always `sum_t w_t L_t / D`: w_t = 1 / (tokens of t's segment) for
seq-mean-token-mean, else 1; D is the step's token count (token-mean), segment count (seq-mean-*)
or segment count x max_response_len (seq-mean-token-sum-norm). Callers that split one optimizer
step into micro-batches or ranks pass the step's D as `denominator`, so the summed loss and
gradients equal those of one call over the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cod_fast.config import LossConfig


@dataclass
class PolicyLossOutput:
    """The loss (float32 scalar, differentiable), per-token logp, and detached scalar metrics."""

    loss: torch.Tensor
    logp: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def aggregation_denominator(config: LossConfig, num_tokens: int, num_segments: int) -> float:
    """D of the aggregation for a step holding `num_tokens` trainable tokens in `num_segments`."""
    if config.agg == "token-mean":
        d = num_tokens
    elif config.agg == "seq-mean-token-sum-norm":
        d = num_segments * config.max_response_len
    else:
        d = num_segments
    return float(max(d, 1))  # an empty step has a zero numerator; avoid 0 / 0


def segment_mean(values: torch.Tensor, seg: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over each segment, broadcast back to its tokens."""
    sums = torch.zeros(counts.shape[0], dtype=values.dtype, device=values.device)
    return (sums.index_add(0, seg, values) / counts.to(values.dtype))[seg]


def require(tensor: torch.Tensor | None, name: str, why: str) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"{why} needs `{name}`; pass it, or change the LossConfig option")
    return tensor


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.float().mean() if x.numel() else x.new_zeros((), dtype=torch.float32)


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1."""
    diff = logp - ref
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    return torch.expm1(-diff) + diff


@dataclass
class TokenWeights:
    """The parts of the loss that do not depend on the current log-probs, per token [N]."""

    seg: torch.Tensor
    """Compact segment index 0..S-1."""
    counts: torch.Tensor
    """[S] tokens per segment."""
    weight: torch.Tensor
    """Aggregation weight w_t / D."""
    corr: torch.Tensor
    """Rollout-correction weight (detached): TIS min(exp(old - roll), C), MIS 0/1, else 1."""
    old: torch.Tensor | None
    """What the ratio is taken against: old, else the sampler's (bypass), else None (on-policy)."""


def token_weights(
    advantages: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    config: LossConfig,
    old_logp: torch.Tensor | None,
    rollout_logp: torch.Tensor | None,
    denominator: float | None,
    dtype: torch.dtype,
) -> TokenWeights:
    """Segments, aggregation weights and rollout correction (a no-op in bypass, old = roll)."""
    _, seg, counts = torch.unique(segment_ids, return_inverse=True, return_counts=True)
    n = advantages.shape[0]
    if denominator is None:
        denominator = aggregation_denominator(config, n, counts.shape[0])
    weight = torch.full((n,), 1.0 / denominator, dtype=dtype, device=advantages.device)
    if config.agg == "seq-mean-token-mean":
        weight = weight / counts[seg].to(dtype)
    old = None if old_logp is None else old_logp.detach().to(dtype)
    roll = None if rollout_logp is None else rollout_logp.detach().to(dtype)
    corr = torch.ones_like(weight)
    if config.rollout_correction != "none" and old is not None:
        roll = require(roll, "rollout_logp", f"rollout_correction {config.rollout_correction!r}")
        behaviour = old - roll
        if config.rollout_correction == "tis":
            corr = behaviour.exp().clamp(max=config.tis_cap)
        else:
            if config.rollout_correction == "mis_sequence":
                behaviour = segment_mean(behaviour, seg, counts)
            r = behaviour.exp()
            corr = ((r >= config.mis_low) & (r <= config.mis_high)).to(dtype)
    return TokenWeights(
        seg=seg, counts=counts, weight=weight, corr=corr, old=old if old is not None else roll
    )


SAMPLER_GAP = "sampler_gap"
"""Prefix of the sampler/trainer mismatch metrics."""


def sampler_gap_metrics(
    config: LossConfig, logp: torch.Tensor, roll: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's: mean and max |logp - roll| over
    the tokens, and the fraction whose ratio exp(logp - roll) lies outside the MIS bounds. Before
    the first update of a batch the two policies are the same weights, so this is the numerical
    mismatch between sampler and trainer that TIS and MIS exist for."""
    log_ratio = logp.detach().float() - roll.float()
    gap, ratio = log_ratio.abs(), log_ratio.exp()
    outside = (ratio < config.mis_low) | (ratio > config.mis_high)
    return {
        f"{SAMPLER_GAP}_mean": _mean(gap),
        f"{SAMPLER_GAP}_max": gap.max() if gap.numel() else _mean(gap),
        f"{SAMPLER_GAP}_mis_out_frac": _mean(outside),
    }


def loss_metrics(
    config: LossConfig,
    ratio: torch.Tensor,
    clipped: torch.Tensor,
    corr: torch.Tensor,
    logp: torch.Tensor,
    ref: torch.Tensor | None,
    entropy: torch.Tensor | None,
    roll: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Detached float32 scalars: clip fraction, ratio stats, KL, entropy, correction stats and,
    given the sampler's log-probs `roll`, the sampler/trainer gap."""
    r = ratio.detach()
    metrics = {
        "clip_frac": _mean(clipped),
        "ratio_mean": _mean(r),
        "ratio_min": r.min().float() if r.numel() else _mean(r),
        "ratio_max": r.max().float() if r.numel() else _mean(r),
    }
    if config.rollout_correction == "tis":
        metrics["tis_weight_mean"] = _mean(corr)
    elif config.rollout_correction != "none":
        metrics["mis_drop_frac"] = _mean(corr == 0)
    if ref is not None:
        metrics["kl"] = _mean(kl_penalty(logp.detach(), ref, config.kl or "k3"))
    if entropy is not None:
        metrics["entropy"] = _mean(entropy.detach())
    if roll is not None:
        metrics.update(sampler_gap_metrics(config, logp, roll))
    return metrics


def policy_loss_from_logp(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    config: LossConfig,
    entropy: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    teacher_logp: torch.Tensor | None = None,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and metrics from per-token log-probs [N], differentiated by autograd."""
    dtype = logp.dtype
    tw = token_weights(
        advantages,
        segment_ids,
        config=config,
        old_logp=old_logp,
        rollout_logp=rollout_logp,
        denominator=denominator,
        dtype=dtype,
    )
    adv = advantages.to(dtype)
    ref = None if ref_logp is None else ref_logp.to(dtype)
    log_ratio = logp - (tw.old if tw.old is not None else logp.detach())
    if config.ratio_level == "sequence":  # GSPO: geometric mean of the segment's token ratios
        log_ratio = segment_mean(log_ratio, tw.seg, tw.counts)
    ratio = log_ratio.exp()

    if config.policy == "ppo":
        unclipped = -adv * ratio
        clipped_term = -adv * ratio.clamp(1 - config.eps_low, 1 + config.eps_high)
        policy = torch.maximum(unclipped, clipped_term)
        clipped = clipped_term > unclipped
    elif config.policy in ("rec_one_side", "rec_one_side_is"):
        r = ratio.detach()
        keep = ((adv >= 0) & (r <= 1 + config.eps_high)) | ((adv < 0) & (r >= 1 - config.eps_low))
        base = logp if config.policy == "rec_one_side" else ratio
        policy = -adv * base * keep
        clipped = ~keep
    else:  # opd: the advantage is the teacher's log-prob margin, logp detached inside it
        teach = require(teacher_logp, "teacher_logp", "policy 'opd'").to(dtype)
        policy = -config.opd_coef * (teach - logp.detach()) * logp
        clipped = torch.zeros_like(logp, dtype=torch.bool)

    per_token = tw.corr * policy
    if config.kl is not None and config.beta > 0:
        ref = require(ref, "ref_logp", f"KL penalty (beta={config.beta})")
        per_token = per_token + config.beta * kl_penalty(logp, ref, config.kl)
    if config.entropy_coef > 0:
        entropy = require(entropy, "entropy", f"entropy_coef={config.entropy_coef}")
        per_token = per_token - config.entropy_coef * entropy
    loss = (tw.weight * per_token).sum()
    return loss, loss_metrics(config, ratio, clipped, tw.corr, logp, ref, entropy, rollout_logp)
