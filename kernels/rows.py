"""Triton row kernels of the chunked loss: softmax statistics, the loss head and dL/dz, per row.

The chunked driver (cod_fast.ops.chunked) forms a chunk's raw logits z = h_c W^T [C, V] in float32
with a torch GEMM; these kernels do everything else on that buffer, with the contract stated in
torch by cod_fast.ops.torch_rows:

- `rows_forward`: lse, the target log-prob and the entropy of softmax(z / T) (docs/concepts.md
  section 4: temperature divides the logits, all statistics in float32).
- `rows_backward_`: overwrite z with dL/dz from the incoming dL/dlogp and dL/dH.
- `rows_fused_`: both, with the per-token policy-loss head (`token_head` of
  cod_fast.ops.loss_head: ppo / rec_one_side / rec_one_side_is / opd, KL k1-k3, entropy bonus)
  evaluated in between, so the chunk's logits are read twice and written once in all.

This module holds the launchers: they check shapes, dtypes and devices, allocate the outputs and
pick the tile; the `@triton.jit` kernels they launch, one program a row, are in
cod_fast.kernels.row_kernels. With `dz_dtype` bf16/fp16 the dz writers store dz in that dtype
over z's own bytes, at `narrow_dz_view(z, dz_dtype)`.
"""

from __future__ import annotations

import torch
import triton

from cod_fast.kernels.row_kernels import (
    AUTOTUNE,
    _rows_backward_kernel,
    _rows_forward_kernel,
    _rows_fused_kernel,
)
from cod_fast.ops.loss_terms import KL_CODES, POLICY_CODES

# A fixed default tile is reproducible and needs no warm-up: 4096 float32 (16 KiB) per tile puts
# 16 values per thread in flight at 8 warps (four 16-byte loads), and at ~80 registers a thread
# three programs fit on an SM to overlap one row's reductions with another's loads.
GPU_BLOCK_V = 4096
GPU_NUM_WARPS = 8
# Under TRITON_INTERPRET=1 every tile is a numpy call: larger tiles only mean fewer of them.
INTERPRETER_BLOCK_V = 1024


def _block_v(z: torch.Tensor, block_v: int | None) -> dict:
    """Launch meta-parameters: the caller's BLOCK_V, the tuner's, or the device default."""
    vocab = z.shape[1]
    if AUTOTUNE:
        return {}
    if block_v is not None:
        if block_v < 1 or block_v & (block_v - 1):
            raise ValueError(f"block_v must be a power of 2, got {block_v}")
        return {"BLOCK_V": block_v}
    if z.device.type == "cuda":
        return {
            "BLOCK_V": min(GPU_BLOCK_V, triton.next_power_of_2(vocab)),
            "num_warps": GPU_NUM_WARPS,
        }
    return {"BLOCK_V": min(INTERPRETER_BLOCK_V, triton.next_power_of_2(vocab))}


def _check_rows(z: torch.Tensor, targets: torch.Tensor) -> None:
    if z.dim() != 2 or z.dtype != torch.float32 or z.stride(1) != 1:
        raise ValueError(
            "z must be float32 logits [C, V] with contiguous rows; got "
            f"{z.dtype} of shape {tuple(z.shape)} and strides {z.stride()}"
        )
    if z.shape[1] == 0:
        raise ValueError("z has an empty vocabulary (V = 0)")
    if targets.shape != (z.shape[0],) or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"targets must be int32/int64 [C] = [{z.shape[0]}], got {targets.dtype} "
            f"of shape {tuple(targets.shape)}"
        )
    _check_same_device(z, targets=targets)


def _check_same_device(z: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != z.device:
            raise ValueError(f"{name} is on {t.device}, z on {z.device}; move them together")


def _token(name: str, t: torch.Tensor | None, z: torch.Tensor) -> torch.Tensor | None:
    """A per-token float32 [C] input, checked (contiguous so row i is element i)."""
    if t is None:
        return None
    if t.shape != (z.shape[0],) or t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous float32 [C] = [{z.shape[0]}] tensor, got {t.dtype} "
            f"of shape {tuple(t.shape)}"
        )
    _check_same_device(z, **{name: t})
    return t


NARROW_DZ_DTYPES = (torch.bfloat16, torch.float16)


def narrow_dz_view(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [C, V] `dtype` view of float32 z's bytes where `dz_dtype=dtype` stores dz: row r is
    the first V 16-bit values of z's row r (row stride twice z's, in elements)."""
    return z.view(dtype)[:, : z.shape[1]]


def _dz_out(z: torch.Tensor, dz_dtype: torch.dtype) -> torch.Tensor:
    """Where the kernel stores dz: z itself for float32, else its narrow view."""
    if dz_dtype == torch.float32:
        return z
    if dz_dtype not in NARROW_DZ_DTYPES:
        raise ValueError(f"dz_dtype must be float32, bfloat16 or float16, got {dz_dtype}")
    return narrow_dz_view(z, dz_dtype)


def rows_forward(
    z: torch.Tensor, targets: torch.Tensor, inv_temp: float, *, block_v: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse) [C] of each row of softmax(inv_temp * z); z is left as it is."""
    _check_rows(z, targets)
    c, vocab = z.shape
    logp, entropy, lse = torch.empty((3, c), dtype=torch.float32, device=z.device)
    if c:
        _rows_forward_kernel[(c,)](
            z, z.stride(0), targets, logp, entropy, lse, vocab, float(inv_temp),
            **_block_v(z, block_v),
        )  # fmt: skip
    return logp, entropy, lse


