"""What every CoD environment provides (docs/concepts.md section 6), and scripted play over a pack.

An environment turns (pack_seed, task_index) into a `Task`: a small text game whose hidden rule
comes from pack_seed alone, so every task of a pack shares it and packs differ. A task states
itself and its action format (`prompt`), shows a first observation (`reset`), takes text actions
(`step`) and ends with a reward and feedback text. Malformed actions end the episode with the
environment's stated reward and feedback that says what was expected. Environment code never runs
model text as code.

Model text is hostile input: it may be megabytes long, repeat a tag 50,000 times or spell a number
with 16,000 digits. Every `Task.step` refuses an action longer than MAX_ACTION_CHARS before it
parses anything (`too_long`), and every pattern applied to model text runs in time linear in its
input: `Tag` finds tagged blocks without a lazy `(.*?)`, and NUMBER has no two parts that can
match the same digits. Numbers read from model text go through range checks, so an overflow, an
infinity or an integer past Python's digit limit is a malformed action, not an exception.

An environment may also ship two scripted agents (the built-ins do): a solver that reads the
hidden rule from the task (an upper bound, and a test of the environment), and an explorer that
does not know the rule but writes what it learns into hints and reads them back on the next
task. `play_pack` runs a scripted agent through a pack the way the rollout driver runs a model
(hints replaced between tasks), so tests and `cod-fast envs solve` can see the CoD effect
without a model. An environment that states its hidden rule as hint entries (`hint_truth`,
`hint_entries`, `knowable_entries`, `render_hints`; FrozenLake and Terminal do) gets hint-quality
diagnostics in every run and `cod-fast eval --hints`.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

from cod_fast.common.errors import CodFastError
from cod_fast.envs.text import NUMBER as NUMBER  # re-exported: environments parse with them
from cod_fast.envs.text import Tag as Tag

if TYPE_CHECKING:
    from cod_fast.envs.judge import JudgeQuery, Verdict

Setting = Literal["train", "eval"]
Size = Literal["tiny", "full"]
NO_HINTS = None
MAX_ACTION_CHARS = 32_000
"""The longest action an environment reads: a 2048-token response is well under 10,000
characters, and refusing longer text before parsing bounds every parser's work."""


