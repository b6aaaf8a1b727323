"""What a judge reads and says: the scoring interface any environment may use.

An environment whose outcome is best scored by a reader (a free-text diagnosis, an essay) gives
each finished solve episode a `JudgeQuery`: the rubric, the hidden reference, the transcript, the
final answer, and its own rule-based verdict. A `Judge` turns the query into a `Verdict`, a score
in [0, 1] and a flag for a trajectory it cannot grade (`malformed`); the task turns the verdict
into its reward (`Task.judged_reward`). The default judge is the environment's own rule
(`RuleJudge`); a Hugging Face model folder or an OpenAI-compatible endpoint can stand in for it
(cod_fast.rollout.judge_clients), reading the same prompt (`judge_prompt`) and answering in the same form
(`parse_verdict`). A malformed trajectory is left out of its pack's advantage group
(cod_fast.algo.assign), as Trinity-RFT drops the trajectories its judge flags.

This module is data and text only: it imports nothing above the environments.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

from cod_fast.common.errors import CodFastError
from cod_fast.envs.text import NUMBER, Tag

SCORE_TAG = Tag("score")
MALFORMED_RE = re.compile(r"<\s*malformed\s*/?\s*>", re.IGNORECASE)
MAX_REPLY_CHARS = 20_000
"""The longest judge reply read; a longer one is an error (a judge that rambles is broken)."""


class JudgeError(RuntimeError, CodFastError):
    """A judge that failed to give a verdict (unreachable, timed out, an unreadable reply); the
    driver scores the episode as an environment error, with this message as its one line."""


@dataclass(frozen=True)
class Verdict:
    """A judge's reading of one finished solve episode."""

    score: float
    """How right the outcome is, in [0, 1]."""
    malformed: bool = False
    """The trajectory cannot be graded (an answer in no readable form): it is left out of its
    pack's advantage group and counted in the metrics."""
    reason: str = ""
    """A short reason, kept in the episode's info."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.score) and 0.0 <= self.score <= 1.0):
            raise JudgeError(f"a verdict's score must be a number in [0, 1], got {self.score}")


@dataclass(frozen=True)
class JudgeQuery:
    """What a judge reads about one finished solve episode."""

    env: str
    """The environment's name."""
    rubric: str
    """What to score and how, in the environment's words."""
    reference: str
    """The hidden facts and the right answer (never shown to the agent)."""
    transcript: str
    """The episode as text: the task, the agent's actions and the replies it got."""
    answer: str
    """The agent's final answer ('' when it gave none)."""
    rule: Verdict
    """The environment's own rule-based verdict (what `RuleJudge` says)."""


class Judge(ABC):
    """Scores finished solve episodes. Implementations: `RuleJudge` here, a model folder and an
    endpoint in cod_fast.rollout.judge_clients."""

    name: str = "judge"

    @abstractmethod
    def score(self, query: JudgeQuery) -> Verdict:
        """The verdict on one episode; JudgeError when there is none."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the judge holds (a model, a connection)."""


class RuleJudge(Judge):
    """The environment's own rule: the verdict the query carries."""

    name = "rule"

    def score(self, query: JudgeQuery) -> Verdict:
        return query.rule


def judge_prompt(query: JudgeQuery) -> tuple[str, str]:
    """The (system, user) messages a model or an endpoint judge reads."""
    system = (
        "You grade one episode of an agent against a hidden reference. "
        f"{query.rubric} Reply with <score>S</score>, S a number from 0 to 1; add <malformed/> "
        "only when the agent's answer is in no form you can grade."
    )
    user = (
        f"Reference (hidden from the agent):\n{query.reference}\n\n"
        f"Episode:\n{query.transcript}\n\nFinal answer: {query.answer or '(none)'}"
    )
    return system, user


def parse_verdict(reply: str) -> Verdict:
    """A judge's reply -> Verdict: the last `<score>S</score>` (S a number, clipped to [0, 1])
    and whether `<malformed/>` appears. JudgeError, in one line, when there is no score."""
    if len(reply) > MAX_REPLY_CHARS:
        raise JudgeError(f"the judge's reply is {len(reply)} characters, at most {MAX_REPLY_CHARS}")
    block = SCORE_TAG.last_block(reply)
    number = re.fullmatch(rf"\s*({NUMBER})\s*", block) if block is not None else None
    malformed = MALFORMED_RE.search(reply) is not None
    if number is None or not math.isfinite(value := float(number.group(1))):
        if malformed:  # a flag alone is a verdict: the trajectory is not graded
            return Verdict(0.0, malformed=True, reason="flagged malformed")
        shown = " ".join(reply.split())[:80]
        raise JudgeError(f"the judge's reply has no <score>NUMBER</score>: {shown!r}")
    return Verdict(
        min(max(value, 0.0), 1.0), malformed=malformed, reason=" ".join(reply.split())[:200]
    )
