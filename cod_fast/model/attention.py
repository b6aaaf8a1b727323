"""Attention over packed micro-batches that never crosses a sequence boundary.

The invariant is docs/concepts.md section 5.

A packed micro-batch is one row of T tokens holding several sequences; `cu_seqlens` marks where
each starts. Three kernels compute the same causal, per-sequence attention, registered with
transformers' `AttentionInterface` so that any Hugging Face decoder (Qwen3, Llama, ...) uses them
unchanged:

- `cod_fa_varlen` (`model.attn_impl=flash_attn`): flash-attn's `flash_attn_varlen_func`
  (CUDA, the flash-attn package; fp16/bf16);
- `cod_torch_varlen` (`varlen_attn`): torch's own `torch.nn.attention.varlen.varlen_attn` (CUDA;
  flash-attention varlen without the flash-attn package; fp16/bf16);
- `cod_per_seq` (`sdpa`; any device and dtype: the CPU path and float32 on CUDA):
  cod_fast.ops.varlen_attention, a C++ kernel over every sequence of the row for float32 on a
  CPU, else one `scaled_dot_product_attention` per sequence. Its cost is sum_s L_s^2, where a
  block-diagonal mask over the whole row would cost T^2 time and memory.
  It cuts the row by the sequences' lengths, which the host must know: given the micro-batch's
  own (`MicroBatch.seqlens`, through `packed_attention_kwargs`), it never reads cu_seqlens back
  from the device.

The registered names avoid every pattern transformers gives a meaning of its own (see
`KERNELS`), so it installs them as they are.

They attend varlen only when the caller passes `cu_seq_lens_q` (see `packed_attention_kwargs`);
without it (generation with a KV cache and a padding mask) they defer to transformers' SDPA with
its usual mask, so one model serves both the trainer and the torch sampler.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from cod_fast.config import ConfigError
from cod_fast.ops.sequence_parallel import SequenceGroup, heads_to_seq, seq_to_heads
from cod_fast.ops.varlen_attention import BlockLengths, varlen_attention

KERNELS = {"flash_attn": "cod_fa_varlen", "varlen_attn": "cod_torch_varlen", "sdpa": "cod_per_seq"}
"""model.attn_impl -> the name registered with transformers. transformers reads a meaning into
some names (5.17 to 5.25, PreTrainedModel._check_and_adjust_attn_implementation): one containing
"flash" is a request for a flash-attention kernel, which it tries to load from the hub and fails
on; "owner/name" is a hub kernel; "paged|" a paged-cache prefix; "sdpa" or "flex_attention"
anywhere runs those backends' own checks. These names hold none of them."""

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes the CUDA varlen kernels take: flash-attn's and torch's flash_api.cpp (behind
varlen_attn) refuse any other ("FlashAttention only support fp16 and bf16 data type")."""


def resolve_attn_impl(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel for ModelConfig.attn_impl on `device` computing in `dtype` (`auto`: the fastest
    that runs there); a ConfigError on model.attn_impl for one that cannot run there."""
    has_flash_attn = importlib.util.find_spec("flash_attn") is not None
    if choice == "auto":
        if device.type != "cuda" or dtype not in HALF_DTYPES:
            return "sdpa"  # per-sequence SDPA takes float32, the CUDA varlen kernels do not
        return "flash_attn" if has_flash_attn else "varlen_attn"
    if choice in ("flash_attn", "varlen_attn"):
        if device.type != "cuda":
            raise ConfigError(
                "model.attn_impl",
                f"got {choice!r} on {device.type}; it needs a CUDA device: use 'sdpa' or 'auto' "
                "on the CPU",
            )
        if dtype not in HALF_DTYPES:
            raise ConfigError(
                "model.attn_impl",
                f"got {choice!r} with a {str(dtype).removeprefix('torch.')} model; its CUDA "
                "kernel takes float16 and bfloat16 only: set model.dtype=bfloat16 (or 'auto'), "
                "or model.attn_impl=sdpa (or 'auto')",
            )
    if choice == "flash_attn" and not has_flash_attn:
        raise ConfigError(
            "model.attn_impl",
            "got 'flash_attn' but flash-attn is not installed; build it with `pip install "
            "flash-attn --no-build-isolation` (README), or use 'varlen_attn' (torch's own) or "
            "'auto'",
        )
    return choice


