"""Packed attention (cod_fast.model.attention): per-sequence kernels against a float64 block-mask
reference, kernel choice per device, and the fallback without cu_seqlens."""

from __future__ import annotations

import importlib.util
import random
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from cod_fast.config import ConfigError, ModelConfig
from cod_fast.data.packing import Sequence, build_microbatch
from cod_fast.model.attention import (
    HALF_DTYPES,
    KERNELS,
    _packed_forward,
    packed_attention_kwargs,
    resolve_attn_impl,
)
from cod_fast.model.loading import block_causal_mask, load_policy, packed_hidden_states

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
    """The tiny Qwen3 with cod_per_seq over a packed row equals the same model with the explicit
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


def test_kernel_choice_per_device_and_dtype():
    """auto: per-sequence SDPA on the CPU and for float32 on CUDA (the varlen kernels take 16-bit
    inputs only), a CUDA varlen kernel for bfloat16 and float16 there; a CUDA-only kernel on the
    CPU or with a float32 model is refused on model.attn_impl, naming the way out."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    fastest = "flash_attn" if importlib.util.find_spec("flash_attn") else "varlen_attn"
    assert resolve_attn_impl("auto", cpu, torch.float32) == "sdpa"
    assert resolve_attn_impl("sdpa", cpu, torch.float32) == "sdpa"
    assert resolve_attn_impl("auto", cuda, torch.float32) == "sdpa"
    assert resolve_attn_impl("sdpa", cuda, torch.float32) == "sdpa"
    for half in (torch.bfloat16, torch.float16):
        assert resolve_attn_impl("auto", cuda, half) == fastest
        assert resolve_attn_impl("varlen_attn", cuda, half) == "varlen_attn"
    for choice in ("flash_attn", "varlen_attn"):
        with pytest.raises(ConfigError, match=r"^model\.attn_impl: .*'sdpa' or 'auto' on the CPU"):
            resolve_attn_impl(choice, cpu, torch.float32)
        fix = r"^model\.attn_impl: .*float32 .*model\.dtype=bfloat16 .*model\.attn_impl=sdpa"
        with pytest.raises(ConfigError, match=fix):
            resolve_attn_impl(choice, cuda, torch.float32)


def test_varlen_kernels_take_16_bit_inputs_only():
    """HALF_DTYPES is what the CUDA varlen kernels accept, a recorded fact: mha_varlen_fwd in
    flash-attn's csrc/flash_attn/flash_api.cpp and in torch's
    aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp (which
    torch.nn.attention.varlen.varlen_attn calls through aten._flash_attention_forward; torch
    2.13's varlen.py has no dtype check of its own) both TORCH_CHECK q_dtype == kFloat16 ||
    q_dtype == kBFloat16, "FlashAttention only support fp16 and bf16 data type"."""
    assert set(HALF_DTYPES) == {torch.float16, torch.bfloat16}
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(ConfigError, match="float16 and bfloat16 only"):
            resolve_attn_impl("varlen_attn", torch.device("cuda"), dtype)


def _tiny_qwen3():
    """A Qwen3 built from a config (no weights downloaded), as transformers checks names on it."""
    config = Qwen3Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    return Qwen3ForCausalLM(config)


def test_every_registered_kernel_is_accepted_by_transformers():
    """The installed transformers installs each registered name as it is: no name is taken for
    a flash-attention request (which tries the hub's kernels and raises "Could not find the
    currently requested flash attention implementation"), a hub kernel, or a built-in backend."""
    model = _tiny_qwen3()
    for name in KERNELS.values():
        model.set_attn_implementation(name)
        assert model.config._attn_implementation == name


def _rules_of_transformers(name: str) -> set[str]:
    """The name rules of transformers that `name` falls under, as recorded from the sources of
    transformers 5.17.0 (the GPU machine's), 5.19.0 (installed here) and 5.25.0 (the newest
    release), the same in all three:
    - utils/generic.py `is_flash_attention_requested`: `"flash" in name` (line 305, 305, 306);
    - integrations/hub_kernels.py `is_kernel`: the hub pattern `owner/name[@rev][:kernel]`
      (line 644, 807, 343), and its loader splits at "|" (line 679 in 5.17, 375 in 5.25);
    - the `paged|` prefix: utils/generic.py `split_attention_implementation` (5.17, line 342),
      modeling_utils.py `_check_and_adjust_attn_implementation` (5.19 line 1740, 5.25 line 1736);
    - modeling_utils.py `get_correct_attn_implementation`: `"flex_attention" in name` and
      `"sdpa" in name` run those backends' checks (lines 1869/1871, 1874/1876, 1880/1882);
    - the built-in names themselves (modeling_utils.py `AttentionInterface._global_mapping`,
      and "eager")."""
    builtin = {"eager", "sdpa", "flex_attention", "paged|eager"}
    builtin |= {f"flash_attention_{v}" for v in (2, 3, 4)}
    hub = r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$"
    rules = {
        "built-in": name in builtin,
        "flash": "flash" in name,
        "hub kernel": re.search(hub, name) is not None,
        "paged prefix": "|" in name,
        "flex_attention": "flex_attention" in name,
        "sdpa": "sdpa" in name,
    }
    return {rule for rule, applies in rules.items() if applies}


def test_registered_names_escape_the_name_rules_of_transformers_5_17_to_5_25():
    """No registered name falls under a name rule of transformers 5.17 to 5.25 (recorded in
    `_rules_of_transformers`); the record agrees with the installed version's own predicates,
    and it does catch the names that transformers misread."""
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.utils.generic import is_flash_attention_requested

    for name in KERNELS.values():
        assert _rules_of_transformers(name) == set(), name
    for name in ("cod_flash_attn", "cod_sdpa", "kernels-community/flash-attn2", *KERNELS.values()):
        rules = _rules_of_transformers(name)
        flash = is_flash_attention_requested(requested_attention_implementation=name)
        assert ("flash" in rules) == flash, name
        assert ("hub kernel" in rules) == is_kernel(name), name
    assert _rules_of_transformers("cod_sdpa") == {"sdpa"}
    assert _rules_of_transformers("paged|cod_x") == {"paged prefix"}


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
