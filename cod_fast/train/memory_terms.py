"""What each buffer of a run holds on one device, in bytes: the terms of the memory plan
(cod_fast.train.memory_plan adds them up per phase).

Every term is the size of tensors the code allocates, from the model's shape (counted on the
meta device, cod_fast.model.shapes) and the config, never a fitted constant:

- FSDP2 (cod_fast.distributed.fsdp): the float32 master shard, the gradient shard and AdamW's two
  moments are 1/S of the parameters each (S ranks share a replica); during a forward and a
  backward the root's parameters stay gathered in the compute dtype and at most two decoder
  layers are gathered at once (the one running and the one prefetched); before each layer's
  reduce-scatter its gradient exists whole, in the compute dtype and again in the reduce dtype.
- Activations: what autograd keeps per token and layer, read off the modules the trainer runs
  (cod_fast.model.lean's norms and SwiGLU, the packed attention, which keeps q, k, v, its
  output and the log-sum-exp as flash attention does), counted on a real forward by
  tests/train/test_memory_plan.py; with gradient checkpointing each layer keeps its input and one
  layer's activations exist again while it is recomputed.
- The fused loss (cod_fast.ops.chunked): its float32 logits chunk and that chunk's gradient
  (`chunk_rows`), the float32 gradients of the LM head and of the hidden states.
- Ulysses sequence parallelism (cod_fast.ops.sequence_parallel): a rank's activations and loss
  chunks are those of its own 1/N of a micro-batch's tokens; on top of them, the attention
  output kept in both layouts, the all-to-alls' buffers, and the whole micro-batch's per-token
  loss vectors, which every rank of the group holds.
- Samplers: the torch sampler's KV cache as the static path pads it (`row_bucket`,
  `width_bucket` in cod_fast.rollout.fast_decode), the CUDA graph's intermediates for one decode
  step, and vLLM's `gpu_memory_utilization` share while it is awake.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cod_fast.model.shapes import ModelShape
from cod_fast.ops.chunked import chunk_rows
from cod_fast.rollout.fast_decode import row_bucket, width_bucket

FLOAT32 = 4
INT64 = 8
REDUCE_BYTES = 4
"""FSDP2's reduce dtype for gradients here: float32 (cod_fast.distributed.fsdp)."""


@dataclass(frozen=True)
class Term:
    """One buffer of a phase: a name the user recognises, its bytes, and how they were counted."""

    name: str
    bytes: int
    what: str


@dataclass(frozen=True)
class Layout:
    """How the run places the model on one device."""

    shards: int
    """Ranks that share one replica's parameters (1: unsharded)."""
    sharded: bool
    """FSDP2 is in use (several ranks, or one rank with float32 masters under a 16-bit compute)."""
    compute: torch.dtype
    master: torch.dtype
    device: torch.device


def master_terms(shape: ModelShape, layout: Layout, optimizer: bool) -> list[Term]:
    """The weights the optimizer updates, and its AdamW moments once it has stepped."""
    share = math.ceil(shape.params / layout.shards)
    size, name = layout.master.itemsize, str(layout.master).removeprefix("torch.")
    how = f"{share:,} parameters" + (f" (1/{layout.shards})" if layout.shards > 1 else "")
    terms = [Term("weights", share * size, f"{how} x {size} B {name}")]
    if optimizer:
        terms.append(Term("AdamW state", 2 * share * size, f"2 moments x {how} x {size} B"))
    return terms


def training_weight_terms(shape: ModelShape, layout: Layout) -> list[Term]:
    """Gradients, and under FSDP2 the gathered compute weights and whole gradients of a step."""
    share = math.ceil(shape.params / layout.shards)
    size = layout.master.itemsize
    terms = [Term("gradients", share * size, f"{share:,} parameters x {size} B")]
    if not layout.sharded:
        return terms
    cb = layout.compute.itemsize
    gathered = (shape.root_params + 2 * shape.layer_params) * cb
    terms.append(
        Term(
            "gathered weights",
            gathered,
            f"root {shape.root_params:,} + 2 layers x {shape.layer_params:,} parameters x {cb} B",
        )
    )
    unit = max(shape.root_params, shape.layer_params)
    terms.append(
        Term(
            "whole gradients",
            unit * (cb + REDUCE_BYTES),
            f"the largest unit's {unit:,} gradients before reduce-scatter, x ({cb} + "
            f"{REDUCE_BYTES}) B",
        )
    )
    return terms


