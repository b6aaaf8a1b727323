"""What every implementation of the policy loss shares (docs/concepts.md section 4).

The torch peer (cod_fast.ops.policy_loss), the closed-form head (cod_fast.ops.loss_head), the
chunked driver (cod_fast.ops.chunked) and the row kernels (C++, Triton) all read from here: the
per-token inputs as one bundle (`LossInputs`), the switch codes the kernels branch on, segment
counting, the aggregation weights and rollout correction (`token_weights`), and the metrics. The
float64 reference of cod_fast.ops.eager is written apart from all of this on purpose.

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

# The integer codes of the `policy` and `kl` switches, as csrc/loss_head.h, the C++ wrapper and
# the Triton kernels (kernels/row_kernels.py) read them.
POLICY_CODES = {"ppo": 0, "rec_one_side": 1, "rec_one_side_is": 2, "opd": 3}
KL_CODES = {None: 0, "k1": 1, "k2": 2, "k3": 3}


@dataclass
class PolicyLossOutput:
    """The loss (float32 scalar, differentiable), per-token logp, and detached scalar metrics."""

    loss: torch.Tensor
    logp: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class LossInputs:
    """What the loss reads besides the model: per-token tensors [N] and the step's D."""

    advantages: torch.Tensor
    segment_ids: torch.Tensor
    """Any integer id per token; tokens with the same id form one segment (episode)."""
    old_logp: torch.Tensor | None = None
    """The behaviour log-probs the ratio is taken against; None means bypass (the sampler's)."""
    rollout_logp: torch.Tensor | None = None
    """The sampler's log-probs: rollout correction, bypass ratios and the sampler-gap metrics."""
    ref_logp: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None
    denominator: float | None = None
    """D of the whole optimizer step (see `aggregation_denominator`); None: this call's own."""
    num_segments: int | None = None
    """The segment count when `segment_ids` are compact, 0..num_segments-1 (as cod_fast.data.packing
    writes them): segments are then counted on the device with no host sync. None: any ids,
    counted with torch.unique (which waits for the device)."""
    entropy_coef: torch.Tensor | None = None
    """The entropy bonus's weight alpha_t per token (update-episode tokens may have their own, see
    LossConfig.update_entropy_coef); None: `LossConfig.entropy_coef` on every token."""

    def check(self, num_targets: int) -> None:
        """Every per-token tensor has one value per target."""
        for name in ("advantages", "segment_ids", "entropy_coef", *LOGP_FIELDS):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (num_targets,):
                raise ValueError(
                    f"{name} must have shape [{num_targets}] (one per target), got {tuple(t.shape)}"
                )


LOGP_FIELDS = ("old_logp", "rollout_logp", "ref_logp", "teacher_logp")


def aggregation_denominator(loss_config: LossConfig, num_tokens: int, num_segments: int) -> float:
    """D of the aggregation for a step holding `num_tokens` trainable tokens in `num_segments`."""
    if loss_config.agg == "token-mean":
        d = num_tokens
    elif loss_config.agg == "seq-mean-token-sum-norm":
        d = num_segments * loss_config.max_response_len
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


def mean_or_zero(x: torch.Tensor) -> torch.Tensor:
    """float32 mean; 0 for an empty tensor (an empty micro-batch is not a NaN)."""
    return x.float().mean() if x.numel() else x.new_zeros((), dtype=torch.float32)


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1."""
    diff = logp - ref
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    return torch.expm1(-diff) + diff


def one_side_keep(
    adv: torch.Tensor, ratio: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """REC's one-sided trust region (bool): where the token's policy term is kept."""
    return ((adv >= 0) & (ratio <= 1 + eps_high)) | ((adv < 0) & (ratio >= 1 - eps_low))


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


def segment_index(inputs: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(compact segment index [N], tokens per segment [S]) of the tokens."""
    if inputs.num_segments is None:
        _, seg, counts = torch.unique(inputs.segment_ids, return_inverse=True, return_counts=True)
        return seg, counts
    seg = inputs.segment_ids.long()
    counts = torch.zeros(inputs.num_segments, dtype=torch.int64, device=seg.device)
    return seg, counts.index_add_(0, seg, torch.ones_like(seg))


