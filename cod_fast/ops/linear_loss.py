"""`linear_policy_loss`: the policy loss of SPEC.md section 4 from hidden states and the LM head.

The `torch` implementation takes the chunked log-probs and differentiates the loss with autograd
(`policy_loss_from_logp`); `cpp` and `triton` run the fused chunked driver, where the closed-form
head turns each chunk's logits into gradients while they are at hand.
"""

from __future__ import annotations

import torch

from cod_fast.config import LossConfig
from cod_fast.ops.chunked import compute_dtype, fused_linear_policy_loss
from cod_fast.ops.dispatch import resolve_impl, row_kernels
from cod_fast.ops.logprobs import check_logprob_inputs, linear_logprobs
from cod_fast.ops.loss_terms import LossInputs, PolicyLossOutput
from cod_fast.ops.policy_loss import policy_loss_from_logp


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
    scalar, float64 for float64 operands; differentiable in hidden and weight), `.logp` [N]
    (detached) and `.metrics`. `denominator` fixes the aggregation's D for a whole optimizer step
    (see `aggregation_denominator`); None uses this call's own tokens and segments.
    """
    check_logprob_inputs(hidden, weight, targets, config.temperature)
    inputs = LossInputs(
        advantages,
        segment_ids,
        old_logp=old_logp,
        rollout_logp=rollout_logp,
        ref_logp=ref_logp,
        teacher_logp=teacher_logp,
        denominator=denominator,
    )
    inputs.check(targets.shape[0])
    dtype = compute_dtype(hidden, weight)
    name, _ = resolve_impl(impl, hidden.device, dtype)
    if name != "torch":
        rows = row_kernels(name, dtype)
        return fused_linear_policy_loss(rows, hidden, weight, targets.long(), inputs, config=config)
    logp, entropy = linear_logprobs(
        hidden, weight, targets, temperature=config.temperature, return_entropy=True, impl="torch"
    )
    loss, metrics = policy_loss_from_logp(logp, inputs, config=config, entropy=entropy)
    return PolicyLossOutput(loss=loss, logp=logp.detach(), metrics=metrics)
