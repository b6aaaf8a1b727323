"""Guess f(x): a CoD environment outside the cod_fast package (docs/environments.md).

Each task shows a number x and asks for f(x) = a * x + b; (a, b) is the pack's hidden rule. A
wrong answer is told "higher" or "lower"; the right one scores 1, less 0.2 per earlier try.
"""

from __future__ import annotations

import re

from cod_fast.envs import register
from cod_fast.envs.base import Agent, Environment, StepOutcome, Task, rng_for, too_long

ANSWER = re.compile(r"\s*answer\s+(\d{1,4})\s*", re.IGNORECASE)  # a few digits: no huge ints
PAIR = re.compile(r"(\d+)->(\d+)")


class GuessTask(Task):
    max_steps = 5

    def __init__(self, pack_seed: int, task_index: int, top_x: int, top_a: int):
        super().__init__(pack_seed, task_index)
        rule = rng_for("guess", pack_seed)  # the hidden rule: from the pack seed alone
        self.a, self.b = rule.randint(1, top_a), rule.randint(0, 9)
        self.x = rng_for("guess", pack_seed, task_index).randint(1, top_x)
        self.tries, self.outcome = 0, ""

    def prompt(self) -> str:
        return (
            "Find f(x) = a*x + b for the x shown (a in 1..9, b in 0..9, the same in every task "
            "of the pack). Reply `answer N`; a wrong answer is told higher or lower."
        )

    def reset(self) -> str:
        self.tries, self.outcome = 0, ""
        return f"x = {self.x}"

    def step(self, action: str) -> StepOutcome:
        found = None if too_long(action) else ANSWER.fullmatch(action)
        if found is None:
            self.outcome = "malformed"
            return StepOutcome("Malformed: reply `answer N`.", done=True, valid=False)
        self.tries += 1
        guess, answer = int(found[1]), self.a * self.x + self.b
        if guess == answer:
            self.outcome = "right"
            return StepOutcome("right", done=True)
        return StepOutcome("higher" if guess < answer else "lower", self.tries == self.max_steps)

    @property
    def reward(self) -> float:
        return 1.0 - 0.2 * (self.tries - 1) if self.outcome == "right" else 0.0

    def feedback(self) -> str:
        return f"{self.outcome or 'wrong'}: {self.x}->{self.a * self.x + self.b}"


class GuessExplorer(Agent):
    """Keeps the rules (a, b) that agree with the (x, f(x)) pairs in its hints and with each
    "higher" or "lower", and answers the middle of what they predict."""

    def start(self, task: Task, hints: str | None) -> None:
        pairs = [(int(x), int(y)) for x, y in PAIR.findall(hints or "")]
        rules = [(a, b) for a in range(1, 10) for b in range(10)]
        self.rules = [(a, b) for a, b in rules if all(a * x + b == y for x, y in pairs)] or rules

    def act(self, observation: str) -> str:
        if observation.startswith("x = "):
            self.x = int(observation[4:])
        elif observation in ("higher", "lower"):
            sign = 1 if observation == "higher" else -1
            self.rules = [(a, b) for a, b in self.rules if sign * (a * self.x + b - self.guess) > 0]
        predictions = sorted(a * self.x + b for a, b in self.rules) or [0]
        self.guess = predictions[len(predictions) // 2]
        return f"answer {self.guess}"

    def write_hints(self, task: Task, old_hints: str | None) -> str | None:
        pairs = PAIR.findall(f"{old_hints or ''} {task.feedback()}")  # feedback shows x->f(x)
        return " ".join(f"{x}->{y}" for x, y in pairs[-2:])


@register("guess")
class GuessEnv(Environment):
    name = "guess"
    description = "Find f(x) = a*x + b; (a, b) is the pack's hidden rule."
    reward_range = (0.0, 1.0)

    def task(self, pack_seed: int, task_index: int) -> Task:
        top_x = 9 if self.size == "tiny" else 99
        return GuessTask(pack_seed, task_index, top_x, top_a=4 if self.setting == "train" else 9)

    def explorer(self) -> Agent:
        return GuessExplorer()
