"""A causal LM's sizes without its weights: what a memory plan reads (cod_fast.train.memory_plan).

`model_shape` takes the run's model as the trainer would load it: the built-in model from the
config's sizes, a model folder from its config.json (read as `load_model_files` reads it, never
code from the folder), and a hub id that is not on this disk from `KNOWN_CONFIGS`, the released
config.json values of the Qwen3 dense models, so a plan for Qwen3-8B or -32B needs no download.
The model is then built on the meta device (no memory, no weights), and its parameters are
counted per FSDP2 unit as `cod_fast.distributed.fsdp.shard_policy` groups them: one unit per
decoder layer, the rest (embedding, final norm, LM head) in the root; a tied LM head counts once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError

from cod_fast.config import ModelConfig
from cod_fast.model.loading import BUILTIN_TINY, ModelFolderError, tiny_qwen3_config

_QWEN3 = dict(
    model_type="qwen3",
    head_dim=128,
    num_key_value_heads=8,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
)
KNOWN_CONFIGS: dict[str, dict] = {
    # name: (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, tied)
    f"Qwen/Qwen3-{name}": _QWEN3
    | dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        tie_word_embeddings=tied,
    )
    for name, (hidden, inter, layers, heads, tied) in {
        "0.6B": (1024, 3072, 28, 16, True),
        "1.7B": (2048, 6144, 28, 16, True),
        "4B": (2560, 9728, 36, 32, True),
        "8B": (4096, 12288, 36, 32, False),
        "14B": (5120, 17408, 40, 40, False),
        "32B": (5120, 25600, 64, 64, False),
    }.items()
}
"""The released config.json sizes of the Qwen3 dense models (huggingface.co/Qwen)."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only LM's sizes and its parameters per FSDP2 unit."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    layer_params: int
    """Parameters of one decoder layer (the largest, where they differ)."""
    root_params: int
    """Parameters outside the decoder layers: embedding, final norm, an untied LM head."""

    @property
    def params(self) -> int:
        return self.root_params + self.layers * self.layer_params

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Key and value bytes a token keeps in a KV cache, over every layer."""
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize


def transformers_config(model: ModelConfig, vocab_size: int | None = None):
    """The transformers config of the run's model: built-in, a folder's config.json, or a known
    hub id; a ModelFolderError of one line for a hub id that is neither on disk nor known."""
    from transformers import AutoConfig, Qwen3Config

    name = model.name_or_path
    if name == BUILTIN_TINY:
        return tiny_qwen3_config(model, vocab_size or model.vocab_size)
    if (Path(name) / "config.json").is_file():
        try:
            return AutoConfig.from_pretrained(name, trust_remote_code=False).get_text_config()
        except (ValueError, StrictDataclassError, OSError, RecursionError) as e:
            raise ModelFolderError(
                f"{name}: its config.json does not load ({' '.join(str(e).split())[:200]}); "
                "repair it (the model's released config.json) or use another model folder"
            ) from None
    if name in KNOWN_CONFIGS:
        return Qwen3Config(**KNOWN_CONFIGS[name])
    known = ", ".join(KNOWN_CONFIGS)
    raise ModelFolderError(
        f"{name}: no model folder with a config.json here and not a model whose sizes cod-fast "
        f"knows ({known}); download the model (or only its config.json) into a folder and give "
        "that folder as model.name_or_path"
    )


def shape_of(config, name: str) -> ModelShape:
    """The shape of a transformers causal-LM config, its parameters counted on the meta
    device (the model's own modules, so every projection, norm and bias is there)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_layers)
    per_layer = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(
        name=name,
        layers=len(layers),
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab=config.vocab_size,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        layer_params=per_layer,
        root_params=root,
    )


def model_shape(model: ModelConfig, vocab_size: int | None = None) -> ModelShape:
    """The shape of the run's model (see the module docstring); `vocab_size`: the built-in
    model's vocabulary where the run's tokenizer sets it (default model.vocab_size)."""
    return shape_of(transformers_config(model, vocab_size), model.name_or_path)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's block list, one FSDP2 unit each (`layers` in Llama/Qwen, the one
    ModuleList child elsewhere)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        return decoder.layers
    lists = [m for m in decoder.children() if isinstance(m, torch.nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: its decoder "
            f"{type(decoder).__name__} has {len(lists)} ModuleList children, expected one"
        )
    return lists[0]
