"""The shared-prefix layout (cod_fast.data.prefix_tree): the radix tree, and that a micro-batch laid
out as a tree gives the flat layout's hidden states, loss and gradients (float64)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3Config, Qwen3ForCausalLM

from cod_fast import LossConfig
from cod_fast.data.packing import (
    Segment,
    Sequence,
    SequenceTooLongError,
    balance,
    balance_shared,
    build_microbatch,
)
from cod_fast.data.prefix_tree import build_tree, unique_tokens
from cod_fast.model.attention import KERNELS
from cod_fast.model.lean import make_lean
from cod_fast.model.loading import packed_hidden_states
from cod_fast.model.policy import Policy
from cod_fast.ops import linear_loss

VOCAB = 40


def _trie_size(token_lists: list[list[int]]) -> int:
    """Distinct non-empty prefixes: the token trie's size, counted the slow way."""
    return len({tuple(t[:i]) for t in token_lists for i in range(1, len(t) + 1)})


token_lists = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=12
)


@settings(max_examples=200, deadline=None)
@given(lists=token_lists)
def test_tree_spells_every_sequence_and_shares_every_common_prefix(lists):
    tree = build_tree(lists)
    for tokens, path in zip(lists, tree.paths, strict=True):
        spelled, depth = [], 0
        for i, n in enumerate(path):
            node = tree.nodes[n]
            assert node.start == depth and node.length >= 1
            assert node.parent == (path[i - 1] if i else -1)
            source = lists[node.source]
            spelled += source[node.start : node.start + node.length]
            depth += node.length
        assert spelled == tokens
    # Each distinct prefix exactly once: the tree holds as many tokens as the token trie.
    assert sum(node.length for node in tree.nodes) == _trie_size(lists) == unique_tokens(lists)
    assert all(tree.nodes[n].parent < n for path in tree.paths for n in path)  # parents first


def _group_sequences(rng: random.Random, groups=3, members=4) -> list[Sequence]:
    """Packs of a step: every episode begins with the same system text; a group's members share
    their first prompt and sometimes their first response tokens or whole responses; some
    sequences are multi-turn (several segments), one is a prefix of another."""
    system = [rng.randrange(VOCAB) for _ in range(6)]
    sequences = []
    for g in range(groups):
        prompt = system + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 7))]
        common = [rng.randrange(VOCAB) for _ in range(3)]
        for m in range(members):
            tokens, segments = list(prompt), []
            for turn in range(rng.randint(1, 3)):
                if m % 2 and turn == 0:
                    response = list(common)  # the same response as another member
                else:
                    response = common[:1] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 4))]
                segments.append(
                    Segment(
                        start=len(tokens),
                        length=len(response),
                        advantage=rng.gauss(0, 1),
                        rollout_logp=[-rng.random() for _ in response],
                        key=(g, m, turn),
                    )
                )
                tokens += response + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
            sequences.append(Sequence(tokens=tokens, segments=segments))
    first = sequences[0]
    cut = first.segments[0].start + first.segments[0].length
    sequences.append(Sequence(tokens=first.tokens[:cut], segments=[first.segments[0]]))
    return sequences


def test_tree_microbatch_keeps_the_flat_per_token_values_and_shrinks():
    sequences = _group_sequences(random.Random(0))
    flat, tree = (build_microbatch(sequences, share_prefix=s) for s in (False, True))
    for name in ("targets", "segment_ids", "advantages", "rollout_logp", "segment_lengths"):
        assert torch.equal(getattr(flat, name), getattr(tree, name)), name
    assert flat.segment_keys == tree.segment_keys
    assert tree.num_tokens == unique_tokens([s.tokens for s in sequences]) < flat.num_tokens
    # Each trainable row predicts its target from the same token and position in both layouts.
    for mb in (flat, tree):
        assert mb.trainable_idx.max() < mb.num_tokens
    assert torch.equal(
        flat.input_ids[flat.trainable_idx], tree.input_ids[tree.trainable_idx]
    ) and torch.equal(flat.position_ids[flat.trainable_idx], tree.position_ids[tree.trainable_idx])
    assert tree.kv_index is not None and flat.kv_index is None


def _model(seed: int):
    """A float64 tiny Qwen3 with grouped-query attention (4 query heads, 2 key/value heads),
    cod-fast's packed attention and lean modules, as the trainer runs it (transformers' own
    RMSNorm rounds to float32, which a gradient summed over a shared row then shows)."""
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).double()
    model.set_attn_implementation(KERNELS["sdpa"])
    make_lean(model)
    return model


