"""Tokenizers built locally with the `tokenizers` library (no downloads).

`char_tokenizer` gives one token per printable character plus special tokens, as a Hugging Face
`PreTrainedTokenizerFast`, so it goes through the same code paths (encode, decode, chat template,
save_pretrained / from_pretrained) as a real model's tokenizer. Tests, benchmarks and the tiny
CPU preset use it.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """One token per printable character and the special tokens; with a (ChatML) template the
    end-of-sequence token is <|im_end|>, as for Qwen models, else <eos>."""
    chars = sorted(set(string.printable))
    specials = ["<eos>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join back without separators
    eos = "<|im_end|>" if chat_template else "<eos>"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        additional_special_tokens=[s for s in specials if s != eos],
    )
    if chat_template:
        fast.chat_template = chat_template
    return fast
