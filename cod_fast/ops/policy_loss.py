"""The segment-masked GRPO-family policy loss over packed trainable tokens (SPEC.md section 4).

`policy_loss_from_logp` is the loss head written once in plain torch on per-token tensors: the
ratio (token or sequence level), the policy term (ppo, rec_one_side, rec_one_side_is, opd),
rollout correction (tis, mis), KL to the reference, the entropy bonus and the aggregation.
`linear_policy_loss` is the public entry of this kernel family: the torch implementation feeds the
head with the chunked log-probs of `cod_fast.ops.logprobs`; fused kernels replace both stages.

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
from cod_fast.ops.dispatch import resolve_impl
from cod_fast.ops.logprobs import linear_logprobs_torch


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


def _require(tensor: torch.Tensor | None, name: str, why: str) -> torch.Tensor:
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
    """Loss and metrics from per-token log-probs [N] (see the module docstring)."""
    dtype = logp.dtype

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    adv, old, roll, ref, teach = map(
        cast, (advantages, old_logp, rollout_logp, ref_logp, teacher_logp)
    )
    _, seg, counts = torch.unique(segment_ids, return_inverse=True, return_counts=True)
    bypass = old is None
    old = old if old is not None else (roll if roll is not None else logp.detach())

    log_ratio = logp - old
    if config.ratio_level == "sequence":  # GSPO: geometric mean of the segment's token ratios
        log_ratio = segment_mean(log_ratio, seg, counts)
    ratio = log_ratio.exp()
    metrics: dict[str, torch.Tensor] = {}

    if config.policy == "ppo":
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1 - config.eps_low, 1 + config.eps_high)
        policy = torch.maximum(unclipped, clipped)
        metrics["clip_frac"] = _mean(clipped > unclipped)
    elif config.policy in ("rec_one_side", "rec_one_side_is"):
        r = ratio.detach()
        keep = ((adv >= 0) & (r <= 1 + config.eps_high)) | ((adv < 0) & (r >= 1 - config.eps_low))
        base = logp if config.policy == "rec_one_side" else ratio
        policy = -adv * base * keep
        metrics["clip_frac"] = _mean(~keep)
    else:  # opd: the advantage is the teacher's log-prob margin, logp detached inside it
        teach = _require(teach, "teacher_logp", "policy 'opd'")
        adv = config.opd_coef * (teach - logp.detach())
        policy = -adv * logp

    if config.rollout_correction != "none" and not bypass:
        roll = _require(roll, "rollout_logp", f"rollout_correction {config.rollout_correction!r}")
        behaviour = (old - roll).detach()
        if config.rollout_correction == "tis":
            weight = behaviour.exp().clamp(max=config.tis_cap)
            metrics["tis_weight_mean"] = _mean(weight)
        else:
            if config.rollout_correction == "mis_sequence":
                behaviour = segment_mean(behaviour, seg, counts)
            r = behaviour.exp()
            weight = ((r >= config.mis_low) & (r <= config.mis_high)).to(dtype)
            metrics["mis_drop_frac"] = _mean(weight == 0)
        policy = policy * weight

    per_token = policy
    if config.kl is not None and config.beta > 0:
        ref = _require(ref, "ref_logp", f"KL penalty (beta={config.beta})")
        per_token = per_token + config.beta * kl_penalty(logp, ref, config.kl)
    if ref is not None:
        metrics["kl"] = _mean(kl_penalty(logp.detach(), ref, config.kl or "k3"))
    if config.entropy_coef > 0:
        entropy = _require(entropy, "entropy", f"entropy_coef={config.entropy_coef}")
        per_token = per_token - config.entropy_coef * entropy
    if entropy is not None:
        metrics["entropy"] = _mean(entropy.detach())

    if config.agg == "seq-mean-token-mean":
        per_token = per_token / counts[seg].to(dtype)
    if denominator is None:
        denominator = aggregation_denominator(config, logp.shape[0], counts.shape[0])
    loss = per_token.sum() / denominator

    r = ratio.detach()
    metrics["ratio_mean"] = _mean(r)
    metrics["ratio_min"] = r.min().float() if r.numel() else _mean(r)
    metrics["ratio_max"] = r.max().float() if r.numel() else _mean(r)
    return loss, metrics


def _linear_policy_loss_torch(
    hidden, weight, targets, advantages, segment_ids, *, config, denominator, **logps
) -> PolicyLossOutput:
    logp, entropy = linear_logprobs_torch(
        hidden, weight, targets, temperature=config.temperature, return_entropy=True
    )
    loss, metrics = policy_loss_from_logp(
        logp,
        advantages,
        segment_ids,
        config=config,
        entropy=entropy,
        denominator=denominator,
        **logps,
    )
    return PolicyLossOutput(loss=loss, logp=logp.detach(), metrics=metrics)


_IMPLS = {"torch": _linear_policy_loss_torch}


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    old_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    teacher_logp: torch.Tensor | None = None,
    config: LossConfig,
    denominator: float | None = None,
    impl: str | None = None,
) -> PolicyLossOutput:
    """The policy loss of SPEC.md section 4 straight from hidden states and the LM head.

    hidden [N, H] holds the trainable positions only (already gathered), weight [V, H],
    targets/advantages/segment_ids and the optional log-probs [N]. Returns `.loss` (float32
    scalar, differentiable in hidden and weight), `.logp` [N] (detached) and `.metrics`.
    `denominator` fixes the aggregation's D for a whole optimizer step (see
    `aggregation_denominator`); None uses this call's own tokens and segments.
    """
    n = targets.shape[0]
    for name, t in (
        ("advantages", advantages),
        ("segment_ids", segment_ids),
        ("old_logp", old_logp),
        ("rollout_logp", rollout_logp),
        ("ref_logp", ref_logp),
        ("teacher_logp", teacher_logp),
    ):
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"{name} must have shape [{n}] (one per target), got {tuple(t.shape)}")
    name, _ = resolve_impl(impl, hidden.device)
    return _IMPLS[name](
        hidden,
        weight,
        targets,
        advantages,
        segment_ids,
        config=config,
        denominator=denominator,
        old_logp=old_logp,
        rollout_logp=rollout_logp,
        ref_logp=ref_logp,
        teacher_logp=teacher_logp,
    )