def _tree_rows(sequences) -> torch.Tensor:
    """Rows of a tree micro-batch holding each position of each sequence, sequence by sequence."""
    tree = build_tree([s.tokens for s in sequences])
    offsets = tree.offsets()
    return torch.tensor(
        [offsets[n] + d for path in tree.paths for n in path for d in range(tree.nodes[n].length)]
    )


def _per_sequence_hidden(model, sequences, share):
    """Hidden states of every position of every sequence, through the given layout."""
    hidden = packed_hidden_states(model, build_microbatch(sequences, share_prefix=share))
    if share:
        hidden = hidden[_tree_rows(sequences)]
    return list(hidden.split([len(s) for s in sequences]))


@pytest.mark.parametrize("attn", [KERNELS["sdpa"], "sdpa"], ids=["cod_per_seq", "explicit-mask"])
def test_tree_hidden_states_equal_the_flat_layouts(attn):
    model = _model(seed=1)
    model.set_attn_implementation(attn)
    sequences = _group_sequences(random.Random(1))
    with torch.no_grad():
        flat = _per_sequence_hidden(model, sequences, share=False)
        tree = _per_sequence_hidden(model, sequences, share=True)
    for i, (a, b) in enumerate(zip(flat, tree, strict=True)):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12, msg=lambda m, i=i: f"seq {i}: {m}")


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(policy="rec_one_side", eps_high=0.28),
        LossConfig(policy="ppo", ratio_level="sequence", agg="seq-mean-token-mean"),
    ],
    ids=["rec-token", "ppo-sequence"],
)
@pytest.mark.parametrize("seed", [2, 3])
@pytest.mark.parametrize("dedupe", [0.0, 1.0], ids=["per-token", "scored-once"])
def test_tree_loss_and_gradients_equal_the_flat_layouts(cfg, seed, dedupe, monkeypatch):
    """The policy loss, its log-probs (from the loss and from `logprobs` mode) and every
    parameter gradient: identical up to float64 rounding whether the micro-batch shares
    prefixes or not, with the tree's repeated (row, target) pairs scored per token or once."""
    monkeypatch.setattr(linear_loss, "DEDUPE_SHARE", dedupe)
    sequences = _group_sequences(random.Random(seed))
    results = []
    for share in (False, True):
        policy = Policy(_model(seed), impl="torch")
        mb = build_microbatch(sequences, share_prefix=share)
        out = policy(mb, loss_config=cfg)
        out.loss.backward()
        grads = {n: p.grad for n, p in policy.named_parameters()}
        with torch.no_grad():
            logp = policy(mb, loss_config=cfg, mode="logprobs")
        torch.testing.assert_close(logp, out.logp, atol=1e-12, rtol=1e-10)
        results.append((out.loss.detach(), out.logp, grads))
    repeats = mb.trainable_idx.numel() - torch.unique(mb.trainable_idx).numel()
    assert repeats > 0  # the tree scores some rows for several tokens
    (l0, p0, g0), (l1, p1, g1) = results
    torch.testing.assert_close(l1, l0, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(p1, p0, atol=1e-12, rtol=1e-10)
    assert l0.abs() > 0
    for name in g0:
        torch.testing.assert_close(
            g1[name], g0[name], atol=1e-12, rtol=1e-9, msg=lambda m, n=name: f"{n}: {m}"
        )


@settings(max_examples=100, deadline=None)
@given(
    lists=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=9), min_size=0, max_size=20),
    budget=st.integers(9, 30),
    world=st.integers(1, 3),
)
def test_balance_shared_places_everything_within_the_tree_budget(lists, budget, world):
    sequences = [Sequence(tokens=t, segments=[]) for t in lists]
    plan = balance_shared(sequences, budget, world)
    assert len({len(rank) for rank in plan}) == 1 and len(plan) == world
    placed = sorted(i for rank in plan for mb in rank for i in mb)
    assert placed == list(range(len(lists)))
    for rank in plan:
        for mb in rank:
            assert unique_tokens([lists[i] for i in mb]) <= budget
            assert build_microbatch([sequences[i] for i in mb], True).num_tokens <= budget


def test_balance_shared_keeps_a_group_together_and_refuses_an_over_budget_sequence():
    sequences = _group_sequences(random.Random(4), groups=2, members=4)
    budget = max(len(s) for s in sequences) + 2
    (plan,) = balance_shared(sequences, budget)
    shared = sum(build_microbatch([sequences[i] for i in mb], True).num_tokens for mb in plan)
    flat = sum(len(s) for s in sequences)
    assert shared < flat and len(plan) < len(balance([len(s) for s in sequences], budget)[0])
    with pytest.raises(SequenceTooLongError, match=r"train\.token_budget"):
        balance_shared(sequences, max(len(s) for s in sequences) - 1)
