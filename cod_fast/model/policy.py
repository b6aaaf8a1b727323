"""The trainable policy as one module: a packed micro-batch in, the fused loss (or log-probs) out.

`Policy.forward` runs the decoder over the packed micro-batch (cod_fast.model.loading), keeps the hidden
states of the trainable positions and hands them with the LM head weight (the embedding itself
when tied) to the fused kernels of cod_fast.ops; the model's own logits are never computed.

Why the loss lives inside a forward: under FSDP2 a sharded module's parameters are gathered by
its forward pre-hook and their gradients reduce-scattered after backward. The LM head weight is
used by the fused loss, not by the model's forward, so computing the loss inside this module's
forward (the FSDP root) keeps that weight gathered exactly while the loss needs it. One code path
serves one process and many.
"""

from __future__ import annotations

from typing import Literal

import torch

from cod_fast.config import LossConfig
from cod_fast.data.packing import MicroBatch
from cod_fast.model.loading import lm_head_weight, packed_hidden_states
from cod_fast.ops import PolicyLossOutput, linear_logprobs, linear_policy_loss
from cod_fast.ops.linear_loss import distinct_pairs
from cod_fast.ops.loss_terms import LossInputs
from cod_fast.ops.policy_loss import policy_loss_from_logp
from cod_fast.ops.sequence_parallel import SequenceGroup, sharded_logprobs, sharded_policy_loss


class Policy(torch.nn.Module):
    """Wraps a Hugging Face causal LM; `impl` picks the kernel implementation (None: auto)."""

    def __init__(
        self,
        model: torch.nn.Module,
        impl: str | None = None,
        sequence_group: SequenceGroup | None = None,
    ):
        super().__init__()
        self.model = model
        self.impl = impl
        self.sequence_group = sequence_group
        """Ulysses sequence parallelism (train.sequence_parallel > 1): each micro-batch carries
        this rank's shard (cod_fast.data.sequence_shard) and the group runs it together."""

    def forward(
        self,
        mb: MicroBatch,
        *,
        loss_config: LossConfig,
        denominator: float | None = None,
        mode: Literal["loss", "logprobs"] = "loss",
    ) -> PolicyLossOutput | torch.Tensor:
        """`loss`: the policy loss of the micro-batch (docs/concepts.md section 4) with the step's
        `denominator`; `logprobs`: float32 log-probs [N] of its targets at the loss's temperature
        (old-policy recompute, the reference model)."""
        if self.sequence_group is not None:
            return self._sharded(mb, loss_config, denominator, mode)
        states = packed_hidden_states(self.model, mb)
        weight = lm_head_weight(self.model)
        _check_vocabulary(mb, weight.shape[0])
        pairs = mb.pairs
        if mode == "logprobs":  # no gradient: scoring a repeated pair once only saves work
            hidden, targets, repeat = states[mb.trainable_idx], mb.targets, None
            if pairs is not None:
                hidden, targets, repeat = distinct_pairs(
                    states, weight, mb.targets, mb.trainable_idx, share=1.0, pairs=pairs
                )
            logp = linear_logprobs(
                hidden,
                weight,
                targets,
                temperature=loss_config.temperature,
                impl=self.impl,
                check_targets=mb.max_target is None,
            )
            return logp if repeat is None else logp[repeat]
        # Rows that several members share (equal responses in a prefix tree) are scored once
        # per target by the loss, which gathers them itself; everything the loss would otherwise
        # read back from the device (segments, target range, repeated pairs) the micro-batch
        # knows from packing, so the step never waits for the device here.
        return linear_policy_loss(
            states if pairs is not None else states[mb.trainable_idx],
            weight,
            mb.targets,
            mb.advantages,
            mb.segment_ids,
            **_token_values(mb),
            loss_config=loss_config,
            denominator=denominator,
            impl=self.impl,
            rows=mb.trainable_idx if pairs is not None else None,
            pairs=pairs,
            num_segments=mb.num_segments,
            check_targets=mb.max_target is None,
        )

    def _sharded(
        self, mb: MicroBatch, loss_config: LossConfig, denominator: float | None, mode: str
    ) -> PolicyLossOutput | torch.Tensor:
        """`forward` over this rank's shard of `mb`: the decoder on its tokens, then the whole
        micro-batch's loss (or log-probs) on every rank of the group from its trainable tokens
        (see cod_fast.ops.sequence_parallel): through the fused driver over the rank's tokens
        where it runs, else from every rank's log-probs and entropies gathered in token order.
        Repeated (row, target) pairs are scored once, as in one process."""
        shard, group = mb.shard, self.sequence_group
        if shard is None or shard.size != group.size or shard.rank != group.rank:
            raise ValueError(
                f"rank {group.rank} of a sequence-parallel group of {group.size} needs the "
                "micro-batch's shard for that rank (cod_fast.data.sequence_shard)"
            )
        states = packed_hidden_states(self.model, mb, group)
        weight = lm_head_weight(self.model)
        _check_vocabulary(mb, weight.shape[0])
        check, inputs = mb.max_target is None, None
        if mode == "loss":
            inputs = LossInputs(
                mb.advantages,
                mb.segment_ids,
                **_token_values(mb),
                denominator=denominator,
                num_segments=mb.num_segments,
            )
            inputs.check(mb.num_trainable)
        rows, targets = shard.rows, mb.targets[shard.tokens]
        if shard.pair_rows is not None:  # repeated (row, target) pairs: each scored once
            rows, targets = shard.pair_rows, shard.pair_targets
        hidden = states[rows]
        # One path for the whole group, as its collectives differ: the micro-batch's repeated
        # pairs (known to every rank) send it to the log-probs, where each rank scores its own
        # distinct pairs once; else the fused driver, where it runs.
        if inputs is not None and mb.pair_rows is None:
            fused = sharded_policy_loss(
                hidden, weight, targets, inputs, shard.tokens, shard.counts, shard.order, group,
                loss_config=loss_config, impl=self.impl, check_targets=check,
            )  # fmt: skip
            if fused is not None:
                return fused
        scored = sharded_logprobs(
            hidden,
            weight,
            targets,
            shard.counts,
            shard.order,
            group,
            temperature=loss_config.temperature,
            impl=self.impl,
            return_entropy=inputs is not None,
            check_targets=check,
            repeat=shard.pair_of_token,
        )
        if inputs is None:
            return scored
        logp, entropy = scored
        loss, metrics = policy_loss_from_logp(
            logp, inputs, loss_config=loss_config, entropy=entropy
        )
        return PolicyLossOutput(loss=loss, logp=logp.detach(), metrics=metrics)


def _token_values(mb: MicroBatch) -> dict[str, torch.Tensor | None]:
    """The micro-batch's per-token log-probs and entropy weights, as the loss takes them."""
    names = ("old_logp", "rollout_logp", "ref_logp", "teacher_logp", "entropy_coef")
    return {name: getattr(mb, name) for name in names}


def _check_vocabulary(mb: MicroBatch, vocab: int) -> None:
    """A micro-batch's targets fit the LM head (from its packed `max_target`, on the host)."""
    if mb.max_target is not None and mb.max_target >= vocab:
        raise ValueError(
            f"target id {mb.max_target} is outside the LM head's vocabulary of {vocab}: the "
            "tokenizer and the model do not match (use the model's own tokenizer)"
        )
