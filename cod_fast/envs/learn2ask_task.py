"""One Learn2Ask consultation (cod_fast.envs.learn2ask): the shapes of the sizes and settings,
the reading of an action, and a case's episode with its reward, feedback and judge hooks.

A task knows its candidates, the listed findings, the right condition and the patient's
replies; how a pack draws them (built-in profiles or user cases) is the environment's business.
"""

from __future__ import annotations

from dataclasses import dataclass

from cod_fast.envs.base import (
    MAX_ACTION_CHARS,
    Setting,
    Size,
    StepOutcome,
    Task,
    too_long,
)
from cod_fast.envs.cases import MAX_NAME_CHARS, normalise
from cod_fast.envs.judge import JudgeQuery, Verdict


@dataclass(frozen=True)
class AskShape:
    """The knobs of one (size, setting)."""

    conditions: tuple[int, int]
    """Range (inclusive) of the candidate conditions of a pack."""
    findings: int
    """Findings the prompt lists."""
    defined: int
    """Listed findings the profiles are drawn from; the patient is `not sure` about the others
    and about any that none of the pack's conditions shows."""
    shows: tuple[int, int]
    """Range (inclusive) of the findings one condition shows."""
    max_steps: int
    """Turns per task: the questions and the final answer."""
    cost: float
    """What one question costs."""
    compact: bool
    """Letters and digits for names, one-word observations, a one-line feedback."""

    @property
    def floor(self) -> float:
        """The malformed reward: every turn spent asking, and no answer."""
        return -self.cost * self.max_steps


SHAPES: dict[tuple[Size, Setting], AskShape] = {
    ("full", "train"): AskShape((4, 5), 8, 5, (2, 3), max_steps=9, cost=0.05, compact=False),
    ("full", "eval"): AskShape((5, 6), 9, 6, (2, 3), max_steps=10, cost=0.05, compact=False),
    ("tiny", "train"): AskShape((3, 3), 5, 3, (1, 1), max_steps=4, cost=0.1, compact=True),
    # A fourth condition and a sixth finding; a lower cost keeps the solver's longer question
    # sequences (2.25 on average) at 0.82.
    ("tiny", "eval"): AskShape((4, 4), 6, 4, (1, 1), max_steps=5, cost=0.08, compact=True),
}


def parse_action(action: str) -> tuple[str, str] | None:
    """`ask FINDING` or `answer CONDITION` -> (command, normalised name); None when neither.
    Forgives case, whitespace, quotes or backticks around it and a trailing period."""
    text = action.strip().strip("`'\"").strip().rstrip(".").strip().strip("`'\"").strip()
    head, _, rest = text.partition(" ")
    name = normalise(rest)
    if head.lower() not in ("ask", "answer") or not 0 < len(name) <= MAX_NAME_CHARS:
        return None
    return head.lower(), name


