"""Packing rollouts into sequences and token-budgeted micro-batches (docs/concepts.md section 5).

episodes -> `Sequence`s (one context window each; a multi-turn episode whose turns only append is
one sequence with one trainable `Segment` per response, "prefix merging") -> `balance` assigns
whole sequences to micro-batches and ranks -> `build_microbatch` flattens them into the varlen
tensors the loss reads: attention boundaries (`cu_seqlens`), per-sequence positions, and for every
trainable position its target token, segment id, advantage and sampler log-prob. The trainer
adds the log-probs it recomputes (old policy, reference) to the micro-batches afterwards, and
the training step each token's entropy weight where update episodes have their own
(`with_entropy_coef`).
With `share_prefix` a micro-batch is its sequences' prefix tree (cod_fast.data.prefix_tree; planned by
`balance_shared`): each shared prefix once, the per-token values those of the flat layout.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from cod_fast.common.errors import CodFastError
from cod_fast.config import LossConfig
from cod_fast.data.prefix_tree import Tree, build_tree, common_prefix, flat_tree
from cod_fast.data.records import Episode, EpisodeKind
from cod_fast.ops.linear_loss import TokenPairs

if TYPE_CHECKING:
    from cod_fast.data.sequence_shard import SequenceShard


class SequenceTooLongError(ValueError, CodFastError):
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
    """Episode key + turn index: (pack_id, member, kind, task_index, turn)."""
    teacher_logp: list[float] | None = None
    """The distillation teacher's log-probs of the response tokens (cod_fast.train.teachers)."""

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
    """[T] int64, each token's position in its sequence (restarting at 0 for every sequence; a
    tree node's tokens continue their ancestors' positions)."""
    cu_seqlens: torch.Tensor
    """[S+1] int32, sequence boundaries starting at 0; attention never crosses them. In the
    shared-prefix layout the boundaries of the prefix tree's nodes (cod_fast.data.prefix_tree)."""
    max_seqlen: int
    """Longest sequence, or tree node (0 when empty)."""
    seqlens: tuple[int, ...] | None = None
    """[S] each sequence's (tree node's) length, cu_seqlens.diff() kept on the host: packed
    attention cuts its blocks by them without reading cu_seqlens back from the device; None:
    unknown (read from cu_seqlens, a host sync on a GPU)."""
    trainable_idx: torch.Tensor
    """[N] int64, the flattened row's position whose hidden state predicts each target, in the
    order of the sequences and their segments (ascending in the flat layout; in the shared-prefix
    layout a shared position appears once per segment that predicts from it)."""
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
    entropy_coef: torch.Tensor | None = None
    """[N] float32, each token's entropy weight when update episodes have their own
    (`with_entropy_coef`); None: the loss config's one weight for every token."""
    kv_index: torch.Tensor | None = None
    """Shared-prefix layout only: [K] int64, the positions each tree node attends to, node by
    node (its ancestors' tokens, then its own); None when every node is a whole sequence."""
    cu_seqlens_k: torch.Tensor | None = None
    """Shared-prefix layout only: [S+1] int32, each node's block of `kv_index`."""
    max_seqlen_k: int = 0
    """Shared-prefix layout only: the longest block of `kv_index`."""
    seqlens_k: tuple[int, ...] | None = None
    """Shared-prefix layout only: [S] each node's block of `kv_index`, cu_seqlens_k.diff() kept
    on the host (as `seqlens`)."""
    pair_rows: torch.Tensor | None = None
    """Shared-prefix layout, when some (trainable_idx, target) pairs repeat (members that wrote
    the same response): [P] the distinct pairs' rows, ascending (see ops.linear_loss.TokenPairs);
    None when every pair is distinct."""
    pair_targets: torch.Tensor | None = None
    """[P] the distinct pairs' targets, beside `pair_rows`."""
    pair_of_token: torch.Tensor | None = None
    """[N] each trainable token's index into the distinct pairs, beside `pair_rows`."""
    max_target: int | None = None
    """The largest target id (-1 when there is none), found while packing so that the loss need
    not read the targets back from the device to check them against the vocabulary; None:
    unknown."""
    shard: SequenceShard | None = None
    """Under sequence parallelism, this rank's share of the micro-batch
    (cod_fast.data.sequence_shard); None: the rank runs all of it."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_trainable(self) -> int:
        return self.trainable_idx.numel()

    @property
    def num_segments(self) -> int:
        return len(self.segment_keys)

    @property
    def pairs(self) -> TokenPairs | None:
        """The distinct (row, target) pairs, when some repeat."""
        if self.pair_rows is None:
            return None
        return TokenPairs(self.pair_rows, self.pair_targets, self.pair_of_token)  # type: ignore[arg-type]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        """A copy with every tensor on `device`: from the host, one copy per dtype (the tensors
        of a dtype are packed into one buffer, then split into views on the device), from
        pinned memory and asynchronous for CUDA."""
        device = torch.device(device)
        values = dict(vars(self))
        host = {k: v for k, v in values.items() if _on_host(v, device)}
        for dtype in {v.dtype for v in host.values()}:
            names = [k for k, v in host.items() if v.dtype == dtype]
            values.update(_copy_together({k: host[k] for k in names}, device, non_blocking))
        for k, v in values.items():  # tensors on another device than the host's
            if isinstance(v, torch.Tensor) and k not in host:
                values[k] = v.to(device, non_blocking=non_blocking)
        if self.shard is not None:
            values["shard"] = self.shard.to(device, non_blocking=non_blocking)
        return MicroBatch(**values)


def _on_host(value, device: torch.device) -> bool:
    """A host tensor that must move to `device`."""
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and device.type != "cpu"


def _copy_together(
    tensors: dict[str, torch.Tensor], device: torch.device, non_blocking: bool
) -> dict[str, torch.Tensor]:
    """Host tensors of one dtype moved to `device` in one copy."""
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    if device.type == "cuda":  # a pageable copy would block the host until it is done
        flat, non_blocking = flat.pin_memory(), True
    parts = flat.to(device, non_blocking=non_blocking).split([t.numel() for t in tensors.values()])
    return {k: part.view(t.shape) for (k, t), part in zip(tensors.items(), parts, strict=True)}


def build_microbatch(sequences: list[Sequence], share_prefix: bool = False) -> MicroBatch:
    """Flatten whole sequences into one micro-batch (an empty list gives a valid empty one).

    `share_prefix` lays them out as their prefix tree (cod_fast.data.prefix_tree): each shared prefix
    once; the per-token values and their order are those of the flat layout.
    """
    token_lists = [seq.tokens for seq in sequences]
    tree = build_tree(token_lists) if share_prefix else flat_tree(token_lists)
    offsets = tree.offsets()
    tokens: list[int] = []
    positions: list[int] = []
    cu_seqlens = [0]
    for node in tree.nodes:
        tokens.extend(token_lists[node.source][node.start : node.start + node.length])
        positions.extend(range(node.start, node.start + node.length))
        cu_seqlens.append(len(tokens))
    trainable: list[int] = []
    targets: list[int] = []
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
    for seq, path in zip(sequences, tree.paths, strict=True):
        # Where each depth of the sequence lies in the flattened row.
        where = [offsets[n] + d for n in path for d in range(tree.nodes[n].length)]
        for seg in seq.segments:
            # Position p predicts token p+1, so the segment's first response token (at `start`)
            # is the target of position start-1; every response token has a target.
            trainable.extend(where[seg.start - 1 : seg.start - 1 + seg.length])
            targets.extend(seq.tokens[seg.start : seg.start + seg.length])
            segment_ids.extend([len(keys)] * seg.length)
            advantages.extend([seg.advantage] * seg.length)
            rollout_logp.extend(seg.rollout_logp)
            lengths.append(seg.length)
            keys.append(seg.key)

    def i64(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64)

    def f32(x: list[float]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float32)

    repeated = None
    if share_prefix:
        repeated = TokenPairs.from_lists(trainable, targets)
        if repeated.rows.numel() == len(targets):
            repeated = None  # every pair distinct
    return MicroBatch(
        input_ids=i64(tokens),
        position_ids=i64(positions),
        cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32),
        max_seqlen=max((node.length for node in tree.nodes), default=0),
        seqlens=tuple(node.length for node in tree.nodes),
        trainable_idx=i64(trainable),
        targets=i64(targets),
        segment_ids=i64(segment_ids),
        advantages=f32(advantages),
        rollout_logp=f32(rollout_logp),
        segment_lengths=i64(lengths),
        segment_keys=keys,
        teacher_logp=f32(teacher) if segments and all(scored) else None,
        **_key_blocks(tree, offsets),
        pair_rows=None if repeated is None else repeated.rows,
        pair_targets=None if repeated is None else repeated.targets,
        pair_of_token=None if repeated is None else repeated.repeat,
        max_target=max(targets, default=-1),
    )


def segment_kind(key: tuple) -> EpisodeKind:
    """The episode kind in a segment's key (Episode.key + turn index)."""
    return key[2]


