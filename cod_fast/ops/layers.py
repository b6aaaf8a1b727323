"""A decoder layer's elementwise kernels: RMSNorm, the SwiGLU product, one-query attention.

Three kernel families, each with ``impl=`` (`cpp`, `torch`; `None`: the default below):

- `rms_norm(x, weight, eps)`: weight * (x / rms(x)) over the last dimension, as transformers
  computes it (float32 inside for 16-bit inputs, the weight applied in the input's dtype; float64
  stays float64). Its autograd function saves x and the [N] reciprocal RMS only.
- `swiglu_down(gate, up, down_weight)`: down(SiLU(gate) * up), saving gate and up only and
  recomputing SiLU(gate) * up in the backward pass.
- `decode_attention(q, k, v, norms, cos, sin, keys, values, mask, col, scale)`: a decode
  step's attention after the projections (the torch sampler's fast path): per-head norms and
  rotary of q and k, the new KV-cache column, one query per row and head against the cache
  (its keys stored transposed for the C++ kernel, see `keys_transposed`).

On a small model each is a chain of 4-12 torch ops, each one more pass over memory plus a
dispatch (`cod-fast bench e2e`, tiny model: the norms and the SwiGLU elementwise work were about
a third of a training step, SDPA's per-call cost about a sixth of a decode step). The C++
kernels (csrc/cpu/layers.cpp) do each in one pass. They take float32 CPU tensors; everything
else (16-bit, float64, CUDA) runs the torch code here, which is also the tests' reference.

Default: ``COD_FAST_IMPL`` when it names `torch` (or `triton`, which has no layer kernels: torch),
else `cpp` for float32 CPU inputs when the extension is built, else `torch`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from cod_fast.ops import cpp_rows
from cod_fast.ops.cpp_rows import np_copy, np_view
from cod_fast.ops.dispatch import ENV_VAR, _warn_cpp_missing

LAYER_IMPLS = ("cpp", "torch")


def layer_impl(impl: str | None, x: torch.Tensor) -> str:
    """`cpp` or `torch` for the layer kernels on `x` (see the module docstring)."""
    cpp_fits = x.device.type == "cpu" and x.dtype == torch.float32
    if impl is None:
        if os.environ.get(ENV_VAR) in ("torch", "triton") or not cpp_fits:
            return "torch"
        if not cpp_rows.HAS_CPP:
            _warn_cpp_missing()
            return "torch"
        return "cpp"
    if impl not in LAYER_IMPLS:
        raise ValueError(
            f"unknown layer kernel implementation {impl!r}; choose one of {LAYER_IMPLS}"
        )
    if impl == "cpp" and not cpp_fits:
        raise ValueError(
            f"impl='cpp' layer kernels take float32 CPU tensors, got {x.dtype} on {x.device}; "
            "use impl='torch' (or None for the default)"
        )
    if impl == "cpp":
        cpp_rows._module()  # raises with the build error when the extension is missing
    return impl


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs and float32 (as transformers computes), float64 for float64
    (where transformers' module would round to float32)."""
    return torch.promote_types(dtype, torch.float32)


# --- RMSNorm -----------------------------------------------------------------------------------


def _rms_forward(x2, weight, eps: float, impl: str):
    """(y, rstd [N]) of rows x2 [N, H]."""
    if impl == "cpp":
        y, rstd = torch.empty_like(x2), x2.new_empty(x2.shape[0])
        cpp_rows._module().rms_norm_forward(
            np_view(x2),
            np_copy(weight),
            eps,
            np_view(y),
            np_view(rstd),
            num_threads=torch.get_num_threads(),
        )
        return y, rstd
    wide = x2.to(_wide(x2.dtype))
    rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (wide * rstd).to(x2.dtype), rstd.squeeze(-1)