def entropy_weight(
    inputs: LossInputs, loss_config: LossConfig, dtype: torch.dtype
) -> torch.Tensor | float | None:
    """alpha of the entropy bonus -alpha_t H_t: the per-token [N] weights when given, else the
    config's scalar; None when the bonus is off (so the entropy is not needed)."""
    if inputs.entropy_coef is not None:
        return inputs.entropy_coef.detach().to(dtype)
    return loss_config.entropy_coef if loss_config.entropy_coef > 0 else None


def token_weights(inputs: LossInputs, loss_config: LossConfig, dtype: torch.dtype) -> TokenWeights:
    """Segments, aggregation weights and rollout correction (a no-op in bypass, old = roll)."""
    seg, counts = segment_index(inputs)
    n = inputs.advantages.shape[0]
    denominator = inputs.denominator
    if denominator is None:
        denominator = aggregation_denominator(loss_config, n, counts.shape[0])
    weight = torch.full((n,), 1.0 / denominator, dtype=dtype, device=inputs.advantages.device)
    if loss_config.agg == "seq-mean-token-mean":
        weight = weight / counts[seg].to(dtype)
    old = None if inputs.old_logp is None else inputs.old_logp.detach().to(dtype)
    roll = None if inputs.rollout_logp is None else inputs.rollout_logp.detach().to(dtype)
    corr = torch.ones_like(weight)
    if loss_config.rollout_correction != "none" and old is not None:
        roll = require(
            roll, "rollout_logp", f"rollout_correction {loss_config.rollout_correction!r}"
        )
        behaviour = old - roll
        if loss_config.rollout_correction == "tis":
            corr = behaviour.exp().clamp(max=loss_config.tis_cap)
        else:
            if loss_config.rollout_correction == "mis_sequence":
                behaviour = segment_mean(behaviour, seg, counts)
            r = behaviour.exp()
            corr = ((r >= loss_config.mis_low) & (r <= loss_config.mis_high)).to(dtype)
    return TokenWeights(
        seg=seg, counts=counts, weight=weight, corr=corr, old=old if old is not None else roll
    )


SAMPLER_GAP = "sampler_gap"
"""Prefix of the sampler/trainer mismatch metrics."""


def sampler_gap_metrics(
    loss_config: LossConfig, logp: torch.Tensor, roll: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's: mean and max |logp - roll| over
    the tokens, and the fraction whose ratio exp(logp - roll) lies outside the MIS bounds. Before
    the first update of a batch the two policies are the same weights, so this is the numerical
    mismatch between sampler and trainer that TIS and MIS exist for."""
    log_ratio = logp.detach().float() - roll.float()
    gap, ratio = log_ratio.abs(), log_ratio.exp()
    outside = (ratio < loss_config.mis_low) | (ratio > loss_config.mis_high)
    return {
        f"{SAMPLER_GAP}_mean": mean_or_zero(gap),
        f"{SAMPLER_GAP}_max": gap.max() if gap.numel() else mean_or_zero(gap),
        f"{SAMPLER_GAP}_mis_out_frac": mean_or_zero(outside),
    }


def loss_metrics(
    loss_config: LossConfig,
    inputs: LossInputs,
    *,
    ratio: torch.Tensor,
    clipped: torch.Tensor,
    corr: torch.Tensor,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """Detached float32 scalars: clip fraction, ratio stats, KL, entropy, correction stats and,
    given the sampler's log-probs, the sampler/trainer gap."""
    r = ratio.detach()
    metrics = {
        "clip_frac": mean_or_zero(clipped),
        "ratio_mean": mean_or_zero(r),
        "ratio_min": r.min().float() if r.numel() else mean_or_zero(r),
        "ratio_max": r.max().float() if r.numel() else mean_or_zero(r),
    }
    if loss_config.rollout_correction == "tis":
        metrics["tis_weight_mean"] = mean_or_zero(corr)
    elif loss_config.rollout_correction != "none":
        metrics["mis_drop_frac"] = mean_or_zero(corr == 0)
    if inputs.ref_logp is not None:
        ref = inputs.ref_logp.to(logp.dtype)
        metrics["kl"] = mean_or_zero(kl_penalty(logp.detach(), ref, loss_config.kl or "k3"))
    if entropy is not None:
        metrics["entropy"] = mean_or_zero(entropy.detach())
    if inputs.rollout_logp is not None:
        metrics.update(sampler_gap_metrics(loss_config, logp, inputs.rollout_logp))
    return metrics
