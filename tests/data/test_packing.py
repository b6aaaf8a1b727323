"""Tests for cod_fast.data.records and cod_fast.data.packing (docs/concepts.md section 5)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cod_fast.config import LossConfig
from cod_fast.data.packing import (
    MicroBatch,
    Segment,
    Sequence,
    SequenceTooLongError,
    balance,
    build_microbatch,
    episode_sequences,
    pack_microbatches,
    rollout_sequences,
    step_totals,
    with_entropy_coef,
)
from cod_fast.data.records import Episode, Rollout, Turn

VOCAB = 50
FAST = settings(max_examples=50, deadline=None)


# ---------------------------------------------------------------- helpers


def _ids(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]


def _logps(rng: random.Random, n: int) -> list[float]:
    return [-3.0 * rng.random() for _ in range(n)]


def make_episode(
    rng: random.Random,
    *,
    n_turns: int,
    rewrite_at: int | None = None,
    task_index: int = 0,
    member: int = 0,
    kind: str = "solve",
    advantage: float | None = None,
) -> Episode:
    """A multi-turn episode whose turn j+1 reads turn j's prompt + response + a new observation.

    At `rewrite_at` the turn instead rewrites one earlier token (moved outside the vocabulary, so
    it can never match), as a context-truncating or re-rendering agent would.
    """
    turns: list[Turn] = []
    prompt = _ids(rng, 1, 6)
    for j in range(n_turns):
        if j > 0:
            prompt = turns[-1].prompt_ids + turns[-1].response_ids + _ids(rng, 0, 4)
            if j == rewrite_at:
                i = rng.randrange(len(turns[-1].prompt_ids) + len(turns[-1].response_ids))
                prompt[i] += VOCAB
        response = _ids(rng, 1, 5)
        turns.append(
            Turn(
                prompt_ids=prompt,
                response_ids=response,
                response_logprobs=_logps(rng, len(response)),
            )
        )
    return Episode(
        pack_id=0,
        member=member,
        kind=kind,
        task_index=task_index,
        turns=turns,
        reward=rng.random(),
        advantage=rng.uniform(-1, 1) if advantage is None else advantage,
    )


def make_episodes(seed: int, n: int) -> list[Episode]:
    """n random episodes, some appending only, some with a rewriting turn."""
    rng = random.Random(seed)
    episodes = []
    for k in range(n):
        n_turns = rng.randint(1, 4)
        rewrite_at = rng.randint(1, n_turns - 1) if n_turns > 1 and rng.random() < 0.4 else None
        episodes.append(make_episode(rng, n_turns=n_turns, rewrite_at=rewrite_at, task_index=k))
    return episodes


def _seq(length: int, starts_lengths: list[tuple[int, int]], adv: float = 1.0) -> Sequence:
    """A sequence of tokens 0..length-1 (offset by 10) with the given segments."""
    segs = [
        Segment(start=s, length=n, advantage=adv, rollout_logp=[-0.5] * n, key=(i,))
        for i, (s, n) in enumerate(starts_lengths)
    ]
    return Sequence(tokens=[10 + t for t in range(length)], segments=segs)


def _spans(mb: MicroBatch) -> list[tuple[int, int]]:
    cu = mb.cu_seqlens.tolist()
    return list(itertools.pairwise(cu))


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Exact equality, reporting mismatch count and the first bad indices."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    bad = (actual != expected).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} mismatches, first at {bad[:5].tolist()}: "
        f"{actual[bad[:5]].tolist()} != {expected[bad[:5]].tolist()}"
    )


def assert_microbatch_invariants(mb: MicroBatch) -> None:
    """Layout invariants every micro-batch must hold."""
    t, n = mb.num_tokens, mb.num_trainable
    assert mb.input_ids.dtype == mb.position_ids.dtype == torch.int64
    assert mb.cu_seqlens.dtype == torch.int32 and mb.cu_seqlens[0] == 0
    assert mb.cu_seqlens[-1] == t and mb.position_ids.shape == (t,)
    for a, b in _spans(mb):
        assert_equal(mb.position_ids[a:b], torch.arange(b - a), "position_ids")
    assert mb.max_seqlen == max((b - a for a, b in _spans(mb)), default=0)
    for name in ("targets", "segment_ids", "advantages", "rollout_logp"):
        assert getattr(mb, name).shape == (n,), name
    assert_equal(mb.targets, mb.input_ids[mb.trainable_idx + 1], "targets")
    # Position p's target p+1 lies in p's own sequence: p+1 < the end of p's sequence.
    ends = mb.cu_seqlens[1:].to(torch.int64)
    seq_of = torch.searchsorted(ends, mb.trainable_idx, right=True)
    assert bool((mb.trainable_idx + 1 < ends[seq_of]).all()), "a target crosses cu_seqlens"
    assert int(mb.segment_lengths.sum()) == n and mb.segment_lengths.shape == (mb.num_segments,)
    assert_equal(
        mb.segment_ids,
        torch.repeat_interleave(torch.arange(mb.num_segments), mb.segment_lengths),
        "segment_ids",
    )
    if n:
        assert bool((mb.trainable_idx[1:] > mb.trainable_idx[:-1]).all())


def _check_segments_match_turns(episodes: list[Episode], sequences: list[Sequence]) -> None:
    turns = {(*ep.key, j): (ep, t) for ep in episodes for j, t in enumerate(ep.turns)}
    seen = []
    for seq in sequences:
        for seg in seq.segments:
            ep, turn = turns[seg.key]
            assert seq.tokens[seg.start : seg.start + seg.length] == turn.response_ids
            assert seg.rollout_logp == turn.response_logprobs and seg.advantage == ep.advantage
            seen.append(seg.key)
    assert sorted(seen, key=str) == sorted(turns, key=str), "every turn is exactly one segment"


def _token_views(sequences: list[Sequence]) -> dict[tuple, tuple]:
    """(segment key, token offset) -> (context read, target, roll, advantage) via a micro-batch."""
    mb = build_microbatch(sequences)
    starts = mb.cu_seqlens[:-1].to(torch.int64)
    seq_of = torch.searchsorted(mb.cu_seqlens[1:].to(torch.int64), mb.trainable_idx, right=True)
    offsets = torch.arange(mb.num_trainable) - torch.repeat_interleave(
        torch.cumsum(mb.segment_lengths, 0) - mb.segment_lengths, mb.segment_lengths
    )
    views = {}
    for i, p in enumerate(mb.trainable_idx.tolist()):
        context = tuple(mb.input_ids[int(starts[seq_of[i]]) : p + 1].tolist())
        key = (mb.segment_keys[int(mb.segment_ids[i])], int(offsets[i]))
        views[key] = (
            context,
            int(mb.targets[i]),
            float(mb.rollout_logp[i]),
            float(mb.advantages[i]),
        )
    return views


# ---------------------------------------------------------------- records


def test_turn_rejects_mismatched_logprobs():
    """A Turn needs one log-prob per response token, a prompt, and a known finish reason."""
    with pytest.raises(ValueError, match="response_logprobs"):
        Turn(prompt_ids=[1], response_ids=[2, 3], response_logprobs=[-1.0])
    with pytest.raises(ValueError, match="prompt_ids"):
        Turn(prompt_ids=[], response_ids=[2], response_logprobs=[-1.0])
    with pytest.raises(ValueError, match="finish_reason"):
        Turn(prompt_ids=[1], response_ids=[2], response_logprobs=[-1.0], finish_reason="eos")


def test_episode_validation_and_key():
    """Episode keys are (pack_id, member, kind, task_index); bad kinds and empty turns fail."""
    turn = Turn(prompt_ids=[1], response_ids=[2], response_logprobs=[-1.0])
    ep = Episode(pack_id=3, member=1, kind="update", task_index=2, turns=[turn], reward=-0.1)
    assert ep.key == (3, 1, "update", 2) and ep.advantage is None and ep.info == {}
    with pytest.raises(ValueError, match="kind"):
        Episode(pack_id=0, member=0, kind="hint", task_index=0, turns=[turn], reward=0.0)
    with pytest.raises(ValueError, match="no turns"):
        Episode(pack_id=0, member=0, kind="solve", task_index=0, turns=[], reward=0.0)


def test_rollout_rewards_by_task_index_and_index_checks():
    """task_rewards / hint_rewards follow task index; solve 0..K-1 and update 0..K-2 required."""
    turn = Turn(prompt_ids=[1], response_ids=[2], response_logprobs=[-1.0])

    def ep(kind: str, k: int, reward: float) -> Episode:
        return Episode(pack_id=7, member=2, kind=kind, task_index=k, turns=[turn], reward=reward)

    ran = [
        ep("solve", 0, 0.1),
        ep("update", 0, 0.0),
        ep("solve", 1, 0.5),
        ep("update", 1, -0.1),
        ep("solve", 2, 0.9),
    ]
    rollout = Rollout(pack_id=7, member=2, env="frozenlake", episodes=ran)
    assert rollout.task_rewards == [0.1, 0.5, 0.9] and rollout.hint_rewards == [0.0, -0.1]
    assert rollout.num_tasks == 3
    task_by_task = Rollout(pack_id=7, member=2, episodes=[ran[0], ran[2]])
    assert task_by_task.hint_rewards == []
    with pytest.raises(ValueError, match="solve"):
        Rollout(pack_id=7, member=2, episodes=[ran[0], ran[4]])
    with pytest.raises(ValueError, match="update"):
        Rollout(pack_id=7, member=2, episodes=[ran[0], ran[2], ran[3], ran[4]])
    with pytest.raises(ValueError, match="does not belong"):
        Rollout(pack_id=8, member=2, episodes=ran)


# ---------------------------------------------------------------- sequences


@FAST
@given(seed=st.integers(0, 2**32 - 1), n_turns=st.integers(1, 5))
def test_appending_episode_is_one_sequence(seed, n_turns):
    """Turns that only append merge into ONE sequence with one segment per turn."""
    ep = make_episode(random.Random(seed), n_turns=n_turns)
    (seq,) = episode_sequences(ep)
    assert len(seq.segments) == n_turns
    assert seq.tokens == ep.turns[-1].prompt_ids + ep.turns[-1].response_ids
    assert [s.key for s in seq.segments] == [(*ep.key, j) for j in range(n_turns)]


@FAST
@given(seed=st.integers(0, 2**32 - 1), n_turns=st.integers(2, 5), data=st.data())
def test_rewriting_turn_starts_new_sequence(seed, n_turns, data):
    """A turn whose prompt does not extend the current sequence starts a new one."""
    rewrite_at = data.draw(st.integers(1, n_turns - 1))
    ep = make_episode(random.Random(seed), n_turns=n_turns, rewrite_at=rewrite_at)
    first, second = episode_sequences(ep)
    assert len(first.segments) == rewrite_at and len(second.segments) == n_turns - rewrite_at
    assert second.tokens[: len(ep.turns[rewrite_at].prompt_ids)] == ep.turns[rewrite_at].prompt_ids


@FAST
@given(seed=st.integers(0, 2**32 - 1), n_turns=st.integers(1, 5))
def test_unmerged_layout_is_one_sequence_per_turn(seed, n_turns):
    """merge_prefix=False gives one sequence (prompt + response, one segment) per turn."""
    ep = make_episode(random.Random(seed), n_turns=n_turns)
    seqs = episode_sequences(ep, merge_prefix=False)
    assert [s.tokens for s in seqs] == [t.prompt_ids + t.response_ids for t in ep.turns]
    assert all(
        len(s.segments) == 1 and s.segments[0].start == len(t.prompt_ids)
        for s, t in zip(seqs, ep.turns, strict=True)
    )


@FAST
@given(seed=st.integers(0, 2**32 - 1), merge=st.booleans())
def test_segments_hold_turn_responses_and_logprobs(seed, merge):
    """In both layouts each segment's tokens are its turn's response_ids, with its log-probs."""
    episodes = make_episodes(seed, 4)
    seqs = rollout_sequences(episodes, merge_prefix=merge)
    _check_segments_match_turns(episodes, seqs)
    mb = build_microbatch(seqs)
    assert_microbatch_invariants(mb)
    for s, key in enumerate(mb.segment_keys):
        ep = next(e for e in episodes if e.key == key[:4])
        turn, mask = ep.turns[key[4]], mb.segment_ids == s
        assert mb.targets[mask].tolist() == turn.response_ids
        assert_equal(mb.rollout_logp[mask], torch.tensor(turn.response_logprobs), "rollout_logp")
        assert_equal(
            mb.advantages[mask], torch.full((len(turn.response_ids),), ep.advantage), "advantages"
        )


@FAST
@given(seed=st.integers(0, 2**32 - 1))
def test_layouts_give_every_token_the_same_context(seed):
    """Merged and per-turn layouts: each trainable token reads the same context and target.

    This is the packing half of docs/concepts.md's layout invariant (same loss and gradients).
    """
    episodes = make_episodes(seed, 3)
    merged = _token_views(rollout_sequences(episodes, merge_prefix=True))
    per_turn = _token_views(rollout_sequences(episodes, merge_prefix=False))
    assert merged == per_turn


def test_episode_without_advantage_raises():
    """Packing needs advantages: an unassigned one is a clear error."""
    ep = make_episode(random.Random(0), n_turns=2)
    ep.advantage = None
    with pytest.raises(ValueError, match="advantages must be assigned first"):
        episode_sequences(ep)


# ---------------------------------------------------------------- micro-batches


def test_worked_example_two_sequences():
    """Hand-computed layout: lengths 5 and 3, trainable positions precede response tokens.

    Sequence A = [10..14] with responses at [2, 4) and [4, 5); B = [10, 11, 12], response at [1, 3).
    Flattened, B starts at 5; trainable = {1, 2, 3} from A and {5, 6} from B.
    """
    a = _seq(5, [(2, 2), (4, 1)], adv=0.5)
    b = _seq(3, [(1, 2)], adv=-1.0)
    mb = build_microbatch([a, b])
    assert mb.input_ids.tolist() == [10, 11, 12, 13, 14, 10, 11, 12]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert mb.cu_seqlens.tolist() == [0, 5, 8] and mb.max_seqlen == 5
    assert mb.trainable_idx.tolist() == [1, 2, 3, 5, 6]
    assert mb.targets.tolist() == [12, 13, 14, 11, 12]
    assert mb.segment_ids.tolist() == [0, 0, 1, 2, 2]
    assert mb.advantages.tolist() == [0.5, 0.5, 0.5, -1.0, -1.0]
    assert mb.segment_lengths.tolist() == [2, 1, 2]
    assert mb.segment_keys == [(0,), (1,), (0,)]
    assert (mb.num_tokens, mb.num_trainable, mb.num_segments) == (8, 5, 3)
    assert mb.old_logp is None and mb.ref_logp is None
    assert_microbatch_invariants(mb.to("cpu"))


def test_worked_example_balance():
    """Hand-computed balance: longest first into the least-loaded bin; one more bin on overflow."""
    # total 14, budget 8 -> 2 bins: 5->b0, 4->b1, 3->b1 (7), 2->b0 (7).
    assert balance([5, 3, 4, 2], token_budget=8) == [[[0, 3], [1, 2]]]
    # 3 x 6 with budget 10 start at 2 bins; the third 6 fits nowhere -> 3 bins.
    assert balance([6, 6, 6], token_budget=10) == [[[0], [1], [2]]]
    # Two ranks get the same micro-batch count even with one sequence: the other is empty.
    assert balance([4], token_budget=8, world_size=2) == [[[0]], [[]]]
    # Bins 9, 8 | 7, 3 dealt in rounds: the second round's heavier bin goes to the lighter rank.
    assert balance([9, 8, 7, 3], token_budget=10, world_size=2) == [[[0], [3]], [[1], [2]]]


def test_empty_microbatch_is_valid():
    """No sequences: zero-length tensors, cu_seqlens == [0], no optional tensors."""
    mb = build_microbatch([])
    assert mb.cu_seqlens.tolist() == [0] and mb.cu_seqlens.dtype == torch.int32
    assert (mb.num_tokens, mb.num_trainable, mb.num_segments, mb.max_seqlen) == (0, 0, 0, 0)
    assert mb.targets.shape == (0,) and mb.advantages.dtype == torch.float32
    assert mb.ref_logp is None
    assert_microbatch_invariants(mb)
    assert [[m.num_tokens for m in r] for r in pack_microbatches([], 16, world_size=3)] == [[0]] * 3


def test_over_budget_error_names_length_and_budget():
    """A too-long sequence fails before packing, naming its length, the budget and the fix."""
    seqs = [_seq(5, [(1, 4)]), _seq(37, [(30, 7)])]
    with pytest.raises(SequenceTooLongError, match=r"37.*32") as err:
        pack_microbatches(seqs, token_budget=32)
    assert "train.token_budget" in str(err.value)
    assert "rollout.max_response_tokens" in str(err.value)


@FAST
@given(
    lengths=st.lists(st.integers(1, 64), max_size=40),
    budget=st.integers(64, 200),
    world_size=st.integers(1, 4),
)
def test_balance_covers_once_within_budget_and_balanced(lengths, budget, world_size):
    """Each sequence lands once; micro-batches fit the budget; ranks step in lockstep, balanced."""
    plan = balance(lengths, budget, world_size)
    assert len(plan) == world_size
    assert len({len(rank) for rank in plan}) == 1, "every rank has the same micro-batch count"
    flat = [i for rank in plan for mb in rank for i in mb]
    assert sorted(flat) == list(range(len(lengths)))
    for rank in plan:
        for mb in rank:
            assert sum(lengths[i] for i in mb) <= budget and mb == sorted(mb)
    totals = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert max(totals) - min(totals) <= max(lengths, default=0)
    assert balance(lengths, budget, world_size) == plan, "deterministic"


@FAST
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 12),
    world_size=st.integers(1, 3),
    slack=st.integers(0, 40),
)
def test_pack_microbatches_keeps_sequences_whole(seed, n, world_size, slack):
    """Packed micro-batches hold whole sequences, each exactly once, within the token budget."""
    seqs = rollout_sequences(make_episodes(seed, n))
    budget = max((len(s) for s in seqs), default=1) + slack
    batches = pack_microbatches(seqs, budget, world_size)
    assert len(batches) == world_size and len({len(r) for r in batches}) == 1
    packed = []
    for rank in batches:
        for mb in rank:
            assert mb.num_tokens <= budget
            assert_microbatch_invariants(mb)
            packed += [tuple(mb.input_ids[a:b].tolist()) for a, b in _spans(mb)]
    assert sorted(packed) == sorted(tuple(s.tokens) for s in seqs)
    tokens, segments = step_totals(batches)
    assert segments == sum(len(s.segments) for s in seqs)
    assert tokens == sum(seg.length for s in seqs for seg in s.segments)


def test_step_totals_sums_over_ranks():
    """step_totals adds trainable tokens and segments over every rank's micro-batches."""
    batches = [
        [build_microbatch([_seq(5, [(2, 2), (4, 1)])]), build_microbatch([])],
        [build_microbatch([_seq(3, [(1, 2)]), _seq(4, [(3, 1)])]), build_microbatch([])],
    ]
    assert step_totals(batches) == (3 + 2 + 1, 2 + 1 + 1)
    assert step_totals([]) == (0, 0)