class Learn2AskTask(Task):
    """One case. Hidden state: `answer`, `facts` and, in a built-in pack, `profiles` (condition
    -> the findings it shows; every other defined finding is `no`)."""

    env_name = "learn2ask"

    def __init__(
        self,
        pack_seed: int,
        task_index: int,
        shape: AskShape,
        candidates: tuple[str, ...],
        findings: tuple[str, ...],
        answer: str,
        facts: dict[str, str],
        profiles: dict[str, frozenset[str]] | None,
    ):
        super().__init__(pack_seed, task_index)
        self.shape, self.candidates, self.findings = shape, candidates, findings
        self.answer, self.facts, self.profiles = answer, facts, profiles
        self.max_steps = shape.max_steps
        self.expected = (
            "expected ask N or answer X, e.g. ask 3"
            if shape.compact
            else f"expected `ask FINDING` or `answer CONDITION`, e.g. `ask {findings[0]}`"
        )
        self.reset()

    def prompt(self) -> str:
        if self.shape.compact:
            return (
                f"which {' '.join(self.candidates)}? ask {' '.join(self.findings)}\n"
                "act ask N or answer X, e.g. ask 3"
            )
        shows = "Each condition shows {} to {} of the findings. ".format(*self.shape.shows)
        return (
            f"A patient has one of these conditions: {', '.join(self.candidates)}.\n"
            f"Findings you may ask about: {', '.join(self.findings)}.\n"
            f"{shows * (self.profiles is not None)}The patient answers yes, no, or not sure "
            f"about a finding that tells nothing here. Ask with `ask FINDING`, e.g. "
            f"`ask {self.findings[0]}`; end with `answer CONDITION`, e.g. "
            f"`answer {self.candidates[0]}`. A right answer scores 1, a wrong one 0, and each "
            f"question costs {self.shape.cost:g}. You have {self.max_steps} turns."
        )

    def reset(self) -> str:
        self.steps, self.questions, self.done = 0, 0, False
        self.outcome = ""  # '', 'right', 'wrong', 'out', 'invalid' or 'too_long'
        self.given = ""  # the condition the final answer named
        self.log: list[tuple[str, str]] = []  # (action, reply), for the solver and the judge
        if self.shape.compact:
            return f"turns {self.max_steps}"
        return f"The patient waits for your first question. Turns left: {self.max_steps}."

    def step(self, action: str) -> StepOutcome:
        if self.done:
            return StepOutcome(self.feedback(), done=True)
        problem = too_long(action)
        if problem is not None:
            return self._refuse("too_long", f"Invalid action ({problem}): {self.expected}.")
        parsed = parse_action(action)
        # A built-in pack's answer must name a candidate; a user case's may name anything
        # (a model or endpoint judge may credit a synonym; the rule credits the case's answer).
        named_other = parsed is not None and parsed[1] not in self.candidates
        if parsed is None or (parsed[0] == "answer" and named_other and self.profiles is not None):
            shown = action.strip()[:40]
            return self._refuse("invalid", f"Invalid action {shown!r}: {self.expected}.")
        command, name = parsed
        self.steps += 1
        if command == "answer":
            self.done, self.given = True, name
            self.outcome = "right" if name == self.answer else "wrong"
            self.log.append((f"answer {name}", self.outcome))
            text = self.outcome if self.shape.compact else f"Your answer is {self.outcome}."
            return StepOutcome(text, done=True)
        self.questions += 1
        reply = self.facts.get(name, "not sure")
        self.log.append((f"ask {name}", reply))
        left = self.max_steps - self.steps
        if left == 0:
            self.done, self.outcome = True, "out"
        if self.shape.compact:
            return StepOutcome(reply + " out of turns" * self.done, done=self.done)
        text = f"{reply.capitalize()} ({name}). Turns left: {left}."
        return StepOutcome(text + " You are out of turns." * self.done, done=self.done)

    def _refuse(self, outcome: str, observation: str) -> StepOutcome:
        self.done, self.outcome = True, outcome
        self.log.append(("(malformed action)", outcome))
        return StepOutcome(observation, done=True, valid=False)

    @property
    def malformed(self) -> bool:
        return self.outcome in ("invalid", "too_long")

    @property
    def reward(self) -> float:
        return self.judged_reward(Verdict(float(self.success)))

    @property
    def success(self) -> bool:
        return self.outcome == "right"

    def feedback(self) -> str:
        """The result and, once done, the true condition (last, so that what was seen can be
        attributed to it)."""
        bad = f"bad action, {self.expected}"
        if self.shape.compact:
            results = {"out": "out of turns", "invalid": bad, "too_long": f"too long, {bad}"}
            result = results.get(self.outcome, self.outcome or "unfinished")
            return f"{result}, it was {self.answer}" if self.done else result
        result = {
            "right": f"Right answer; questions asked: {self.questions}.",
            "wrong": f"Wrong answer ({self.given}); questions asked: {self.questions}.",
            "out": "Out of turns without an answer.",
            "": "Not finished.",
            "invalid": f"Stopped by an invalid action ({self.expected}).",
            "too_long": f"Stopped by an action over {MAX_ACTION_CHARS} characters "
            f"({self.expected}).",
        }[self.outcome]
        return f"{result} The patient had: {self.answer}" if self.done else result

    def judge_query(self) -> JudgeQuery | None:
        """Once done: the reference (the condition and the case's findings), the questions and
        replies, the condition named, and the rule's verdict (1 when it is the right one)."""
        if not self.done:
            return None
        facts = ", ".join(f"{f} {reply}" for f, reply in self.facts.items())
        turns = "\n".join(f"{action} -> {reply}" for action, reply in self.log)
        return JudgeQuery(
            env=self.env_name,
            rubric="Score 1 if the final answer names the reference condition, else 0.",
            reference=f"condition: {self.answer}; findings: {facts}; any other: not sure",
            transcript=f"{self.prompt()}\n{turns}",
            answer=self.given,
            rule=Verdict(float(self.success), reason=self.outcome),
        )

    def judged_reward(self, verdict: Verdict) -> float:
        """The verdict's score less the questions' cost; a malformed action keeps the floor."""
        if self.malformed:
            return self.shape.floor
        return verdict.score - self.shape.cost * self.questions
