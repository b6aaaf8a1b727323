"""Cutting a packed micro-batch into the shards of a sequence-parallel group
(cod_fast.data.sequence_shard says what a shard holds)."""

from __future__ import annotations

import dataclasses

import torch

from cod_fast.data.packing import MicroBatch
from cod_fast.data.sequence_shard import SequenceShard
from cod_fast.ops.linear_loss import DEDUPE_SHARE, TokenPairs


def shard_microbatch(mb: MicroBatch, rank: int, size: int) -> SequenceShard:
    """Rank `rank` of `size`'s share of `mb` (a micro-batch with at least one token)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a sequence-parallel group of {size}")
    total = mb.num_tokens
    if total < 1:
        raise ValueError("an empty micro-batch has no tokens to split (see train.step.runnable)")
    width = -(-total // size)
    pad = width * size - total
    ids = torch.cat([mb.input_ids, mb.input_ids.new_zeros(pad)])
    positions = torch.cat([mb.position_ids, torch.arange(pad, dtype=mb.position_ids.dtype)])
    mine = slice(rank * width, (rank + 1) * width)
    owner = torch.div(mb.trainable_idx, width, rounding_mode="floor")
    counts = torch.bincount(owner, minlength=size).tolist()
    held = torch.nonzero(owner == rank).flatten()
    rows = mb.trainable_idx[held] - rank * width
    order = None
    if not bool((owner[1:] >= owner[:-1]).all()):  # not one rank's tokens after another's
        by_rank = torch.argsort(owner, stable=True)  # the concatenation's tokens
        order = torch.empty_like(by_rank)
        order[by_rank] = torch.arange(by_rank.numel())
    keys = {}
    if mb.kv_index is not None:
        assert mb.cu_seqlens_k is not None and mb.seqlens_k is not None
        keys = {
            "kv_index": torch.cat([mb.kv_index, torch.arange(total, total + pad)]),
            "cu_seqlens_k": _padded_offsets(mb.cu_seqlens_k, pad),
            "seqlens_k": mb.seqlens_k + ((pad,) if pad else ()),
            "max_seqlen_k": max(mb.max_seqlen_k, pad),
        }
    if mb.pair_rows is not None:  # some tokens repeat a (row, target) pair
        keys.update(_distinct_pairs(rows, mb.targets[held]))
    seqlens = mb.seqlens if mb.seqlens is not None else tuple(mb.cu_seqlens.diff().tolist())
    return SequenceShard(
        rank=rank,
        size=size,
        input_ids=ids[mine],
        position_ids=positions[mine],
        cu_seqlens=_padded_offsets(mb.cu_seqlens, pad),
        seqlens=seqlens + ((pad,) if pad else ()),
        max_seqlen=max(mb.max_seqlen, pad),
        rows=rows,
        tokens=held,
        counts=tuple(counts),
        order=order,
        **keys,
    )


def _distinct_pairs(rows: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rank's distinct (row, target) pairs, found on the host, when they are at most
    DEDUPE_SHARE of its tokens (as the one-rank loss scores them); else none."""
    pairs = TokenPairs.from_lists(rows.tolist(), targets.tolist())
    if pairs.rows.numel() > DEDUPE_SHARE * rows.numel():
        return {}
    return {"pair_rows": pairs.rows, "pair_targets": pairs.targets, "pair_of_token": pairs.repeat}


def _padded_offsets(offsets: torch.Tensor, pad: int) -> torch.Tensor:
    """Block offsets with one more block of `pad` tokens at the end (none when pad is 0)."""
    if not pad:
        return offsets
    return torch.cat([offsets, (offsets[-1:] + pad).to(offsets.dtype)])


def with_sequence_shard(mb: MicroBatch, rank: int, size: int) -> MicroBatch:
    """`mb` carrying rank `rank`'s share (`MicroBatch.shard`), built where `mb` is: on the
    host before `MicroBatch.to`, it moves with the micro-batch's other tensors."""
    return dataclasses.replace(mb, shard=shard_microbatch(mb, rank, size))
