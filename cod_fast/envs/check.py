"""`cod-fast envs check`: an environment against the contract every built-in one is held to
(docs/concepts.md section 6, docs/robustness.md), one result per check.

- class: an Environment subclass with a name, a description and a reward range inside [-1, 1];
- settings: the train and the eval setting construct, and their tasks state themselves;
- determinism: fresh environments give the same prompt, observations, rewards and feedback for
  the same (pack seed, task index) and actions, and a task replays the same after `reset()`;
- fuzz: hostile model text (empty, megabytes, NUL and unicode, numbers of 16,000 digits,
  repeated and unclosed tags, the built-ins' commands followed by junk) is answered within
  STEP_SECONDS without an exception, and an action over MAX_ACTION_CHARS ends the episode as
  malformed;
- solver, explorer (each where the environment has one): they play packs to the end; the
  solver, which reads the hidden rule, scores near the top of the reward range; the explorer,
  its hints carried from task to task, scores no worse late in a pack than on its first task
  (the CoD premise: hints about the pack's hidden rule help the tasks after; a rule drawn per
  task makes them mislead);
- hints (where the environment declares hint entries): entries come back from the text
  `render_hints` writes for them, as the driver reads hints (`hint_entries`).

Every step of every check must keep the reward finite and inside the environment's declared
`reward_range`. The tests of the built-in environments run these same checks
(tests/envs/test_env_fuzz.py, tests/envs/test_envs_registry.py).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from cod_fast.config import shown
from cod_fast.envs.base import (
    MAX_ACTION_CHARS,
    Agent,
    Environment,
    PackResult,
    Size,
    StepOutcome,
    Task,
    play_pack,
    play_task,
)
from cod_fast.envs.packs import pack_seeds
from cod_fast.envs.registry import env_class, error_line

STEP_SECONDS = 0.5
"""The longest one step may take. Generous for a busy machine: a linear parser reads a megabyte
in milliseconds; the quadratic patterns the built-ins once had took 7 to 11 s on 16K digits or
128K characters of tags."""
SOLVER_SHARE = 0.75
"""The solver's mean reward must reach this share of the top of the reward range (the built-in
solvers score 0.85 to 1.0 of it)."""
TASKS = 4
"""Tasks per pack that the solver and the explorer play."""
LATE = TASKS // 2
"""The explorer's rewards at positions LATE..TASKS-1 are the late ones, held against position 0."""
STANDARD_ERRORS = 2.0
"""Standard errors of the per-pack difference the explorer's late mean may fall below its first."""
SLACK = 0.05
"""And this share of the reward range's width on top (an explorer that scores the same in every
pack has a standard error of 0)."""

NUMBERS = [
    "1e308",
    "1e309",
    "-1e309",
    "inf",
    "-inf",
    "nan",
    "1" + "0" * 5000,  # past Python's int <-> str digit limit (4300)
    "9" * 16_000,
    "0." + "0" * 20_000 + "1",
    "1e-999999",
    "1e+99999999999999999999",
    "-" * 1000 + "1",
]
HOSTILE = [
    "",
    " ",
    "\x00" * 1000,
    "a" * 1_000_000,
    "a" * (MAX_ACTION_CHARS + 1),
    "\u202e" + "evil" * 100,  # right-to-left override
    "e\u0301" * 5000,  # combining accents
    "\U0001f600" * 5000,
    "(" * 20_000 + ")" * 20_000,
    "[" * 50_000,
    "<answer>" * 50_000,
    "<law>" * 50_000,
    "<answer>" + "x" * 100_000,
    "<answer></answer>" * 20_000,
    "< answer >" * 20_000 + "</ answer >",
    "<answer>" + "<answer>" * 1000 + "1</answer>",
    "\n" * 100_000,
    "right " + "9" * 16_000,
    *NUMBERS,
]
COMMANDS = [
    "direction {x}",
    "Direction 1 {x}",
    "up {x}",
    "right {x}",
    "sample {x} 3",
    "sample 0.1 {x}",
    "regress {x}",
    "summary {x}",
    "answer {x}",
    "<answer>{x}</answer>",
    "<answer>cd {x}</answer>",
    "<answer>ls {x}</answer>",
    "<answer>u + {x}*u^2</answer>",
    "<law>a = {x}, b = {x}</law>",
    "<law>{x}</law>",
    "{x} + {x}",
    "combine {x} + {x}",
]
"""The built-in environments' commands (a valid-looking head), to reach the parsers behind them."""


