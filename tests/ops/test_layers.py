"""Layer kernels (cod_fast.ops.layers): the C++ and torch RMSNorm, SwiGLU and decode attention
against float64 references, on odd shapes and fresh random inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cod_fast.ops import layers
from cod_fast.ops.cpp_rows import HAS_CPP
from cod_fast.ops.layers import (
    RMSNormFunction,
    SwiGLUDownFunction,
    decode_attention,
    keys_transposed,
    layer_impl,
    rms_norm,
    swiglu_down,
)

IMPLS = ["torch"] + (["cpp"] if HAS_CPP else [])
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason="cod_fast._cpp not built")
EPS32 = torch.finfo(torch.float32).eps


def report(name, got, want):
    """Max abs error and where, for a failing assertion's message."""
    diff = (got.double() - want).abs()
    idx = np.unravel_index(int(diff.argmax()), tuple(diff.shape)) if diff.numel() else ()
    return f"{name}: max error {diff.max().item() if diff.numel() else 0:.3e} at {idx}"


def within_budget(name, got, torch32, exact, slack=4.0, scale=0.0):
    """`got` (float32) is no further from the float64 `exact` than eager torch's float32
    `torch32`, times 2, plus `slack` ulps of the larger of the result's scale and `scale` (the
    size of the terms that cancel in it)."""
    assert got.shape == exact.shape, name
    if exact.numel() == 0:
        return
    scale = max(scale, exact.abs().max().item())
    budget = 2 * (torch32.double() - exact).abs().max().item() + slack * EPS32 * max(scale, 1e-30)
    err = (got.double() - exact).abs().max().item()
    assert err <= budget, f"{report(name, got, exact)} > budget {budget:.3e}"


def exact_rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


RMS_SHAPES = [(1, 1), (7, 123), (3, 5, 96), (2, 9, 3, 13), (300, 513), (0, 8)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", RMS_SHAPES)
def test_rms_norm_forward_and_gradients_match_float64(impl, shape):
    """y, dx and dw of the RMSNorm in float32 are within eager float32's distance of float64."""
    g = torch.Generator().manual_seed(hash(shape) % 2**31)
    x64 = 3 * torch.randn(*shape, generator=g, dtype=torch.float64)
    w64 = 1 + 0.5 * torch.randn(shape[-1], generator=g, dtype=torch.float64)
    up64 = torch.randn(*shape, generator=g, dtype=torch.float64)
    eps = 1e-6

    def run(fn, dtype):
        x = x64.to(dtype, copy=True).requires_grad_()
        w = w64.to(dtype, copy=True).requires_grad_()
        y = fn(x, w)
        (y * up64.to(dtype)).sum().backward()
        return y.detach(), x.grad, w.grad

    exact = run(lambda x, w: exact_rms(x, w, eps), torch.float64)
    eager = run(lambda x, w: exact_rms(x, w, eps), torch.float32)
    got = run(lambda x, w: rms_norm(x, w, eps, impl=impl), torch.float32)
    # dx = rstd (g w - xhat mean(g w xhat)) cancels to ~0 when H = 1: its terms set the scale
    terms = (up64 * w64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).abs()
    scales = (0.0, terms.max().item() if terms.numel() else 0.0, 0.0)
    for name, a, b, c, s in zip(("y", "dx", "dw"), got, eager, exact, scales, strict=True):
        within_budget(name, a, b, c, scale=s)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(1, 1, 1), (5, 7, 37), (2, 50, 256), (0, 3, 4)])
def test_swiglu_down_forward_and_gradients_match_float64(impl, shape):
    """down(SiLU(g) u) and its three gradients in float32 are within eager float32's distance
    of float64, with gates far in both tails (sigmoid saturates)."""
    g = torch.Generator().manual_seed(sum(shape) + 11)
    gate64 = 4 * torch.randn(*shape, generator=g, dtype=torch.float64)
    gate64.view(-1)[::7] *= 30  # |g| up to ~400: exp(-|g|) underflows
    up64 = torch.randn(*shape, generator=g, dtype=torch.float64)
    w64 = torch.randn(9, shape[-1], generator=g, dtype=torch.float64) / math.sqrt(shape[-1])
    upstream = torch.randn(*shape[:-1], 9, generator=g, dtype=torch.float64)

    def run(fn, dtype):
        ins = [t.to(dtype, copy=True).requires_grad_() for t in (gate64, up64, w64)]
        y = fn(*ins)
        (y * upstream.to(dtype)).sum().backward()
        return (y.detach(), *(t.grad for t in ins))

    def plain(a, b, w):
        return F.linear(F.silu(a) * b, w)

    exact = run(plain, torch.float64)
    eager = run(plain, torch.float32)
    got = run(lambda a, b, w: swiglu_down(a, b, w, impl=impl), torch.float32)
    for name, a, b, c in zip(("y", "dgate", "dup", "dw"), got, eager, exact, strict=True):
        within_budget(name, a, b, c)


