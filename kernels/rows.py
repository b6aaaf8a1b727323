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

One program owns one row and sweeps it in BLOCK_V tiles. The statistics are gathered online in a
single sweep: with x = z / T, the running max m, s = sum e^(x-m) and u = sum e^(x-m) (x-m) give
lse = m + log s and H = -sum p log p = log s - u / s. Both terms of H are >= 0 (u <= 0), so H does
not come from a difference of large numbers the way lse - sum p x does for peaked rows.

With `dz_dtype` bf16/fp16 the two dz writers store dz in that dtype over z's own bytes (row r's
dz fills the first V 16-bit values of its row, see `narrow_dz_view`), so the driver's GEMMs read
bf16 dz without a separate cast pass over [C, V]. That is safe within a row because 16-bit value
j lands in the bytes of float32 value j // 2 <= j, which the sweep has read in this tile or an
earlier one; a barrier between each tile's loads and its stores makes that hold for every warp
of the program, not only for each thread.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cod_fast.ops.loss_terms import KL_CODES, POLICY_CODES

# The switch codes as compile-time constants for the kernels to compare against.
PPO = tl.constexpr(POLICY_CODES["ppo"])
REC_ONE_SIDE = tl.constexpr(POLICY_CODES["rec_one_side"])
OPD = tl.constexpr(POLICY_CODES["opd"])
KL_OFF = tl.constexpr(KL_CODES[None])
KL_K1 = tl.constexpr(KL_CODES["k1"])
KL_K2 = tl.constexpr(KL_CODES["k2"])

# A fixed default tile is reproducible and needs no warm-up: 4096 float32 (16 KiB) per tile puts
# 16 values per thread in flight at 8 warps (four 16-byte loads), and at ~80 registers a thread
# three programs fit on an SM to overlap one row's reductions with another's loads.
GPU_BLOCK_V = 4096
GPU_NUM_WARPS = 8
# Under TRITON_INTERPRET=1 every tile is a numpy call: larger tiles only mean fewer of them.
INTERPRETER_BLOCK_V = 1024
AUTOTUNE = os.environ.get("COD_FAST_AUTOTUNE", "0") == "1"


def _tunable(key: list[str], restore: tuple[str, ...] = ()):
    """Autotune over BLOCK_V and warps when COD_FAST_AUTOTUNE=1, else leave the kernel as is.

    Kernels that write into z restore it between trials, so tuning never corrupts the logits.
    """

    def wrap(kernel):
        if not AUTOTUNE:
            return kernel
        configs = [
            triton.Config({"BLOCK_V": block}, num_warps=warps)
            for block in (1024, 2048, 4096, 8192)
            for warps in (4, 8, 16)
        ]
        return triton.autotune(configs, key=key, restore_value=list(restore))(kernel)

    return wrap


@triton.jit
def _row_stats(z_row, V, inv_temp, BLOCK_V: tl.constexpr):
    """(m, s, u) of x = inv_temp * z over one row, one tile at a time."""
    m = float("-inf")
    s = 0.0
    u = 0.0
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(z_row + start + cols, mask=mask, other=float("-inf")) * inv_temp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = m - m_new
        alpha = tl.exp(shift)
        d = x - m_new
        e = tl.exp(d)
        # Rescale the old sums to the new max: s' = a s, u' = a (u + (m - m') s). Before the first
        # tile s = 0 and m = -inf, where (m - m') s would be -inf * 0 = NaN; likewise e d for
        # masked lanes (e = 0, d = -inf).
        u = alpha * (u + tl.where(s > 0, shift * s, 0.0)) + tl.sum(
            tl.where(e > 0, e * d, 0.0), axis=0
        )
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
    return m, s, u