class ContractError(Exception):
    """An environment breaks the contract; the message says where and how."""


@dataclass
class CheckResult:
    """One line of `cod-fast envs check`."""

    name: str
    status: str
    """ok, FAILED, or skipped (no such agent, or an earlier check failed)."""
    detail: str = ""

    def line(self) -> str:
        return f"{self.name:<12} {self.status}" + (f": {self.detail}" if self.detail else "")


def hostile_corpus(seed: int = 0) -> list[str]:
    """HOSTILE, then each command of COMMANDS twice with junk drawn (by `seed`) in its slot."""
    rng = random.Random(seed)
    junk = [*NUMBERS, "(" * 5000, "<answer>" * 2000, "\x00", "\U0001f600" * 100, "x" * 20_000]
    return HOSTILE + [cmd.format(x=rng.choice(junk)) for cmd in COMMANDS for _ in range(2)]


def check_reward(reward: object, reward_range: tuple[float, float], when: str) -> None:
    """A reward must be a finite number inside the environment's `reward_range`."""
    low, high = reward_range
    if not (isinstance(reward, (int, float)) and math.isfinite(reward) and low <= reward <= high):
        raise ContractError(f"reward {reward!r} {when}, outside reward_range ({low}, {high})")


def check_step(task: Task, action: str, reward_range: tuple[float, float]) -> StepOutcome:
    """One step of `action`: no exception, at most STEP_SECONDS, a text observation and a reward
    in range."""
    started = time.perf_counter()
    try:
        outcome = task.step(action)
    except Exception as e:  # the environment's own bug, whatever it raises
        raise ContractError(f"step({shown(action)}) raised {error_line(e)}") from e
    elapsed = time.perf_counter() - started
    if elapsed > STEP_SECONDS:
        raise ContractError(
            f"step({shown(action)}) took {elapsed:.2f} s (at most {STEP_SECONDS}): a parser "
            "slower than linear in the text?"
        )
    if not (isinstance(outcome, StepOutcome) and isinstance(outcome.observation, str)):
        raise ContractError(f"step({shown(action)}) returned {shown(outcome)}, not a StepOutcome")
    check_reward(task.reward, reward_range, f"after step({shown(action)})")
    return outcome


