"""The policy model: loading, the built-in tiny Qwen3, and hidden states of packed micro-batches.

Training never computes the model's logits: `packed_hidden_states` runs the decoder only and the
fused loss takes the hidden states of the trainable positions and the LM head weight
(docs/concepts.md section 4). Packed sequences must not attend to each other (docs/concepts.md
section 5): `load_policy` installs one of the varlen kernels of cod_fast.model.attention (flash-attn,
torch's varlen_attn, or per-sequence SDPA on the CPU and for float32), which read cu_seqlens. A
model with any other attention implementation gets a block-diagonal causal mask instead (O(T^2)
memory: the reference the tests compare the kernels with). A model folder is checked before any
weights exist (`load_model_files`): a folder that is one (config.json and tokenizer files; a missing
local path is not taken for a hub id), positive sizes in config.json, a vocabulary that holds every
token id of its tokenizer, and weights that fit in this machine's memory at all.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from cod_fast.common.errors import CodFastError
from cod_fast.common.values import first_words
from cod_fast.config import ModelConfig, clipped
from cod_fast.data.packing import MicroBatch
from cod_fast.model.attention import KERNELS, packed_attention_kwargs, resolve_attn_impl
from cod_fast.model.lean import make_lean
from cod_fast.model.tokenizer import char_tokenizer
from cod_fast.ops.sequence_parallel import SequenceGroup

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


def tiny_qwen3_config(cfg: ModelConfig, vocab_size: int, eos_token_id: int | None = None):
    """The Qwen3 config of the built-in model: the sizes of `cfg`, a vocabulary of `vocab_size`."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


BUILTIN_SIZES_FIX = "lower model.hidden_size, model.intermediate_size or model.num_layers"


def build_tiny_qwen3(cfg: ModelConfig, seed: int = 0, tokenizer=None):
    """A Qwen3-architecture model from the config's sizes, for `tokenizer` (default: the local
    character tokenizer)."""
    tokenizer = tokenizer if tokenizer is not None else char_tokenizer()
    config = tiny_qwen3_config(cfg, len(tokenizer), tokenizer.eos_token_id)
    # Built in float32 in host memory, whatever dtype and device it then goes to.
    check_parameter_memory(
        config, torch.device("cpu"), torch.float32, BUILTIN_TINY, BUILTIN_SIZES_FIX
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
    `device`), such as host memory for a model moved to the device only when it runs. A model
    that cannot work there is a ModelFolderError before any weights exist."""
    device = torch.device(device)
    dtype = dtype or resolve_dtype(cfg, device)
    place = device if place is None else torch.device(place)
    if cfg.name_or_path == BUILTIN_TINY:
        model, tokenizer = build_tiny_qwen3(cfg, seed, tokenizer)
        model = model.to(dtype)
    else:
        config, tokenizer = load_model_files(cfg.name_or_path, place, dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.name_or_path,
                config=config,
                dtype=dtype,
                attn_implementation="sdpa",
                trust_remote_code=False,
            )
        # Pickled weights load as plain tensors only (transformers' weights_only load): a
        # pickle that calls code is refused, never run; RecursionError: generation_config.json
        # nested past the stack.
        except (pickle.UnpicklingError, RecursionError) as e:
            raise ModelFolderError(
                f"{cfg.name_or_path}: its weights or generation_config.json do not load as plain "
                f"data ({first_words(e)}); cod-fast runs no code from a model folder: use the "
                "model's safetensors weights"
            ) from None
    prepare_model(model, cfg, device)
    return model.to(place), tokenizer


class ModelFolderError(ValueError, CodFastError):
    """A model (a folder's config.json, or the built-in model's sizes) that does not fit its
    tokenizer or this machine, or a local path that is no model folder: one line naming the
    model, the field or the missing files, the values and the fix."""


SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
"""The sizes of a config.json that shape the weights (as transformers names them for every
architecture); each must be a positive integer where the config has it."""
ESTIMATE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers")
"""The sizes without which parameter_count makes no estimate."""


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "*.model", "*.tiktoken")
"""What a transformers tokenizer reads its vocabulary from: a fast tokenizer's tokenizer.json,
a BPE vocab.json, a WordPiece vocab.txt, a sentencepiece or a tiktoken model. A folder with
none of them fails inside sentencepiece, or (a Qwen config.json) loads a one-token tokenizer."""
HUB_ID_HINT = "for a hub id, write owner/name as on huggingface.co, such as Qwen/Qwen3-0.6B"


JSON_FILES = ("config.json", "generation_config.json")
"""A model folder's settings files that transformers reads whole, bounded by MAX_JSON_BYTES."""
MAX_JSON_BYTES = 2**24


