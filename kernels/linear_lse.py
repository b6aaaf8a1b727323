"""Fused LM-head GEMM + online log-sum-exp: per-token log-probs without any [N, V] buffer.

The no-grad paths (recomputing old / reference log-probs, evaluation) need only
logp_t = x_t[y_t] - lse(x_t) and optionally H_t for x_t = h_t W^T / T (docs/concepts.md section 4:
temperature divides the logits; statistics in float32 whatever the operand dtype). Here the
logits exist one [BLOCK_N, BLOCK_V] register tile at a time: each program owns a block of tokens
and one split of the vocabulary, forms every logit tile of its split with tl.dot (float32
accumulation over H in BLOCK_K steps) and folds it into running per-token statistics, the same
online triple as kernels/row_kernels.py: max m, s = sum e^(x-m), u = sum e^(x-m) (x-m),
giving lse = m + log s and H = log s - u / s. Splits write their partial (m, s, u); a small
combine kernel merges them with the same rescaling. The program that holds a token's target tile
records the target logit.

Memory traffic: the LM head (V x H, often larger than L2) dominates. Programs are ordered in
groups of GROUP_SIZE token blocks that sweep the same vocabulary splits side by side (the
grouped ordering of the Triton matmul tutorial), so each head tile is fetched from DRAM once per
group and served from L2 to the rest, while the group's hidden blocks stay L2-resident.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cod_fast.kernels.row_kernels import AUTOTUNE

# Default GPU tiles (H100/H200), bf16/fp16 operands: wgmma on a 128 x 128 float32 accumulator
# (64 registers a thread at 8 warps for the accumulator alone), BLOCK_K = 64. Compiled for sm_90
# by Triton 3.9 (`python -m cod_fast.bench.kernel_resources`) it uses 255 registers and spills
# ~300 bytes with the softmax epilogue, and one 32 KiB shared-memory stage: the K loop sits inside
# the vocabulary loop and is not multi-buffered. 64 x 128 x 64 does not spill there. Neither has
# been timed on a GPU yet, so the default stays the wider tile until one has.
GPU_BLOCKS = {"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_K": 64}
GPU_LAUNCH = {"num_warps": 8, "num_stages": 3}
# float32 operands take the exact FMA path (no TF32, to match torch's float32 matmul), whose
# register-held operands need the smaller 64 x 128 x 32 tile (it still spills ~40 bytes).
GPU_BLOCKS_FP32 = {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_K": 32}
# The interpreter runs tiles as numpy calls; tl.dot needs every dimension >= 16.
INTERPRETER_BLOCKS = {"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_K": 32}
GROUP_SIZE = 8
# Programs to aim for, in multiples of the SM count: enough to balance uneven sweeps.
WAVES = 2
# Partials the combine kernel holds per program (splits x tokens): 16 a thread at 4 warps keeps
# it near 128 registers (8192 spilled).
COMBINE_ELEMENTS = 2048


def _autotune_configs() -> list[triton.Config]:
    return [
        triton.Config(
            {"BLOCK_N": n, "BLOCK_V": v, "BLOCK_K": k}, num_warps=warps, num_stages=stages
        )
        for n, v, k, warps, stages in (
            (128, 128, 64, 8, 3),
            (128, 128, 64, 8, 4),
            (64, 128, 64, 4, 4),
            (128, 64, 64, 4, 4),
            (64, 256, 64, 8, 3),
            (128, 256, 64, 8, 3),
        )
    ]


@triton.jit
def _linear_lse_fwd_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    part_ptr,
    x_y_ptr,
    N,
    V,
    H,
    stride_hn,
    stride_wv,
    inv_temp,
    split_size,
    num_splits,
    WITH_ENTROPY: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_OPERANDS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Grouped order: consecutive programs take GROUP_SIZE token blocks for one split, then the
    # same token blocks for the next split, so concurrent programs share head tiles in L2.
    pid = tl.program_id(0)
    num_token_blocks = tl.cdiv(N, BLOCK_N)
    programs_per_group = GROUP_SIZE * num_splits
    first_block = (pid // programs_per_group) * GROUP_SIZE
    group_blocks = tl.minimum(num_token_blocks - first_block, GROUP_SIZE)
    block_n = first_block + (pid % programs_per_group) % group_blocks
    split = (pid % programs_per_group) // group_blocks

    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    y = tl.load(y_ptr + offs_n, mask=n_mask, other=-1).to(tl.int32)
    offs_k = tl.arange(0, BLOCK_K)
    # int64 row offsets: N x H and V x H pass 2^31 elements for large batches and heads.
    h_rows = h_ptr + offs_n.to(tl.int64)[:, None] * stride_hn + offs_k[None, :]

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    u = tl.zeros((BLOCK_N,), tl.float32)
    x_y = tl.zeros((BLOCK_N,), tl.float32)
    v_begin = split * split_size
    v_end = tl.minimum(v_begin + split_size, V)
    for v_start in range(v_begin, v_end, BLOCK_V):
        offs_v = v_start + tl.arange(0, BLOCK_V)
        v_mask = offs_v < V
        w_rows = w_ptr + offs_v.to(tl.int64)[:, None] * stride_wv + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for k_start in range(0, H, BLOCK_K):
            if EVEN_K:
                h = tl.load(h_rows + k_start, mask=n_mask[:, None], other=0.0)
                w = tl.load(w_rows + k_start, mask=v_mask[:, None], other=0.0)
            else:
                k_mask = (k_start + offs_k) < H
                h = tl.load(h_rows + k_start, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(w_rows + k_start, mask=v_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST_OPERANDS:
                # The interpreter multiplies bf16 bit patterns as integers; float32 operands
                # give the same exact products and float32 sums as the GPU's bf16 MMA.
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)

        x = tl.where(v_mask[None, :], acc * inv_temp, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        shift = m - m_new
        alpha = tl.exp(shift)
        d = x - m_new[:, None]
        e = tl.exp(d)
        if WITH_ENTROPY:
            # Rescale u to the new max; guard -inf * 0 before the first tile and in masked lanes.
            u = alpha * (u + tl.where(s > 0, shift * s, 0.0))
            u += tl.sum(tl.where(e > 0, e * d, 0.0), axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new
        x_y += tl.sum(tl.where(offs_v[None, :] == y[:, None], x, 0.0), axis=1)

    # Partials laid out [statistic, split, token], so the combine reads contiguous tokens.
    tl.store(part_ptr + split.to(tl.int64) * N + offs_n, m, mask=n_mask)
    tl.store(part_ptr + (num_splits + split).to(tl.int64) * N + offs_n, s, mask=n_mask)
    if WITH_ENTROPY:
        tl.store(part_ptr + (2 * num_splits + split).to(tl.int64) * N + offs_n, u, mask=n_mask)
    tl.store(x_y_ptr + offs_n, x_y, mask=n_mask & (y >= v_begin) & (y < v_end))


@triton.jit
def _linear_lse_combine_kernel(
    part_ptr,
    x_y_ptr,
    logp_ptr,
    entropy_ptr,
    lse_ptr,
    N,
    num_splits,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    n_mask = offs_n < N
    mask = (offs_s[:, None] < num_splits) & n_mask[None, :]
    rows = part_ptr + offs_n[None, :]
    m = tl.load(rows + offs_s.to(tl.int64)[:, None] * N, mask=mask, other=float("-inf"))
    s = tl.load(rows + (num_splits + offs_s).to(tl.int64)[:, None] * N, mask=mask, other=0.0)
    m_all = tl.max(m, axis=0)
    shift = m - m_all[None, :]
    alpha = tl.where(mask, tl.exp(shift), 0.0)
    s_all = tl.sum(alpha * s, axis=0)
    log_s = tl.log(s_all)
    x_y = tl.load(x_y_ptr + offs_n, mask=n_mask, other=0.0)
    tl.store(logp_ptr + offs_n, (x_y - m_all) - log_s, mask=n_mask)
    tl.store(lse_ptr + offs_n, m_all + log_s, mask=n_mask)
    if WITH_ENTROPY:
        u = tl.load(
            rows + (2 * num_splits + offs_s).to(tl.int64)[:, None] * N, mask=mask, other=0.0
        )
        u_all = tl.sum(tl.where(mask, alpha * (u + shift * s), 0.0), axis=0)
        tl.store(entropy_ptr + offs_n, log_s - u_all / s_all, mask=n_mask)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            f"expected hidden [N, H], weight [V, H], targets [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"targets {tuple(targets.shape)}"
        )
    if hidden.dtype != weight.dtype or hidden.dtype not in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
    ):
        raise ValueError(
            f"hidden and weight must share one of bfloat16, float16, float32; got "
            f"{hidden.dtype} and {weight.dtype}"
        )
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be int32 or int64 token ids, got {targets.dtype}")
    if weight.shape[0] == 0 or hidden.shape[1] == 0:
        raise ValueError(f"empty LM head: weight has shape {tuple(weight.shape)}")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(
            f"hidden ({hidden.device}), weight ({weight.device}) and targets "
            f"({targets.device}) must be on one device"
        )
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t.stride(1) != 1:
            raise ValueError(f"{name} rows must be contiguous (stride(1) == 1), got {t.stride()}")


def _blocks(
    device: torch.device, dtype: torch.dtype, block_sizes: tuple[int, int, int] | None
) -> dict:
    """Tile sizes of the main kernel: the caller's, the device default, or {} when autotuning."""
    if block_sizes is not None:
        if AUTOTUNE:
            raise ValueError("block_sizes cannot be fixed while COD_FAST_AUTOTUNE=1")
        if any(b < 16 or b & (b - 1) for b in block_sizes):
            raise ValueError(f"block sizes must be powers of 2 >= 16 (tl.dot), got {block_sizes}")
        return dict(zip(("BLOCK_N", "BLOCK_V", "BLOCK_K"), block_sizes, strict=True))
    if AUTOTUNE:
        return {}
    if device.type != "cuda":
        return dict(INTERPRETER_BLOCKS)
    return dict(GPU_BLOCKS_FP32 if dtype == torch.float32 else GPU_BLOCKS)


