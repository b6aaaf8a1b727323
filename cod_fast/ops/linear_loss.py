"""`linear_policy_loss`: the policy loss (docs/concepts.md section 4) from hidden states and head.

The `torch` implementation takes the chunked log-probs and differentiates the loss with autograd
(`policy_loss_from_logp`); `cpp` and `triton` run the fused chunked driver, where the closed-form
head turns each chunk's logits into gradients while they are at hand.

Repeated rows. In a shared-prefix tree (cod_fast.data.prefix_tree) the members of a group that wrote
the same response read the same hidden rows with the same targets, and each of them still needs
its own loss term (its own advantage). Given `rows`, the tokens' indices into all rows of the
micro-batch, each distinct (row, target) pair is scored once: its log-prob and entropy come from
the chunked log-prob kernels and are repeated per token, and autograd sums the tokens' gradients
back onto the pair. That path streams the LM head four times per chunk (logits, then in the
backward logits again, dh, dW) where the fused driver streams it three times, so it is taken when
the distinct pairs are at most DEDUPE_SHARE of the tokens. Finding the distinct pairs on the
device (torch.unique) waits for it; a caller that knows them (cod_fast.data.packing finds them on the
host while it packs) passes them as `pairs`.

Host syncs. With `num_segments` and, for repeated rows, `pairs`, the loss and its backward never
wait for the device (tests/ops/test_host_syncs.py counts them). The targets' range check waits
for nothing either: on CUDA it is a device-side assert (cod_fast.ops.logprobs.check_target_range).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cod_fast.config import LossConfig
from cod_fast.ops.chunked import compute_dtype, fused_linear_policy_loss
from cod_fast.ops.dispatch import resolve_impl, row_kernels
from cod_fast.ops.logprobs import check_logprob_inputs, linear_logprobs
from cod_fast.ops.loss_terms import LossInputs, PolicyLossOutput
from cod_fast.ops.policy_loss import policy_loss_from_logp

DEDUPE_SHARE = 0.75
"""Score distinct (row, target) pairs once when they are at most this share of the tokens."""


@dataclass(frozen=True)
class TokenPairs:
    """The distinct (row, target) pairs of a micro-batch's tokens, ascending by (row, target),
    and each token's pair."""

    rows: torch.Tensor
    """[P] int64, the hidden row of each distinct pair."""
    targets: torch.Tensor
    """[P] int64, the target of each distinct pair."""
    repeat: torch.Tensor
    """[N] int64, each token's index into the pairs."""

    @classmethod
    def from_lists(cls, rows: list[int], targets: list[int]) -> TokenPairs:
        """Found on the host, as a packer can while it builds the micro-batch."""
        tokens = list(zip(rows, targets, strict=True))
        distinct = sorted(set(tokens))
        where = {pair: i for i, pair in enumerate(distinct)}
        return cls(
            rows=torch.tensor([r for r, _ in distinct], dtype=torch.int64),
            targets=torch.tensor([t for _, t in distinct], dtype=torch.int64),
            repeat=torch.tensor([where[pair] for pair in tokens], dtype=torch.int64),
        )

    @classmethod
    def from_tensors(cls, rows: torch.Tensor, targets: torch.Tensor, vocab: int) -> TokenPairs:
        """Found on the device (torch.unique: a host sync)."""
        pairs = rows.long() * vocab + targets.long()
        distinct, repeat = torch.unique(pairs, return_inverse=True)
        return cls(rows=distinct // vocab, targets=distinct % vocab, repeat=repeat)


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
    entropy_coef: torch.Tensor | None = None,
    loss_config: LossConfig,
    denominator: float | None = None,
    impl: str | None = None,
    rows: torch.Tensor | None = None,
    pairs: TokenPairs | None = None,
    num_segments: int | None = None,
    check_targets: bool = True,
) -> PolicyLossOutput:
    """The policy loss of docs/concepts.md section 4 straight from hidden states and the LM head.

    hidden [N, H] holds the trainable positions only (already gathered), weight [V, H],
    targets/advantages/segment_ids and the optional log-probs [N]. Returns `.loss` (float32
    scalar, float64 for float64 operands; differentiable in hidden and weight), `.logp` [N]
    (detached) and `.metrics`. `denominator` fixes the aggregation's D for a whole optimizer step
    (see `aggregation_denominator`); None uses this call's own tokens and segments. With `rows`
    [N], hidden holds every row of a packed micro-batch and token t reads hidden[rows[t]]; equal
    (row, target) pairs are then scored once (see the module docstring): the same loss,
    log-probs and gradients; `pairs` are those pairs if the caller knows them (else they are
    found here, a host sync).

    `entropy_coef` [N]: each token's weight of the entropy bonus (update-episode tokens may have
    their own, LossConfig.update_entropy_coef) instead of `config.entropy_coef` on every token.

    `num_segments`: segment_ids are compact, 0..num_segments-1 (see `LossInputs`); it spares a
    host sync (see the module docstring). `check_targets`: every target must lie in [0, V). On
    the CPU an id outside raises a ValueError at once; on CUDA it trips a device-side assert,
    reported asynchronously by a later call that waits for the device, and the process's CUDA
    context is unusable after it (see cod_fast.ops.logprobs.check_target_range). False: the
    caller has made sure of it (cod_fast.model.policy checks the micro-batch's largest target on
    the host), which spares the check's few kernel launches.
    """
    num_tokens, repeat = targets.shape[0], None
    if rows is not None:
        hidden, targets, repeat = distinct_pairs(
            hidden, weight, targets, rows, DEDUPE_SHARE, pairs=pairs
        )
    check_logprob_inputs(hidden, weight, targets, loss_config.temperature, check_targets)
    inputs = LossInputs(
        advantages,
        segment_ids,
        old_logp=old_logp,
        rollout_logp=rollout_logp,
        ref_logp=ref_logp,
        teacher_logp=teacher_logp,
        denominator=denominator,
        num_segments=num_segments,
        entropy_coef=entropy_coef,
    )
    inputs.check(num_tokens)
    dtype = compute_dtype(hidden, weight)
    name, _ = resolve_impl(impl, hidden.device, dtype)
    if name != "torch" and repeat is None:
        kernels = row_kernels(name, dtype)
        return fused_linear_policy_loss(
            kernels, hidden, weight, targets.long(), inputs, loss_config=loss_config
        )
    logp, entropy = linear_logprobs(
        hidden,
        weight,
        targets,
        temperature=loss_config.temperature,
        return_entropy=True,
        impl=name,
        check_targets=False,  # checked above
    )
    if repeat is not None:
        logp, entropy = logp[repeat], entropy[repeat]
    loss, metrics = policy_loss_from_logp(logp, inputs, loss_config=loss_config, entropy=entropy)
    return PolicyLossOutput(loss=loss, logp=logp.detach(), metrics=metrics)


def distinct_pairs(hidden, weight, targets, rows, share: float, pairs: TokenPairs | None = None):
    """(hidden rows, targets, repeat) to score for tokens that read hidden[rows] with `targets`:
    the distinct (row, target) pairs (`pairs`, else found here) and, for each token, its pair,
    when they are at most `share` of the tokens; else the tokens' own rows and targets and None."""
    if rows.dim() != 1 or rows.shape != targets.shape:
        raise ValueError(
            f"rows must be [N] like targets, got {tuple(rows.shape)} and {tuple(targets.shape)}"
        )
    rows = rows.to(hidden.device).long()
    if pairs is None:
        pairs = TokenPairs.from_tensors(rows, targets.to(hidden.device), weight.shape[0])
    if pairs.rows.numel() > share * rows.numel():
        return hidden[rows], targets, None
    return hidden[pairs.rows], pairs.targets.to(targets.dtype), pairs.repeat