def model_path_problem(name: str) -> str | None:
    """Why `name`, meant as a local model folder, is none (one line naming it and the fix), or
    None: a folder with config.json and tokenizer files, or a hub id (whether that exists only
    the hub knows). A name is meant as local where it starts with / . or ~, has more parts than
    a hub id's owner/name, or its parent folder exists here; transformers would take a missing
    one for a hub id and answer with the hub's complaint about its form."""
    if name.startswith("builtin:"):
        return f"{name}: no such built-in model; the built-in model is {BUILTIN_TINY!r}"
    if name.startswith("~"):
        return f"{name}: transformers does not expand ~; write the path out in full"
    path = Path(name)
    if not path.exists():
        local = name.startswith(("/", ".")) or len(path.parts) > 2
        if local or (len(path.parts) == 2 and path.parent.is_dir()):
            return f"{name}: no such folder (a local path that does not exist; {HUB_ID_HINT})"
        return None
    if not path.is_dir():
        return f"{name}: a file; expected a model folder (config.json, tokenizer, weights)"
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        missing.append(f"tokenizer files ({', '.join(TOKENIZER_FILES)})")
    if missing:
        return (
            f"{name}: a folder without {' and '.join(missing)}; expected a model folder as "
            "`cod-fast export` or a model's save_pretrained writes it"
        )
    for file in JSON_FILES:  # transformers reads them whole: a stranger's folder may hold gigabytes
        entry = path / file
        if entry.exists() and not (entry.is_file() and entry.stat().st_size <= MAX_JSON_BYTES):
            what = "no regular file" if not entry.is_file() else f"over {MAX_JSON_BYTES} bytes"
            return (
                f"{name}: its {file} is {what} (a model's is a few KB); repair it (the "
                "model's released one) or use another model folder"
            )
    return None


CONFIG_FIX = "repair config.json (the model's released one) or use another model folder"


def size_problem(name: str, sizes) -> str | None:
    """Why the language-model config `sizes` of model `name` has a size that is no positive
    integer (one line), or None."""
    for field in SIZE_FIELDS:
        value = getattr(sizes, field, None)
        if value is not None and not (type(value) is int and value >= 1):
            return f"{name}: config.json has {field}={value!r}; expected a positive integer: {CONFIG_FIX}"
    return None


def load_model_files(name: str, place: torch.device | str, dtype: torch.dtype) -> tuple[Any, Any]:
    """(config, tokenizer) of the causal LM `name` (a folder or hub id), checked against each
    other and against the memory where its weights in `dtype` would be put (`place`), before
    any weights exist: a bad size in config.json otherwise surfaces as a tensor error or a
    terabyte allocation, and a vocabulary smaller than the tokenizer's as an index error in the
    middle of sampling."""
    if problem := model_path_problem(name):
        raise ModelFolderError(problem)
    # Never code from a model folder: a model that needs its own Python fails with
    # transformers' message instead of asking on the terminal whether to run it.
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=False)
    # ValueError, StrictDataclassError: transformers' own checks of its fields; RecursionError:
    # JSON nested past the stack
    except (ValueError, StrictDataclassError, RecursionError) as e:
        raise ModelFolderError(
            f"{name}: its config.json does not load ({clipped(' '.join(str(e).split()))}); "
            "repair it (the model's released config.json) or use another model folder"
        ) from None
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    fix = CONFIG_FIX
    sizes = config.get_text_config()  # the language model's part of a multimodal config
    if problem := size_problem(name, sizes):
        raise ModelFolderError(problem)
    vocab = getattr(sizes, "vocab_size", None)
    if vocab is not None and vocab < len(tokenizer):  # larger is padding, as many models have
        raise ModelFolderError(
            f"{name}: its tokenizer has {len(tokenizer)} tokens, but config.json has vocab_size="
            f"{vocab}: token ids {vocab} and up have no embedding row; use the tokenizer the "
            f"model was trained with, or a model with vocab_size >= {len(tokenizer)}"
        )
    check_parameter_memory(sizes, torch.device(place), dtype, name, fix)
    return config, tokenizer


