"""Ulysses sequence parallelism: the collectives that move a packed micro-batch between sequence
shards and head shards, differentiable.

A sequence-parallel group of N ranks runs one packed micro-batch of T tokens (T a multiple of
N), each rank holding the T/N consecutive tokens of its shard. Everything in a decoder layer but
attention acts on each token alone, so it runs on the rank's own tokens. Attention needs every
token of a sequence: `seq_to_heads` trades the shard's tokens of every head for every token of
1/N of the heads, attention runs over the whole row for those heads, and `heads_to_seq` trades
back (DeepSpeed-Ulysses, arXiv:2309.14509; verl's and AReaL's `ulysses` modules do the same).
Query, key and value travel in one all-to-all (each rank's chunk holds its heads of the three),
so a layer costs two all-to-alls forward and two backward, each moving (N-1)/N of the rank's
q, k and v (or its output) once. The backward of each all-to-all is the other one.

The loss, two ways. `sharded_policy_loss` runs the fused driver (cod_fast.ops.chunked) over the
rank's own tokens, with everything its closed form reads prepared from the whole micro-batch
(segment weights; for sequence-level ratios each segment's ratio from every rank's pre-pass
log-probs); the group's losses are summed for the value, each rank keeps its own gradient.
`sharded_logprobs` scores the rank's tokens with differentiable log-probs, and `gather_tokens`
puts every rank's rows (log-prob, entropy) in the micro-batch's token order on every rank,
where every rank computes the same loss from them; its backward takes only the rank's own rows
of the incoming gradient. Either way the parameters' gradients are summed over the ranks
(FSDP2's reduce-scatter), which counts each token's gradient exactly once.

torch.distributed's all-to-all and all-gather run on NCCL and on gloo (the CPU tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cod_fast.config import LossConfig
from cod_fast.ops.chunked import (
    compute_dtype,
    fused_chunk,
    fused_metrics,
    fused_rows,
    prepass_logprobs,
)
from cod_fast.ops.dispatch import resolve_impl, row_kernels
from cod_fast.ops.logprobs import check_logprob_inputs, linear_logprobs
from cod_fast.ops.loss_head import prepare_head
from cod_fast.ops.loss_terms import LossInputs, PolicyLossOutput


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's place in its sequence-parallel group."""

    group: dist.ProcessGroup | None
    """The group's process group (None: the default group, every rank)."""
    rank: int
    """This rank's index in the group: its shard of each micro-batch."""
    size: int
    """N, the ranks of the group."""


def split_heads(heads: int, size: int) -> int:
    """Heads per rank after the all-to-all; ValueError when `size` does not divide `heads`."""
    if heads % size:
        raise ValueError(
            f"{heads} attention heads do not split over train.sequence_parallel={size} ranks; "
            "set it to a divisor of the model's attention heads"
        )
    return heads // size


def _all_to_all(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """Chunk i of x's first dimension to rank i, and rank i's chunk back into place i."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous too: all_to_all_single writes chunks one after another
    dist.all_to_all_single(out, x, group=sp.group)
    return out


def _to_heads(xs: tuple[torch.Tensor, ...], sp: SequenceGroup) -> tuple[torch.Tensor, ...]:
    """[t, H_i, D] each (this rank's tokens, every head) -> [N t, H_i/N, D] each (every token,
    its heads), all in one all-to-all: rank i's chunk holds its heads of every tensor."""
    t, d = xs[0].shape[0], xs[0].shape[2]
    per = [split_heads(x.shape[1], sp.size) for x in xs]
    chunks = torch.cat([x.reshape(t, sp.size, h, d) for x, h in zip(xs, per, strict=True)], 2)
    out = _all_to_all(chunks.transpose(0, 1), sp)  # [N, t, sum h, D]: from rank j, its tokens
    return tuple(out.reshape(sp.size * t, sum(per), d).split(per, dim=1))


def _to_sequence(xs: tuple[torch.Tensor, ...], sp: SequenceGroup) -> tuple[torch.Tensor, ...]:
    """[N t, h_i, D] each -> [t, N h_i, D] each: the inverse of `_to_heads`."""
    total, d = xs[0].shape[0], xs[0].shape[2]
    t, per = total // sp.size, [x.shape[1] for x in xs]
    joined = torch.cat(xs, dim=1).reshape(sp.size, t, sum(per), d)
    back = _all_to_all(joined, sp).transpose(0, 1)  # [t, N, sum h, D]: head chunk j from rank j
    return tuple(
        part.reshape(t, sp.size * h, d) for part, h in zip(back.split(per, 2), per, strict=True)
    )


class _Exchange(torch.autograd.Function):
    """`_to_heads` or `_to_sequence` forward; the other one is its backward."""

    @staticmethod
    def forward(ctx, sp, to_heads, *xs):
        ctx.sp, ctx.to_heads = sp, to_heads
        return (_to_heads if to_heads else _to_sequence)(xs, sp)

    @staticmethod
    def backward(ctx, *grads):
        back = _to_sequence if ctx.to_heads else _to_heads
        return None, None, *back(grads, ctx.sp)


def seq_to_heads(sp: SequenceGroup, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[T/N, H_i, D] of this rank's tokens -> [T, H_i/N, D] each: every token of the rank's
    heads (rank r gets heads r H_i/N ... (r+1) H_i/N - 1 of each), in one all-to-all.
    Differentiable."""
    return _Exchange.apply(sp, True, *xs)


def heads_to_seq(sp: SequenceGroup, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[T, h_i, D] each -> [T/N, N h_i, D] each: the inverse of `seq_to_heads`. Differentiable."""
    return _Exchange.apply(sp, False, *xs)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, counts, order, sp):
        ctx.start, ctx.count, ctx.order = sum(counts[: sp.rank]), rows.shape[0], order
        padded = rows.new_zeros((max(*counts, 1), *rows.shape[1:]))  # no empty collective
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(sp.size)]
        dist.all_gather(parts, padded, group=sp.group)
        joined = torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])
        return joined if order is None else joined[order]

    @staticmethod
    def backward(ctx, grad):
        if ctx.order is not None:  # back into the ranks' concatenation (order is a permutation)
            joined = torch.empty_like(grad)
            joined[ctx.order] = grad
            grad = joined
        return grad[ctx.start : ctx.start + ctx.count], None, None, None