def layer_activation_bytes(shape: ModelShape, itemsize: int, lean: bool) -> int:
    """Bytes autograd keeps per token for one decoder layer. Lean (cod_fast.model.lean): the
    two norms' inputs and outputs (4 H) and their reciprocal RMS (float32); q and k before
    their head norms, after rotary, and v (3 widths each, the q-side one being the attention
    output as well); the attention's float32 log-sum-exp per query head; the SwiGLU's gate and
    up (2 I). transformers' own modules keep 2 I + 2 H + the q and k widths more."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    elements = 4 * shape.hidden + 3 * q + 3 * kv + 2 * shape.intermediate
    small = FLOAT32 * (2 + shape.heads + shape.kv_heads + shape.heads)
    if not lean:
        elements += 2 * shape.intermediate + 2 * shape.hidden + q + kv
    return elements * itemsize + small


def activation_terms(
    shape: ModelShape, tokens: int, itemsize: int, lean: bool, checkpointing: bool
) -> list[Term]:
    """What a micro-batch of `tokens` keeps for its backward, and the hidden states the loss
    reads: the final norm's input and reciprocal RMS, the rotary tables (one pair per forward)."""
    layer = layer_activation_bytes(shape, itemsize, lean)
    around = tokens * (shape.hidden * itemsize + FLOAT32 + 2 * shape.head_dim * itemsize)
    if checkpointing:
        kept = tokens * shape.layers * shape.hidden * itemsize
        how = f"{shape.layers} layer inputs + 1 layer recomputed ({layer:,} B) a token"
        total = kept + tokens * layer
    else:
        how = f"{shape.layers} layers x {layer:,} B a token"
        total = tokens * shape.layers * layer
    return [
        Term("activations", total + around, f"{tokens:,} tokens x ({how}) + final norm, rotary")
    ]


def loss_terms(shape: ModelShape, rows: int, device: torch.device, itemsize: int) -> list[Term]:
    """The fused loss's buffers (cod_fast.ops.chunked) for `rows` trainable tokens: the final
    hidden states it keeps, one float32 logits chunk (its rows' gradient overwrites it in place,
    cod_fast.ops.cpp_rows and the Triton rows alike), and the float32 gradients of the LM head
    and of the hidden states, made in the forward and kept for the backward."""
    chunk = chunk_rows(rows, shape.vocab, device, torch.float32)
    grads = (shape.vocab + rows) * shape.hidden * FLOAT32
    return [
        Term("loss inputs", rows * shape.hidden * itemsize, f"{rows:,} hidden states"),
        Term(
            "loss chunks",
            chunk * shape.vocab * FLOAT32,
            f"{chunk:,} rows x {shape.vocab:,} logits x 4 B",
        ),
        Term("loss gradients", grads, f"(V {shape.vocab:,} + {rows:,} rows) x H x 4 B"),
    ]


ROW_BYTES = 2 * INT64
"""Per token of a micro-batch, on every rank of a sequence-parallel group: its token id and
position (the whole row moves to each rank; the shard's own are a share of it)."""
SEQUENCE_LOSS_BYTES = 3 * INT64 + 4 * FLOAT32 + 2 * FLOAT32 + 20 * FLOAT32
"""Per trainable token of a micro-batch, on every rank of a sequence-parallel group: its index,
target and segment id (int64), advantage and rollout, old and reference log-probs (float32), the
all-gather's padded parts of the log-prob and entropy, and the loss computed from the gathered
values (cod_fast.ops.policy_loss): at most 20 float32 vectors alive at its peak, forward and
backward, the gathered values included (tests/train/test_memory_plan.py counts them)."""


def sequence_parallel_terms(
    shape: ModelShape, tokens: int, size: int, rows: int, itemsize: int, checkpointing: bool
) -> list[Term]:
    """What a rank of a sequence-parallel group of `size` adds to its own `tokens` tokens'
    activations and loss (train.sequence_parallel, cod_fast.ops.sequence_parallel), for
    micro-batches of `size` x `tokens` tokens of which `rows` are trained on:

    - attention layouts: the attention output exists twice, in head layout (the kernel keeps it
      for its backward) and back in sequence layout (the output projection's input), one Hq x D
      more a token for every layer that keeps its activations (one, recomputed, with gradient
      checkpointing); key/value heads that `size` does not divide are repeated to the query
      heads before the all-to-all, and the kernel keeps them so;
    - all-to-all buffers: transient, one layer's q, k and v in the sequence layout (the
      attention module still holds them while the kernel runs on their head layout, which the
      activations count) and one more output-sized buffer (a send copy, the output received
      back; in the backward the gradients the same way);
    - loss vectors: the whole micro-batch's per-token values (`ROW_BYTES`,
      `SEQUENCE_LOSS_BYTES`) on every rank: each rank computes the whole loss.
    """
    kv = shape.kv_heads if shape.kv_heads % size == 0 else shape.heads
    d, layers = shape.head_dim, 1 if checkpointing else shape.layers
    kept = tokens * layers * (shape.heads + 2 * (kv - shape.kv_heads)) * d * itemsize
    repeat = f", {shape.kv_heads} kv heads repeated to {kv}" if kv != shape.kv_heads else ""
    moved = tokens * (2 * shape.heads + 2 * kv) * d * itemsize
    whole = size * tokens
    vectors = whole * ROW_BYTES + rows * SEQUENCE_LOSS_BYTES
    return [
        Term(
            "attention layouts",
            kept,
            f"{tokens:,} tokens x {layers} layer(s) x the output's 2nd layout{repeat}",
        ),
        Term(
            "all-to-all buffers",
            moved,
            f"{tokens:,} tokens x (q, k, v + 1 buffer: 2 x {shape.heads} + 2 x {kv} heads) x "
            f"{d} x {itemsize} B, one layer",
        ),
        Term(
            "loss vectors",
            vectors,
            f"the whole micro-batch: {whole:,} tokens x {ROW_BYTES} B + {rows:,} trained x "
            f"{SEQUENCE_LOSS_BYTES} B, on each of {size} ranks",
        ),
    ]


