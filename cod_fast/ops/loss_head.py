"""The policy-loss head in closed form, per token, and the per-token inputs it needs.

The fused kernels never build an autograd graph over the loss: for every trainable token they
compute the weighted loss L_t and its derivatives dL/dlogp_t and dL/dH_t directly, then turn
those into logit gradients while the chunk's logits are at hand. This module states that head
once in torch (`token_head`, the contract the C++ and Triton row kernels implement) and prepares
everything it reads that does not depend on the current log-probs (`prepare_head`): the
aggregation weight w_t / D, the rollout-correction weight, and for sequence-level ratios the
segment ratio and the chain-rule term through the segment mean (docs/concepts.md section 4).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from cod_fast.config import LossConfig
from cod_fast.ops.loss_terms import (
    KL_CODES,
    POLICY_CODES,
    LossInputs,
    one_side_keep,
    require,
    segment_mean,
    token_weights,
)


@dataclass
class HeadInputs:
    """Per-token [N] tensors (None where the config does not read them) and scalar switches."""

    adv: torch.Tensor
    corr: torch.Tensor
    """Rollout-correction weight (TIS cap or MIS mask), detached; 1 in bypass."""
    weight: torch.Tensor
    """Aggregation weight w_t / D."""
    old: torch.Tensor | None
    """The log-probs the ratio is taken against; None means on-policy (ratio 1)."""
    ref: torch.Tensor | None = None
    teach: torch.Tensor | None = None
    seq_ratio: torch.Tensor | None = None
    """Sequence level: exp(mean of the segment's log-ratio), from a log-prob pre-pass."""
    seq_grad: torch.Tensor | None = None
    """Sequence level: dL/dlogp_u through the segment mean, r_s / n_s sum_t corr w dpol/dr."""
    ent_coef: torch.Tensor | None = None
    """The entropy bonus's weight per token; None: the scalar switch `entropy_coef`."""

    def kernel_args(self) -> dict[str, torch.Tensor | None]:
        """The per-token keyword arguments of a row kernel's fused call."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def rows(self, rows: slice) -> HeadInputs:
        """The inputs of a chunk of tokens."""
        return replace(
            self,
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                for f in fields(self)
            },
        )


def kernel_switches(loss_config: LossConfig, on_policy: bool) -> dict:
    """The scalar arguments every row kernel's fused call takes."""
    kl = loss_config.kl if loss_config.beta > 0 else None
    return dict(
        policy=POLICY_CODES[loss_config.policy],
        seq_level=int(loss_config.ratio_level == "sequence"),
        on_policy=int(on_policy),
        eps_low=loss_config.eps_low,
        eps_high=loss_config.eps_high,
        kl=KL_CODES[kl],
        beta=loss_config.beta,
        entropy_coef=loss_config.entropy_coef,
        opd_coef=loss_config.opd_coef,
    )


def _dpol_dratio(adv: torch.Tensor, ratio: torch.Tensor, loss_config: LossConfig) -> torch.Tensor:
    """d(policy term)/d(ratio) for the policies whose term depends on the ratio (else 0)."""
    if loss_config.policy == "ppo":
        clipped = (
            -adv * ratio.clamp(1 - loss_config.eps_low, 1 + loss_config.eps_high) > -adv * ratio
        )
        return torch.where(clipped, 0.0, -adv)
    if loss_config.policy == "rec_one_side_is":
        return -adv * one_side_keep(adv, ratio, loss_config.eps_low, loss_config.eps_high).to(
            adv.dtype
        )
    return torch.zeros_like(adv)


def prepare_head(
    inputs: LossInputs,
    loss_config: LossConfig,
    *,
    prepass_logp: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> HeadInputs:
    """Everything the head reads except the current log-probs and entropy.

    `prepass_logp` (the current log-probs, detached) is needed for sequence-level ratios only.
    """
    tw = token_weights(inputs, loss_config, dtype)
    head = HeadInputs(
        adv=inputs.advantages.to(dtype).contiguous(), corr=tw.corr, weight=tw.weight, old=tw.old
    )
    if loss_config.kl is not None and loss_config.beta > 0:
        ref = require(inputs.ref_logp, "ref_logp", f"KL penalty (beta={loss_config.beta})")
        head.ref = ref.detach().to(dtype).contiguous()
    if inputs.entropy_coef is not None:
        head.ent_coef = inputs.entropy_coef.detach().to(dtype).contiguous()
    if loss_config.policy == "opd":
        head.teach = require(inputs.teacher_logp, "teacher_logp", "policy 'opd'").detach().to(dtype)
    if loss_config.ratio_level == "sequence":
        if prepass_logp is None:
            raise ValueError("sequence-level ratios need the log-prob pre-pass (prepass_logp)")
        log_ratio = prepass_logp.to(dtype) - tw.old if tw.old is not None else 0 * head.adv
        head.seq_ratio = segment_mean(log_ratio, tw.seg, tw.counts).exp()
        per_token = tw.corr * tw.weight * _dpol_dratio(head.adv, head.seq_ratio, loss_config)
        head.seq_grad = head.seq_ratio * segment_mean(per_token, tw.seg, tw.counts)
    return head


def token_head(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    *,
    adv: torch.Tensor,
    corr: torch.Tensor,
    weight: torch.Tensor,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    teach: torch.Tensor | None,
    seq_ratio: torch.Tensor | None,
    seq_grad: torch.Tensor | None,
    ent_coef: torch.Tensor | None = None,
    policy: int,
    seq_level: int,
    on_policy: int,
    eps_low: float,
    eps_high: float,
    kl: int,
    beta: float,
    entropy_coef: float,
    opd_coef: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w L_t, dL/dlogp_t, dL/dH_t, clipped_t) for every token: the row kernels' contract.

    Takes the fields of `HeadInputs` and the codes of `kernel_switches`, as the kernels do; a
    per-token `ent_coef` replaces the scalar `entropy_coef`.
    """
    if seq_level:
        ratio = seq_ratio
    elif on_policy:
        ratio = torch.ones_like(logp)
    else:
        ratio = (logp - old).exp()
    zeros = torch.zeros_like(logp)
    if policy == POLICY_CODES["ppo"]:
        unclipped = -adv * ratio
        clipped_term = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
        loss = torch.maximum(unclipped, clipped_term)
        clipped = (clipped_term > unclipped).to(logp.dtype)
        grad = zeros if seq_level else unclipped * (1 - clipped)
    elif policy == POLICY_CODES["opd"]:
        a = opd_coef * (teach - logp)
        loss, grad, clipped = -a * logp, -a, zeros
    else:
        keep = one_side_keep(adv, ratio, eps_low, eps_high).to(logp.dtype)
        clipped = 1 - keep
        if policy == POLICY_CODES["rec_one_side"]:
            loss, grad = -adv * logp * keep, -adv * keep
        else:
            loss = -adv * ratio * keep
            grad = zeros if seq_level else loss
    loss, grad = corr * loss, corr * grad
    if kl:
        d = logp - ref
        if kl == KL_CODES["k1"]:
            k, dk = d, torch.ones_like(d)
        elif kl == KL_CODES["k2"]:
            k, dk = 0.5 * d * d, d
        else:
            k, dk = torch.expm1(-d) + d, -torch.expm1(-d)
        loss, grad = loss + beta * k, grad + beta * dk
    alpha = entropy_coef if ent_coef is None else ent_coef
    loss = weight * (loss - alpha * entropy)
    grad = weight * grad + (seq_grad if seq_level else 0)
    return loss, grad, -alpha * weight, clipped
