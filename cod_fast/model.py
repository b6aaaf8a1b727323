"""The policy model: loading, the built-in tiny Qwen3, and hidden states of packed micro-batches.

Training never computes the model's logits: `packed_hidden_states` runs the decoder only and the
fused loss takes the hidden states of the trainable positions and the LM head weight (SPEC.md
section 4). Packed sequences must not attend to each other (SPEC.md section 5): `load_policy`
installs one of the varlen kernels of cod_fast.attention (flash-attn, torch's varlen_attn, or
per-sequence SDPA on the CPU and for float32), which read cu_seqlens. A model with any other
attention implementation gets a block-diagonal causal mask instead (O(T^2) memory: the reference
the tests compare the kernels with).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from cod_fast.attention import KERNELS, packed_attention_kwargs, resolve_attn_impl
from cod_fast.config import ModelConfig
from cod_fast.lean import make_lean
from cod_fast.packing import MicroBatch
from cod_fast.tokenizer import char_tokenizer

BUILTIN_TINY = "builtin:tiny-qwen3"


def resolve_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The compute dtype of `cfg` on `device`: what every forward runs in."""
    if cfg.dtype == "auto":
        # bf16 matmuls are ~80x slower than fp32 on the CPUs this runs on; GPUs want bf16.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def master_dtype(cfg: ModelConfig, master: str, device: torch.device) -> torch.dtype:
    """The dtype a trainer keeps its weights in (`train.master_dtype`): float32 for `float32`,
    else the compute dtype. The two differ exactly when the run is in mixed precision."""
    return torch.float32 if master == "float32" else resolve_dtype(cfg, device)


def build_tiny_qwen3(cfg: ModelConfig, seed: int = 0, tokenizer=None):
    """A Qwen3-architecture model from the config's sizes, for `tokenizer` (default: the local
    character tokenizer)."""
    tokenizer = tokenizer if tokenizer is not None else char_tokenizer()
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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model, tokenizer


def load_policy(
    cfg: ModelConfig,
    device: torch.device | str = "cpu",
    seed: int = 0,
    tokenizer=None,
    *,
    dtype: torch.dtype | None = None,
    place: torch.device | str | None = None,
):
    """(model, tokenizer): the built-in tiny model (for `tokenizer`, default the character
    tokenizer), or any causal LM folder / hub id with its own tokenizer. Its parameters are in
    `dtype` (default: the compute dtype; a trainer in mixed precision asks for its float32
    master dtype); the attention kernel is chosen for the compute dtype. Dtype and kernel are
    those of `device`, where the model will compute; its weights are put on `place` (default:
    `device`), such as host memory for a model moved to the device only when it runs."""
    device = torch.device(device)
    dtype = dtype or resolve_dtype(cfg, device)
    if cfg.name_or_path == BUILTIN_TINY:
        model, tokenizer = build_tiny_qwen3(cfg, seed, tokenizer)
        model = model.to(dtype)
    else:
        # Never code from a model folder: a model that needs its own Python fails with
        # transformers' message instead of asking on the terminal whether to run it.
        tokenizer = AutoTokenizer.from_pretrained(cfg.name_or_path, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            cfg.name_or_path, dtype=dtype, attn_implementation="sdpa", trust_remote_code=False
        )
    prepare_model(model, cfg, device)
    return model.to(device if place is None else place), tokenizer


def prepare_model(model, cfg: ModelConfig, device: torch.device) -> None:
    """What training on `device` needs from a loaded causal LM, per `cfg`: cod-fast's packed
    attention kernel, the memory-lean modules, gradient checkpointing."""
    kernel = resolve_attn_impl(cfg.attn_impl, device, resolve_dtype(cfg, device))
    model.set_attn_implementation(KERNELS[kernel])
    if cfg.lean_activations:
        make_lean(model)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)


def enable_checkpointing(model) -> None:
    """Recompute each decoder layer in the backward pass (non-reentrant). transformers renamed
    `gradient_checkpointing_enable` to `activation_checkpointing_enable` during 5.x."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})


def lm_head_weight(model) -> torch.Tensor:
    """The [V, H] LM head (the embedding matrix itself when tied)."""
    return model.get_output_embeddings().weight


def block_causal_mask(
    cu_seqlens: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """[1, 1, T, T] additive mask: 0 where a token may attend (its own sequence, not later).
    `tree` = (kv_index, cu_seqlens_k, position_ids) of the shared-prefix layout: block i's
    queries may attend to its keys at no greater position."""
    if tree is None:
        lengths = cu_seqlens.diff().long().cpu()
        seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        idx = torch.arange(seq.numel())
        allowed = (seq[:, None] == seq[None, :]) & (idx[:, None] >= idx[None, :])
    else:
        kv_index, cu_k, depth = (x.cpu() for x in tree)
        cu, cu_k = cu_seqlens.tolist(), cu_k.tolist()
        allowed = torch.zeros(cu[-1], cu[-1], dtype=torch.bool)
        for i in range(len(cu) - 1):
            rows, cols = slice(cu[i], cu[i + 1]), kv_index[cu_k[i] : cu_k[i + 1]]
            allowed[rows, cols] = depth[cols][None, :] <= depth[rows][:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None].to(device)


def packed_hidden_states(model, mb: MicroBatch) -> torch.Tensor:
    """Final hidden states [T, H] of a packed micro-batch; sequences never see each other.

    With a cod_fast.attention kernel the decoder attends per sequence (tree node) from
    cu_seqlens (and the key blocks of the shared-prefix layout); any other attention
    implementation gets the explicit [T, T] mask (recent transformers also infer packing from
    restarting position_ids, but not every version or implementation does, nor trees).
    """
    param = next(model.parameters())
    if model.config._attn_implementation in KERNELS.values():
        cu = mb.cu_seqlens.to(param.device)  # the key blocks follow it to its device
        attention = packed_attention_kwargs(
            cu, mb.max_seqlen, mb.kv_index, mb.cu_seqlens_k, mb.max_seqlen_k
        )
    else:
        tree = None if mb.kv_index is None else (mb.kv_index, mb.cu_seqlens_k, mb.position_ids)
        mask = block_causal_mask(mb.cu_seqlens, param.dtype, param.device, tree)
        attention = {"attention_mask": mask}
    out = model.get_decoder()(
        input_ids=mb.input_ids[None].to(param.device),
        position_ids=mb.position_ids[None].to(param.device),
        use_cache=False,
        **attention,
    )
    return out.last_hidden_state[0]