def rows_backward_(
    z: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g_logp: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    inv_temp: float,
    *,
    dz_dtype: torch.dtype = torch.float32,
    block_v: int | None = None,
) -> None:
    """Overwrite z with dL/dz = inv_temp (g_logp (onehot - p) - g_entropy p (log p + H)).

    p = exp(inv_temp z - lse). A None gradient counts as zero (and skips its terms). With a
    bf16/fp16 `dz_dtype`, dz is stored in that dtype at `narrow_dz_view(z, dz_dtype)` instead.
    """
    _check_rows(z, targets)
    lse = _token("lse", lse, z)
    g_logp = _token("g_logp", g_logp, z)
    g_entropy = _token("g_entropy", g_entropy, z)
    if g_entropy is not None:
        entropy = _token("entropy", entropy, z)
    dz = _dz_out(z, dz_dtype)
    c, vocab = z.shape
    if c:
        _rows_backward_kernel[(c,)](
            z, z.stride(0), dz, dz.stride(0), targets, lse, entropy, g_logp, g_entropy, vocab,
            float(inv_temp), HAS_LOGP_GRAD=g_logp is not None,
            HAS_ENTROPY_GRAD=g_entropy is not None, NARROW_DZ=dz is not z,
            **_block_v(z, block_v),
        )  # fmt: skip


def _require_iff(name: str, t: torch.Tensor | None, needed: bool, when: str) -> None:
    if needed and t is None:
        raise ValueError(f"`{name}` is required when {when}")
    if not needed and t is not None:
        raise ValueError(f"`{name}` must be None unless {when} (it would be ignored)")


def rows_fused_(
    z: torch.Tensor,
    targets: torch.Tensor,
    inv_temp: float,
    *,
    adv: torch.Tensor | None,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    teach: torch.Tensor | None,
    corr: torch.Tensor,
    weight: torch.Tensor,
    seq_ratio: torch.Tensor | None,
    seq_grad: torch.Tensor | None,
    ent_coef: torch.Tensor | None = None,
    policy: int,
    seq_level: int,
    on_policy: int,
    eps_low: float,
    eps_high: float,
    kl: int,
    beta: float,
    entropy_coef: float,
    opd_coef: float,
    dz_dtype: torch.dtype = torch.float32,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Statistics, the loss head, then dL/dz into z: (logp, entropy, loss, clipped) [C] float32.

    loss is w_t L_t; clipped is 1.0 where the token's ratio left the trust region. Per-token
    inputs are float32 [C]; `old` is None iff on_policy, `ref` iff the KL is off, `teach` unless
    the policy is opd, `seq_ratio`/`seq_grad` unless seq_level. `adv` may be None for opd only.
    `ent_coef` weighs each token's entropy bonus instead of `entropy_coef` (None: the scalar;
    the kernel then compiles without the per-token load, HAS_ENT_VEC).
    The codes are those of cod_fast.ops.loss_terms. With a bf16/fp16 `dz_dtype`, dz is stored
    in that dtype at `narrow_dz_view(z, dz_dtype)`.
    """
    if policy not in POLICY_CODES.values() or kl not in KL_CODES.values():
        raise ValueError(f"unknown policy code {policy} or kl code {kl}")
    _check_rows(z, targets)
    _require_iff("old", old, not on_policy, "the ratio is off-policy (on_policy = 0)")
    _require_iff("ref", ref, kl != KL_CODES[None], "a KL penalty is on")
    _require_iff("teach", teach, policy == POLICY_CODES["opd"], "the policy is opd")
    _require_iff("seq_ratio", seq_ratio, bool(seq_level), "seq_level = 1")
    _require_iff("seq_grad", seq_grad, bool(seq_level), "seq_level = 1")
    if adv is None and policy != POLICY_CODES["opd"]:
        raise ValueError("`adv` is required unless the policy is opd")
    if corr is None or weight is None:
        raise ValueError("`corr` and `weight` are required (pass ones for no correction)")
    per_token = dict(
        adv=adv,
        old=old,
        ref=ref,
        teach=teach,
        corr=corr,
        weight=weight,
        seq_ratio=seq_ratio,
        seq_grad=seq_grad,
        ent_coef=ent_coef,
    )
    per_token = {name: _token(name, t, z) for name, t in per_token.items()}
    dz = _dz_out(z, dz_dtype)
    c, vocab = z.shape
    logp, entropy, loss, clipped = torch.empty((4, c), dtype=torch.float32, device=z.device)
    if c:
        _rows_fused_kernel[(c,)](
            z, z.stride(0), dz, dz.stride(0), targets, *per_token.values(),
            logp, entropy, loss, clipped,
            vocab, float(inv_temp), float(eps_low), float(eps_high), float(beta),
            float(entropy_coef), float(opd_coef),
            POLICY=int(policy), SEQ_LEVEL=bool(seq_level), ON_POLICY=bool(on_policy),
            KL=int(kl), HAS_ADV=adv is not None, HAS_ENT_VEC=ent_coef is not None,
            HAS_ENTROPY_GRAD=ent_coef is not None or entropy_coef != 0,
            NARROW_DZ=dz is not z, **_block_v(z, block_v),
        )  # fmt: skip
    return logp, entropy, loss, clipped
