"""Cutting a packed micro-batch into sequence-parallel shards (cod_fast.data.sequence_split):
every rank's tokens put back together are the padded row, every trainable token is held by
exactly one rank at its own row, and the ranks' tokens go back into the micro-batch's order."""

from __future__ import annotations

import random

import pytest
import torch

from cod_fast.data.packing import build_microbatch, rollout_sequences
from cod_fast.data.records import Episode, Turn
from cod_fast.data.sequence_split import shard_microbatch, with_sequence_shard
from cod_fast.train.step import runnable

VOCAB = 40


def episodes(seed: int) -> list[Episode]:
    """Groups of members sharing their first prompt (some writing the same response: repeated
    pairs in the prefix tree), each a multi-turn episode whose turns only append."""
    rng = random.Random(seed)
    out = []
    for pack in range(3):
        first = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))]
        same = [rng.randrange(VOCAB) for _ in range(4)]
        for member in range(3):
            prompt, turns = list(first), []
            for turn in range(rng.randint(1, 3)):
                response = (
                    list(same)
                    if member < 2 and turn == 0
                    else [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
                )
                logps = [-rng.random() for _ in response]
                turns.append(
                    Turn(prompt_ids=prompt, response_ids=response, response_logprobs=logps)
                )
                prompt = prompt + response + [rng.randrange(VOCAB) for _ in range(2)]
            out.append(
                Episode(
                    pack_id=pack,
                    member=member,
                    kind="solve",
                    task_index=0,
                    turns=turns,
                    reward=rng.random(),
                    advantage=rng.gauss(0, 1),
                )
            )
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_shards_cover_the_row_and_its_tokens_once(size, share, seed):
    mb = build_microbatch(rollout_sequences(episodes(seed)), share_prefix=share)
    shards = [shard_microbatch(mb, r, size) for r in range(size)]
    total, width = mb.num_tokens, shards[0].input_ids.numel()
    pad = width * size - total
    assert 0 <= pad < size
    ids = torch.cat([s.input_ids for s in shards])
    positions = torch.cat([s.position_ids for s in shards])
    assert torch.equal(ids[:total], mb.input_ids) and not ids[total:].any()
    assert torch.equal(positions[:total], mb.position_ids)
    assert positions[total:].tolist() == list(range(pad))
    for s in shards:  # the whole row's blocks, the padding a block of its own
        assert s.cu_seqlens.tolist() == mb.cu_seqlens.tolist() + ([total + pad] if pad else [])
        assert list(s.seqlens) == mb.cu_seqlens.diff().tolist() + ([pad] if pad else [])
        if share:
            blocks = s.cu_seqlens_k.tolist()
            assert blocks[-1] == s.kv_index.numel() == mb.kv_index.numel() + pad
            assert s.kv_index[mb.kv_index.numel() :].tolist() == list(range(total, total + pad))
    held = torch.cat([s.tokens for s in shards])
    assert sorted(held.tolist()) == list(range(mb.num_trainable))
    for r, s in enumerate(shards):
        assert s.counts == tuple(len(x.tokens) for x in shards)
        assert torch.equal(s.rows + r * width, mb.trainable_idx[s.tokens])
        assert ((s.rows >= 0) & (s.rows < width)).all()
    order = shards[0].order
    back = held if order is None else held[order]
    assert back.tolist() == list(range(mb.num_trainable))  # token t at place t


def test_the_shared_layout_needs_an_order_and_the_flat_one_none():
    """In the prefix tree a shared position is read by several segments, so some rank's tokens
    come before another's in the token order; the flat layout's positions ascend."""
    sequences = rollout_sequences(episodes(0))
    flat = build_microbatch(sequences)
    shared = build_microbatch(sequences, share_prefix=True)
    assert shard_microbatch(flat, 0, 3).order is None
    assert shard_microbatch(shared, 0, 3).order is not None
    assert shared.pair_rows is not None  # members that wrote the same response


def test_a_rank_scores_its_repeated_pairs_once():
    """Members that wrote the same response read the same rows with the same targets: the rank
    holding them keeps each distinct (row, target) pair once, and every token its pair."""
    shared = build_microbatch(rollout_sequences(episodes(7)), share_prefix=True)
    shards = [shard_microbatch(shared, r, 2) for r in range(2)]
    deduped = [s for s in shards if s.pair_rows is not None]
    assert deduped
    for s in deduped:
        targets = shared.targets[s.tokens]
        assert torch.equal(s.pair_rows[s.pair_of_token], s.rows)
        assert torch.equal(s.pair_targets[s.pair_of_token], targets)
        pairs = set(zip(s.rows.tolist(), targets.tolist(), strict=True))
        assert s.pair_rows.numel() == len(pairs) < s.rows.numel()
    flat = build_microbatch(rollout_sequences(episodes(7)))
    assert all(shard_microbatch(flat, r, 2).pair_rows is None for r in range(2))


def test_a_one_token_microbatch_pads_every_rank_and_an_empty_one_is_refused():
    one = build_microbatch(rollout_sequences(episodes(0))[:1])
    placeholder = runnable(build_microbatch([]))
    shards = [shard_microbatch(placeholder, r, 4) for r in range(4)]
    assert [s.input_ids.numel() for s in shards] == [1] * 4 and shards[0].counts == (0,) * 4
    with pytest.raises(ValueError, match="empty micro-batch"):
        shard_microbatch(build_microbatch([]), 0, 2)
    with pytest.raises(ValueError, match="not in a sequence-parallel group"):
        shard_microbatch(one, 2, 2)


def test_the_shard_moves_with_its_microbatch():
    mb = with_sequence_shard(build_microbatch(rollout_sequences(episodes(3))), 1, 2)
    moved = mb.to("meta")
    assert moved.shard.rows.device.type == "meta" and moved.shard.counts == mb.shard.counts