def derive_seed(*parts: object) -> int:
    """A stable 64-bit seed from any parts (Python's hash() of str changes per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rng_for(*parts: object) -> random.Random:
    return random.Random(derive_seed(*parts))


def too_long(action: str) -> str | None:
    """Why `action` is refused before it is parsed (None when its length is fine); a Task.step
    turns this into its own malformed-action outcome."""
    if len(action) <= MAX_ACTION_CHARS:
        return None
    return f"the action is too long: {len(action)} characters, at most {MAX_ACTION_CHARS}"


@dataclass
class StepOutcome:
    """What one action led to."""

    observation: str
    """Text the agent sees next (or the final message when done)."""
    done: bool
    """The episode is over (goal reached, failure, step budget spent, or a malformed action)."""
    valid: bool = True
    """False when the action did not parse; the episode then ends."""


class Task(ABC):
    """One task of a pack. Subclasses keep their hidden state in attributes the solver may read."""

    env_name: ClassVar[str]
    max_steps: int
    """Agent steps (model responses) allowed in this task."""

    def __init__(self, pack_seed: int, task_index: int):
        self.pack_seed = pack_seed
        self.task_index = task_index

    @abstractmethod
    def prompt(self) -> str:
        """The task statement and the exact action format (no hints: the driver adds those)."""

    @abstractmethod
    def reset(self) -> str:
        """Start (or restart) the task; returns the first observation."""

    @abstractmethod
    def step(self, action: str) -> StepOutcome:
        """Apply one action (model text, untrusted: refused as malformed when `too_long`)."""

    @property
    @abstractmethod
    def reward(self) -> float:
        """The task reward so far; final once the episode is done (in the env's bounded scale)."""

    @abstractmethod
    def feedback(self) -> str:
        """Environment feedback after the episode, shown to the update-context episode."""

    @property
    def success(self) -> bool | None:
        """Whether the task was solved, for environments with a notion of success."""
        return None

    def judge_query(self) -> JudgeQuery | None:
        """What a judge reads about the finished episode (cod_fast.envs.judge); None for an
        environment that scores itself (the default). A task that returns a query has its reward
        set by `judged_reward` from whichever judge the run uses."""
        return None

    def judged_reward(self, verdict: Verdict) -> float:
        """The reward the judge's verdict gives (for a `RuleJudge`, `reward` itself)."""
        raise NotImplementedError(f"{type(self).__qualname__} is not scored by a judge")


class Agent(ABC):
    """A scripted player: sees what a model would see (text), returns text."""

    def start(self, task: Task, hints: str | None) -> None:  # noqa: B027 - optional hook
        """Called before a task with the current hints (None on the first task)."""

    @abstractmethod
    def act(self, observation: str) -> str:
        """The next action for the last observation."""

    def write_hints(self, task: Task, old_hints: str | None) -> str | None:
        """The hints to carry to the next task (None: keep none). Default: keep the old ones."""
        return old_hints


class MissingScriptedAgent(ValueError, CodFastError):
    """A scripted agent (solver or explorer) asked of an environment that defines none."""

    def __init__(self, env: Environment, agent: str, used_as: str):
        name = getattr(env, "name", type(env).__qualname__)
        super().__init__(
            f"environment {name} has no scripted {agent}, which {used_as}; "
            f"define {type(env).__qualname__}.{agent}() to give it one"
        )


class Environment(ABC):
    """A family of tasks with a hidden rule per pack, in a train or a harder eval setting."""

    name: ClassVar[str]
    description: ClassVar[str]
    reveals_reward: ClassVar[bool] = True
    """Whether the update-context episode is shown the task reward (PDE discovery hides it)."""
    reward_range: ClassVar[tuple[float, float]] = (-1.0, 1.0)
    """The lowest and the highest reward a task can give, inside [-1, 1] (docs/concepts.md
    section 1); `cod-fast envs check` holds the environment to it. The default is the whole of
    [-1, 1]; an environment that scores in [0, 1] says so."""

    def __init__(self, setting: Setting = "train", size: Size = "full"):
        if setting not in ("train", "eval"):
            raise ValueError(f"setting must be 'train' or 'eval', got {setting!r}")
        if size not in ("tiny", "full"):
            raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
        self.setting = setting
        self.size = size

    @abstractmethod
    def task(self, pack_seed: int, task_index: int) -> Task:
        """Task `task_index` of pack `pack_seed` (deterministic; the hidden rule from pack_seed)."""

    def solver(self) -> Agent:
        """A scripted agent that reads the task's hidden rule (an upper bound). Optional: `cod-fast
        envs solve` and `envs check` play it where there is one."""
        raise MissingScriptedAgent(self, "solver", "`cod-fast envs solve` plays as the upper bound")

    def explorer(self) -> Agent:
        """A scripted agent that does not know the rule and carries what it learns in hints.
        Optional, but the warm start imitates it and the built-in `bpe` tokenizer is trained on
        its transcripts (the preflight refuses such a run without one)."""
        raise MissingScriptedAgent(
            self, "explorer", "the warm start imitates and the bpe tokenizer is trained on"
        )

    @classmethod
    def has_solver(cls) -> bool:
        """Whether the environment defines a scripted solver."""
        return cls.solver is not Environment.solver

    @classmethod
    def has_explorer(cls) -> bool:
        """Whether the environment defines a scripted explorer."""
        return cls.explorer is not Environment.explorer

    # Hint diagnostics: optional. An environment that declares them states its hidden rule as
    # entries (name -> value), reads entries out of hint text and renders them back, so a run
    # can score the hints a model writes and evaluation can hand it perfect or scripted ones.

    @classmethod
    def has_hint_entries(cls) -> bool:
        """Whether the environment declares its hint entries (defines `hint_truth`)."""
        return cls.hint_truth is not Environment.hint_truth

    def hint_truth(self, pack_seed: int) -> dict[str, str] | None:
        """The entries a perfect hint states for this pack; None where the environment declares
        no hint entries."""
        return None

    def hint_entries(self, hints: str | None) -> dict[str, str]:
        """The entries a hint text states (None: no hints); an entry it leaves open is not
        stated. Hints are model text: read in time linear in their length."""
        return {}

    def knowable_entries(
        self, known: dict[str, str], task: Task, steps: Sequence[tuple[str, str]], feedback: str
    ) -> dict[str, str]:
        """The entries the scripted explorer states after one more task of a pack, had it chosen
        that episode's actions, when it knew `known` before (a pack starts from {}): `task` as
        the episode left it, its (observation, action) pairs (actions are model text) and the
        feedback after it. Folded over a pack's episodes, what its trajectory shows."""
        return {}

    def render_hints(self, entries: dict[str, str]) -> str:
        """Hint text that states `entries` and no others, in the form `hint_entries` reads."""
        raise NotImplementedError(f"{self.name} declares no hint format")


@dataclass
class PackResult:
    """Per-position rewards of one scripted pass through a pack, with the hints after each task."""

    rewards: list[float]
    hints: list[str | None] = field(default_factory=list)
    successes: list[bool | None] = field(default_factory=list)


def play_task(task: Task, agent: Agent, hints: str | None) -> float:
    """Run `agent` through one task until it is done or its step budget is spent."""
    agent.start(task, hints)
    observation = task.reset()
    for _ in range(task.max_steps):
        outcome = task.step(agent.act(observation))
        observation = outcome.observation
        if outcome.done:
            break
    return task.reward


def play_pack(
    env: Environment, agent: Agent, pack_seed: int, num_tasks: int, use_hints: bool = True
) -> PackResult:
    """Tasks 0..K-1 of a pack in order; between tasks the agent rewrites its hints (replacing the
    old ones), unless `use_hints` is False, when every task starts from no hints."""
    result = PackResult(rewards=[])
    hints: str | None = NO_HINTS
    for k in range(num_tasks):
        task = env.task(pack_seed, k)
        result.rewards.append(play_task(task, agent, hints if use_hints else NO_HINTS))
        result.successes.append(task.success)
        hints = agent.write_hints(task, hints)
        result.hints.append(hints)
    return result