def _rms_backward(grad, x2, weight, rstd, weight_grad: bool, impl: str):
    """(dx, dweight or None) of rows x2 [N, H] given dL/dy `grad` [N, H]."""
    if impl == "cpp":
        dx = torch.empty_like(x2)
        dw = torch.empty_like(weight) if weight_grad else None
        cpp_rows._module().rms_norm_backward(
            np_view(grad),
            np_view(x2),
            np_copy(weight),
            np_view(rstd),
            np_view(dx),
            np_view(dw),
            num_threads=torch.get_num_threads(),
        )
        return dx, dw
    wide, rstd = rstd.dtype, rstd[:, None]
    xhat = x2.to(wide) * rstd
    grad_weight = None
    if weight_grad:
        grad_weight = (grad.to(wide) * xhat).sum(0).to(weight.dtype)
    grad_xhat = grad.to(wide) * weight.to(wide)
    # d(x * rstd)/dx applied to g: rstd * (g - xhat * mean(g * xhat))
    mean = (grad_xhat * xhat).mean(-1, keepdim=True)
    return grad_xhat.sub_(xhat.mul_(mean)).mul_(rstd).to(x2.dtype), grad_weight


class RMSNormFunction(torch.autograd.Function):
    """weight * (x / rms(x)) with x and 1/rms saved."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, impl: str):
        x2 = x.reshape(-1, x.shape[-1])
        y, rstd = _rms_forward(x2, weight, eps, impl)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.impl = impl
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight, rstd = ctx.saved_tensors
        grad = grad_out.reshape(x2.shape)
        if ctx.impl == "cpp":
            grad = grad.contiguous()
        dx, dw = _rms_backward(grad, x2, weight, rstd, ctx.needs_input_grad[1], ctx.impl)
        return dx.view(grad_out.shape), dw, None, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str | None = None
) -> torch.Tensor:
    """weight * x / rms(x) over x's last dimension (see the module docstring)."""
    impl = layer_impl(impl, x)
    if impl == "cpp":
        x = x.contiguous()
        if weight.dtype != torch.float32 or weight.device != x.device:
            impl = "torch"  # a float32 input with another weight: transformers' own rounding
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNormFunction.apply(x, weight, eps, impl)
    y, _ = _rms_forward(x.reshape(-1, x.shape[-1]), weight, eps, impl)
    return y.view(x.shape)


# --- SwiGLU ------------------------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """SiLU(gate) * up (no autograd)."""
    if layer_impl(impl, gate) == "cpp":
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        cpp_rows._module().swiglu_forward(
            np_view(gate.view(-1, gate.shape[-1])),
            np_view(up.view(-1, up.shape[-1])),
            np_view(y.view(-1, y.shape[-1])),
            num_threads=torch.get_num_threads(),
        )
        return y
    return F.silu(gate) * up


def _swiglu_backward(grad_product, gate, up, product: bool, impl: str):
    """(dgate, dup, SiLU(gate) * up or None); `grad_product` is overwritten."""
    if impl == "cpp":
        grad_up = torch.empty_like(gate)
        prod = torch.empty_like(gate) if product else None
        rows = (-1, gate.shape[-1])
        cpp_rows._module().swiglu_backward_(
            np_view(grad_product.view(rows)),
            np_view(gate.view(rows)),
            np_view(up.view(rows)),
            np_view(grad_up.view(rows)),
            None if prod is None else np_view(prod.view(rows)),
            num_threads=torch.get_num_threads(),
        )
        return grad_product, grad_up, prod
    sig = torch.sigmoid(gate)
    silu = gate * sig
    prod = silu * up if product else None
    grad_up = grad_product * silu
    # d SiLU(g) / dg = sig * (1 + g * (1 - sig))
    grad_gate = grad_product.mul_(up).mul_(sig.mul_(1 + gate * (1 - sig)))
    return grad_gate, grad_up, prod


class SwiGLUDownFunction(torch.autograd.Function):
    """down(SiLU(gate) * up) with only gate and up saved."""

    @staticmethod
    def forward(ctx, gate, up, down_weight, impl: str):
        ctx.save_for_backward(gate, up, down_weight)
        ctx.impl = impl
        return F.linear(swiglu(gate, up, impl), down_weight)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, down_weight = ctx.saved_tensors
        grad_product = grad_out @ down_weight
        grad_gate, grad_up, product = _swiglu_backward(
            grad_product, gate, up, ctx.needs_input_grad[2], ctx.impl
        )
        grad_w = None
        if product is not None:
            grad_w = grad_out.flatten(0, -2).T @ product.flatten(0, -2)
        return grad_gate, grad_up, grad_w, None


