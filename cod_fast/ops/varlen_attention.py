"""Causal attention within the blocks of a packed micro-batch, off CUDA (docs/concepts.md sec. 5).

`varlen_attention(q, k, v, cu_q, cu_k, kv_index, scale, impl=None, lengths=None)`: q [T, Hq, d], k
and v [Tk, Hkv, d]; block b holds queries cu_q[b]..cu_q[b+1] and keys cu_k[b]..cu_k[b+1], or, in
the shared-prefix layout (cod_fast.data.prefix_tree), the key rows kv_index[cu_k[b]..cu_k[b+1]]. A
block with more keys than queries (a node after its shared prefix) is causal aligned at the end, as
flash-attention's varlen: query t sees keys j <= lk - lq + t. Hq is a multiple of Hkv.

- `cpp` (float32 CPU tensors, csrc/cpu/attention.cpp): one call per layer for every block,
  forward and backward, the keys gathered per block inside the kernel and the key/value
  gradients scatter-added back through kv_index; it saves the [Hq, T] log-sum-exp and
  recomputes the probabilities in the backward pass. On the tiny model the per-block SDPA calls
  and the tree's gathers were about a third of a training step (`cod-fast bench e2e`).
- `torch`: the gather, then one `scaled_dot_product_attention` per block; the reference, and
  the path for every other dtype and device.

Default: as cod_fast.ops.layers (`cpp` for float32 CPU inputs when built, unless COD_FAST_IMPL
says torch).

Host syncs. The torch path cuts its blocks by their lengths, which the host must know. A caller
that packed the blocks knows them (cod_fast.data.packing keeps them beside cu_seqlens) and passes
them as `lengths`; without them they are read from cu_q and cu_k, which on a GPU (float32 models
on CUDA take this path) is a host sync in every layer of every micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cod_fast.ops import cpp_rows
from cod_fast.ops.cpp_rows import np_view
from cod_fast.ops.layers import layer_impl

BlockLengths = tuple[Sequence[int], Sequence[int]]
"""(query lengths, key lengths) of the blocks on the host: cu_q.diff() and cu_k.diff() as ints."""


def block_lengths(cu_q: torch.Tensor, cu_k: torch.Tensor) -> BlockLengths:
    """The blocks' lengths read from their offsets: free for CPU tensors, a host sync (a copy to
    the host that waits for the device) for tensors on a GPU."""
    return cu_q.diff().tolist(), cu_k.diff().tolist()


def per_block_sdpa(q, k, v, cu_q, cu_k, scale, lengths: BlockLengths | None = None):
    """[T, H, D] inputs; one causal SDPA call per block. The inputs are 4-D ([1, H, L, D]):
    torch's fused CPU (flash) kernel takes only 4-D ones; 3-D inputs fall back to the math path,
    which is ~3x slower and keeps the [H, L, L] probabilities for backward. The blocks are cut
    with one `split` (its backward is one concatenation; slicing would make each slice's
    backward write a zero-filled [T, H, D] gradient) by `lengths`, read from cu_q and cu_k only
    when not given (see `block_lengths`)."""
    q_lengths, k_lengths = block_lengths(cu_q, cu_k) if lengths is None else lengths
    gqa = q.shape[1] != k.shape[1]
    outs = []
    qs = q.transpose(0, 1)[None].split(q_lengths, dim=2)
    ks, vs = (x.transpose(0, 1)[None].split(k_lengths, dim=2) for x in (k, v))
    for qb, kb, vb in zip(qs, ks, vs, strict=True):
        lq, lk = qb.shape[2], kb.shape[2]
        mask = None if lq == lk else _lower_right(lq, lk, qb.device)
        out = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def _lower_right(lq: int, lk: int, device: torch.device) -> torch.Tensor:
    """[lq, lk] bool: query t may see keys up to lk - lq + t (causal, aligned at the end)."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)


class VarlenAttentionFunction(torch.autograd.Function):
    """The C++ kernels; q, k, v contiguous float32, cu_q/cu_k int32, kv_index int64 or None."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, kv_index, scale: float):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[1], q.shape[0])
        cpp_rows._module().varlen_attention_forward(
            np_view(q), np_view(k), np_view(v), np_view(cu_q), np_view(cu_k), np_view(kv_index), scale, np_view(out),
            np_view(lse), num_threads=torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, kv_index)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_q, cu_k, kv_index = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        cpp_rows._module().varlen_attention_backward(
            np_view(q), np_view(k), np_view(v), np_view(out), np_view(grad_out.contiguous()), np_view(lse), np_view(cu_q),
            np_view(cu_k), np_view(kv_index), ctx.scale, np_view(dq), np_view(dk), np_view(dv),
            num_threads=torch.get_num_threads(),
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    kv_index: torch.Tensor | None = None,
    scale: float | None = None,
    impl: str | None = None,
    lengths: BlockLengths | None = None,
) -> torch.Tensor:
    """[T, Hq, d] causal attention per block (see the module docstring); `scale` None is
    1 / sqrt(d). `lengths`: the blocks' (query lengths, key lengths) on the host, which must
    agree with cu_q and cu_k; None reads them from cu_q and cu_k (a host sync on a GPU)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if layer_impl(impl, q) == "cpp" and k.dtype == v.dtype == torch.float32:
        cu = (x.to("cpu", torch.int32).contiguous() for x in (cu_q, cu_k))
        index = None if kv_index is None else kv_index.to("cpu", torch.int64).contiguous()
        q, k, v = (x.contiguous() for x in (q, k, v))
        return VarlenAttentionFunction.apply(q, k, v, *cu, index, scale)
    if kv_index is not None:
        k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
    return per_block_sdpa(q, k, v, cu_q, cu_k, scale, lengths)
