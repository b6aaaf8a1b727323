"""One rank's share of a packed micro-batch under sequence parallelism (train.sequence_parallel).

A sequence-parallel group of N ranks runs the same micro-batch; rank r holds its tokens
[r T', (r+1) T') of the row padded to T' N tokens (T' = ceil(T / N)). The padding is a sequence
of its own at the end of the row, so no real token attends to it, and it has no target. Attention
runs over the whole row after the all-to-all (cod_fast.ops.sequence_parallel), so the row's
boundaries (`cu_seqlens`, and the shared-prefix layout's key blocks) are the whole row's, padded;
the token ids and positions are the rank's own.

Each trainable token belongs to the rank that holds its position (`trainable_idx`): that rank
scores it, and the ranks' scores are put back in the micro-batch's token order by `counts` and
`order`. In the flat layout the positions ascend, so the ranks' tokens follow one another and no
order is needed; in the shared-prefix layout a shared position appears once per segment that
predicts from it, in any order.

cod_fast.data.sequence_split cuts it where the micro-batch is, on the host before it moves to
the device, so the forward never waits for the device to learn its shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class SequenceShard:
    """Rank `rank` of `size`'s share of one micro-batch (see the module docstring)."""

    rank: int
    size: int
    input_ids: torch.Tensor
    """[T'] int64, the rank's tokens of the padded row."""
    position_ids: torch.Tensor
    """[T'] int64, their positions in their sequences."""
    cu_seqlens: torch.Tensor
    """[S+1] int32 (S+2 with padding): the whole padded row's boundaries."""
    seqlens: tuple[int, ...]
    max_seqlen: int
    rows: torch.Tensor
    """[n] int64, the rank's row (0 .. T'-1) of each trainable token it holds."""
    tokens: torch.Tensor
    """[n] int64, those tokens' indices in the micro-batch's trainable tokens."""
    counts: tuple[int, ...]
    """Trainable tokens held by each rank of the group."""
    order: torch.Tensor | None = None
    """[N] int64, each trainable token's place in the ranks' tokens one after the other; None
    when that is the micro-batch's own order."""
    kv_index: torch.Tensor | None = None
    """Shared-prefix layout: the micro-batch's key blocks, with the padding's own block."""
    cu_seqlens_k: torch.Tensor | None = None
    seqlens_k: tuple[int, ...] | None = None
    max_seqlen_k: int = 0
    pair_rows: torch.Tensor | None = None
    """[P] the distinct (row, target) pairs of the rank's tokens, when members that wrote the
    same response (a prefix tree's repeated pairs) make them few enough to score each once
    (cod_fast.ops.linear_loss.DEDUPE_SHARE); None: every token scored."""
    pair_targets: torch.Tensor | None = None
    """[P] their targets."""
    pair_of_token: torch.Tensor | None = None
    """[n] each of the rank's tokens' pair."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SequenceShard:
        """A copy with every tensor on `device`."""
        moved = {
            k: v.to(device, non_blocking=non_blocking)
            for k, v in vars(self).items()
            if isinstance(v, torch.Tensor)
        }
        return dataclasses.replace(self, **moved)
