"""The policy model: the built-in tiny Qwen3, from_pretrained round trip, packed hidden states."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from cod_fast import LossConfig
from cod_fast.config import ModelConfig
from cod_fast.data.packing import Sequence, build_microbatch, rollout_sequences
from cod_fast.model.loading import (
    lm_head_weight,
    load_policy,
    packed_hidden_states,
    parameter_count,
)
from cod_fast.model.policy import Policy
from cod_fast.ops import linear_policy_loss
from tests.data.test_layout_invariance import random_episode


@pytest.fixture(scope="module")
def tiny():
    return load_policy(
        ModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64), "cpu", seed=1
    )


def test_builtin_model_round_trips_through_from_pretrained(tiny, tmp_path):
    """save_pretrained -> from_pretrained (the path real users take) gives the same logits."""
    model, tokenizer = tiny
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([tokenizer.encode("pos 1 2\nDirection 3")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert lm_head_weight(model).shape == (len(tokenizer), 32)


def test_packed_hidden_states_equal_separate_forwards(tiny):
    """Each packed sequence's hidden states equal a forward pass over that sequence alone."""
    model, _ = tiny
    rng = random.Random(0)
    seqs = [[rng.randrange(90) for _ in range(n)] for n in (7, 1, 12)]
    dummy = [Sequence(tokens=s, segments=[]) for s in seqs]
    packed = packed_hidden_states(model, build_microbatch(dummy))
    start = 0
    with torch.no_grad():
        for s in seqs:
            alone = model.get_decoder()(input_ids=torch.tensor([s])).last_hidden_state[0]
            torch.testing.assert_close(
                packed[start : start + len(s)].detach(), alone, atol=1e-5, rtol=1e-5
            )
            start += len(s)


def test_merged_and_per_turn_layouts_agree_on_qwen3(tiny):
    """docs/concepts.md section 5's invariant on the real model: prefix-merged and
    one-sequence-per-turn layouts give the same loss and the same parameter gradients."""
    model, _ = tiny
    rng = random.Random(3)
    episodes = [random_episode(rng, p, "solve", k) for p in range(2) for k in range(2)]
    cfg = LossConfig(policy="rec_one_side", agg="seq-mean-token-mean")
    results = []
    for merge in (True, False):
        mb = build_microbatch(rollout_sequences(episodes, merge_prefix=merge))
        model.zero_grad()
        hidden = packed_hidden_states(model, mb)
        out = linear_policy_loss(
            hidden[mb.trainable_idx],
            lm_head_weight(model),
            mb.targets,
            mb.advantages,
            mb.segment_ids,
            rollout_logp=mb.rollout_logp,
            loss_config=cfg,
        )
        out.loss.backward()
        results.append(
            (
                out.loss.detach(),
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            )
        )
    (loss_m, grads_m), (loss_s, grads_s) = results
    torch.testing.assert_close(loss_m, loss_s, atol=1e-6, rtol=1e-5)
    assert grads_m.keys() == grads_s.keys() and grads_m
    for name in grads_m:
        torch.testing.assert_close(
            grads_m[name],
            grads_s[name],
            atol=1e-6,
            rtol=1e-4,
            msg=lambda m, n=name: f"gradient of {n}: {m}",
        )


def test_segment_free_sequences_are_allowed():
    """A micro-batch of prompt-only sequences (no segments) packs and runs (nothing to train)."""
    mb = build_microbatch([Sequence(tokens=[1, 2, 3], segments=[])])
    assert mb.num_trainable == 0 and mb.num_tokens == 3


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    """ModelConfig.gradient_checkpointing recomputes each layer in the backward pass of the
    packed, fused-loss step: same loss, same parameter gradients as keeping activations."""
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
    rng = random.Random(5)
    episodes = [random_episode(rng, p, "solve", k) for p in range(2) for k in range(2)]
    mb = build_microbatch(rollout_sequences(episodes, merge_prefix=True))
    loss_cfg = LossConfig(policy="rec_one_side")
    results = []
    for checkpointing in (False, True):
        cfg = replace(cfg, gradient_checkpointing=checkpointing)
        model, _ = load_policy(cfg, "cpu", seed=2)
        model.train()  # transformers recomputes only in training mode
        out = Policy(model)(mb, loss_config=loss_cfg)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((model.model.gradient_checkpointing, out.loss.detach(), grads))
    (off, loss_plain, grads_plain), (on, loss_ckpt, grads_ckpt) = results
    assert (off, on) == (False, True)
    torch.testing.assert_close(loss_ckpt, loss_plain, atol=0, rtol=0)
    assert grads_plain.keys() == grads_ckpt.keys() and len(grads_plain) > 10
    for name in grads_plain:
        torch.testing.assert_close(grads_ckpt[name], grads_plain[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("cls", "config"),
    [
        (  # the sizes of Qwen/Qwen3-1.7B's config.json: tied embeddings, grouped KV heads
            Qwen3ForCausalLM,
            Qwen3Config(
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=6144,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                tie_word_embeddings=True,
            ),
        ),
        (  # the sizes of meta-llama/Meta-Llama-3-8B's config.json: an untied LM head
            LlamaForCausalLM,
            LlamaConfig(
                vocab_size=128256,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                tie_word_embeddings=False,
            ),
        ),
    ],
    ids=["qwen3-1.7b", "llama-3-8b"],
)
def test_parameter_count_estimates_real_models_within_a_tenth_of_a_percent(cls, config):
    """The estimate a model folder is refused by (embedding + attention and gated-MLP matrices
    per layer) is within 0.1% of the parameters transformers' own class creates for the same
    config (built on the meta device: no memory), here 1.72B and 8.03B."""
    with torch.device("meta"):
        model = cls(config)
    real = sum(p.numel() for p in model.parameters())
    assert parameter_count(config) == pytest.approx(real, rel=1e-3)
    assert parameter_count(config) <= real  # norms and biases left out: never above
