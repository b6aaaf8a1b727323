"""The run's vocabulary: the built-in model's tokenizer, built once per run and kept in
`RUN/tokenizer`, where a resumed run, a rollout worker and `cod-fast export` find it.

A `bpe` vocabulary is trained on the scripted explorer's transcripts of the run's environments
(cod_fast.rollout.scripted), or taken from `model.tokenizer_path`, else from `train.init_from`.
A Hugging Face model brings its own tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from cod_fast.common.safe_write import LinkError
from cod_fast.common.values import write_cause
from cod_fast.config import Config, ConfigError, clipped
from cod_fast.envs.base import Environment
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.model.loading import BUILTIN_TINY
from cod_fast.model.tokenizer import CHATML, bpe_tokenizer, char_tokenizer, load_saved_tokenizer
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings
from cod_fast.rollout.hints import HINT_END, HINT_START
from cod_fast.rollout.scripted import demonstrations, transcripts
from cod_fast.run.init_from import tokenizer_folder

CORPUS_PACKS = 64
"""Scripted packs whose transcripts train a `bpe` tokenizer."""


def environment_tokenizer(
    env: Environment | Sequence[Environment], settings: DriverSettings, vocab_size: int, seed: int
) -> PreTrainedTokenizerBase:
    """A byte-pair vocabulary of at most `vocab_size` tokens trained on the scripted explorer's
    transcripts of `env` (CORPUS_PACKS packs of each environment, when several), with the hint
    markers as whole tokens: what the built-in model's `bpe` tokenizer is. Deterministic given
    `seed`."""
    chat = ChatFormat(char_tokenizer(CHATML))
    # Token caps are meant for the trained vocabulary, not for characters: lift them to the most
    # a config allows (far above any scripted response or hint), or the corpus would lack the
    # ends of responses and hints.
    uncapped = settings.with_rollout(max_response_tokens=2**17, max_hint_tokens=2**17)
    corpus = []
    for one in [env] if isinstance(env, Environment) else env:
        packs = make_packs(pack_seeds("corpus", CORPUS_PACKS, seed), 4)
        corpus += transcripts(demonstrations(one, chat, uncapped, packs), chat)
    return bpe_tokenizer(corpus, vocab_size, whole=[HINT_START, HINT_END])


def run_tokenizer(
    cfg: Config, env: Environment | Sequence[Environment], settings: DriverSettings, is_main: bool
) -> PreTrainedTokenizerBase | None:
    """The built-in model's tokenizer for a run (None for a Hugging Face model, which has its
    own). A `bpe` vocabulary is trained once per run on all its environments (or taken from
    `model.tokenizer_path`, else `train.init_from`) and kept in the run directory, where a
    resumed run and `cod-fast export` find it; only the main process writes it."""
    if cfg.model.name_or_path != BUILTIN_TINY:
        return None
    if cfg.model.tokenizer == "char":
        return char_tokenizer(CHATML)
    saved = Path(cfg.runtime.run_dir) / "tokenizer"
    if saved.exists():
        return load_saved_tokenizer(saved)
    if cfg.model.tokenizer_path is not None:
        tokenizer = _given_tokenizer(Path(cfg.model.tokenizer_path), "model.tokenizer_path")
    elif cfg.train.init_from is not None:  # the vocabulary the starting weights were trained with
        tokenizer = _given_tokenizer(tokenizer_folder(cfg.train.init_from), "train.init_from")
    else:
        tokenizer = environment_tokenizer(env, settings, cfg.model.vocab_size, cfg.train.seed)
    if is_main:  # whole or absent: the other ranks load it as soon as the folder exists
        _save_tokenizer(tokenizer, saved)
    return tokenizer


def _given_tokenizer(folder: Path, key: str) -> PreTrainedTokenizerBase:
    """The saved tokenizer in `folder`, which the config's `key` names; a ConfigError of `key`
    naming that folder when it holds none."""
    try:
        return load_saved_tokenizer(folder)
    except (OSError, ValueError) as e:
        raise ConfigError(
            key,
            f"{clipped(str(folder))} holds no tokenizer the run can use ({clipped(str(e))}); "
            "give a run directory or a model folder `cod-fast export` wrote (it holds the "
            "tokenizer the weights were trained with), or name that tokenizer's folder with "
            "model.tokenizer_path",
        ) from None


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, saved: Path) -> None:
    """`tokenizer` written to `saved` whole, or an OSError of one line naming the folder, the
    cause and the fix (a link where it goes keeps its own line, which names the link)."""
    from cod_fast.run.export import replacing

    try:
        with replacing(saved) as folder:
            tokenizer.save_pretrained(folder)
    except LinkError:
        raise
    # A full disk reaches here as OSError from transformers' own files and as a plain
    # Exception from the `tokenizers` library ("File too large (os error 27)"), so any
    # failure of the write is taken as the disk's.
    except Exception as exc:
        raise OSError(
            f"could not write {saved} ({write_cause(saved, exc)}); free disk space or set "
            "runtime.run_dir to a folder with room"
        ) from exc
