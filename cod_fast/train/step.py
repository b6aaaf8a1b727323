"""One optimizer step of policy training over packed micro-batches (docs/concepts.md sections 4-5).

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

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from cod_fast.common.errors import CodFastError
from cod_fast.config import LossConfig
from cod_fast.data.packing import MicroBatch, Sequence, build_microbatch, with_entropy_coef
from cod_fast.data.sequence_split import with_sequence_shard
from cod_fast.model.policy import Policy


class NonFiniteError(FloatingPointError, CodFastError):
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


def runnable(mb: MicroBatch, loss_config: LossConfig | None = None) -> MicroBatch:
    """`mb`, or for an empty bin a one-token micro-batch with no trainable position: under FSDP2
    every rank must run a forward for every micro-batch, or the collectives would not match.
    The placeholder carries the (empty) log-probs that `loss_config`'s loss requires, the reference's
    for a KL term and the teachers' for opd, as the other ranks' micro-batches do: so its loss
    runs and reports the same metrics."""
    if mb.num_tokens:
        return mb
    placeholder = build_microbatch([Sequence(tokens=[0], segments=[])])
    if loss_config is None:
        return placeholder
    empty = torch.zeros(0, dtype=torch.float32)
    kl = loss_config.kl is not None and loss_config.beta > 0
    return dataclasses.replace(
        placeholder,
        ref_logp=empty if kl else None,
        teacher_logp=empty if loss_config.policy == "opd" else None,
    )


def on_device(mb: MicroBatch, policy: Policy, device: torch.device) -> MicroBatch:
    """`mb` on `device`, carrying this rank's shard when `policy` is sequence-parallel (cut on
    the host, so the forward never reads its shape back from the device)."""
    group = policy.sequence_group
    held = None if mb.shard is None else (mb.shard.rank, mb.shard.size)
    if group is not None and held != (group.rank, group.size):
        mb = with_sequence_shard(mb, group.rank, group.size)
    return mb.to(device)


class _MetricSums:
    """The step's loss metrics, on the device, three vectors in all: token-weighted sums, and
    running minima of `*_min` and maxima of `*_max`. A micro-batch's metrics are stacked into
    one tensor and folded in with three ops, whatever their number; an empty micro-batch adds
    its keys too (neutrally), so all ranks reduce alike."""

    def __init__(self, device: torch.device):
        self.names: list[str] = []
        # sums, minima, maxima
        self.groups = [torch.zeros(0, dtype=torch.float64, device=device) for _ in range(3)]

    def add(self, metrics: dict[str, torch.Tensor], n: int) -> None:
        if not metrics:
            return
        if not self.names:  # the first micro-batch fixes the order: sums, then _min, then _max
            kinds = [[k for k in metrics if not k.endswith(("_min", "_max"))]]
            kinds += [[k for k in metrics if k.endswith(suffix)] for suffix in ("_min", "_max")]
            self.names = [k for kind in kinds for k in kind]
            device = self.groups[0].device
            self.groups = [
                torch.full((len(kind),), start, dtype=torch.float64, device=device)
                for kind, start in zip(kinds, (0.0, math.inf, -math.inf), strict=True)
            ]
        values = torch.stack([metrics[k].detach() for k in self.names]).double()
        sums, minima, maxima = values.split([len(group) for group in self.groups])
        self.groups[0].add_(sums, alpha=n)
        if n:  # an empty micro-batch's minima and maxima are no values at all
            torch.minimum(self.groups[1], minima, out=self.groups[1])
            torch.maximum(self.groups[2], maxima, out=self.groups[2])


def _read_totals(
    tokens: int,
    loss: torch.Tensor,
    norm: torch.Tensor,
    sums: _MetricSums,
    group: dist.ProcessGroup | None,
) -> tuple[int, float, float, dict[str, float]]:
    """(tokens, loss, gradient norm, metrics) summed (min, max) over the trainer ranks (`group`;
    None: every rank), read to the host at once: the step's one wait for the device. The
    reductions run on the device, as NCCL needs."""
    head = torch.full((1,), float(tokens), dtype=torch.float64, device=loss.device)
    parts = [torch.cat([head, loss.reshape(1), sums.groups[0]]), *sums.groups[1:]]
    if dist.is_available() and dist.is_initialized():
        ops = (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX)
        for part, op in zip(parts, ops, strict=True):
            if part.numel():
                dist.all_reduce(part, op=op, group=group)
    values = torch.cat([*parts, norm.detach().double().reshape(1)]).tolist()
    tokens_sum, loss_sum = values[:2]
    metrics = dict(zip(sums.names, values[2:-1], strict=True))
    return int(tokens_sum), loss_sum, values[-1], metrics


def train_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    microbatches: list[MicroBatch],
    *,
    denominator: float,
    loss_config: LossConfig,
    grad_clip: float,
    group: dist.ProcessGroup | None = None,
) -> StepResult:
    """Accumulate the loss over this rank's micro-batches, clip, and step the optimizer; the
    step's totals are summed over `group`'s ranks (None: every rank)."""
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    device = next(policy.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    sums = _MetricSums(device)
    # Under sequence parallelism every rank of a group computes its micro-batch's whole loss;
    # the group's first rank counts it in the totals, the others add zeros (alike shapes).
    counted = int(policy.sequence_group is None or policy.sequence_group.rank == 0)
    for mb in microbatches:
        # Per-token entropy weights (update episodes' own) and a sequence-parallel rank's shard
        # are built on the host, then copied with the micro-batch's other tensors.
        mb = on_device(with_entropy_coef(runnable(mb, loss_config), loss_config), policy, device)
        out = policy(mb, loss_config=loss_config, denominator=denominator)
        out.loss.backward()
        total += out.loss.detach().double() * counted
        tokens += mb.num_trainable * counted
        sums.add(out.metrics, mb.num_trainable * counted)
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
    if isinstance(norm, DTensor):  # FSDP2: the norm over every shard
        norm = norm.full_tensor()
    tokens, total, norm, sums = _read_totals(tokens, total, norm, sums, group)
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
