"""Scripted demonstrations: the environment's explorer playing packs through the rollout driver.

A tiny model that starts from random weights does not find the CoD behaviour by sampling alone
(measured on the `tiny-cpu` preset, docs/benchmarks.md): it first imitates the environment's
scripted explorer (cod_fast.envs), which writes what it learns into hints and reads them back on
the next task. Demonstrations go through the same rollout driver as the model's own rollouts:
`ScriptedDriver` answers each prompt with the agent of its (pack, member) instead of a sampler,
so prompts, token ids and hint blocks are exactly what the model will later see and write. The
warm start (cod_fast.train.warm_start) trains on them; `transcripts` are the corpus of a run's
`bpe` vocabulary (cod_fast.run.vocab).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from cod_fast.data.records import Rollout
from cod_fast.envs.base import Agent, Environment
from cod_fast.envs.packs import PackSpec
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings, MemberPlay, RolloutDriver
from cod_fast.rollout.hints import hint_block
from cod_fast.rollout.sampler import Sample, text_sample


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

    def _sample(self, live: list[MemberPlay], keyed: bool) -> list[Sample]:
        return [  # scripted: no sampling noise to key
            text_sample(self.chat, self._answer(play), self.settings.rollout.max_response_tokens)
            for play in live
        ]

    def _answer(self, play: MemberPlay) -> str:
        key = (play.spec.pack_id, play.member)
        if play.phase == "update":
            return hint_block(
                self._hints(play, self.agents[key].write_hints(play.task, play.shown_hints))
            )
        if not play.turns:  # the first response of a solve episode
            if play.position == 0:  # the explorer of the pack's environment, unless given one
                make = self.agent_factory or self.env_of(play.spec).explorer
                self.agents[key] = make()
            self.agents[key].start(play.task, play.shown_hints)
        return self.agents[key].act(play.observation)

    def _hints(self, play: MemberPlay, own: str | None) -> str | None:
        """`own`, or with probability `hint_noise` another pack's latest hints (when there are
        any yet)."""
        donors = [hints for pack, hints in self.written.items() if pack != play.spec.pack_id]
        if own is not None:
            self.written[play.spec.pack_id] = own
        rng = random.Random(f"hint-noise/{play.spec.pack_seed}/{play.position}")
        if donors and rng.random() < self.hint_noise:
            return rng.choice(sorted(donors))
        if own is None or not self.hint_dropout:
            return own
        env = self.env_of(play.spec)
        kept = {
            name: value
            for name, value in env.hint_entries(own).items()
            if random.Random(f"hint-dropout/{play.spec.pack_seed}/{play.position}/{name}").random()
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