@triton.jit
def _write_dz(
    z_row,
    dz_row,
    y,
    V,
    inv_temp,
    m,
    log_s,
    g_logp,
    g_entropy,
    entropy,
    HAS_ENTROPY_GRAD: tl.constexpr,
    NARROW_DZ: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """dz <- inv_temp (g_logp (onehot - p) - g_H p (log p + H)), log p = (x - m) - log s.

    (x - m) - log s rather than x - lse: m is one of the row's values, so x - m is exact where p
    matters, while lse = m + log s carries a rounding of |lse| ulps. The backward, which only
    has lse, passes m = lse and log s = 0. Written as g_logp onehot - p (g_logp + g_H (log p + H)).
    dz goes to dz_row in its element type: z_row itself, or z_row's bytes as 16-bit values
    (NARROW_DZ), stored tile by tile after every warp has read the tile (see the module
    docstring).
    """
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        log_p = (tl.load(z_row + offs, mask=mask, other=0.0) * inv_temp - m) - log_s
        p = tl.exp(log_p)
        coef = g_logp
        if HAS_ENTROPY_GRAD:
            coef = g_logp + g_entropy * (log_p + entropy)
        dz = (tl.where(offs == y, g_logp, 0.0) - p * coef) * inv_temp
        if NARROW_DZ:
            tl.debug_barrier()
        tl.store(dz_row + offs, dz.to(dz_row.dtype.element_ty), mask=mask)


@triton.jit
def _target_logit(z_row, y_ptr, row, V, inv_temp):
    """(y, x_y) of a row. An id outside [0, V) reads nothing and gives x_y = NaN, so the row's
    logp and loss come out NaN instead of junk (a host-side range check would sync the device)."""
    y = tl.load(y_ptr + row).to(tl.int64)
    valid = (y >= 0) & (y < V)
    return y, tl.load(z_row + y, mask=valid, other=float("nan")) * inv_temp


@_tunable(key=["V"])
@triton.jit
def _rows_forward_kernel(
    z_ptr,
    stride_z,
    y_ptr,
    logp_ptr,
    entropy_ptr,
    lse_ptr,
    V,
    inv_temp,
    BLOCK_V: tl.constexpr,
):
    # int64 row offsets: C * V passes 2^31 at 14k rows of a 150k vocabulary.
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    m, s, u = _row_stats(z_row, V, inv_temp, BLOCK_V)
    _, x_y = _target_logit(z_row, y_ptr, row, V, inv_temp)
    log_s = tl.log(s)
    # (x_y - m) - log s, not x_y - lse: exact for the peaked rows where logp is near 0 and m large.
    tl.store(logp_ptr + row, (x_y - m) - log_s)
    tl.store(entropy_ptr + row, log_s - u / s)
    tl.store(lse_ptr + row, m + log_s)


@_tunable(key=["V", "HAS_LOGP_GRAD", "HAS_ENTROPY_GRAD", "NARROW_DZ"], restore=("z_ptr",))
@triton.jit
def _rows_backward_kernel(
    z_ptr,
    stride_z,
    dz_ptr,
    stride_dz,
    y_ptr,
    lse_ptr,
    entropy_ptr,
    g_logp_ptr,
    g_entropy_ptr,
    V,
    inv_temp,
    HAS_LOGP_GRAD: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    NARROW_DZ: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    y = tl.load(y_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    g_logp = 0.0
    if HAS_LOGP_GRAD:
        g_logp = tl.load(g_logp_ptr + row)
    g_entropy = 0.0
    entropy = 0.0
    if HAS_ENTROPY_GRAD:
        g_entropy = tl.load(g_entropy_ptr + row)
        entropy = tl.load(entropy_ptr + row)
    dz_row = dz_ptr + row * stride_dz
    _write_dz(
        z_row, dz_row, y, V, inv_temp, lse, 0.0, g_logp, g_entropy, entropy,
        HAS_ENTROPY_GRAD, NARROW_DZ, BLOCK_V,
    )  # fmt: skip


@triton.jit
def _k3_and_grad(d):
    """k3 = e^-d - 1 + d and dk3/dd = 1 - e^-d without cancellation near d = 0.

    With x = -d and S(x) = sum_{n>=2} x^(n-2) / n!: k3 = x^2 S(x), 1 - e^-d = -x (1 + x S(x)).
    Eleven terms of S are exact in float32 for |d| < 1; beyond, e^-d - 1 + d loses nothing.
    """
    x = -d
    series = 1.0 / 39916800.0  # 1/11!
    series = series * x + 1.0 / 3628800.0
    series = series * x + 1.0 / 362880.0
    series = series * x + 1.0 / 40320.0
    series = series * x + 1.0 / 5040.0
    series = series * x + 1.0 / 720.0
    series = series * x + 1.0 / 120.0
    series = series * x + 1.0 / 24.0
    series = series * x + 1.0 / 6.0
    series = series * x + 0.5
    small = tl.abs(d) < 1.0
    e = tl.exp(x)
    k = tl.where(small, x * x * series, (e - 1.0) + d)
    dk = tl.where(small, -x * (1.0 + x * series), 1.0 - e)
    return k, dk


@triton.jit
def _policy_head(
    logp,
    entropy,
    adv,
    old,
    ref,
    teach,
    corr,
    weight,
    seq_ratio,
    seq_grad,
    eps_low,
    eps_high,
    beta,
    entropy_coef,
    opd_coef,
    POLICY: tl.constexpr,
    SEQ_LEVEL: tl.constexpr,
    ON_POLICY: tl.constexpr,
    KL: tl.constexpr,
):
    """(w L_t, dL/dlogp_t, dL/dH_t, clipped_t) of one token: `token_head` of loss_head.py.

    At sequence level the ratio is the segment's and its gradient arrives as seq_grad (computed
    by the driver through the segment mean), so the ratio-dependent terms add nothing here.
    """
    if SEQ_LEVEL:
        ratio = seq_ratio
    elif ON_POLICY:
        ratio = 1.0
    else:
        ratio = tl.exp(logp - old)
    if POLICY == PPO:
        unclipped = -adv * ratio
        clipped_term = -adv * tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
        loss = tl.maximum(unclipped, clipped_term)
        clipped = (clipped_term > unclipped).to(tl.float32)
        grad = 0.0 if SEQ_LEVEL else unclipped * (1.0 - clipped)
    elif POLICY == OPD:  # the advantage is the teacher's margin, logp detached inside it
        a = opd_coef * (teach - logp)
        loss = -a * logp
        grad = -a
        clipped = 0.0
    else:  # rec_one_side, rec_one_side_is
        keep = (
            ((adv >= 0) & (ratio <= 1.0 + eps_high)) | ((adv < 0) & (ratio >= 1.0 - eps_low))
        ).to(tl.float32)
        clipped = 1.0 - keep
        if POLICY == REC_ONE_SIDE:
            loss = -adv * logp * keep
            grad = -adv * keep
        else:
            loss = -adv * ratio * keep
            grad = 0.0 if SEQ_LEVEL else loss
    loss = corr * loss
    grad = corr * grad
    if KL != KL_OFF:
        d = logp - ref
        if KL == KL_K1:
            k = d
            dk = 1.0
        elif KL == KL_K2:
            k = 0.5 * d * d
            dk = d
        else:
            k, dk = _k3_and_grad(d)
        loss = loss + beta * k
        grad = grad + beta * dk
    loss = weight * (loss - entropy_coef * entropy)
    grad = weight * grad
    if SEQ_LEVEL:
        grad = grad + seq_grad
    return loss, grad, -entropy_coef * weight, clipped


@_tunable(
    key=[
        "V",
        "POLICY",
        "SEQ_LEVEL",
        "ON_POLICY",
        "KL",
        "HAS_ADV",
        "HAS_ENT_VEC",
        "HAS_ENTROPY_GRAD",
        "NARROW_DZ",
    ],
    restore=("z_ptr",),
)
@triton.jit
def _rows_fused_kernel(
    z_ptr,
    stride_z,
    dz_ptr,
    stride_dz,
    y_ptr,
    adv_ptr,
    old_ptr,
    ref_ptr,
    teach_ptr,
    corr_ptr,
    weight_ptr,
    seq_ratio_ptr,
    seq_grad_ptr,
    ent_coef_ptr,
    logp_ptr,
    entropy_ptr,
    loss_ptr,
    clipped_ptr,
    V,
    inv_temp,
    eps_low,
    eps_high,
    beta,
    entropy_coef,
    opd_coef,
    POLICY: tl.constexpr,
    SEQ_LEVEL: tl.constexpr,
    ON_POLICY: tl.constexpr,
    KL: tl.constexpr,
    HAS_ADV: tl.constexpr,
    HAS_ENT_VEC: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    NARROW_DZ: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    # Pass 1: statistics of the row.
    m, s, u = _row_stats(z_row, V, inv_temp, BLOCK_V)
    y, x_y = _target_logit(z_row, y_ptr, row, V, inv_temp)
    log_s = tl.log(s)
    logp = (x_y - m) - log_s
    entropy = log_s - u / s

    # The head, on scalars; absent inputs are constants the head never reads.
    adv = 0.0
    if HAS_ADV:
        adv = tl.load(adv_ptr + row)
    old = 0.0
    if not ON_POLICY:
        old = tl.load(old_ptr + row)
    ref = 0.0
    if KL != KL_OFF:
        ref = tl.load(ref_ptr + row)
    teach = 0.0
    if POLICY == OPD:
        teach = tl.load(teach_ptr + row)
    seq_ratio = 0.0
    seq_grad = 0.0
    if SEQ_LEVEL:
        seq_ratio = tl.load(seq_ratio_ptr + row)
        seq_grad = tl.load(seq_grad_ptr + row)
    # The entropy bonus's weight: one per token (HAS_ENT_VEC), else the scalar.
    alpha = entropy_coef
    if HAS_ENT_VEC:
        alpha = tl.load(ent_coef_ptr + row)
    loss, g_logp, g_entropy, clipped = _policy_head(
        logp,
        entropy,
        adv,
        old,
        ref,
        teach,
        tl.load(corr_ptr + row),
        tl.load(weight_ptr + row),
        seq_ratio,
        seq_grad,
        eps_low,
        eps_high,
        beta,
        alpha,
        opd_coef,
        POLICY,
        SEQ_LEVEL,
        ON_POLICY,
        KL,
    )
    tl.store(logp_ptr + row, logp)
    tl.store(entropy_ptr + row, entropy)
    tl.store(loss_ptr + row, loss)
    tl.store(clipped_ptr + row, clipped)

    # Pass 2: dL/dz over the row, with log p = (x - m) - log s as in pass 1. Every read of the
    # row's float32 values (pass 1, x_y) came before it.
    _write_dz(
        z_row, dz_ptr + row * stride_dz, y, V, inv_temp, m, log_s, g_logp, g_entropy, entropy,
        HAS_ENTROPY_GRAD, NARROW_DZ, BLOCK_V,
    )  # fmt: skip


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
