"""Tokenizers built locally with the `tokenizers` library (no downloads).

Both are Hugging Face `PreTrainedTokenizerFast`s, so they go through the same code paths (encode,
decode, chat template, save_pretrained / from_pretrained) as a real model's tokenizer.
`char_tokenizer` gives one token per printable character plus special tokens (tests and
benchmarks). `bpe_tokenizer` trains a small byte-pair vocabulary on sample text of the run's
environment, so a tiny model reads a prompt in a few dozen tokens instead of a few hundred
characters (the `tiny-cpu` preset): merges may cross spaces and line breaks, so a constant
phrase such as "\nAction: Direction " becomes one token, but every digit stays a token of its
own (numbers stay compositional), and every printable character stays in the vocabulary, so
any text still encodes and decoding gives it back exactly. Its chat template (`TINY_CHAT`)
spends one special token per message (ChatML spends four), since a tiny model pays for every
prompt token as much as for a response token.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


TINY_CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHATML_SPECIALS = ["<eos>", "<|im_start|>", "<|im_end|>"]
TINY_SPECIALS = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def _wrap(
    tok: Tokenizer, chat_template: str | None, specials: list[str], eos: str
) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        additional_special_tokens=[s for s in specials if s != eos],
    )
    if chat_template:
        fast.chat_template = chat_template
    return fast


def bpe_tokenizer(
    corpus: Iterable[str], vocab_size: int = 512, whole: Iterable[str] = ()
) -> PreTrainedTokenizerFast:
    """A BPE tokenizer with the TINY_CHAT template trained on `corpus` (deterministic for a
    given corpus); end of sequence is <|end|>. `whole` lists strings that become single tokens
    (e.g. the hint-block marker lines)."""
    tok = Tokenizer(models.BPE(unk_token="?", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[0-9]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=TINY_SPECIALS,
        initial_alphabet=sorted(set(string.printable)),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(w, normalized=False) for w in whole])
    return _wrap(tok, TINY_CHAT, TINY_SPECIALS, "<|end|>")


def char_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """One token per printable character and the special tokens; with a (ChatML) template the
    end-of-sequence token is <|im_end|>, as for Qwen models, else <eos>."""
    chars = sorted(set(string.printable))
    vocab = {tok: i for i, tok in enumerate(CHATML_SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join back without separators
    eos = "<|im_end|>" if chat_template else "<eos>"
    return _wrap(tok, chat_template, CHATML_SPECIALS, eos)


def load_saved_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """A tokenizer folder that a run saved (its bpe vocabulary), read as data only.

    The concrete fast class reads tokenizer.json and its JSON settings; AutoTokenizer would also
    follow an `auto_map` in a folder someone else wrote to Python code there, and ask on the
    terminal whether to run it. A folder without tokenizer.json is refused in one line naming
    it; transformers would fail inside sentencepiece, on a slow tokenizer it cannot convert.
    """
    if not (Path(folder) / "tokenizer.json").is_file():
        what = "no tokenizer.json there" if Path(folder).exists() else "no such folder"
        raise ValueError(
            f"{folder}: {what}; expected a tokenizer folder that a run saved (its tokenizer/)"
        )
    return PreTrainedTokenizerFast.from_pretrained(folder)
