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

import json
import stat
import string
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from cod_fast.common.bounded_read import ReadRefused, read_bounded

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


MAX_TOKENIZER_FILE_BYTES = 2**28
"""The largest file of a saved tokenizer folder that is read: a run's bpe vocabulary takes
tens of KB, the largest real tokenizer.json files tens of MB."""
_JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
)
"""The JSON files of a tokenizer folder that transformers reads, each an object."""
_TEMPLATES = "additional_chat_templates"
"""The one subfolder whose files transformers reads (named chat templates)."""


class _Damage(Exception):
    """A file of a tokenizer folder that is not what transformers reads, as `PATH is ...`."""


def load_saved_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """A tokenizer folder that a run saved (its bpe vocabulary), read as data only.

    The concrete fast class reads tokenizer.json and its JSON settings; AutoTokenizer would also
    follow an `auto_map` in a folder someone else wrote to Python code there, and ask on the
    terminal whether to run it. A folder without tokenizer.json is refused in one line naming
    it; transformers would fail inside sentencepiece, on a slow tokenizer it cannot convert.

    The folder may come from someone else, or a damaged disk: any file that is not a regular
    one of at most MAX_TOKENIZER_FILE_BYTES (a named pipe would block the read, /dev/zero never
    end it), a JSON file that is not an object, and whatever else keeps it from loading is one
    ValueError line naming the folder (and the file, where it can tell) and the fix.
    """
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        what = "no tokenizer.json there" if folder.exists() else "no such folder"
        raise ValueError(
            f"{folder}: {what}; expected a tokenizer folder that a run saved (its tokenizer/)"
        )
    fix = f"restore {folder} from a copy of the run that saved it"
    try:
        _check_files(folder)
    except _Damage as exc:
        raise ValueError(f"{exc}; {fix}") from None
    try:
        return PreTrainedTokenizerFast.from_pretrained(folder)
    # The `tokenizers` library raises a plain Exception for a vocabulary that does not hold
    # together ("Token `c` out of vocabulary"), and transformers whatever a setting of another
    # type meets (TypeError, KeyError, RecursionError): any failure here is the folder's.
    except Exception as exc:
        text = " ".join(str(exc).split())[:200] or "no message"
        raise ValueError(
            f"{folder} does not load as a tokenizer ({type(exc).__name__}: {text}); {fix}"
        ) from None


def _check_files(folder: Path) -> None:
    """Raise _Damage for the first file of `folder` (or of its chat templates' subfolder) that
    is not a regular file of at most MAX_TOKENIZER_FILE_BYTES, or a JSON file of _JSON_FILES
    that is not an object, before transformers opens any."""
    entries = [*folder.iterdir()]
    if (folder / _TEMPLATES).is_dir():
        entries += (folder / _TEMPLATES).iterdir()
    for path in sorted(entries):
        try:
            info = path.stat()  # a link counts as what it points to
        except OSError as exc:  # a link to nothing, no permission
            raise _Damage(f"{path} cannot be read ({exc.strerror or exc})") from None
        if stat.S_ISDIR(info.st_mode):
            continue  # transformers reads no folder but _TEMPLATES
        if not stat.S_ISREG(info.st_mode):
            raise _Damage(f"{path} is not a regular file (a named pipe or a device)")
        if info.st_size > MAX_TOKENIZER_FILE_BYTES:
            raise _Damage(f"{path} is more than {MAX_TOKENIZER_FILE_BYTES} bytes")
    for name in _JSON_FILES:
        path = folder / name
        if not path.exists():
            continue
        try:
            data = json.loads(read_bounded(path, MAX_TOKENIZER_FILE_BYTES))
        except ReadRefused as exc:  # changed since the stat above
            raise _Damage(f"{path} is {exc}") from None
        except OSError as exc:
            raise _Damage(f"{path} cannot be read ({exc.strerror or exc})") from None
        # JSONDecodeError, UnicodeDecodeError for binary junk, RecursionError for `[[[[...`
        except (ValueError, RecursionError) as exc:
            first = " ".join(str(exc).split())[:200]
            raise _Damage(f"{path} is not valid JSON ({first})") from None
        if not isinstance(data, dict):
            raise _Damage(f"{path} holds a JSON {type(data).__name__}, not an object")
