"""Memory-lean SwiGLU MLP and RMSNorm (cod_fast.model.lean) against transformers' own modules."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from cod_fast.model.lean import make_lean


def qwen3(dtype=torch.float64, **overrides):
    """A random 2-layer Qwen3 with odd sizes (GQA, head_dim not hidden/heads)."""
    sizes = dict(
        vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**(sizes | overrides))).to(dtype)
    for p in model.parameters():  # norm weights start at 1: move them so their gradient matters
        p.data.add_(0.1 * torch.randn_like(p))
    return model


def forward_backward(model, ids, seed):
    """(logits, {parameter name: gradient}) of a random linear function of the logits."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
    (logits * weights.to(logits.device, logits.dtype)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def exact_norms(model):
    """transformers' RMSNorm rounds float64 inputs to float32; the float64 reference needs every
    norm in float64 (plain autograd ops)."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    for module in model.modules():
        if type(module).__name__ == "Qwen3RMSNorm":
            module.eps = module.variance_epsilon
            module.forward = types.MethodType(forward, module)
    return model


def test_lean_qwen3_matches_a_float64_reference():
    """Every parameter's gradient equals the float64 autograd reference's."""
    reference = exact_norms(qwen3())
    lean = qwen3()
    assert make_lean(lean) == {"mlp": 2, "norm": 2 * 2 + 2 * 2 + 1}  # 2 + q/k per layer, final
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(2))
    ref_logits, ref_grads = forward_backward(reference, ids, seed=3)
    logits, grads = forward_backward(lean, ids, seed=3)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-12, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_forward_is_bitwise_the_plain_forward(dtype, monkeypatch):
    """With the torch layer kernels, the lean forward is transformers' arithmetic, op for op."""
    monkeypatch.setenv("COD_FAST_IMPL", "torch")
    plain = qwen3(dtype)
    lean = copy.deepcopy(plain)
    make_lean(lean)
    ids = torch.randint(0, 97, (1, 21), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(lean(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_float32_gradients_are_as_close_to_float64_as_the_plain_modules():
    ids = torch.randint(0, 97, (1, 31))
    _, exact = forward_backward(exact_norms(qwen3()), ids, seed=6)
    plain, lean = qwen3(torch.float32), qwen3(torch.float32)
    make_lean(lean)
    _, plain_grads = forward_backward(plain, ids, seed=6)
    _, lean_grads = forward_backward(lean, ids, seed=6)
    for name, g in exact.items():
        scale = g.abs().max().item()
        plain_err = (plain_grads[name].double() - g).abs().max().item() / scale
        lean_err = (lean_grads[name].double() - g).abs().max().item() / scale
        assert lean_err <= max(4 * plain_err, 1e-6), (name, lean_err, plain_err)


def saved_floats(model, ids) -> int:
    """Elements of the distinct tensors autograd saves in a forward pass (what the backward
    keeps alive, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes() // t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids).logits.sum()
    return sum(seen.values())


def test_lean_modules_save_fewer_activations_by_the_documented_amount():
    """Per token and layer, 2*I (SwiGLU) plus one copy of each normalised tensor (H twice, and the
    q and k head widths) fewer floats; one H more for the final norm."""
    plain = qwen3(torch.float32)
    lean = copy.deepcopy(plain)
    make_lean(lean)
    tokens = 50
    ids = torch.randint(0, 97, (1, tokens), generator=torch.Generator().manual_seed(7))
    c = plain.config
    per_layer = 2 * c.intermediate_size + 2 * c.hidden_size
    per_layer += (c.num_attention_heads + c.num_key_value_heads) * c.head_dim
    expected = tokens * (c.num_hidden_layers * per_layer + c.hidden_size)
    assert saved_floats(plain, ids) - saved_floats(lean, ids) == expected


def test_only_known_swiglu_modules_change():
    gelu = qwen3(hidden_act="gelu")
    assert make_lean(gelu)["mlp"] == 0
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)
    )  # fmt: skip
    assert make_lean(llama) == {"mlp": 1, "norm": 3}
    llama_bias = LlamaForCausalLM(
        LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, mlp_bias=True)
    )  # fmt: skip
    assert make_lean(llama_bias)["mlp"] == 0


@pytest.mark.parametrize("lean", [True, False])
def test_load_policy_makes_the_model_lean_unless_configured_off(lean):
    from cod_fast.config import ModelConfig
    from cod_fast.model.loading import load_policy

    cfg = ModelConfig(
        hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64, lean_activations=lean
    )
    model, _ = load_policy(cfg, "cpu")
    layer = model.model.layers[0]
    assert ("forward" in vars(layer.mlp)) == lean
    assert ("forward" in vars(layer.input_layernorm)) == lean


@pytest.mark.gpu
def test_lean_on_cuda_matches_the_float64_reference():
    base = qwen3()  # the float32 copy must hold the same weights (qwen3(float32) draws others)
    lean = copy.deepcopy(base).float().cuda()
    reference = exact_norms(base)
    make_lean(lean)
    ids = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(8))
    _, ref_grads = forward_backward(reference, ids, seed=9)
    _, grads = forward_backward(lean, ids.cuda(), seed=9)
    for name, grad in grads.items():
        torch.testing.assert_close(grad.cpu().double(), ref_grads[name], rtol=1e-3, atol=1e-4)