def with_entropy_coef(mb: MicroBatch, loss_config: LossConfig) -> MicroBatch:
    """`mb` carrying each token's entropy weight when `config` gives update episodes their own
    (update_entropy_coef set and unlike entropy_coef): update_entropy_coef on the tokens of
    update episodes, entropy_coef on the others. Otherwise `mb` itself, and the loss applies
    entropy_coef to every token. Built where `mb`'s segment ids are (on the host before
    `MicroBatch.to`, so it moves with the other float32 tensors), with no read from a device."""
    update = loss_config.update_entropy_coef
    if update is None or update == loss_config.entropy_coef:
        return mb
    weights = [
        update if segment_kind(key) == "update" else loss_config.entropy_coef
        for key in mb.segment_keys
    ]
    per_segment = torch.tensor(weights, dtype=torch.float32, device=mb.segment_ids.device)
    return replace(mb, entropy_coef=per_segment[mb.segment_ids])


def _key_blocks(tree: Tree, offsets: list[int]) -> dict:
    """kv_index, cu_seqlens_k and max_seqlen_k of a tree with shared nodes ({} when none)."""
    if all(node.parent < 0 for node in tree.nodes):
        return {}
    kv: list[int] = []
    cu = [0]
    for i in range(len(tree.nodes)):
        chain = [i]
        while tree.nodes[chain[-1]].parent >= 0:
            chain.append(tree.nodes[chain[-1]].parent)
        for n in reversed(chain):
            kv.extend(range(offsets[n], offsets[n] + tree.nodes[n].length))
        cu.append(len(kv))
    return {
        "kv_index": torch.tensor(kv, dtype=torch.int64),
        "cu_seqlens_k": torch.tensor(cu, dtype=torch.int32),
        "max_seqlen_k": max(node.start + node.length for node in tree.nodes),
        "seqlens_k": tuple(b - a for a, b in itertools.pairwise(cu)),
    }


