"""The policy model and how it runs: `ModelConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cod_fast.config.base import ConfigError, _Config, shown


@dataclass(kw_only=True)
class ModelConfig(_Config):
    """The policy model and how it runs."""

    name_or_path: str = "builtin:tiny-qwen3"
    """A Hugging Face folder or hub id, or `builtin:tiny-qwen3`, built locally from the fields
    below."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype; `auto` is bfloat16 on a GPU and float32 on the CPU."""
    attn_impl: Literal["auto", "flash_attn", "varlen_attn", "sdpa"] = "auto"
    """Attention over packed sequences; `auto` picks the best one installed."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    lean_activations: bool = True
    """SwiGLU MLPs and RMSNorms (Qwen3, Qwen2, Llama, Mistral) that keep only what their backward
    needs: about a third less activation memory, the same forward values (cod_fast.model.lean)."""
    hidden_size: int = 96
    """Builtin models only: width of the residual stream."""
    num_layers: int = 3
    """Builtin models only: number of decoder layers."""
    num_heads: int = 4
    """Builtin models only: attention heads; must divide hidden_size."""
    intermediate_size: int = 256
    """Builtin models only: width of the MLP."""
    tokenizer: Literal["char", "bpe"] = "char"
    """Builtin models only: one token per character, or a byte-pair vocabulary trained locally on
    the scripted explorer's transcripts of the run's environment."""
    vocab_size: int = 512
    """Builtin models with the `bpe` tokenizer: the most tokens the vocabulary may have."""
    tokenizer_path: str | None = None
    """Builtin models: this saved tokenizer folder (a run's `tokenizer/`) instead of one built for
    the run, so that runs on different environments share a vocabulary (a distillation's
    teachers and student)."""
    chat_template: str | None = None
    """A Jinja chat template used instead of the tokenizer's: the template itself, or the path of
    a file holding one (a value that names an existing file is read; a relative path is from
    the working directory). A template without a system role gets the system text at the head
    of the first user turn. Null: the tokenizer's own."""
    chat_template_kwargs: dict[str, object] | None = None
    """Extra variables for every render of the chat template, e.g. `{enable_thinking: false}`
    for Qwen3 (not the arguments cod-fast sets itself, such as `tokenize`). Null: none."""

    def __post_init__(self) -> None:
        super().__post_init__()
        named = bool(self.name_or_path.strip())
        self._require(named, "name_or_path", "a model folder, a hub id or 'builtin:tiny-qwen3'")
        if self.tokenizer_path is not None:
            self._require(bool(self.tokenizer_path.strip()), "tokenizer_path", "a folder or null")
        if self.chat_template is not None:
            blank = not self.chat_template.strip()
            self._require(not blank, "chat_template", "a Jinja template, a file or null")
        # What cod-fast sets itself: the arguments of transformers' `apply_chat_template`
        # (PreTrainedTokenizerBase, 5.19; tests/rollout/test_chat_templates.py reads its signature)
        # and the conversation a template receives as `messages`.
        ours = (
            "conversation",
            "messages",
            "tools",
            "documents",
            "chat_template",
            "add_generation_prompt",
            "continue_final_message",
            "tokenize",
            "padding",
            "truncation",
            "max_length",
            "return_tensors",
            "return_dict",
            "return_assistant_tokens_mask",
            "tokenizer_kwargs",
        )
        for key, value in (self.chat_template_kwargs or {}).items():
            if key in ours:
                raise ConfigError(
                    "chat_template_kwargs",
                    f"{shown(key)} is set by cod-fast, not a template variable; remove it "
                    f"(cod-fast sets {', '.join(ours)})",
                )
            if not (isinstance(key, str) and key.isidentifier()) or key in JINJA_NAMES:
                raise ConfigError(
                    "chat_template_kwargs",
                    f"{shown(key)} is not a name a template can read; write a variable name "
                    "such as enable_thinking",
                )
            if not _plain(value):
                raise ConfigError(
                    f"chat_template_kwargs.{key}",
                    f"got {shown(value)}; expected text, a number, true/false, null, or a list "
                    "or mapping of them (quote a date: '2024-07-26')",
                )
        self._at_least(1, "hidden_size", "num_layers", "num_heads", "intermediate_size")
        self._at_least(128, "vocab_size")
        # Built-in model sizes at about 4x the largest open models (width 16k, MLP 53k, 126
        # layers, vocabularies of 262k); what fits this machine is the preflight's estimate.
        self._at_most(2**16, "hidden_size")
        self._at_most(2**18, "intermediate_size")
        self._at_most(2**10, "num_layers")
        self._at_most(2**20, "vocab_size")
        divisible = self.hidden_size % self.num_heads == 0
        self._require(divisible, "hidden_size", f"a multiple of num_heads={self.num_heads}")


JINJA_NAMES = ("self", "loop", "super", "caller", "varargs", "kwargs")
"""Names Jinja gives a meaning of its own inside a template."""


def _plain(value: object, depth: int = 0) -> bool:
    """Whether `value` is plain data the run's config can record (JSON's kinds): YAML also
    reads dates, binary and sets, which no checkpoint's record of the config could hold."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if depth < 32 and isinstance(value, list):
        return all(_plain(v, depth + 1) for v in value)
    if depth < 32 and isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def refuse_cpu_dtype(dtype: str, device: str) -> None:
    """Refuse a model dtype that cannot train on the CPU; `device` says how the run got there.

    Measured on the tiny model: float16 weights are NaN after the first AdamW step (its eps and
    the small squared gradients underflow to 0 in float16, so updates divide 0 by 0); bfloat16
    has float32's exponent range and trains (slowly). Nothing in that arithmetic is particular
    to the CPU, but only the CPU was measured. The preflight (cod_fast.train.preflight) calls this
    again for `runtime.device=auto`, once it knows where that lands.
    """
    if dtype == "float16":
        raise ConfigError(
            "model.dtype",
            f"got 'float16' with {device}; expected 'float32' (or 'auto', which is float32 "
            "there) on the CPU: float16 weights turn NaN at the first AdamW step there",
        )