def parameter_count(config) -> int | None:
    """A rough parameter count of a decoder-only LM from its config (None where the config
    lacks vocab_size, hidden_size or num_hidden_layers): the embedding (vocab_size
    x hidden_size, twice when the LM head is not tied to it) plus, per layer, the attention
    projections (q and o: hidden_size x heads x head_dim each; k and v: hidden_size x kv_heads
    x head_dim each) and a gated MLP (3 x hidden_size x intermediate_size). Norms and biases
    are left out (well under 1% at real sizes), and so are the extra experts of a
    mixture-of-experts model; an MLP without a gate has 2 matrices, not 3. Rough, but within a
    factor of two, which is all that catching absurd sizes needs."""
    if any(getattr(config, f, None) is None for f in ESTIMATE_FIELDS):
        return None
    hidden = config.hidden_size
    heads = getattr(config, "num_attention_heads", None) or 1
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    mlp = getattr(config, "intermediate_size", None) or 4 * hidden
    embeddings = 1 if getattr(config, "tie_word_embeddings", False) else 2
    layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * mlp
    return embeddings * config.vocab_size * hidden + config.num_hidden_layers * layer


def host_memory() -> int:
    """This machine's physical memory, in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_memory(device: torch.device) -> int:
    """The memory of `device`, in bytes: a GPU's own, or the host's for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory()


def gib(nbytes: float) -> str:
    """`nbytes` as an error message shows it."""
    return f"{nbytes / 2**30:,.1f} GiB"


def check_parameter_memory(config, place: torch.device, dtype: torch.dtype, name: str, fix: str):
    """Refuse a model whose weights (parameter_count in `dtype`) cannot fit even in all of
    this machine's memory: the host's, plus the GPU's when they go to one. A loose bound on
    purpose: it catches absurd sizes (a typo in config.json) before a terabyte allocation, not
    a model that merely leaves too little room for training."""
    count = parameter_count(config)
    if count is None:
        return
    need = count * dtype.itemsize
    memory, where = host_memory(), "host"
    if place.type == "cuda":
        memory, where = memory + device_memory(place), f"host + {place}"
    if need > memory:
        raise ModelFolderError(
            f"{name}: about {count:.3g} parameters (embedding + layers, from vocab_size, "
            f"hidden_size, intermediate_size and num_hidden_layers) take {gib(need)} in "
            f"{str(dtype).removeprefix('torch.')}, more than all {gib(memory)} of memory here "
            f"({where}); {fix}"
        )


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


def packed_hidden_states(
    model, mb: MicroBatch, sequence_group: SequenceGroup | None = None
) -> torch.Tensor:
    """Final hidden states [T, H] of a packed micro-batch; sequences never see each other.

    With a cod_fast.model.attention kernel the decoder attends per sequence (tree node) from
    cu_seqlens (and the key blocks of the shared-prefix layout); any other attention
    implementation gets the explicit [T, T] mask (recent transformers also infer packing from
    restarting position_ids, but not every version or implementation does, nor trees).

    With `sequence_group` the decoder runs this rank's share of the row (`mb.shard`, see
    cod_fast.data.sequence_shard) and returns its [T/N, H] states; attention sees the whole row.
    """
    param = next(model.parameters())
    packed = model.config._attn_implementation in KERNELS.values()
    rows = mb if sequence_group is None else mb.shard
    if rows is None or (sequence_group is not None and not packed):
        raise ValueError(
            "sequence parallelism needs the micro-batch's shard (with_sequence_shard) and a "
            "packed attention kernel (model.attn_impl: sdpa, varlen_attn or flash_attn)"
        )
    if packed:
        cu = rows.cu_seqlens.to(param.device)  # the key blocks follow it to its device
        attention = packed_attention_kwargs(
            cu,
            rows.max_seqlen,
            rows.kv_index,
            rows.cu_seqlens_k,
            rows.max_seqlen_k,
            seqlens=rows.seqlens,
            seqlens_k=rows.seqlens_k,
            sequence_group=sequence_group,
        )
    else:
        tree = None if mb.kv_index is None else (mb.kv_index, mb.cu_seqlens_k, mb.position_ids)
        mask = block_causal_mask(mb.cu_seqlens, param.dtype, param.device, tree)
        attention = {"attention_mask": mask}
    out = model.get_decoder()(
        input_ids=rows.input_ids[None].to(param.device),
        position_ids=rows.position_ids[None].to(param.device),
        use_cache=False,
        **attention,
    )
    return out.last_hidden_state[0]