def check_fuzz(env: Environment, seed: int = 0) -> str:
    """Each hostile action as the first action of a fresh task, and its first half again when
    the episode goes on; the feedback after it is text."""
    corpus = hostile_corpus(seed)
    for i, action in enumerate(corpus):
        task = env.task(pack_seed=1000 + i, task_index=i % 4)
        task.prompt()
        task.reset()
        outcome = check_step(task, action, env.reward_range)
        if len(action) > MAX_ACTION_CHARS and not (outcome.done and not outcome.valid):
            raise ContractError(
                f"a {len(action)}-character action did not end the episode as malformed "
                f"(refuse actions over {MAX_ACTION_CHARS} characters with base.too_long)"
            )
        if not outcome.done:
            check_step(task, action[: len(action) // 2], env.reward_range)
        if not isinstance(task.feedback(), str):
            raise ContractError(f"feedback() after step({shown(action)}) is not text")
    return f"{len(corpus)} hostile actions, each answered within {STEP_SECONDS} s"


def check_class(cls: type[Environment]) -> str:
    """The class's declarations: a name and a description (text), `reward_range` inside [-1, 1]
    with low < high, `reveals_reward` a bool."""
    for attribute in ("name", "description"):
        value = getattr(cls, attribute, None)
        if not (isinstance(value, str) and value.strip()):
            raise ContractError(f"{cls.__qualname__}.{attribute} is {shown(value)}; expected text")
    bounds = cls.reward_range
    numbers = isinstance(bounds, tuple) and len(bounds) == 2
    if not (numbers and all(isinstance(b, (int, float)) for b in bounds)):
        raise ContractError(f"reward_range is {shown(bounds)}; expected a (low, high) tuple")
    if not -1 <= bounds[0] < bounds[1] <= 1:
        raise ContractError(f"reward_range is {bounds}; expected -1 <= low < high <= 1")
    if not isinstance(cls.reveals_reward, bool):
        raise ContractError(f"reveals_reward is {shown(cls.reveals_reward)}; expected a bool")
    return f"{cls.name}, reward_range {bounds}"


def check_settings(cls: type[Environment], size: Size) -> str:
    """Both settings construct, and a task of each gives a text prompt and first observation
    and at least one step."""
    for setting in ("train", "eval"):
        task = cls(setting=setting, size=size).task(pack_seeds("check", 1)[0], 0)
        prompt, observation = task.prompt(), task.reset()
        if not (isinstance(prompt, str) and isinstance(observation, str)):
            raise ContractError(f"{setting}: prompt() and reset() must return text")
        if not (isinstance(task.max_steps, int) and task.max_steps >= 1):
            raise ContractError(f"{setting}: max_steps is {shown(task.max_steps)}; expected >= 1")
    return "train and eval"


class _Recorder(Agent):
    """An agent's (observation, action) steps, recorded as it plays."""

    def __init__(self, inner: Agent):
        self.inner, self.steps = inner, []

    def start(self, task: Task, hints: str | None) -> None:
        self.inner.start(task, hints)

    def act(self, observation: str) -> str:
        self.steps.append((observation, self.inner.act(observation)))
        return self.steps[-1][1]

    def write_hints(self, task: Task, old_hints: str | None) -> str | None:
        return self.inner.write_hints(task, old_hints)


def _scripts(env: Environment, pack_seed: int, task_index: int) -> list[list[str]]:
    """Action scripts to replay: the built-ins' commands, and the actions of the environment's
    own scripted agents on this task (where it has them)."""
    scripts = [[cmd.format(x=1) for cmd in COMMANDS]]
    for make in [env.solver] * env.has_solver() + [env.explorer] * env.has_explorer():
        recorder = _Recorder(make())
        play_task(env.task(pack_seed, task_index), recorder, None)
        scripts.append([action for _, action in recorder.steps])
    return scripts


def _trace(
    task: Task, actions: list[str], reward_range: tuple[float, float]
) -> list[tuple[str, object]]:
    """(what, value) for everything an episode of `actions` shows, from its prompt on."""
    trace: list[tuple[str, object]] = [("prompt", task.prompt()), ("observation 0", task.reset())]
    for i, action in enumerate(actions[: task.max_steps], start=1):
        outcome = check_step(task, action, reward_range)
        trace += [(f"observation {i}", outcome.observation), (f"done {i}", outcome.done)]
        trace += [(f"valid {i}", outcome.valid), (f"reward {i}", task.reward)]
        if outcome.done:
            break
    return [*trace, ("feedback", task.feedback()), ("success", task.success)]


def _difference(reference: list[tuple[str, object]], other: list[tuple[str, object]]) -> str:
    """What differs first between two traces ("" when nothing does)."""
    for (what, value), (_, again) in zip(reference, other, strict=False):  # a shorter one: below
        if value != again:
            return what
    return "" if len(reference) == len(other) else "number of steps"


def check_determinism(cls: type[Environment], size: Size) -> str:
    """For a few (pack seed, task index) in each setting and for each script: the same episode
    again from the same task after `reset()`, and from a fresh environment."""
    tasks = [(seed, k) for k, seed in enumerate(pack_seeds("check-determinism", 3))]
    for setting in ("train", "eval"):
        env, fresh = cls(setting=setting, size=size), cls(setting=setting, size=size)
        for pack_seed, k in tasks:
            for actions in _scripts(env, pack_seed, k):
                task = env.task(pack_seed, k)
                reference = _trace(task, actions, cls.reward_range)
                again = {
                    "a replay after reset()": _trace(task, actions, cls.reward_range),
                    "a fresh environment": _trace(
                        fresh.task(pack_seed, k), actions, cls.reward_range
                    ),
                }
                for how, trace in again.items():
                    if what := _difference(reference, trace):
                        raise ContractError(
                            f"{setting}, pack seed {pack_seed}, task {k}: {how} gave another "
                            f"{what} for the same actions"
                        )
    return f"{len(tasks)} tasks per setting, replayed after reset() and in a fresh environment"


def _play(env: Environment, make: Callable[[], Agent], packs: int) -> list[PackResult]:
    """`packs` packs of TASKS tasks played by fresh agents, their rewards in range and their
    hints text (or None)."""
    results = []
    for pack_seed in pack_seeds("check", packs):
        result = play_pack(env, make(), pack_seed, TASKS)
        for k, (reward, hints) in enumerate(zip(result.rewards, result.hints, strict=True)):
            when = f"at the end of pack seed {pack_seed}, task {k}"
            check_reward(reward, env.reward_range, when)
            if not (hints is None or isinstance(hints, str)):
                raise ContractError(f"hints {shown(hints)} {when}; expected text or None")
        results.append(result)
    return results


def check_solver(cls: type[Environment], size: Size, packs: int) -> str:
    """The solver through `packs` packs of each setting: its mean reward is at least SOLVER_SHARE
    of the top of the reward range."""
    floor = SOLVER_SHARE * cls.reward_range[1]
    means = {}
    for setting in ("train", "eval"):
        env = cls(setting=setting, size=size)
        rewards = [r for result in _play(env, env.solver, packs) for r in result.rewards]
        means[setting] = sum(rewards) / len(rewards)
        if means[setting] < floor:
            raise ContractError(
                f"{setting}: mean reward {means[setting]:.3f}, below {floor:.3f} "
                f"({SOLVER_SHARE} x the top of reward_range): a solver reads the hidden rule"
            )
    return "mean reward " + ", ".join(f"{mean:.3f} ({setting})" for setting, mean in means.items())


def check_explorer(cls: type[Environment], size: Size, packs: int) -> str:
    """The explorer through `packs` packs of each setting, hints carried between tasks: its mean
    reward at the late positions is at least its first position's, less the tolerance
    (STANDARD_ERRORS, SLACK). Says both means (the CoD gain it shows)."""
    shown_means = []
    for setting in ("train", "eval"):
        env = cls(setting=setting, size=size)
        first, late, tolerance = _first_and_late(_play(env, env.explorer, packs), cls.reward_range)
        if late < first - tolerance:
            raise ContractError(
                f"{setting}: the explorer's mean reward falls from {first:.2f} at position 0 to "
                f"{late:.2f} at positions {LATE}-{TASKS - 1} over {packs} packs, hints carried "
                f"(tolerance {tolerance:.2f}): the hidden rule changes within a pack: draw it "
                f"once per pack seed, in {cls.task.__qualname__}() from pack_seed alone (never "
                "from task_index), so that hints about it help the later tasks"
            )
        shown_means.append(f"{first:.2f} -> {late:.2f} ({setting})")
    return f"mean reward at position 0 -> {LATE}-{TASKS - 1}: " + ", ".join(shown_means)


def _first_and_late(
    results: list[PackResult], reward_range: tuple[float, float]
) -> tuple[float, float, float]:
    """The mean reward at position 0, the mean at the late positions, and how far the late one
    may fall below the first: STANDARD_ERRORS standard errors of the per-pack difference (late
    mean less first) plus SLACK of the range's width."""
    firsts = [result.rewards[0] for result in results]
    lates = [sum(result.rewards[LATE:]) / (TASKS - LATE) for result in results]
    differences = [late - first for first, late in zip(firsts, lates, strict=True)]
    error = statistics.stdev(differences) / math.sqrt(len(results)) if len(results) > 1 else 0.0
    tolerance = STANDARD_ERRORS * error + SLACK * (reward_range[1] - reward_range[0])
    return statistics.fmean(firsts), statistics.fmean(lates), tolerance


def check_hints(cls: type[Environment], size: Size, packs: int) -> str:
    """Hint entries read back from the text that states them, in each setting and each of
    `packs` packs: the pack's true entries (`hint_truth`), none, each alone, all but each, and
    what the explorer's episodes show (`knowable_entries` folded over the pack: the driver's
    `explorer` hint source) go through `render_hints`, then as the driver reads a hint block
    (its text stripped, cod_fast.rollout.hints.parse_hints) through `hint_entries`, and come
    back the same."""
    read = 0
    for setting in ("train", "eval"):
        env = cls(setting=setting, size=size)
        for pack_seed in pack_seeds("check", packs):
            where = f"{setting}, pack seed {pack_seed}"
            truth = env.hint_truth(pack_seed)
            if truth is None:  # no entries for this pack (learn2ask with user cases)
                continue
            texts = isinstance(truth, dict) and all(
                isinstance(x, str) for x in (*truth, *truth.values())
            )
            if not texts:
                raise ContractError(f"{where}: hint_truth gave {shown(truth)}; expected str -> str")
            for entries in [*_subsets(truth), *_knowable(env, pack_seed)]:
                _round_trip(env, entries, where)
                read += 1
    if not read:
        return "hint_truth gave None for every pack: nothing to read back"
    return f"{read} sets of entries read back from render_hints"


def _subsets(truth: dict[str, str]) -> list[dict[str, str]]:
    """All of `truth`, none of it, each entry alone and all but each."""
    alone = [{name: value} for name, value in truth.items()]
    but = [{n: v for n, v in truth.items() if n != name} for name in truth]
    return [dict(truth), {}, *alone, *but]


def _knowable(env: Environment, pack_seed: int) -> list[dict[str, str]]:
    """The entries the explorer's episodes of a pack show, after each task (`knowable_entries`
    folded as the driver folds it); none without an explorer."""
    if not env.has_explorer():
        return []
    agent, known, hints, shown_after = _Recorder(env.explorer()), {}, None, []
    for k in range(TASKS):
        task, agent.steps = env.task(pack_seed, k), []
        play_task(task, agent, hints)
        known = env.knowable_entries(known, task, agent.steps, task.feedback())
        hints = agent.write_hints(task, hints)
        shown_after.append(known)
    return shown_after


def _round_trip(env: Environment, entries: dict[str, str], where: str) -> None:
    text = env.render_hints(dict(entries))
    if not isinstance(text, str):
        raise ContractError(f"{where}: render_hints returned {shown(text)}; expected text")
    back = env.hint_entries(text.strip())
    if back != entries:
        lost = sorted(name for name in entries if back.get(name) != entries[name])
        added = sorted(set(back) - set(entries))
        raise ContractError(
            f"{where}: render_hints({shown(entries)}) wrote {shown(text)}, which hint_entries "
            f"reads as {shown(back)} (lost: {shown(lost)}, added: {shown(added)}): write every "
            "entry, and no other, in the form hint_entries reads"
        )


def run_checks(name: str, size: Size = "full", packs: int = 8) -> list[CheckResult]:
    """Every check of the environment `name` (a name or a path, as `env_class` takes it) at
    `size`, the solver and explorer over `packs` packs per setting. When the class or the
    settings fail, the others are not run."""
    cls = env_class(name)
    checks: list[tuple[str, Callable[[], str] | str]] = [
        ("class", lambda: check_class(cls)),
        ("settings", lambda: check_settings(cls, size)),
        ("determinism", lambda: check_determinism(cls, size)),
        ("fuzz", lambda: check_fuzz(cls(setting="train", size=size))),
        (
            "solver",
            (lambda: check_solver(cls, size, packs))
            if cls.has_solver()
            else "no solver() (optional: the upper bound of cod-fast envs solve)",
        ),
        (
            "explorer",
            (lambda: check_explorer(cls, size, packs))
            if cls.has_explorer()
            else "no explorer() (needed for a warm start and the bpe tokenizer)",
        ),
        (
            "hints",
            (lambda: check_hints(cls, size, packs))
            if cls.has_hint_entries()
            else "no hint entries (optional: hint-quality diagnostics, docs/environments.md)",
        ),
    ]
    results: list[CheckResult] = []
    for check, run in checks:
        if isinstance(run, str):
            results.append(CheckResult(check, "skipped", run))
        elif any(r.status == "FAILED" for r in results[:2]):
            results.append(CheckResult(check, "skipped", "not run: the class or settings failed"))
        else:
            results.append(_run(check, run))
    return results


def _run(check: str, run: Callable[[], str]) -> CheckResult:
    try:
        return CheckResult(check, "ok", run())
    except ContractError as e:
        return CheckResult(check, "FAILED", " ".join(str(e).split()))
    except Exception as e:  # the environment's own bug, whatever it raises: reported, not raised
        return CheckResult(check, "FAILED", f"raised {error_line(e)}")