def swiglu_down(
    gate: torch.Tensor, up: torch.Tensor, down_weight: torch.Tensor, impl: str | None = None
) -> torch.Tensor:
    """down_proj(SiLU(gate) * up) for bias-free projections (see the module docstring)."""
    impl = layer_impl(impl, gate)
    if impl == "cpp":
        gate, up = gate.contiguous(), up.contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (gate, up, down_weight)):
        return SwiGLUDownFunction.apply(gate, up, down_weight, impl)
    return F.linear(swiglu(gate, up, impl), down_weight)


# --- one-query attention -----------------------------------------------------------------------


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., d] (halves layout, as transformers')."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def position_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [..., heads, d] normalised per head when `norms` = (q_norm weight, k_norm
    weight, eps) is given (Qwen3), then rotated by cos, sin [..., d] (one per position)."""
    if norms is not None:
        q, k = rms_norm(q, norms[0], norms[2], impl), rms_norm(k, norms[1], norms[2], impl)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # over the heads
    return rotate(q, cos, sin), rotate(k, cos, sin)


def keys_transposed(impl: str | None, x: torch.Tensor) -> bool:
    """Whether `decode_attention` with `impl` on tensors like `x` takes the cache's keys
    transposed, [B, Hkv, d, W]: the C++ kernel's layout, each key dimension a contiguous row over
    the columns. Otherwise they are [B, Hkv, W, d], as the values: SDPA's fused backends (flash,
    memory-efficient, cuDNN) need a contiguous last dimension, and handed a transposed view
    SDPA falls back to its math kernel, which copies the keys at every step and layer."""
    return layer_impl(impl, x) == "cpp"


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    col: int,
    scale: float,
    impl: str | None = None,
) -> torch.Tensor:
    """One decode step's attention from the projections q [B, Hq, d], k and v [B, Hkv, d]
    (Hq a multiple of Hkv): q and k normalised per head when `norms` = (q_norm weight, k_norm
    weight, eps) is given (Qwen3), then rotated by cos, sin [B, d]; k and v written into column
    `col` of a KV cache: `keys` [B, Hkv, d, W] where `keys_transposed(impl, q)` (the C++ kernel,
    which takes contiguous caches), else [B, Hkv, W, d], and `values` [B, Hkv, W, d]; then each
    query attends to columns 0..col where the bool `mask` [B, >= col + 1] is true. Returns
    [B, Hq, d]; a row with no key gets zeros (as torch's CPU SDPA)."""
    impl = layer_impl(impl, q)
    if impl == "cpp":
        q_w, k_w, eps = norms if norms is not None else (None, None, 0.0)
        out = torch.empty_like(q)
        cpp_rows._module().decode_attention_(
            np_view(q.contiguous()), np_view(k.contiguous()), np_view(v.contiguous()),
            np_copy(q_w), np_copy(k_w), eps,
            np_view(cos.contiguous()), np_view(sin.contiguous()), np_view(keys), np_view(values),
            np_view(mask.contiguous()), col, scale, np_view(out), num_threads=torch.get_num_threads(),
        )  # fmt: skip
        return out
    q, k = position_heads(q, k, norms, cos, sin, impl)
    keys[:, :, col] = k
    values[:, :, col] = v
    # Grouped heads share their key-value head inside SDPA (enable_gqa) instead of a repeated
    # copy of the cache.
    out = F.scaled_dot_product_attention(
        q[:, :, None],
        keys[:, :, : col + 1],
        values[:, :, : col + 1],
        attn_mask=mask[:, None, None, : col + 1],
        scale=scale,
        enable_gqa=keys.shape[1] != q.shape[1],
    )
    return out[:, :, 0]
