"""One optimizer step of policy training over packed micro-batches (SPEC.md sections 4-5).

Each micro-batch goes through `Policy.forward` (decoder -> hidden states of the trainable
positions -> fused loss with the LM head) with the step's global denominator, so gradient
accumulation over micro-batches and ranks sums to the loss of one big batch. Under FSDP2 every
rank runs the same number of forwards (the packer gives every rank the same number of
micro-batches; an empty one runs as a one-token placeholder that trains nothing), and the
gradient norm is global, so every rank takes or skips the step together. A non-finite loss or
gradient norm skips the update and raises, naming the cause and the fix, before any parameter
changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cod_fast.config import LossConfig
from cod_fast.packing import MicroBatch, Sequence, build_microbatch
from cod_fast.policy import Policy


class NonFiniteError(FloatingPointError):
    """The loss or the gradients of a step were NaN or inf; the parameters were not updated."""


@dataclass
class StepResult:
    loss: float
    """The step's loss, summed over micro-batches and ranks."""
    grad_norm: float
    """Global gradient norm before clipping."""
    trainable_tokens: int
    """Trainable tokens of the step, over every rank."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Loss metrics: token-weighted means, and the min / max of `*_min` / `*_max`."""


def runnable(mb: MicroBatch) -> MicroBatch:
    """`mb`, or for an empty bin a one-token micro-batch with no trainable position: under FSDP2
    every rank must run a forward for every micro-batch, or the collectives would not match."""
    return mb if mb.num_tokens else build_microbatch([Sequence(tokens=[0], segments=[])])


def _reduce(tokens: int, loss: float, sums: dict[str, float]) -> tuple[int, float, dict]:
    """Totals over every rank (a no-op in one process); every rank holds the same keys."""
    if not (dist.is_available() and dist.is_initialized()):
        return tokens, loss, sums
    names = sorted(sums)
    plain = [n for n in names if not n.endswith(("_min", "_max"))]
    totals = torch.tensor([tokens, loss, *(sums[n] for n in plain)], dtype=torch.float64)
    dist.all_reduce(totals)
    out = dict(zip(plain, totals[2:].tolist(), strict=True))
    for suffix, op in (("_min", dist.ReduceOp.MIN), ("_max", dist.ReduceOp.MAX)):
        for name in (n for n in names if n.endswith(suffix)):
            value = torch.tensor([sums[name]], dtype=torch.float64)
            dist.all_reduce(value, op=op)
            out[name] = float(value)
    return int(totals[0]), float(totals[1]), out


def train_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    microbatches: list[MicroBatch],
    *,
    denominator: float,
    config: LossConfig,
    grad_clip: float,
) -> StepResult:
    """Accumulate the loss over this rank's micro-batches, clip, and step the optimizer."""
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    device = next(policy.parameters()).device
    total, tokens = 0.0, 0
    sums: dict[str, float] = {}
    for mb in microbatches:
        mb = runnable(mb).to(device)
        out = policy(mb, config=config, denominator=denominator)
        out.loss.backward()
        total += float(out.loss.detach())
        n = mb.num_trainable
        tokens += n
        # Every micro-batch adds every key (an empty one neutrally), so all ranks reduce alike.
        for name, value in out.metrics.items():
            value = float(value)
            if name.endswith("_min"):
                sums[name] = min(sums.get(name, math.inf), value if n else math.inf)
            elif name.endswith("_max"):
                sums[name] = max(sums.get(name, -math.inf), value if n else -math.inf)
            else:  # token-weighted over micro-batches (and ranks)
                sums[name] = sums.get(name, 0.0) + value * n
    tokens, total, sums = _reduce(tokens, total, sums)
    norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip))
    if not math.isfinite(total):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(
            f"the step's loss is {total}; the step was skipped "
            "(check the rewards and advantages for NaN, lower train.lr)"
        )
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(
            f"the gradient norm is {norm}; the step was skipped (lower "
            "train.lr or train.grad_clip, or check the inputs)"
        )
    optimizer.step()
    metrics = {
        name: value if name.endswith(("_min", "_max")) else value / max(tokens, 1)
        for name, value in sums.items()
        if math.isfinite(value)
    }
    return StepResult(loss=total, grad_norm=norm, trainable_tokens=tokens, metrics=metrics)