def test_segment_must_fit_sequence():
    """A segment past the end of its sequence, or overlapping the previous one, is rejected."""
    with pytest.raises(ValueError, match="runs past"):
        _seq(4, [(2, 3)])
    with pytest.raises(ValueError, match="overlaps"):
        _seq(6, [(1, 3), (2, 1)])
    with pytest.raises(ValueError, match="start >= 1"):
        _seq(4, [(0, 2)])


def _update_and_solve_sequences(seed: int) -> list[Sequence]:
    """Solve and update episodes of two members that share their prompts, in a shuffled order."""
    rng = random.Random(seed)
    episodes = [
        make_episode(random.Random(seed + k), n_turns=rng.randint(1, 3), task_index=k,
                     member=member, kind=kind)
        for k, kind in enumerate(["solve", "update", "solve", "update", "solve"])
        for member in (0, 1)
    ]  # fmt: skip
    rng.shuffle(episodes)
    return rollout_sequences(episodes)


@pytest.mark.parametrize("share_prefix", [False, True], ids=["flat", "shared-prefix"])
def test_entropy_weights_follow_the_episode_kinds(share_prefix):
    """With update_entropy_coef set and unlike entropy_coef, every trainable token carries its
    episode kind's weight (update_entropy_coef on update tokens, entropy_coef elsewhere), in
    the order of the tokens, in the flat and the shared-prefix layout alike; it moves with the
    other per-token tensors. Unset or equal: no per-token weights."""
    sequences = _update_and_solve_sequences(seed=4)
    mb = build_microbatch(sequences, share_prefix=share_prefix)
    cfg = LossConfig(entropy_coef=0.01, update_entropy_coef=0.25)
    weighted = with_entropy_coef(mb, cfg)
    want = [
        0.25 if key[2] == "update" else 0.01
        for key, length in zip(mb.segment_keys, mb.segment_lengths.tolist(), strict=True)
        for _ in range(length)
    ]
    assert {0.25, 0.01} <= set(want)
    assert_equal(weighted.entropy_coef, torch.tensor(want), "entropy_coef")
    assert mb.entropy_coef is None  # the micro-batch given is left as it was
    moved = weighted.to("meta")
    assert moved.entropy_coef.device.type == "meta" and moved.entropy_coef.shape == (len(want),)
    for same in (
        LossConfig(entropy_coef=0.01),
        LossConfig(entropy_coef=0.1, update_entropy_coef=0.1),
    ):
        assert with_entropy_coef(mb, same) is mb


def test_entropy_weights_of_an_empty_microbatch():
    """No tokens: an empty weight vector, not an error."""
    cfg = LossConfig(update_entropy_coef=0.5)
    assert with_entropy_coef(build_microbatch([]), cfg).entropy_coef.shape == (0,)
