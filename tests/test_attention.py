"""Packed attention (cod_fast.attention): per-sequence kernels against a float64 block-mask
reference, kernel choice per device, and the fallback without cu_seqlens."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from cod_fast.attention import KERNELS, _packed_forward, packed_attention_kwargs, resolve_attn_impl
from cod_fast.config import ModelConfig
from cod_fast.model import block_causal_mask, load_policy, packed_hidden_states
from cod_fast.packing import Sequence, build_microbatch

CUDA = torch.cuda.is_available()


class _Module(torch.nn.Module):
    """What transformers passes as `module`: only `.training` is read."""


def reference(q, k, v, cu_seqlens, scaling):
    """float64 attention over the whole row with an explicit block-diagonal causal mask."""
    q, k, v = (x.double() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = block_causal_mask(cu_seqlens, torch.float64, q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)  # [1, T, H, D]


def packed_inputs(lengths, heads=4, kv_heads=2, dim=16, device="cpu", dtype=torch.float32):
    total = sum(lengths)
    q = torch.randn(1, heads, total, dim, device=device, dtype=dtype)
    k = torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype)
    v = torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu.to(device)


def worst(a, b):
    diff = (a.double() - b.double()).abs()
    return f"max |diff| {diff.max():.3g} at {divmod(int(diff.argmax()), diff.shape[-1])}"


@pytest.mark.parametrize(
    "kernel,device,dtype,slack",
    [
        ("sdpa", "cpu", torch.float32, 1e-6),
        pytest.param(
            "varlen_attn",
            "cuda",
            torch.bfloat16,
            2e-2,
            marks=pytest.mark.gpu,
        ),
    ],
)
def test_packed_kernels_match_a_float64_block_mask(kernel, device, dtype, slack):
    """Odd lengths (a 1-token sequence among them), GQA: each kernel is within the error budget
    of the fp32/bf16 eager block-mask attention's own error against float64, plus slack."""
    torch.manual_seed(0)
    lengths = [7, 1, 33, 12, 5]
    q, k, v, cu = packed_inputs(lengths, device=device, dtype=dtype)
    scaling = q.shape[-1] ** -0.5
    kwargs = {**packed_attention_kwargs(cu, max(lengths)), "scaling": scaling}
    out, weights = _packed_forward(kernel, _Module(), q, k, v, **kwargs)
    assert weights is None and out.shape == (1, sum(lengths), 4, 16)
    want = reference(q, k, v, cu, scaling)
    groups = q.shape[1] // k.shape[1]
    mask = block_causal_mask(cu, dtype, q.device)
    eager = F.scaled_dot_product_attention(
        q,
        k.repeat_interleave(groups, 1),
        v.repeat_interleave(groups, 1),
        attn_mask=mask,
        scale=scaling,
    ).transpose(1, 2)
    budget = (eager.double() - want).abs().max().item() + slack
    assert (out.double() - want).abs().max().item() <= budget, worst(out, want)


def test_without_cu_seqlens_the_kernels_defer_to_sdpa():
    """No cu_seq_lens (generation with a padding mask): the output is transformers' SDPA with
    the given mask, unchanged."""
    torch.manual_seed(1)
    q, k, v, _ = packed_inputs([9], kv_heads=4)
    mask = torch.ones(1, 1, 9, 9, dtype=torch.bool).tril()
    out, _ = _packed_forward("sdpa", _Module(), q, k, v, mask, scaling=0.25)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out, want)


def test_packed_model_forward_equals_the_block_mask_model_and_gradients_agree():
    """The tiny Qwen3 with cod_sdpa over a packed row equals the same model with the explicit
    block-diagonal mask, in hidden states and in parameter gradients."""
    model, _ = load_policy(
        ModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64), "cpu", seed=3
    )
    rng = random.Random(0)
    mb = build_microbatch(
        [Sequence(tokens=[rng.randrange(90) for _ in range(n)], segments=[]) for n in (5, 1, 17, 9)]
    )
    results = []
    for impl in (KERNELS["sdpa"], "sdpa"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        hidden = packed_hidden_states(model, mb)
        (hidden.square().sum()).backward()
        results.append((hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (h1, g1), (h2, g2) = results
    torch.testing.assert_close(h1, h2, atol=1e-5, rtol=1e-5)
    for name in g1:
        torch.testing.assert_close(
            g1[name], g2[name], atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_kernel_choice_per_device():
    """auto: per-sequence SDPA on the CPU; CUDA-only kernels on the CPU are refused naming the
    field and the way out."""
    assert resolve_attn_impl("auto", torch.device("cpu")) == "sdpa"
    assert resolve_attn_impl("sdpa", torch.device("cpu")) == "sdpa"
    for choice in ("flash_attn", "varlen_attn"):
        with pytest.raises(ValueError, match=r"model\.attn_impl"):
            resolve_attn_impl(choice, torch.device("cpu"))


def _tree_microbatch(seed: int):
    """Sequences that share prefixes (a common start, equal and diverging continuations, one a
    prefix of another), laid out as their prefix tree."""
    rng = random.Random(seed)
    start = [rng.randrange(9) for _ in range(5)]
    seqs = [start + [rng.randrange(9) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    seqs += [seqs[0] + [1, 2, 3], list(seqs[1]), start[:3]]
    return build_microbatch([Sequence(tokens=t, segments=[]) for t in seqs], share_prefix=True)


@pytest.mark.parametrize(
    "kernel,device,dtype,slack",
    [
        ("sdpa", "cpu", torch.float32, 1e-6),
        pytest.param("varlen_attn", "cuda", torch.bfloat16, 2e-2, marks=pytest.mark.gpu),
        pytest.param("flash_attn", "cuda", torch.bfloat16, 2e-2, marks=pytest.mark.gpu),
    ],
)
def test_tree_blocks_match_a_float64_tree_mask(kernel, device, dtype, slack):
    """The shared-prefix layout: each tree node's queries attend to its ancestors' keys and,
    causally aligned at the end, its own (GQA); within the fp32/bf16 eager masked attention's
    own error against float64, plus slack."""
    if kernel == "flash_attn":
        pytest.importorskip("flash_attn")
    torch.manual_seed(2)
    mb = _tree_microbatch(seed=2)
    assert mb.kv_index is not None
    total = mb.num_tokens
    q = torch.randn(1, 4, total, 16, device=device, dtype=dtype)
    k = torch.randn(1, 2, total, 16, device=device, dtype=dtype)
    v = torch.randn(1, 2, total, 16, device=device, dtype=dtype)
    scaling = 0.25
    attention = packed_attention_kwargs(
        mb.cu_seqlens.to(device), mb.max_seqlen, mb.kv_index, mb.cu_seqlens_k, mb.max_seqlen_k
    )
    out, _ = _packed_forward(kernel, _Module(), q, k, v, **attention, scaling=scaling)
    tree = (mb.kv_index, mb.cu_seqlens_k, mb.position_ids)

    def masked(dt):
        mask = block_causal_mask(mb.cu_seqlens, dt, device, tree)
        kk, vv = (x.to(dt).repeat_interleave(2, 1) for x in (k, v))
        return F.scaled_dot_product_attention(q.to(dt), kk, vv, attn_mask=mask, scale=scaling)

    want = masked(torch.float64).transpose(1, 2)
    budget = (masked(dtype).transpose(1, 2).double() - want).abs().max().item() + slack
    assert (out.double() - want).abs().max().item() <= budget, worst(out, want)
