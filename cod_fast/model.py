"""The policy model: loading, the built-in tiny Qwen3, and hidden states of packed micro-batches.

Training never computes the model's logits: `packed_hidden_states` runs the decoder only and the
fused loss takes the hidden states of the trainable positions and the LM head weight (SPEC.md
section 4). Packed sequences must not attend to each other (SPEC.md section 5); on this torch
path that is a block-diagonal causal mask built from cu_seqlens (O(T^2) memory: fine for CPU-sized
and moderate GPU micro-batches; the flash-attention varlen path is the trainer's).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from cod_fast.config import ModelConfig
from cod_fast.packing import MicroBatch
from cod_fast.tokenizer import char_tokenizer

BUILTIN_TINY = "builtin:tiny-qwen3"


def resolve_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        # bf16 matmuls are ~80x slower than fp32 on the CPUs this runs on; GPUs want bf16.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def build_tiny_qwen3(cfg: ModelConfig, seed: int = 0):
    """A Qwen3-architecture model from the config's sizes and a local character tokenizer."""
    tokenizer = char_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model, tokenizer


def load_policy(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0):
    """(model, tokenizer): the built-in tiny model, or any causal LM folder / hub id."""
    device = torch.device(device)
    dtype = resolve_dtype(cfg, device)
    if cfg.name_or_path == BUILTIN_TINY:
        model, tokenizer = build_tiny_qwen3(cfg, seed)
        model = model.to(dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(cfg.name_or_path)
        model = AutoModelForCausalLM.from_pretrained(
            cfg.name_or_path, dtype=dtype, attn_implementation="sdpa"
        )
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.to(device), tokenizer


def lm_head_weight(model) -> torch.Tensor:
    """The [V, H] LM head (the embedding matrix itself when tied)."""
    return model.get_output_embeddings().weight


def block_causal_mask(
    cu_seqlens: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[1, 1, T, T] additive mask: 0 where a token may attend (same sequence, not later)."""
    lengths = cu_seqlens.diff().long().to(device)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    idx = torch.arange(seq.numel(), device=device)
    allowed = (seq[:, None] == seq[None, :]) & (idx[:, None] >= idx[None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def packed_hidden_states(model, mb: MicroBatch) -> torch.Tensor:
    """Final hidden states [T, H] of a packed micro-batch; sequences never see each other.

    Recent transformers also infer packing from restarting position_ids when no cache is used;
    the explicit mask keeps this correct whatever the version or attention implementation.
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    out = model.get_decoder()(
        input_ids=mb.input_ids[None].to(device),
        position_ids=mb.position_ids[None].to(device),
        attention_mask=block_causal_mask(mb.cu_seqlens, dtype, device),
        use_cache=False,
    )
    return out.last_hidden_state[0]