def gather_tokens(
    rows: torch.Tensor,
    counts: tuple[int, ...],
    order: torch.Tensor | None,
    sp: SequenceGroup,
) -> torch.Tensor:
    """Every rank's `rows` ([counts[rank], ...], its tokens' values) in the micro-batch's token
    order, on every rank: the ranks' rows one after the other, then permuted by `order` ([sum
    counts] int64, token t's place in that concatenation; None: already in order).

    The backward returns this rank's rows of the incoming gradient only, not their sum over the
    ranks: every rank computes the same function of the gathered tokens (the whole micro-batch's
    loss), so the sum over ranks of each rank's own rows is that function's gradient, once."""
    if rows.shape[0] != counts[sp.rank]:
        raise ValueError(f"rank {sp.rank} holds {rows.shape[0]} rows, its count is {counts}")
    return _GatherTokens.apply(rows, tuple(counts), order, sp)


def sharded_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    counts: tuple[int, ...],
    order: torch.Tensor | None,
    sp: SequenceGroup,
    *,
    temperature: float,
    impl: str | None = None,
    return_entropy: bool = False,
    check_targets: bool = True,
    repeat: torch.Tensor | None = None,
):
    """`linear_logprobs` of this rank's trainable tokens (hidden [n, H], targets [n]), then
    every rank's in the micro-batch's token order (`gather_tokens`): log-probs [N], and entropy
    [N] with `return_entropy`, on every rank of the group. The loss computed from them is the
    whole micro-batch's, and each rank's backward reaches its own tokens' rows only.
    With `repeat` ([n], each token's row of `hidden`), hidden and targets hold the rank's
    distinct (row, target) pairs, each scored once and repeated per token."""
    scored = linear_logprobs(
        hidden,
        weight,
        targets,
        temperature=temperature,
        return_entropy=return_entropy,
        impl=impl,
        check_targets=check_targets,
    )
    rows = torch.stack(scored, dim=1) if return_entropy else scored[:, None]
    if repeat is not None:
        rows = rows[repeat]
    joined = gather_tokens(rows, counts, order, sp)
    return tuple(joined.unbind(1)) if return_entropy else joined[:, 0]


def sharded_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inputs: LossInputs,
    tokens: torch.Tensor,
    counts: tuple[int, ...],
    order: torch.Tensor | None,
    sp: SequenceGroup,
    *,
    loss_config: LossConfig,
    impl: str | None = None,
    check_targets: bool = True,
) -> PolicyLossOutput | None:
    """The whole micro-batch's policy loss through the fused driver (cod_fast.ops.chunked),
    which forms each token's gradient in closed form while its chunk's logits are at hand, over
    this rank's tokens: hidden [n, H] and targets [n] of the tokens `tokens` ([n], their indices
    among the micro-batch's), `inputs` the micro-batch's per-token values, all of them.

    Everything the closed form reads is prepared from the whole micro-batch (segment weights,
    and for sequence-level ratios each segment's ratio from every rank's pre-pass log-probs),
    then taken at the rank's tokens. The returned loss's value is the group's sum, the whole
    micro-batch's loss on every rank, and its gradient this rank's part; log-probs and metrics
    are the whole micro-batch's. None where the driver does not run (the torch implementation):
    the caller then scores log-probs (`sharded_logprobs`)."""
    dtype = compute_dtype(hidden, weight)
    name, _ = resolve_impl(impl, hidden.device, dtype)
    if name == "torch":
        return None
    check_logprob_inputs(hidden, weight, targets, loss_config.temperature, check_targets)
    inputs.check(sum(counts))
    kernels, targets = row_kernels(name, dtype), targets.long()
    chunk, inv_temp = fused_chunk(hidden, weight, targets), 1.0 / loss_config.temperature
    prepass = None
    if loss_config.ratio_level == "sequence":  # a segment's ratio needs all of its tokens
        mine = prepass_logprobs(kernels, hidden, weight, targets, inv_temp, chunk)
        prepass = gather_tokens(mine[:, None], counts, order, sp)[:, 0]
    head = prepare_head(inputs, loss_config, prepass_logp=prepass, dtype=dtype)
    loss, logp, entropy, clipped = fused_rows(
        kernels, hidden, weight, targets, head.rows(tokens), loss_config, chunk
    )
    values = gather_tokens(torch.stack([logp, entropy, clipped], dim=1), counts, order, sp)
    total = loss.detach().clone()
    dist.all_reduce(total, group=sp.group)
    loss = loss + (total - loss.detach())  # the group's sum, this rank's gradient
    logp, entropy, clipped = values.unbind(1)
    metrics = fused_metrics(loss_config, inputs, head, logp, entropy, clipped)
    return PolicyLossOutput(loss=loss, logp=logp, metrics=metrics)
