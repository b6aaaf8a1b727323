"""The segment-masked GRPO-family policy loss over packed trainable tokens (docs/concepts.md 4).

`policy_loss_from_logp` is the loss written in plain torch on per-token log-probs and differentiated
by autograd: the ratio (token or sequence level), the policy term (ppo, rec_one_side,
rec_one_side_is, opd), rollout correction (tis, mis), KL to the reference, the entropy bonus
(one weight, or one per token) and the aggregation of cod_fast.ops.loss_terms. It is the `torch`
implementation's head; the fused implementations use the closed form of cod_fast.ops.loss_head
instead.
"""

from __future__ import annotations

import torch

from cod_fast.config import LossConfig
from cod_fast.ops.loss_terms import (
    LossInputs,
    entropy_weight,
    kl_penalty,
    loss_metrics,
    one_side_keep,
    require,
    segment_mean,
    token_weights,
)


def policy_loss_from_logp(
    logp: torch.Tensor,
    inputs: LossInputs,
    *,
    loss_config: LossConfig,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and metrics from per-token log-probs [N], differentiated by autograd."""
    dtype = logp.dtype
    tw = token_weights(inputs, loss_config, dtype)
    adv = inputs.advantages.to(dtype)
    ref = None if inputs.ref_logp is None else inputs.ref_logp.to(dtype)
    log_ratio = logp - (tw.old if tw.old is not None else logp.detach())
    if loss_config.ratio_level == "sequence":  # GSPO: geometric mean of the segment's token ratios
        log_ratio = segment_mean(log_ratio, tw.seg, tw.counts)
    ratio = log_ratio.exp()

    if loss_config.policy == "ppo":
        unclipped = -adv * ratio
        clipped_term = -adv * ratio.clamp(1 - loss_config.eps_low, 1 + loss_config.eps_high)
        policy = torch.maximum(unclipped, clipped_term)
        clipped = clipped_term > unclipped
    elif loss_config.policy in ("rec_one_side", "rec_one_side_is"):
        keep = one_side_keep(adv, ratio.detach(), loss_config.eps_low, loss_config.eps_high)
        base = logp if loss_config.policy == "rec_one_side" else ratio
        policy = -adv * base * keep
        clipped = ~keep
    else:  # opd: the advantage is the teacher's log-prob margin, logp detached inside it
        teach = require(inputs.teacher_logp, "teacher_logp", "policy 'opd'").to(dtype)
        policy = -loss_config.opd_coef * (teach - logp.detach()) * logp
        clipped = torch.zeros_like(logp, dtype=torch.bool)

    per_token = tw.corr * policy
    if loss_config.kl is not None and loss_config.beta > 0:
        ref = require(ref, "ref_logp", f"KL penalty (beta={loss_config.beta})")
        per_token = per_token + loss_config.beta * kl_penalty(logp, ref, loss_config.kl)
    alpha = entropy_weight(inputs, loss_config, dtype)
    if alpha is not None:
        entropy = require(entropy, "entropy", "the entropy bonus (entropy_coef)")
        per_token = per_token - alpha * entropy
    loss = (tw.weight * per_token).sum()
    metrics = loss_metrics(
        loss_config, inputs, ratio=ratio, clipped=clipped, corr=tw.corr, logp=logp, entropy=entropy
    )
    return loss, metrics