def test_torch_functions_pass_gradcheck_in_float64():
    """The hand-written backward passes of the torch path are the derivatives of their forwards."""
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(3, 5, 7, generator=g, dtype=torch.float64) for _ in range(2))
    down = torch.randn(6, 7, generator=g, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (gate, up, down)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: SwiGLUDownFunction.apply(a, b, c, "torch"), inputs
    )
    x = (3 * torch.randn(4, 2, 9, generator=g, dtype=torch.float64)).requires_grad_()
    w = torch.randn(9, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFunction.apply(a, b, 1e-6, "torch"), [x, w])


def exact_decode(q, k, v, norms, cos, sin, keys, values, mask, col, scale):
    """float64 reference of a decode step: per-head norms, rotary, the new column, then
    softmax(scale q K^T) V over columns 0..col where `mask` is true (grouped heads; a row with
    no key gives zeros). Returns (out, rotated k)."""
    q, k, v, cos, sin = (t.double() for t in (q, k, v, cos, sin))
    if norms is not None:
        q = exact_rms(q, norms[0].double(), norms[2])
        k = exact_rms(k, norms[1].double(), norms[2])
    half = q.shape[-1] // 2

    def rope(x):
        return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]

    q, k = rope(q), rope(k)
    keys, values = keys[:, :, : col + 1].double().clone(), values[:, :, : col + 1].double().clone()
    keys[:, :, col], values[:, :, col] = k, v
    group = q.shape[1] // keys.shape[1]
    keys, values = (t.repeat_interleave(group, dim=1) for t in (keys, values))
    s = scale * (q[:, :, None] @ keys.transpose(-1, -2))[:, :, 0]  # [B, Hq, col + 1]
    s = s.masked_fill(~mask[:, None, : col + 1], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p[:, :, None] @ values)[:, :, 0], k


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("normed", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize(
    "rows, heads, kv_heads, width, col, d",
    [(1, 1, 1, 1, 0, 2), (5, 6, 2, 40, 32, 14), (32, 3, 3, 80, 56, 32), (3, 4, 1, 9, 8, 64)],
)
def test_decode_attention_matches_float64(impl, normed, rows, heads, kv_heads, width, col, d):
    """A decode step after the projections (per-head norms, rotary, the new cache column, one
    query per row and head under a key mask with a fully masked row, grouped heads) is within
    twice the torch float32 path's distance of float64; it writes column `col` of the cache
    and nothing past it."""
    g = torch.Generator().manual_seed(rows * 100 + col + normed)
    q = 2 * torch.randn(rows, heads, d, generator=g)
    k, v = (torch.randn(rows, kv_heads, d, generator=g) for _ in range(2))
    theta = torch.rand(rows, d // 2, generator=g) * 50
    cos, sin = torch.cat((theta, theta), -1).cos(), torch.cat((theta, theta), -1).sin()
    norms = (1 + 0.3 * torch.randn(d, generator=g), 1 + 0.3 * torch.randn(d, generator=g), 1e-6)
    norms = norms if normed else None
    keys = torch.randn(rows, kv_heads, width, d, generator=g)
    values = torch.randn(rows, kv_heads, width, d, generator=g)
    keys[:, :, col + 1 :] = float("nan")  # columns past col must be neither read nor written
    values[:, :, col + 1 :] = float("nan")
    mask = torch.rand(rows, width + 3, generator=g) > 0.3
    mask[:, col] = True
    if rows > 2:
        mask[1] = False  # no key at all
    scale = 1 / math.sqrt(d)
    exact, exact_k = exact_decode(q, k, v, norms, cos, sin, keys, values, mask, col, scale)

    def run(impl):
        """(out, the cache's keys seen as [B, Hkv, W, d], its values) in impl's key layout."""
        transposed = keys_transposed(impl, q)
        cache = keys.transpose(-1, -2).contiguous() if transposed else keys.clone()
        vals = values.clone()
        out = decode_attention(q, k, v, norms, cos, sin, cache, vals, mask, col, scale, impl)
        return out, cache.transpose(-1, -2) if transposed else cache, vals

    eager, _, _ = run("torch")
    got, cached, vals = run(impl)
    assert got.shape == q.shape
    within_budget("out", got, eager, exact, slack=16)
    torch.testing.assert_close(cached[:, :, col].double(), exact_k, rtol=0, atol=1e-5)
    assert torch.equal(vals[:, :, col], v)
    assert cached[:, :, col + 1 :].isnan().all() and vals[:, :, col + 1 :].isnan().all()


@needs_cpp
def test_cpp_kernels_overwrite_every_output():
    """Outputs poisoned with NaN before the call hold finite values after it."""
    from cod_fast import _cpp

    g = np.random.default_rng(3)
    x = g.standard_normal((6, 11), dtype=np.float32)
    w = g.standard_normal(11, dtype=np.float32)
    y, rstd = np.full_like(x, np.nan), np.full(6, np.nan, dtype=np.float32)
    _cpp.rms_norm_forward(x, w, 1e-6, y, rstd)
    dx, dw = np.full_like(x, np.nan), np.full_like(w, np.nan)
    _cpp.rms_norm_backward(x, x, w, rstd, dx, dw)
    gp, du, prod = x.copy(), np.full_like(x, np.nan), np.full_like(x, np.nan)
    _cpp.swiglu_forward(x, x, y)
    _cpp.swiglu_backward_(gp, x, x, du, prod)
    q = g.standard_normal((2, 2, 4), dtype=np.float32)
    kv = g.standard_normal((2, 1, 4), dtype=np.float32)
    cos_sin = g.standard_normal((2, 4), dtype=np.float32)
    keys_t = g.standard_normal((2, 1, 4, 5), dtype=np.float32)
    values = g.standard_normal((2, 1, 5, 4), dtype=np.float32)
    out = np.full_like(q, np.nan)
    mask = np.ones((2, 5), dtype=bool)
    _cpp.decode_attention_(q, kv, kv, None, None, 1e-6, cos_sin, cos_sin, keys_t, values, mask,
                           2, 0.5, out)  # fmt: skip
    for name, a in dict(y=y, rstd=rstd, dx=dx, dw=dw, gp=gp, du=du, prod=prod, out=out).items():
        assert np.isfinite(a).all(), name


@needs_cpp
def test_cpp_kernels_propagate_nan():
    """A NaN input reaches its own outputs (no clamp or select swallows it)."""
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    y = rms_norm(x, torch.ones(8), 1e-6, impl="cpp")
    assert y[1].isnan().all() and not y[[0, 2]].isnan().any()
    out = swiglu_down(x, torch.ones(3, 8), torch.eye(8), impl="cpp")
    assert out[1, 2].isnan() and not out[0].isnan().any()


@needs_cpp
def test_bad_arguments_are_named():
    """A float64 input to impl='cpp' and a column count past the cache are refused by name."""
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        rms_norm(
            torch.ones(2, 3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), 1e-6, "cpp"
        )
    q, kv, cs = torch.ones(1, 2, 4), torch.ones(1, 1, 4), torch.ones(1, 4)
    keys_t, values = torch.ones(1, 1, 4, 3), torch.ones(1, 1, 3, 4)
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="col = 3 must be in"):
        decode_attention(q, kv, kv, None, cs, cs, keys_t, values, mask, 3, 1.0, impl="cpp")
    with pytest.raises(ValueError, match="multiple of key-value heads"):
        decode_attention(q, torch.ones(1, 3, 4), torch.ones(1, 3, 4), None, cs, cs,
                         keys_t.expand(1, 3, 4, 3).contiguous(),
                         values.expand(1, 3, 3, 4).contiguous(), mask, 2, 1.0, impl="cpp")  # fmt: skip
    with pytest.raises(ValueError, match="must be even"):
        odd = torch.ones(1, 2, 3)
        decode_attention(odd, odd[:, :1], odd[:, :1], None, torch.ones(1, 3), torch.ones(1, 3),
                         torch.ones(1, 1, 3, 3), torch.ones(1, 1, 3, 3), mask, 0, 1.0, "cpp")  # fmt: skip
    with pytest.raises(ValueError, match="unknown layer kernel"):
        layer_impl("triton", torch.ones(1))


def test_default_impl_follows_device_dtype_and_env(monkeypatch):
    """cpp for float32 CPU tensors when built; torch for other dtypes and under
    COD_FAST_IMPL=torch."""
    monkeypatch.delenv("COD_FAST_IMPL", raising=False)
    assert layer_impl(None, torch.ones(1)) == ("cpp" if HAS_CPP else "torch")
    assert layer_impl(None, torch.ones(1, dtype=torch.bfloat16)) == "torch"
    assert layer_impl(None, torch.ones(1, dtype=torch.float64)) == "torch"
    monkeypatch.setenv("COD_FAST_IMPL", "torch")
    assert layer_impl(None, torch.ones(1)) == "torch"
    assert layers.LAYER_IMPLS == ("cpp", "torch")


@needs_cpp
def test_parameters_stay_resizable():
    """FSDP2 frees a gathered parameter by resizing its storage to 0; sharing a storage with
    numpy makes it non-resizable, so the kernels must never take a parameter's own storage."""
    w = torch.nn.Parameter(torch.ones(8))
    x = torch.randn(3, 8, requires_grad=True)
    rms_norm(x, w, 1e-6, impl="cpp").sum().backward()
    w.data.untyped_storage().resize_(0)