def torch_sampler_terms(
    shape: ModelShape, rows: int, columns: int, itemsize: int, static: bool, graphs: bool
) -> list[Term]:
    """The torch sampler's decode state for `rows` sequences of up to `columns` tokens: the KV
    cache as the static path pads it (or unpadded, compacting), the logits and draw buffers of a
    step, and with CUDA graphs the graph's own intermediates of one step."""
    padded_rows = row_bucket(rows) if static else rows
    width = width_bucket(columns) if static else columns
    kv = padded_rows * width * shape.kv_bytes_per_token(itemsize)
    shape_note = f"{padded_rows} rows x {width} columns" + (
        f" (padded from {rows} x {columns})" if static else ""
    )
    terms = [Term("KV cache", kv, f"{shape_note} x {shape.kv_bytes_per_token(itemsize):,} B")]
    # A step's logits, their float32 copy and log-softmax, and draw's float64 running sum; with
    # CUDA graphs they live in the graph's pool, with the layers' intermediates of one step.
    per_row = shape.vocab * (itemsize + FLOAT32 + FLOAT32 + 8)
    step = padded_rows * per_row
    if not graphs:
        terms.append(
            Term("decode step", step, f"{padded_rows} rows x V x {per_row // shape.vocab} B")
        )
        return terms
    layer = padded_rows * (4 * shape.hidden + 2 * shape.intermediate) * itemsize
    how = f"{padded_rows} rows x (V x {per_row // shape.vocab} B + (4 H + 2 I) x {itemsize} B)"
    terms.append(Term("CUDA graph pool", step + layer, how))
    return terms


def prefill_terms(shape: ModelShape, prompts: int, prompt_tokens: int, itemsize: int) -> list[Term]:
    """The prefill's cache of the distinct prompts (a group's members share one), which lives
    beside the static cache it is copied into while a call decodes."""
    kv = prompts * prompt_tokens * shape.kv_bytes_per_token(itemsize)
    return [Term("prefill cache", kv, f"{prompts} prompts x {prompt_tokens} tokens")]


def checkpoint_host_terms(
    shape: ModelShape, layout: Layout, ranks_per_node: int, sharded_format: bool
) -> list[Term]:
    """Host memory of one node while a checkpoint is saved or loaded: the float32 (master)
    weights and AdamW's two moments as CPU copies. Sharded (cod_fast.run.sharded: every rank its
    own shard) each rank holds 1/S of them; in the one-process format the main rank holds all of
    them, on the first node."""
    size = layout.master.itemsize
    if sharded_format:
        share = math.ceil(shape.params / layout.shards)
        nbytes = ranks_per_node * 3 * share * size
        how = f"{ranks_per_node} ranks x 3 x {share:,} parameters x {size} B (each its shard)"
        return [Term("checkpoint save / load", nbytes, how)]
    how = f"3 x {shape.params:,} parameters x {size} B on the main rank (whole)"
    return [Term("checkpoint save / load", 3 * shape.params * size, how)]


def teacher_host_terms(
    teachers: list[ModelShape], ranks_per_node: int, itemsize: int
) -> list[Term]:
    """Teachers that wait in host memory (cod_fast.train.teachers: when they do not all fit on
    the device beside the student), whole on every rank."""
    params = sum(t.params for t in teachers)
    how = f"{ranks_per_node} ranks x {params:,} teacher parameters x {itemsize} B"
    return [Term("teachers waiting", ranks_per_node * params * itemsize, how)]
