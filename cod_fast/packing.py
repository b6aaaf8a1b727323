"""Packing rollouts into sequences and token-budgeted micro-batches (SPEC.md section 5).

episodes -> `Sequence`s (one context window each; a multi-turn episode whose turns only append is
one sequence with one trainable `Segment` per response, "prefix merging") -> `balance` assigns
whole sequences to micro-batches and ranks -> `build_microbatch` flattens them into the varlen
tensors the loss reads: attention boundaries (`cu_seqlens`), per-sequence positions, and for every
trainable position its target token, segment id, advantage and sampler log-prob. The trainer
adds the log-probs it recomputes (old policy, reference) to the micro-batches afterwards.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from cod_fast.records import Episode


class SequenceTooLongError(ValueError):
    """A sequence does not fit in one micro-batch."""


@dataclass(kw_only=True)
class Segment:
    """One model response inside a sequence: the trainable tokens and their per-token values."""

    start: int
    """Index in the sequence of the first response token (>= 1: a prompt always precedes it)."""
    length: int
    """Number of response tokens."""
    advantage: float
    """The episode's advantage, shared by every token."""
    rollout_logp: list[float]
    """Sampler log-probs (roll_t)."""
    key: tuple = ()
    """Episode key + turn index."""
    teacher_logp: list[float] | None = None
    """The distillation teacher's log-probs of the response tokens (cod_fast.teachers)."""

    def __post_init__(self) -> None:
        if self.start < 1 or self.length < 1:
            raise ValueError(
                f"segment {self.key} needs start >= 1 and length >= 1, got "
                f"start={self.start}, length={self.length}"
            )
        if len(self.rollout_logp) != self.length:
            raise ValueError(
                f"segment {self.key}: rollout_logp has {len(self.rollout_logp)} entries, "
                f"expected length={self.length}"
            )


@dataclass(kw_only=True)
class Sequence:
    """One context window: token ids and the response segments inside it, in order."""

    tokens: list[int]
    segments: list[Segment]
    env: str = ""
    """The environment of its episode (picks the distillation teacher)."""

    def __post_init__(self) -> None:
        end = 0
        for seg in self.segments:
            if seg.start < end or seg.start + seg.length > len(self.tokens):
                raise ValueError(
                    f"segment {seg.key} [{seg.start}, {seg.start + seg.length}) "
                    f"overlaps the previous one or runs past the sequence "
                    f"({len(self.tokens)} tokens)"
                )
            end = seg.start + seg.length

    def __len__(self) -> int:
        return len(self.tokens)


def episode_sequences(episode: Episode, merge_prefix: bool = True) -> list[Sequence]:
    """Lay out an episode's turns as sequences, merging turns that only append (prefix merging).

    A turn whose prompt starts with the whole current sequence (previous prompt + response)
    extends it; any other turn (one that rewrote earlier text) starts a new sequence.
    `merge_prefix=False` gives one sequence per turn.
    """
    if episode.advantage is None:
        raise ValueError(
            f"episode {episode.key} has no advantage: advantages must be assigned "
            "first (see cod_fast.algo.advantages) before packing"
        )
    layouts: list[tuple[list[int], list[Segment]]] = []
    for j, turn in enumerate(episode.turns):
        prev = layouts[-1][0] if layouts else None
        if merge_prefix and prev is not None and turn.prompt_ids[: len(prev)] == prev:
            tokens, segments = layouts[-1]
            tokens.extend(turn.prompt_ids[len(tokens) :])
        else:
            tokens, segments = list(turn.prompt_ids), []
            layouts.append((tokens, segments))
        segments.append(
            Segment(
                start=len(tokens),
                length=len(turn.response_ids),
                advantage=float(episode.advantage),
                rollout_logp=list(turn.response_logprobs),
                key=(*episode.key, j),
            )
        )
        tokens.extend(turn.response_ids)
    return [
        Sequence(tokens=tokens, segments=segments, env=episode.env) for tokens, segments in layouts
    ]


def rollout_sequences(episodes: Iterable[Episode], merge_prefix: bool = True) -> list[Sequence]:
    """`episode_sequences` over many episodes, in order."""
    return [seq for ep in episodes for seq in episode_sequences(ep, merge_prefix)]