def _launch_options(device: torch.device, blocks: dict) -> dict:
    if AUTOTUNE or device.type != "cuda":
        return {}
    if blocks["BLOCK_N"] * blocks["BLOCK_V"] >= 64 * 128:
        return dict(GPU_LAUNCH)
    return {"num_warps": 4, "num_stages": 2}  # small test tiles


def _num_splits(num_token_blocks: int, num_vocab_tiles: int, device: torch.device) -> int:
    """Vocabulary splits: enough programs for WAVES per SM, and enough splits that one group of
    GROUP_SIZE token blocks spans the SMs, so few token blocks (evaluation) still fill the GPU."""
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = 4
    want = max(triton.cdiv(WAVES * sms, num_token_blocks), triton.cdiv(sms, GROUP_SIZE))
    return max(1, min(num_vocab_tiles, want))


# With COD_FAST_AUTOTUNE=1 the tile sizes come from the tuner; the split size handed to it is a
# multiple of every config's BLOCK_V, so any config sweeps whole tiles.
_fwd_kernel = (
    triton.autotune(_autotune_configs(), key=["V", "H", "WITH_ENTROPY", "DOT_PRECISION"])(
        _linear_lse_fwd_kernel
    )
    if AUTOTUNE
    else _linear_lse_fwd_kernel
)
_TUNE_BLOCK_N, _TUNE_BLOCK_V, _TUNE_BLOCK_K = 64, 256, 64