def balance(lengths: list[int], token_budget: int, world_size: int = 1) -> list[list[list[int]]]:
    """Assign whole sequences to micro-batches: `result[rank][mb]` = sequence indices.

    Every rank gets the same number of micro-batches (FSDP steps in lockstep; some may be empty).
    Sequences go longest first into the least-loaded bin (worst-fit decreasing), starting from
    the fewest bins the total allows and adding one bin per rank until everything fits. Bins are
    then dealt to ranks in rounds of `world_size`, the heaviest bin of a round to the lightest
    rank. Both steps keep the spread (max - min load) at most the longest sequence.
    """
    _check_lengths(lengths, token_budget, world_size)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    per_rank = max(1, math.ceil(sum(lengths) / (token_budget * world_size)))
    while (bins := _worst_fit(order, lengths, token_budget, per_rank * world_size)) is None:
        per_rank += 1
    return _deal(bins, [sum(lengths[i] for i in b) for b in bins], world_size)


def balance_shared(
    sequences: list[Sequence], token_budget: int, world_size: int = 1
) -> list[list[list[int]]]:
    """`balance` for the shared-prefix layout: the budget bounds a micro-batch's tree tokens.

    Sequences in token order put the ones that share a prefix side by side; each joins the
    current micro-batch while the tree's tokens stay within the budget (a sequence adds what it
    does not share with the one before it), else starts the next. Bins are dealt to ranks as in
    `balance`, with empty ones added so that every rank gets as many.
    """
    _check_lengths([len(seq) for seq in sequences], token_budget, world_size)
    order = sorted(range(len(sequences)), key=lambda i: sequences[i].tokens)
    bins: list[list[int]] = []
    loads: list[int] = []
    previous: list[int] = []
    for i in order:
        tokens = sequences[i].tokens
        added = len(tokens) - common_prefix(tokens, previous)
        if not bins or loads[-1] + added > token_budget:
            bins.append([])
            loads.append(0)
            added = len(tokens)
        bins[-1].append(i)
        loads[-1] += added
        previous = tokens
    empty = max(1, math.ceil(len(bins) / world_size)) * world_size - len(bins)
    return _deal(bins + [[] for _ in range(empty)], loads + [0] * empty, world_size)


