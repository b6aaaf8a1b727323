"""Scripted demonstrations, the tiny tokenizer's corpus, and the supervised warm start.

A tiny model that starts from random weights does not find the CoD behaviour by sampling alone
(measured on the `tiny-cpu` preset, docs/benchmarks.md): it first imitates the environment's
scripted explorer (cod_fast.envs), which writes what it learns into hints and reads them back on
the next task.
Demonstrations go through the same rollout driver as the model's own rollouts:
`ScriptedDriver` answers each prompt with its run's agent instead of a sampler, so prompts, token
ids and hint blocks are exactly what the model will later see and write.

The warm-start loss is the REC policy loss with A = 1 (`SFT_LOSS`): a demonstration's log-probs
are 0 (a deterministic policy), so every ratio exp(logp - 0) <= 1 is kept, and -A logp averaged
over the tokens is the mean negative log-likelihood. Both phases run through `train_step`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from cod_fast.checkpoint import write_cause
from cod_fast.config import Config, LossConfig
from cod_fast.envs.base import Agent, Environment
from cod_fast.envs.packs import PackSpec, make_packs, pack_seeds
from cod_fast.init_from import tokenizer_folder
from cod_fast.model import BUILTIN_TINY
from cod_fast.records import Rollout
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings, RolloutDriver, RunState
from cod_fast.rollout.hints import HINT_END, HINT_START, hint_block
from cod_fast.rollout.sampler import Sample, text_sample
from cod_fast.safe_write import LinkError
from cod_fast.tokenizer import CHATML, bpe_tokenizer, char_tokenizer, load_saved_tokenizer

SFT_LOSS = LossConfig(policy="rec_one_side", eps_low=0.2, eps_high=0.2, agg="token-mean")


class ScriptedDriver(RolloutDriver):
    """The rollout driver with a scripted agent per (pack, member) in place of the sampler.

    The agent sees what the model would: the task (its prompt and step budget), the hints the
    solve prompt shows, each observation; it writes the next hints after each solve episode.

    With `hint_noise` q, each update episode writes, with probability q, hints that another
    pack's agent wrote earlier in this run instead of its own: well-formed, but about another
    pack's hidden rule, so they are wrong wherever the packs' rules differ. The agent's own
    state is unchanged; on the next task it reads what was written and corrects it from what it
    sees. A model warm-started on such demonstrations writes right hints only part of the time,
    which leaves hint quality for RL to raise. Whether an update episode is swapped is drawn
    from its pack seed and position alone (one before any other pack wrote hints keeps its own).

    With `hint_dropout` p, each entry the agent's own hints state is written as unknown with
    probability p (the environment's `hint_entries` and `render_hints`): incomplete hints, never
    wrong ones. The agent reads them on the next task and relearns what was dropped, so a model
    warm-started on them leaves entries open that RL can teach it to fill. The draws come from
    the pack seed, the position and the entry alone.
    """

    def __init__(
        self,
        env: Environment | Sequence[Environment],
        chat: ChatFormat,
        settings: DriverSettings,
        agent_factory: Callable[[], Agent] | None = None,
        hint_noise: float = 0.0,
        hint_dropout: float = 0.0,
    ):
        super().__init__(env, sampler=None, chat=chat, settings=settings)  # type: ignore[arg-type]
        if hint_dropout:
            for one in self.envs.values():
                if not one.has_hint_entries():
                    raise ValueError(
                        f"train.warm_start_hint_dropout={hint_dropout}: environment {one.name} "
                        "declares no hint format to drop entries from (docs/environments.md); "
                        "set train.warm_start_hint_dropout=0"
                    )
        self.agent_factory = agent_factory
        self.agents: dict[tuple[int, int], Agent] = {}
        self.hint_noise, self.hint_dropout = hint_noise, hint_dropout
        self.written: dict[int, str] = {}  # pack id -> the latest hints its agent wrote

    def _sample(self, live: list[RunState], keyed: bool) -> list[Sample]:
        return [  # scripted: no sampling noise to key
            text_sample(self.chat, self._answer(run), self.settings.max_response_tokens)
            for run in live
        ]

    def _answer(self, run: RunState) -> str:
        key = (run.spec.pack_id, run.member)
        if run.phase == "update":
            return hint_block(
                self._hints(run, self.agents[key].write_hints(run.task, run.shown_hints))
            )
        if not run.turns:  # the first response of a solve episode
            if run.position == 0:  # the explorer of the pack's environment, unless given one
                make = self.agent_factory or self.env_of(run.spec).explorer
                self.agents[key] = make()
            self.agents[key].start(run.task, run.shown_hints)
        return self.agents[key].act(run.observation)

    def _hints(self, run: RunState, own: str | None) -> str | None:
        """`own`, or with probability `hint_noise` another pack's latest hints (when there are
        any yet)."""
        donors = [hints for pack, hints in self.written.items() if pack != run.spec.pack_id]
        if own is not None:
            self.written[run.spec.pack_id] = own
        rng = random.Random(f"hint-noise/{run.spec.pack_seed}/{run.position}")
        if donors and rng.random() < self.hint_noise:
            return rng.choice(sorted(donors))
        if own is None or not self.hint_dropout:
            return own
        env = self.env_of(run.spec)
        kept = {
            name: value
            for name, value in env.hint_entries(own).items()
            if random.Random(f"hint-dropout/{run.spec.pack_seed}/{run.position}/{name}").random()
            >= self.hint_dropout
        }
        return env.render_hints(kept)


def demonstrations(
    env: Environment | Sequence[Environment],
    chat: ChatFormat,
    settings: DriverSettings,
    packs: list[PackSpec],
    hint_noise: float = 0.0,
    hint_dropout: float = 0.0,
) -> list[Rollout]:
    """The scripted explorer through `packs` (one member each), every advantage set to 1;
    `hint_noise` and `hint_dropout` as in ScriptedDriver."""
    driver = ScriptedDriver(env, chat, settings, hint_noise=hint_noise, hint_dropout=hint_dropout)
    rollouts = driver.run(packs, group_size=1)
    for rollout in rollouts:
        for episode in rollout.episodes:
            episode.advantage = 1.0
    return rollouts


def transcripts(rollouts: list[Rollout], chat: ChatFormat) -> list[str]:
    """The text of every turn (prompt and response): a tokenizer corpus for the environment."""
    return [
        chat.decode(turn.prompt_ids + turn.response_ids)
        for rollout in rollouts
        for episode in rollout.episodes
        for turn in episode.turns
    ]


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
    # Token caps are meant for the trained vocabulary, not for characters: lift them, or the
    # corpus would lack the ends of responses and hints.
    uncapped = dataclasses.replace(settings, max_response_tokens=10**6, max_hint_tokens=10**6)
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
        tokenizer = load_saved_tokenizer(Path(cfg.model.tokenizer_path))
    elif cfg.train.init_from is not None:  # the vocabulary the starting weights were trained with
        tokenizer = load_saved_tokenizer(tokenizer_folder(cfg.train.init_from))
    else:
        tokenizer = environment_tokenizer(env, settings, cfg.model.vocab_size, cfg.train.seed)
    if is_main:  # whole or absent: the other ranks load it as soon as the folder exists
        _save_tokenizer(tokenizer, saved)
    return tokenizer


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, saved: Path) -> None:
    """`tokenizer` written to `saved` whole, or an OSError of one line naming the folder, the
    cause and the fix (a link where it goes keeps its own line, which names the link)."""
    from cod_fast.export import replacing

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
