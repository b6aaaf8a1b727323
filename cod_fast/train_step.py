"""One optimizer step of policy training over packed micro-batches (SPEC.md sections 4-5).

The model runs as a base model (hidden states only); the fused loss takes the hidden states of
the trainable positions and the LM head weight, with the step's global denominator so that
gradient accumulation over micro-batches (and, later, ranks) sums to the loss of one big batch.
A non-finite loss or gradient norm skips the update and raises, naming the cause and the fix,
before anything is changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cod_fast.config import LossConfig
from cod_fast.model import lm_head_weight, packed_hidden_states
from cod_fast.ops import linear_policy_loss
from cod_fast.packing import MicroBatch


class NonFiniteError(FloatingPointError):
    """The loss or the gradients of a step were NaN or inf; the parameters were not updated."""


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    trainable_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    microbatches: list[MicroBatch],
    *,
    denominator: float,
    config: LossConfig,
    grad_clip: float,
    impl: str | None = None,
) -> StepResult:
    """Accumulate the loss over this rank's micro-batches, clip, and step the optimizer."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    sums: dict[str, float] = {}
    for mb in microbatches:
        if mb.num_trainable == 0:
            continue
        mb = mb.to(device)
        hidden = packed_hidden_states(model, mb)[mb.trainable_idx]
        out = linear_policy_loss(
            hidden,
            lm_head_weight(model),
            mb.targets,
            mb.advantages,
            mb.segment_ids,
            old_logp=mb.old_logp,
            rollout_logp=mb.rollout_logp,
            ref_logp=mb.ref_logp,
            teacher_logp=mb.teacher_logp,
            config=config,
            denominator=denominator,
            impl=impl,
        )
        loss = float(out.loss.detach())
        if not math.isfinite(loss):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(
                f"the loss of a micro-batch is {loss}; the step was skipped "
                "(check the rewards and advantages for NaN, lower train.lr)"
            )
        out.loss.backward()
        total += loss
        tokens += mb.num_trainable
        for name, value in out.metrics.items():  # token-weighted means over micro-batches
            sums[name] = sums.get(name, 0.0) + float(value) * mb.num_trainable
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(
            f"the gradient norm is {norm}; the step was skipped (lower "
            "train.lr or train.grad_clip, or check the inputs)"
        )
    optimizer.step()
    metrics = {name: value / tokens for name, value in sums.items()} if tokens else {}
    return StepResult(loss=total, grad_norm=norm, trainable_tokens=tokens, metrics=metrics)