@dataclass(kw_only=True)
class MicroBatch:
    """Whole sequences concatenated into one varlen row; per-token values at trainable positions.

    T tokens, S sequences, N trainable positions (position p is trainable when token p+1 is a
    response token of the same sequence), n_segments response segments.
    """

    input_ids: torch.Tensor
    """[T] int64."""
    position_ids: torch.Tensor
    """[T] int64, restarting at 0 for every sequence."""
    cu_seqlens: torch.Tensor
    """[S+1] int32, sequence boundaries starting at 0; attention never crosses them."""
    max_seqlen: int
    """Longest sequence (0 when empty)."""
    trainable_idx: torch.Tensor
    """[N] int64, ascending positions in the flattened row."""
    targets: torch.Tensor
    """[N] int64, input_ids[trainable_idx + 1]."""
    segment_ids: torch.Tensor
    """[N] int64, compact 0..n_segments-1 in order of appearance."""
    advantages: torch.Tensor
    """[N] float32, the segment's advantage on each of its tokens."""
    rollout_logp: torch.Tensor
    """[N] float32."""
    segment_lengths: torch.Tensor
    """[n_segments] int64, trainable tokens per segment."""
    segment_keys: list[tuple]
    """Episode key + turn index of each segment."""
    old_logp: torch.Tensor | None = None
    """[N] float32 from the trainer (algo.old_logp=recompute); None: old = rollout ("bypass")."""
    ref_logp: torch.Tensor | None = None
    """[N] float32 from the trainer's reference model when a KL term is on, else None."""
    teacher_logp: torch.Tensor | None = None
    """[N] float32 from the distillation teachers (`opd`), else None."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_trainable(self) -> int:
        return self.trainable_idx.numel()

    @property
    def num_segments(self) -> int:
        return len(self.segment_keys)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        """A copy with every tensor on `device`."""
        return MicroBatch(
            **{
                k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
                for k, v in vars(self).items()
            }
        )


def build_microbatch(sequences: list[Sequence]) -> MicroBatch:
    """Flatten whole sequences into one micro-batch (an empty list gives a valid empty one)."""
    tokens: list[int] = []
    positions: list[int] = []
    cu_seqlens = [0]
    trainable: list[int] = []
    segment_ids: list[int] = []
    advantages: list[float] = []
    rollout_logp: list[float] = []
    lengths: list[int] = []
    keys: list[tuple] = []
    segments = [seg for seq in sequences for seg in seq.segments]
    scored = [seg.teacher_logp is not None for seg in segments]
    if any(scored) and not all(scored):
        raise ValueError("some segments have teacher log-probs and some not; score them all")
    teacher: list[float] = [x for seg in segments for x in seg.teacher_logp or []]
    for seq in sequences:
        offset = len(tokens)
        tokens.extend(seq.tokens)
        positions.extend(range(len(seq)))
        cu_seqlens.append(len(tokens))
        for seg in seq.segments:
            # Position p predicts token p+1, so the segment's first response token (at `start`)
            # is the target of position start-1; every response token has a target.
            first = offset + seg.start - 1
            trainable.extend(range(first, first + seg.length))
            segment_ids.extend([len(keys)] * seg.length)
            advantages.extend([seg.advantage] * seg.length)
            rollout_logp.extend(seg.rollout_logp)
            lengths.append(seg.length)
            keys.append(seg.key)

    def i64(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64)

    def f32(x: list[float]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float32)

    input_ids = i64(tokens)
    trainable_idx = i64(trainable)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=i64(positions),
        cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32),
        max_seqlen=max((len(seq) for seq in sequences), default=0),
        trainable_idx=trainable_idx,
        targets=input_ids[trainable_idx + 1],
        segment_ids=i64(segment_ids),
        advantages=f32(advantages),
        rollout_logp=f32(rollout_logp),
        segment_lengths=i64(lengths),
        segment_keys=keys,
        teacher_logp=f32(teacher) if segments and all(scored) else None,
    )


def balance(lengths: list[int], token_budget: int, world_size: int = 1) -> list[list[list[int]]]:
    """Assign whole sequences to micro-batches: `result[rank][mb]` = sequence indices.

    Every rank gets the same number of micro-batches (FSDP steps in lockstep; some may be empty).
    Sequences go longest first into the least-loaded bin (worst-fit decreasing), starting from
    the fewest bins the total allows and adding one bin per rank until everything fits. Bins are
    then dealt to ranks in rounds of `world_size`, the heaviest bin of a round to the lightest
    rank. Both steps keep the spread (max - min load) at most the longest sequence.
    """
    if token_budget < 1 or world_size < 1:
        raise ValueError(
            f"token_budget and world_size must be >= 1, got {token_budget}, {world_size}"
        )
    for i, n in enumerate(lengths):
        if n > token_budget:
            raise SequenceTooLongError(
                f"sequence {i} has {n} tokens but train.token_budget is {token_budget}; raise "
                "train.token_budget or lower rollout.max_response_tokens (or the prompt length)"
            )
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; sequences must be non-empty")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    per_rank = max(1, math.ceil(sum(lengths) / (token_budget * world_size)))
    while (bins := _worst_fit(order, lengths, token_budget, per_rank * world_size)) is None:
        per_rank += 1

    loads = [sum(lengths[i] for i in b) for b in bins]
    by_load = sorted(range(len(bins)), key=lambda b: (-loads[b], b))
    result: list[list[list[int]]] = [[] for _ in range(world_size)]
    totals = [0] * world_size
    for r in range(per_rank):
        ranks = sorted(range(world_size), key=lambda k: (totals[k], k))
        for rank, b in zip(ranks, by_load[r * world_size : (r + 1) * world_size], strict=True):
            result[rank].append(sorted(bins[b]))
            totals[rank] += loads[b]
    return result


def _worst_fit(
    order: list[int], lengths: list[int], budget: int, num_bins: int
) -> list[list[int]] | None:
    """Place each sequence into the least-loaded bin (ties: lowest index); None if one won't fit.

    The least-loaded bin has the most room, so if it cannot take a sequence no bin can.
    """
    heap = [(0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in order:
        load, b = heapq.heappop(heap)
        if load + lengths[i] > budget:
            return None
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins


def pack_microbatches(
    sequences: list[Sequence], token_budget: int, world_size: int = 1
) -> list[list[MicroBatch]]:
    """rank -> its micro-batches for one optimizer step. All checks run before any tensor."""
    plan = balance([len(seq) for seq in sequences], token_budget, world_size)
    return [[build_microbatch([sequences[i] for i in mb]) for mb in rank] for rank in plan]


def step_totals(batches: Iterable[Iterable[MicroBatch]]) -> tuple[int, int]:
    """(trainable tokens, segments) over every rank's micro-batches of one optimizer step."""
    mbs = [mb for rank in batches for mb in rank]
    return sum(mb.num_trainable for mb in mbs), sum(mb.num_segments for mb in mbs)
