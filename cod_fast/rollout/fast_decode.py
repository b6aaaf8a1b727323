"""Decode steps for the torch sampler without the Hugging Face module stack.

A decode step feeds one token per row through the model. Through transformers' modules that is
some 60 module calls and a growing-cache concatenation per layer, and on a small model on a CPU
that Python work, not arithmetic, is the step (`cod-fast bench e2e`, tiny model: 3.6 ms per step
for 32 rows, a third of it in torch kernels). `FastDecoder` runs the same arithmetic from the
model's own parameters (read at every step, so optimizer updates are seen without a copy) into a
preallocated KV cache that each step writes one column of:

    x = embed(token)
    per layer: h = norm(x); q, k, v = proj(h); [q_norm, k_norm]; rope(q, k) at the row's
               position; cache[:, :, col] = k, v; x += o_proj(sdpa(q, cache[:, :, :col+1],
               mask = the prompt's left padding)); x += down(silu(gate(norm(x))) * up(norm(x)))
    logits = lm_head(norm(x))

Rows decode in lockstep (the prompts are left-padded to one width), so every live row writes the
same cache column, and a row that stops leaves the batch (its cache rows are dropped) as with
transformers' cache. The prompts are prefilled by the same arithmetic (`prefill`, one left-padded
bucket at a time, into a transformers cache the sampler joins across buckets), then copied in.

Supported: the plain pre-norm decoders whose modules this reads (`ARCHITECTURES`: Qwen3, Qwen2,
Llama, Mistral) with SiLU-gated MLPs, full attention in every layer and default or scaled RoPE
(the model's own rotary module computes cos and sin), built of plain `nn.Linear`/`nn.Embedding`
modules with no forward hooks and no replaced forward (cod_fast.model.lean's excepted: same
arithmetic). `FastDecoder.supports` says why any other model is refused (an adapter such as
LoRA, a hook that edits logits, a sliding window); the sampler then decodes through
transformers. The RMSNorm, the SwiGLU product and a decode step's attention are
cod_fast.ops.layers' kernels, as in cod_fast.model.lean (C++ for float32 on a CPU; the RMSNorm float32
inside for 16-bit inputs and float64 for float64, which is transformers' arithmetic except that
transformers rounds float64 to float32).

Static shapes (`StaticCache`, the sampler's path on CUDA): on a GPU a small model's decode step
is a few hundred kernel launches and host work around them (an 8-layer H = 1024 model on an
H200: ~26 ms per step for ~0.2 ms of GPU work). Compaction changes the batch's shape whenever a
row stops, and the column `col` is a host int, so no step can be recorded once and replayed.
A `StaticCache` holds the batch padded to a row bucket (`row_bucket`) and the cache to a width
bucket (`width_bucket`); the column and the positions are device tensors advanced in place; the
new column is written with `index_copy_` and attention reads the whole width under an additive
mask, -inf on the left padding and on the columns not written yet. Rows that stop stay in the
batch and compute on finite leftovers that nobody reads. Every step is then the same kernels on
the same buffers, so `CapturedStep` records it as a CUDA graph and replays it: the weights are
read by address, so in-place weight updates are seen and a replaced parameter needs a new graph
(the sampler keys its graphs on the parameters' data_ptr). The keys and values of every bucket
are views of one `KVStorage`, sized for the largest bucket (rows x width) seen: a bucket costs
no KV memory of its own, and a memory plan counts row_bucket(rows) x width_bucket(columns) x
layers x 2 x kv_heads x head_dim x itemsize bytes for the sampler's cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from cod_fast.model.lean import _lean_mlp_forward, _lean_norm_forward
from cod_fast.ops.layers import (
    decode_attention,
    keys_transposed,
    position_heads,
    rms_norm,
    swiglu,
)
from cod_fast.rollout.vllm_sampler import head_dim, kv_heads

_LINEAR_NAMES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"
)  # fmt: skip
LEAN_FORWARDS = (_lean_mlp_forward, _lean_norm_forward)  # the same arithmetic, read as weights

ARCHITECTURES = {
    # model_type: whether the attention normalises q and k per head (q_norm, k_norm)
    "qwen3": True,
    "qwen2": False,
    "llama": False,
    "mistral": False,
}


ROW_BUCKET_MIN = 8
WIDTH_BUCKET = 256


def row_bucket(rows: int) -> int:
    """The static path's batch size for `rows` rows: the next power of two, at least 8 (few
    shapes, so few graphs, at most twice the rows)."""
    return max(ROW_BUCKET_MIN, 1 << (rows - 1).bit_length())


def width_bucket(columns: int) -> int:
    """The static path's cache width for `columns` columns: the next multiple of 256."""
    return -(-columns // WIDTH_BUCKET) * WIDTH_BUCKET


@dataclass
class _Layer:
    attn: torch.nn.Module
    mlp: torch.nn.Module
    norm_in: torch.nn.Module
    norm_post: torch.nn.Module


class FastDecoder:
    """Decode steps of one supported causal LM (see the module docstring)."""

    def __init__(self, model):
        why = self.supports(model)
        if why is not None:
            raise ValueError(f"FastDecoder: {why}")
        self.model = model
        config = model.config
        self.qk_norm = ARCHITECTURES[config.model_type]
        inner = model.model
        self.embed, self.final_norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.head = model.get_output_embeddings()
        self.layers = [
            _Layer(lay.self_attn, lay.mlp, lay.input_layernorm, lay.post_attention_layernorm)
            for lay in inner.layers
        ]
        self.heads = config.num_attention_heads
        self.kv_heads = kv_heads(config)
        self.head_dim = head_dim(config)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask = torch.empty(0, 0, dtype=torch.bool)
        self.col = 0

    @staticmethod
    def supports(model) -> str | None:
        """None when FastDecoder computes what `model`'s forward computes, else why not."""
        config = getattr(model, "config", None)
        kind = getattr(config, "model_type", None)
        if kind not in ARCHITECTURES:
            return f"model_type {kind!r} is not one of {sorted(ARCHITECTURES)}"
        if getattr(config, "hidden_act", None) != "silu":
            return f"hidden_act {config.hidden_act!r} (only the SiLU-gated MLP is implemented)"
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        if any(t != "full_attention" for t in layer_types):
            return "sliding-window layers (only full attention is implemented)"
        if getattr(config, "sliding_window", None) and kind == "mistral":
            return "a sliding window (only full attention is implemented)"
        inner = getattr(model, "model", None)
        for name in ("embed_tokens", "norm", "rotary_emb", "layers"):
            if not hasattr(inner, name):
                return f"the model has no model.{name}"
        for layer in inner.layers:
            attn = layer.self_attn
            if getattr(attn, "sliding_window", None):
                return "a sliding-window attention layer"
            norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
            if (
                ARCHITECTURES[kind]
                and len({getattr(m, "variance_epsilon", None) for m in norms}) != 1
            ):
                return "q_norm and k_norm with different epsilons (the fast path takes one)"
        for name, module in model.named_modules():
            if module._forward_hooks or module._forward_pre_hooks:
                return f"{name or 'the model'} has a forward hook (the fast path would skip it)"
            if name.endswith(_LINEAR_NAMES) and type(module) is not torch.nn.Linear:
                return f"{name} is a {type(module).__name__}, not a plain nn.Linear"
            forward = vars(module).get("forward")
            if forward is not None and getattr(forward, "__func__", None) not in LEAN_FORWARDS:
                return f"{name}'s forward was replaced (the fast path would skip it)"
        if type(inner.embed_tokens) is not torch.nn.Embedding:
            return f"the embedding is a {type(inner.embed_tokens).__name__}, not nn.Embedding"
        return None

    def static_refusal(self) -> str | None:
        """None when `StaticCache` steps compute what `step` computes, else why not: a dynamic
        or long RoPE recomputes its frequencies from the largest position in the batch (a host
        read, and in a padded batch the positions of stopped rows would count)."""
        rope = getattr(self.rotary, "rope_type", "default")
        if "dynamic" in rope or rope == "longrope":
            return f"rope_type {rope!r} depends on the batch's largest position"
        return None

    # --- prefill and the cache -------------------------------------------------------------

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
        """(transformers DynamicCache of the prompt's keys and values, [B, V] logits of the last
        position) of left-padded prompts `ids` [B, W] with padding `mask` [B, W] and `positions`.

        A query sees the real keys at or before it; a padding query sees itself alone: a query
        with no key at all is NaN in some SDPA kernels (torch 2.13's CPU kernel returns 0), and a
        NaN value vector would reach real rows through 0 * NaN."""
        width = ids.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril_()
        own = torch.eye(width, dtype=torch.bool, device=ids.device)
        attn_mask = (causal & mask.bool()[:, None, :]) | own  # [B, W queries, W keys]
        cache = DynamicCache(config=self.model.config)

        def attend(layer, attn, q, k, v, cos, sin):
            q, k = position_heads(q, k, self._head_norms(attn), cos, sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, kv_heads, W, d]
            cache.update(k, v, layer)
            out = self._sdpa(q.transpose(1, 2), k, v, attn_mask[:, None], attn.scaling)
            return out.transpose(1, 2)

        return cache, self._run(ids, positions, attend)

    def start(self, cache, mask: torch.Tensor, new_tokens: int, index: torch.Tensor) -> None:
        """Take over the rows `index` (repeats allowed) of a prefilled cache (keys [B, kv_heads,
        W, d] per layer) and of its left-padding mask [B, W], with room for `new_tokens` more
        columns. The keys are kept in the layout decode_attention reads on their dtype and
        device: transposed, [B, kv_heads, d, W], for the C++ kernel, else [B, kv_heads, W, d]
        (ops.layers.keys_transposed)."""
        rows, width = len(index), mask.shape[1]
        full = -(-(width + new_tokens) // 16) * 16  # whole vectors for the C++ key loops
        # The dimension order the keys are stored in (a swap, its own inverse).
        order = (0, 1, 3, 2) if keys_transposed(None, cache.layers[0].keys) else (0, 1, 2, 3)
        self.keys, self.values = [], []
        for layer in cache.layers:
            keys, values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
            shape = (rows, self.kv_heads, full, self.head_dim)
            self.keys.append(keys.new_zeros([shape[i] for i in order]))
            self.keys[-1].permute(order)[:, :, :width] = keys
            self.values.append(values.new_empty(shape))
            self.values[-1][:, :, :width] = values
        self.mask = torch.ones(rows, full, dtype=torch.bool, device=mask.device)
        self.mask[:, :width] = mask.bool()[index]
        self.col = width

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows `index` (the rows still decoding)."""
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.mask = self.mask.index_select(0, index)

    # --- decode ---------------------------------------------------------------------------

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B, V] logits of `tokens` [B, 1] at `positions` [B, 1]; the cache grows by one column."""
        col = self.col
        if col >= self.mask.shape[1]:
            raise RuntimeError("FastDecoder: the cache is full; start() with more new_tokens")

        def attend(layer, attn, q, k, v, cos, sin):
            out = decode_attention(
                q[:, 0], k[:, 0], v[:, 0], self._head_norms(attn), cos[:, 0],
                sin[:, 0], self.keys[layer], self.values[layer], self.mask, col, attn.scaling,
            )  # fmt: skip
            return out[:, None]

        logits = self._run(tokens, positions, attend)
        self.col += 1
        return logits

    # --- the arithmetic -------------------------------------------------------------------

    def _run(self, tokens, positions, attend) -> torch.Tensor:
        """The model on `tokens` [B, T] at `positions` [B, T]: [B, V] logits of the last
        position; `attend(layer, attention module, q, k, v, cos, sin)` (the projections
        [B, T, heads, d], the rotary's [B, T, d]) returns the attention [B, T, heads, d]."""
        rows, count = tokens.shape
        x = self.embed(tokens)  # [B, T, H]
        cos, sin = self.rotary(x, positions)  # [B, T, d]
        shape = (rows, count, -1, self.head_dim)
        for i, layer in enumerate(self.layers):
            attn = layer.attn
            h = self._norm(layer.norm_in, x)
            q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(shape)
            k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(shape)
            v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(shape)
            out = attend(i, attn, q, k, v, cos, sin).reshape(rows, count, -1)
            x = x + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            x = x + self._mlp(layer.mlp, self._norm(layer.norm_post, x))
        x = self._norm(self.final_norm, x[:, -1])
        return F.linear(x, self.head.weight, self.head.bias)

    def _head_norms(self, attn):
        """(q_norm weight, k_norm weight, eps) of a Qwen3 attention, else None (`supports`
        checked that the two epsilons agree)."""
        if not self.qk_norm:
            return None
        return attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon

    def _sdpa(self, q, k, v, attn_mask, scale):
        gqa = self.kv_heads != self.heads
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=gqa
        )

    def _norm(self, module, x):
        return rms_norm(x, module.weight, module.variance_epsilon)

    def _mlp(self, mlp, h):
        gate = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
        up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
        product = swiglu(gate, up)
        return F.linear(product, mlp.down_proj.weight, mlp.down_proj.bias)


class KVStorage:
    """The static path's keys and values: one flat buffer per layer for each, shared by every
    (rows, width) bucket. A bucket's cache is a view of the first rows x kv_heads x width x d
    elements of each buffer (`views`): calls run one at a time, so two buckets never hold live
    data at once, and a bucket's steps read only the columns its `StaticCache.load` and its own
    steps wrote (another bucket's leftovers lie under the -inf mask, weight exactly 0). A
    captured graph reads these addresses, so storage that grows is new storage, and every graph
    recorded on the old one goes with it (`cod_fast.rollout.torch_batch.StaticRuns`)."""

    def __init__(self, layers: int, numel: int, dtype, device):
        # Zeros, not empty: masked columns are multiplied by 0 weights, and 0 * NaN is NaN.
        self.keys = [torch.zeros(numel, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(numel, dtype=dtype, device=device) for _ in range(layers)]
        self.numel, self.dtype, self.device = numel, dtype, torch.device(device)

    def fits(self, numel: int, dtype, device) -> bool:
        """Whether a bucket of `numel` elements per layer in `dtype` on `device` fits here."""
        return numel <= self.numel and dtype == self.dtype and torch.device(device) == self.device

    def nbytes(self) -> int:
        """Bytes held: layers x 2 (keys, values) x numel x itemsize."""
        return 2 * len(self.keys) * self.numel * self.keys[0].element_size()

    def views(self, shape: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(keys, values): every layer's first prod(shape) elements as contiguous `shape`."""
        numel = math.prod(shape)
        if numel > self.numel:
            raise ValueError(
                f"KVStorage: a {shape} cache needs {numel} elements, it holds {self.numel}"
            )
        return (
            [k[:numel].view(shape) for k in self.keys],
            [v[:numel].view(shape) for v in self.values],
        )


class StaticCache:
    """A FastDecoder's decode state in buffers of one shape (see the module docstring): keys
    and values [rows, kv_heads, width, d] per layer (views of `storage`), the additive attention
    mask [rows, width], the input tokens and positions [rows, 1] and the column [1] that the next
    step writes. `step` reads and advances them in place, with the same kernels on the same
    buffers at every step, so it can run as a CUDA graph."""

    def __init__(self, decoder: FastDecoder, rows: int, width: int, storage: KVStorage):
        self.decoder = decoder
        dtype, device = storage.dtype, storage.device
        self.keys, self.values = storage.views((rows, decoder.kv_heads, width, decoder.head_dim))
        self.bias = torch.zeros(rows, width, dtype=dtype, device=device)
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.col = torch.zeros(1, dtype=torch.long, device=device)

    def nbytes(self) -> int:
        """Bytes of the buffers this bucket owns (the mask, tokens, positions and column; the
        keys and values belong to the storage)."""
        return sum(t.nbytes for t in (self.bias, self.tokens, self.positions, self.col))

    def load(self, cache, mask: torch.Tensor, next_pos: torch.Tensor, index: torch.Tensor):
        """Take over the rows `index` [rows] (repeats allowed) of a prefilled cache (keys and
        values [B, kv_heads, W, d] per layer), of its left-padding mask [B, W] and of its next
        positions [B, 1]. Steps write columns W, W + 1, ... up to the buffers' width."""
        width = mask.shape[1]
        for layer, keys, values in zip(cache.layers, self.keys, self.values, strict=True):
            keys[:, :, :width] = layer.keys.index_select(0, index)
            values[:, :, :width] = layer.values.index_select(0, index)
        self.bias.fill_(-math.inf)
        self.bias[:, :width].masked_fill_(mask.bool()[index], 0.0)
        self.positions.copy_(next_pos[index])
        self.col.fill_(width)

    def step(self) -> torch.Tensor:
        """[rows, V] logits of `tokens` at `positions`; writes their keys and values into
        column `col`, then advances `col` and `positions` by one (no host read, no shape that
        depends on the step)."""
        self.bias.index_fill_(1, self.col, 0.0)
        logits = self.decoder._run(self.tokens, self.positions, self._attend)
        self.col += 1
        self.positions += 1
        return logits

    def _attend(self, layer, attn, q, k, v, cos, sin):
        """A step's attention over the whole width. The query heads that share a key-value
        head become that head's queries ([rows, kv_heads, group, d]), so SDPA reads the cache
        as it is without enable_gqa: on CUDA a masked call with enable_gqa goes to the math
        kernel (transformers' SDPA attention avoids it for that reason), which repeats the keys
        and values for every query head."""
        decoder = self.decoder
        q, k = position_heads(q[:, 0], k[:, 0], decoder._head_norms(attn), cos[:, 0], sin[:, 0])
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(2, self.col, k[:, :, None])
        values.index_copy_(2, self.col, v[:, 0, :, None])
        rows, heads, dim = q.shape
        grouped = q.view(rows, decoder.kv_heads, heads // decoder.kv_heads, dim)
        out = F.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=self.bias[:, None, None], scale=attn.scaling
        )
        return out.reshape(rows, 1, heads, dim)


class CapturedStep:
    """`step()`, a function of fixed buffers only, recorded once as a CUDA graph; calling this
    replays it (one launch for the whole step). Recording runs `step` once first, on a side
    stream as torch.cuda.graphs asks (cuBLAS handles and workspaces are made outside the
    capture): call it before the buffers hold real data.

    The graph's intermediates come from the memory pool `pool` (a new one, torch.cuda's
    graph_pool_handle(), when None); `self.pool` is the pool it used, for the next capture to
    share. Graphs in one pool may replay in any order as long as they never replay at once and
    none reads another's intermediates (torch/cuda/graphs.py, `graph`'s `pool` argument;
    pytorch/pytorch#166975): a step leaves nothing in the pool, its results are written into
    buffers allocated before the capture. Every capture here uses `torch.cuda.graph`'s one
    default capture stream, as the same docstring asks of captures that share a pool. A pool
    whose graphs are all gone cannot take another capture (c10/cuda/CUDACachingAllocator.cpp,
    `create_or_incref_pool` asserts use_count > 0): start a new one then."""

    def __init__(self, step, pool=None):
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a data loader, a checkpoint writer) during
        # the capture are theirs, not the graph's.
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            step()

    def __call__(self) -> None:
        self.graph.replay()