def packed_attention_kwargs(
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    kv_index: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int = 0,
    seqlens: tuple[int, ...] | None = None,
    seqlens_k: tuple[int, ...] | None = None,
    sequence_group: SequenceGroup | None = None,
) -> dict:
    """The keyword arguments that make a decoder forward attend per sequence (the names of
    transformers' FlashAttentionKwargs, so its own flash-attention path reads them too).

    `attention_mask` is an empty 4-D tensor: every transformers decoder takes a 4-D mask as
    already prepared, so no [T, T] mask is built; the packed kernels never read it, and anything
    else that did would fail on its shape instead of attending wrongly.

    The shared-prefix layout (cod_fast.data.prefix_tree) adds `kv_index`: block i of the queries
    (cu_seqlens) attends to the keys at kv_index[cu_seqlens_k[i]:cu_seqlens_k[i+1]], causally
    aligned at the end (the last query sees every key of its block).

    `seqlens` (and `seqlens_k` with kv_index): the blocks' lengths on the host, as packed
    (`MicroBatch.seqlens`). The per-sequence kernel cuts the row by them; without them it reads
    offsets that are on a GPU back in every layer, a host sync each time.

    `sequence_group` (Ulysses sequence parallelism): the decoder holds this rank's 1/N of the
    row's tokens, and the offsets describe the whole row; each attention trades tokens for heads
    before its kernel and back after it (cod_fast.ops.sequence_parallel).
    """
    cu = cu_seqlens.to(torch.int32)
    shared = kv_index is not None
    cu_k = cu_seqlens_k.to(device=cu.device, dtype=torch.int32) if shared else cu
    key_offsets = cu_seqlens_k if shared else cu  # on the host still, when it was given so
    lengths = _host_lengths(cu, key_offsets, seqlens, seqlens_k if shared else seqlens)
    kwargs = {
        "attention_mask": torch.zeros(1, 1, 0, 0, dtype=torch.bool, device=cu.device),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu_k,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen_k if shared else max_seqlen,
    }
    if shared:
        kwargs["cod_kv_index"] = kv_index.to(cu.device)
    if lengths is not None:
        kwargs["cod_block_lengths"] = lengths
    if sequence_group is not None:
        kwargs["cod_sequence_group"] = sequence_group
    return kwargs


def _host_lengths(cu_q, cu_k, seqlens, seqlens_k) -> BlockLengths | None:
    """The blocks' (query, key) lengths on the host: those given, else read from offsets on the
    CPU (free); None when one is unknown and its offsets are on a device. Reading those here
    would make every kernel wait, the CUDA varlen kernels too, which never need the lengths."""
    if seqlens is None and cu_q.device.type == "cpu":
        seqlens = cu_q.diff().tolist()
    if seqlens_k is None and cu_k.device.type == "cpu":
        seqlens_k = cu_k.diff().tolist()
    return None if seqlens is None or seqlens_k is None else (seqlens, seqlens_k)


@functools.cache
def _varlen_options() -> tuple[bool, bool]:
    """(takes is_causal, takes enable_gqa): the varlen_attn signature moved between torch 2.10
    (is_causal=) and 2.13 (window_size=(-1, 0) for causal, enable_gqa=)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return "is_causal" in params, "enable_gqa" in params


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling):
    from torch.nn.attention.varlen import varlen_attn

    takes_causal, takes_gqa = _varlen_options()
    extra = {"is_causal": True} if takes_causal else {"window_size": (-1, 0)}
    if q.shape[1] != k.shape[1]:
        if takes_gqa:
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, **extra)


def _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scaling, causal=True
    )


def _packed_forward(kernel: str, module, query, key, value, attention_mask, **kwargs):
    """transformers' attention signature: query [B, Hq, T, D], key/value [B, Hkv, T, D] ->
    ([B, T, Hq, D], None)."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(
            f"packed attention takes one row of packed sequences, got {query.shape[0]}"
        )
    if module.training and kwargs.get("dropout", 0.0):
        raise ValueError("packed attention does not implement attention dropout; set it to 0")
    if kwargs.get("sliding_window"):
        raise ValueError(
            "packed attention does not implement sliding-window layers; use model.attn_impl="
            "'sdpa' with a model whose config disables the sliding window"
        )
    scaling = kwargs.get("scaling")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    cu_q = cu_seqlens.to(device=q.device, dtype=torch.int32)
    cu_k = kwargs.get("cu_seq_lens_k")
    cu_k = cu_q if cu_k is None else cu_k.to(device=q.device, dtype=torch.int32)
    kv_index = kwargs.get("cod_kv_index")  # shared prefixes: the key rows of each block
    sp = kwargs.get("cod_sequence_group")  # Ulysses: this rank holds 1/N of the row's tokens
    if sp is not None:
        q, k, v = _heads_of_whole_row(q, k, v, sp)
    if kernel == "sdpa":
        lengths = kwargs.get("cod_block_lengths")  # None: read from cu_q and cu_k
        out = varlen_attention(q, k, v, cu_q, cu_k, kv_index, scaling, lengths=lengths)
    else:
        if kv_index is not None:
            k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
        run = _torch_varlen if kernel == "varlen_attn" else _flash_varlen
        max_q = int(kwargs["max_length_q"])
        lengths = max_q, int(kwargs.get("max_length_k") or max_q)
        out = run(q, k, v, cu_q, cu_k, *lengths, scaling)
    if sp is not None:
        (out,) = heads_to_seq(sp, out)
    return out[None], None


def _heads_of_whole_row(q, k, v, sp: SequenceGroup):
    """This rank's tokens of every head -> every token of its 1/N of the heads. Key/value heads
    that do not split over N are repeated to the query heads first, so each rank still holds
    the key head of each of its query heads (query head j reads key head j // (Hq / Hkv))."""
    if k.shape[1] % sp.size:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return seq_to_heads(sp, q, k, v)  # one all-to-all for the three


for _kernel, _name in KERNELS.items():
    AttentionInterface.register(_name, functools.partial(_packed_forward, _kernel))
    # Without cu_seqlens the kernels defer to SDPA, which needs SDPA's padding/causal mask.
    AttentionMaskInterface.register(_name, sdpa_mask)