def linear_logprobs_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    block_sizes: tuple[int, int, int] | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(logp [N], entropy [N] or None, lse [N]) float32 of softmax(hidden @ weight.T / T).

    hidden [N, H] and weight [V, H] share a dtype (bf16 / fp16 / fp32; products accumulate in
    float32, fp32 operands without TF32); targets [N] int ids, assumed in [0, V): an id outside
    gives NaN (a host-side check would sync the device). No autograd. `block_sizes`
    (BLOCK_N, BLOCK_V, BLOCK_K) and `num_splits` override the defaults (tests).
    """
    _check(hidden, weight, targets)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n, dim = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    logp = torch.empty(n, dtype=torch.float32, device=device)
    lse = torch.empty(n, dtype=torch.float32, device=device)
    entropy = torch.empty(n, dtype=torch.float32, device=device) if with_entropy else None
    if n == 0:
        return logp, entropy, lse

    blocks = _blocks(device, hidden.dtype, block_sizes)
    block_n = blocks.get("BLOCK_N", _TUNE_BLOCK_N)
    block_v = blocks.get("BLOCK_V", _TUNE_BLOCK_V)
    block_k = blocks.get("BLOCK_K", _TUNE_BLOCK_K)
    num_vocab_tiles = triton.cdiv(vocab, block_v)
    splits = num_splits or _num_splits(triton.cdiv(n, block_n), num_vocab_tiles, device)
    tiles_per_split = triton.cdiv(num_vocab_tiles, min(max(splits, 1), num_vocab_tiles))
    splits = triton.cdiv(num_vocab_tiles, tiles_per_split)  # every split non-empty

    part = torch.empty((3 if with_entropy else 2, splits, n), dtype=torch.float32, device=device)
    # NaN until the split holding the target writes it: an out-of-range id gives NaN, not junk.
    x_y = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
    _fwd_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]) * splits,)](
        hidden, weight, targets, part, x_y, n, vocab, dim, hidden.stride(0), weight.stride(0),
        1.0 / float(temperature), tiles_per_split * block_v, splits,
        WITH_ENTROPY=with_entropy,
        EVEN_K=dim % block_k == 0,
        DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        UPCAST_OPERANDS=device.type != "cuda" and hidden.dtype == torch.bfloat16,
        GROUP_SIZE=GROUP_SIZE,
        **blocks,
        **_launch_options(device, blocks),
    )  # fmt: skip
    block_s = triton.next_power_of_2(splits)
    combine_n = max(1, min(128, COMBINE_ELEMENTS // block_s))
    _linear_lse_combine_kernel[(triton.cdiv(n, combine_n),)](
        part, x_y, logp, entropy, lse, n, splits,
        WITH_ENTROPY=with_entropy, BLOCK_S=block_s, BLOCK_N=combine_n,
    )  # fmt: skip
    return logp, entropy, lse
