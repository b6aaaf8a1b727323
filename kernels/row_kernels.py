"""The Triton row kernels of the chunked loss: one program a row, swept in BLOCK_V tiles.

`_rows_forward_kernel` (softmax statistics), `_rows_backward_kernel` (dL/dz from dL/dlogp and
dL/dH) and `_rows_fused_kernel` (both, with the per-token policy-loss head in between), and the
`@triton.jit` sweeps they share. Their launchers, which check shapes and allocate, and the
contract they keep are in cod_fast.kernels.rows.

The statistics are gathered online in a single sweep: with x = z / T, the running max m,
s = sum e^(x-m) and u = sum e^(x-m) (x-m) give lse = m + log s and H = -sum p log p =
log s - u / s. Both terms of H are >= 0 (u <= 0), so H does not come from a difference of large
numbers the way lse - sum p x does for peaked rows.

With `NARROW_DZ` the two dz writers store dz as bf16/fp16 over z's own bytes (row r's dz fills
the first V 16-bit values of its row, see `rows.narrow_dz_view`), so the driver's GEMMs read
bf16 dz without a separate cast pass over [C, V]. That is safe within a row because 16-bit value
j lands in the bytes of float32 value j // 2 <= j, which the sweep has read in this tile or an
earlier one; a barrier between each tile's loads and its stores makes that hold for every warp
of the program, not only for each thread.
"""

from __future__ import annotations

import os

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

# Autotuning is opt-in (COD_FAST_AUTOTUNE=1): the launchers' fixed tile (rows.GPU_BLOCK_V) is
# reproducible and needs no warm-up.
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