def _check_lengths(lengths: list[int], token_budget: int, world_size: int) -> None:
    if token_budget < 1 or world_size < 1:
        raise ValueError(
            f"token_budget and world_size must be >= 1, got {token_budget}, {world_size}"
        )
    for i, n in enumerate(lengths):
        if n > token_budget:
            raise SequenceTooLongError(
                f"sequence {i} has {n} tokens but a micro-batch holds {token_budget} "
                "(train.token_budget x train.sequence_parallel); raise either, or lower "
                "rollout.max_response_tokens (or the prompt length)"
            )
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; sequences must be non-empty")


def _deal(bins: list[list[int]], loads: list[int], world_size: int) -> list[list[list[int]]]:
    """Bins (a multiple of world_size) to ranks in rounds, the heaviest of a round to the
    lightest rank so far; each bin's indices ascending."""
    per_rank = len(bins) // world_size
    by_load = sorted(range(len(bins)), key=lambda b: (-loads[b], b))
    result: list[list[list[int]]] = [[] for _ in range(world_size)]
    totals = [0] * world_size
    for r in range(per_rank):
        ranks = sorted(range(world_size), key=lambda k: (totals[k], k))
        for rank, b in zip(ranks, by_load[r * world_size : (r + 1) * world_size], strict=True):
            result[rank].append(sorted(bins[b]))
            totals[rank] += loads[b]
    return result


def plan_microbatches(
    sequences: list[Sequence], token_budget: int, world_size: int = 1, share_prefix: bool = False
) -> list[list[list[int]]]:
    """`result[rank][mb]` = sequence indices: `balance_shared` or `balance`."""
    if share_prefix:
        return balance_shared(sequences, token_budget, world_size)
    return balance([len(seq) for seq in sequences], token_budget, world_size)


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
    sequences: list[Sequence], token_budget: int, world_size: int = 1, share_prefix: bool = False
) -> list[list[MicroBatch]]:
    """rank -> its micro-batches for one optimizer step. All checks run before any tensor."""
    plan = plan_microbatches(sequences, token_budget, world_size, share_prefix)
    return [
        [build_microbatch([sequences[i] for i in mb], share_prefix) for mb in rank] for rank in plan
    ]


def step_totals(batches: Iterable[Iterable[MicroBatch]]) -> tuple[int, int]:
    """(trainable tokens, segments) over every rank's micro-batches of one optimizer step."""
    mbs = [mb for rank in batches for mb in rank]
    return sum(mb.num_trainable for mb in mbs), sum(mb.num_segments for mb in mbs)
