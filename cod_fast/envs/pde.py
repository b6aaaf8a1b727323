"""PDE discovery: find a hidden sparse reaction term (docs/concepts.md section 6, "PDE discovery").

Each pack hides a reaction term R(u) in the 1-D reaction-diffusion equation

    u_t = D u_xx + R(u),   R(u) = sum_j c_j f_j(u),

with one or two terms (train) from the family {u, u^2, u^3} or one to three terms (eval) from the
disjoint family {sin(u), cos(u), u/(1+u^2)}; the coefficients come from pack_seed alone (the
hidden rule) and are redrawn until R cannot blow up within the simulated time. The tasks of a
pack share R and differ in the domain length, the diffusivity D (stated) and the initial field
(a few random Fourier modes scaled to max |u| = 1.5).

The field is simulated once per task with an explicit finite-difference scheme on a periodic
grid and "measured" with Gaussian noise. The agent works with tools, one per response:
`sample T N` draws N unused grid points at time T from its budget, and returns u with the
finite-difference estimates of u_t and u_xx *from the noisy measurements* (so the derivatives are
much noisier than u, as in real data); `regress TERMS` fits y = u_t - D u_xx to the named terms
by least squares on everything sampled so far and returns coefficients with standard errors;
`summary` describes the data. `<answer>0.5*u - 1.2*u^3</answer>` ends the task; the formula is
read by the safe parser in `expr.py`.

Scoring over the canonical basis B = both families (6 terms): the answer is evaluated on a probe
grid of u and projected onto B by least squares, giving coefficients a_j (exact for any formula
in the span of B, however it is written). With the true coefficients c_j,

    error = sum_j |a_j - c_j| / sum_j |c_j|,   extra = #{j: c_j = 0, a_j != 0} (+1 if the answer
    has a part outside the span of B),   reward = 1 / (1 + error + 0.25 extra).

A malformed action (unknown command, bad numbers or a time outside [0, T_END], unknown term, an
answer that does not parse, an action over MAX_ACTION_CHARS) ends the task with reward 0. The
reward is not revealed (`reveals_reward = False`); the feedback repeats what the tools returned.
What carries across a pack is the support and the coefficients: a later task regressed on the
right terms only has less variance, and estimates pool across tasks.

The basis, the simulator, the regression and the scoring are in cod_fast.envs.pde_numerics; this
module holds the task's tools, the environment and its scripted agents.
"""

from __future__ import annotations

import math
import re

import numpy as np

from cod_fast.envs.base import (
    NUMBER,
    Agent,
    Environment,
    StepOutcome,
    Tag,
    Task,
    derive_seed,
    rng_for,
    too_long,
)
from cod_fast.envs.expr import ExpressionError, parse_expression
from cod_fast.envs.pde_numerics import (
    BASIS,
    EVAL_TERMS,
    EXTRA_PENALTY,
    NX,
    SNAPSHOTS,
    T_END,
    TERMS,
    TRAIN_TERMS,
    U_MAX,
    ReactionRule,
    draw_rule,
    format_formula,
    parse_terms,
    pool,
    project,
    regress,
    score,
    simulate,
)

MAX_COUNT_DIGITS = 9
"""N of `sample T N` may have this many digits (a larger count is clamped to the budget anyway;
a longer one is no count, and int() refuses one past Python's digit limit)."""
_ANSWER = Tag("answer", spaced=True)
_SAMPLE_ARGS = re.compile(rf"\s*({NUMBER})\s+(\d+)\s*")
_PROMPT = (
    "PDE discovery. A field u(x, t) on a periodic domain obeys u_t = D*u_xx + R(u), where the "
    "reaction term R(u) is a sparse sum of coefficient*term over the candidate terms: {terms}. "
    "R is hidden and the same for every task of this series; the domain, D and the start differ. "
    "Find R.\n"
    "Tools (one command per response, on its last line):\n"
    "  sample T N   measure N new points at time T (0 < T < {t_end:g}); returns u and noisy "
    "finite-difference estimates of u_t and u_xx\n"
    "  regress TERMS   least-squares fit of u_t - D*u_xx to the listed terms over all points "
    "sampled so far, e.g. regress u u^3\n"
    "  summary   describe the data sampled so far\n"
    "  <answer>FORMULA</answer>   submit R(u), e.g. <answer>0.5*u - 1.2*u^3</answer>; ends the task\n"
    "Budget: {budget} points and {steps} responses. Score: 1/(1 + relative L1 error of the "
    "coefficients + {penalty:g} per wrong extra term). A malformed command ends the task with "
    "score 0."
)
_TINY_PROMPT = (
    "Find R in u_t=D*u_xx+R(u), terms {terms}. Cmds: sample T N | regress TERMS | "
    "answer R, e.g. answer 0.5*u-u^3. {budget} pts, {steps} steps, 0<T<{t_end:g}."
)


class PdeTask(Task):
    """One simulated field under the pack's hidden reaction term; tools, then one answer."""

    env_name = "pde"

    def __init__(
        self,
        pack_seed: int,
        task_index: int,
        rule: ReactionRule,
        library: tuple[str, ...],
        length: float,
        diffusivity: float,
        u0: np.ndarray,
        budget: int,
        max_steps: int,
        tiny: bool,
        seed: int,
    ):
        super().__init__(pack_seed, task_index)
        self.rule = rule
        self.library = library
        self.length = length
        self.diffusivity = diffusivity
        self.budget = budget
        self.max_steps = max_steps
        self.tiny = tiny
        self.seed = seed
        self.field = simulate(rule, length, diffusivity, u0, derive_seed(seed, "noise"))
        self.reset()

    def prompt(self) -> str:
        template = _TINY_PROMPT if self.tiny else _PROMPT
        terms = (" " if self.tiny else ", ").join(self.library)
        values = {"budget": self.budget, "steps": self.max_steps, "penalty": EXTRA_PENALTY}
        return template.format(terms=terms, t_end=T_END, **values)

    def reset(self) -> str:
        # What the agent has sampled so far: u, y = u_t - D u_xx, and the sampling times.
        self.u: list[float] = []
        self.y: list[float] = []
        self.times: list[float] = []
        self.used: dict[int, set[int]] = {}
        self.steps = 0
        self.log: list[str] = []
        self.answer: str | None = None
        self.error: float | None = None
        self.extra: int | None = None
        self._reward = 0.0
        self._done = False
        # Which grid points a `sample` returns depends only on the task and the commands so far.
        self._rng = np.random.default_rng(derive_seed(self.seed, "points"))
        if self.tiny:
            return f"L={self.length:g} D={self.diffusivity:g}"
        return (
            f"Domain length {self.length:g}, D={self.diffusivity:g}. No data yet; "
            f"{self.budget} points and {self.max_steps} responses left."
        )

    def step(self, action: str) -> StepOutcome:
        if self._done:
            return StepOutcome("The task is over.", done=True)
        self.steps += 1
        outcome = self._dispatch(action)
        if not outcome.done and self.steps >= self.max_steps:
            self.log.append("no answer")
            outcome = StepOutcome(
                outcome.observation + " Out of responses without an answer (score 0).", done=True
            )
        self._done = outcome.done
        return outcome

    def _dispatch(self, action: str) -> StepOutcome:
        problem = too_long(action)
        if problem is not None:
            return self._malformed(problem)
        block = _ANSWER.last_block(action)
        lines = [line.strip() for line in action.strip().splitlines() if line.strip()]
        command = lines[-1] if lines else ""
        if block is not None or command.lower().startswith("answer "):
            return self._answer(block if block is not None else command[len("answer ") :])
        word, _, rest = command.partition(" ")
        word = word.lower()
        numbers = _SAMPLE_ARGS.fullmatch(rest) if word == "sample" else None
        if numbers:
            return self._sample_checked(numbers[1], numbers[2])
        if word == "regress":
            terms = parse_terms(rest)
            if terms is not None:
                return StepOutcome(self._regress(terms), done=False)
        if word == "summary" and not rest.strip():
            return StepOutcome(self._summary(), done=False)
        return self._malformed(f"could not read {command[:60]!r}")

    def _malformed(self, what: str) -> StepOutcome:
        expected = (
            f"expected one of: sample T N | regress TERMS (from {', '.join(self.library)}) | "
            "summary | <answer>FORMULA</answer> (or: answer FORMULA)"
        )
        self.log.append(f"malformed: {what}")
        self._reward = 0.0
        return StepOutcome(
            f"Malformed command ({what}); {expected}. Score 0.", done=True, valid=False
        )

    def _sample_checked(self, t_text: str, n_text: str) -> StepOutcome:
        """`sample T N` once T and N read as numbers: a time outside the simulated span (an
        overflow to infinity included) or a count too long to be one is a malformed command."""
        if len(n_text) > MAX_COUNT_DIGITS:
            return self._malformed(
                f"N has {len(n_text)} digits, expected at most {MAX_COUNT_DIGITS}"
            )
        t = float(t_text)  # never raises on a NUMBER: one too large reads as inf
        if not 0 <= t <= T_END:
            return self._malformed(f"T={t_text[:20]} is not a time in [0, {T_END:g}]")
        return StepOutcome(self._sample(t, int(n_text)), done=False)

    def _sample(self, t: float, n: int) -> str:
        j = min(SNAPSHOTS - 2, max(1, round(t / self.field.gap)))
        used = self.used.setdefault(j, set())
        free = np.array([i for i in range(NX) if i not in used], dtype=int)
        n = min(n, self.budget - len(self.u), len(free))
        if n <= 0:
            return "No points sampled (budget spent or no new points at that time)."
        points = np.sort(self._rng.choice(free, size=n, replace=False))
        used.update(points.tolist())
        u, u_t, u_xx = self.field.data(j, points)
        self.u += u.tolist()
        self.y += (u_t - self.diffusivity * u_xx).tolist()
        self.times += [j * self.field.gap] * n
        left = self.budget - len(self.u)
        self.log.append(f"sample t={j * self.field.gap:.3g} n={n}")
        if self.tiny:
            return f"{n} pts t={j * self.field.gap:.3g} u {u.min():.1f}..{u.max():.1f} left {left}"
        shown = ", ".join(
            f"({a:.3f}, {b:.3f}, {c:.3f})" for a, b, c in list(zip(u, u_t, u_xx, strict=True))[:3]
        )
        return (
            f"Sampled {n} points at t={j * self.field.gap:.3g} (budget left {left}); u from "
            f"{u.min():.3f} to {u.max():.3f}. First points (u, u_t, u_xx): {shown}."
        )

    def _regress(self, terms: list[str]) -> str:
        if len(self.u) <= len(terms):
            return f"Need more than {len(terms)} sampled points to fit {len(terms)} terms."
        coef, se, rms = regress(self.u, self.y, terms)
        fits = (" " if self.tiny else ", ").join(
            f"{t}={c:.2f}+-{s:.2f}" for t, c, s in zip(terms, coef, se, strict=True)
        )
        self.log.append(f"regress: {fits}")
        if self.tiny:
            return fits
        return f"Fit of u_t - D*u_xx on {len(self.u)} points: {fits}; rms residual {rms:.3f}."

    def _summary(self) -> str:
        n, left = len(self.u), self.budget - len(self.u)
        if n < 2:
            return f"{n} points sampled; budget left {left}."
        u, y = np.array(self.u), np.array(self.y)
        times = ", ".join(f"{t:.3g}" for t in sorted(set(self.times)))
        if self.tiny:
            return f"{n} pts u {u.min():.1f}..{u.max():.1f} left {left}"
        corr = ", ".join(f"{t} {np.corrcoef(y, TERMS[t](u))[0, 1]:.2f}" for t in self.library)
        return (
            f"{n} points at t={times}; u from {u.min():.3f} to {u.max():.3f}; "
            f"y = u_t - D*u_xx has mean {y.mean():.3f}, sd {y.std():.3f}; correlation of y "
            f"with {corr}; budget left {left}, responses left {self.max_steps - self.steps}."
        )

    def _answer(self, text: str) -> StepOutcome:
        try:
            expression = parse_expression(text, ["u"])
            self._reward, self.error, self.extra = score(expression, self.rule)
        except ExpressionError as err:
            return self._malformed(f"the answer is not a usable formula in u: {err}")
        self.answer = expression.text
        self.log.append(f"answer {self.answer}")
        return StepOutcome(f"Answer recorded: R(u) = {self.answer}.", done=True)

    @property
    def reward(self) -> float:
        return self._reward

    @property
    def success(self) -> bool:
        """The right terms, no extra ones, coefficients within 10% (relative L1)."""
        return self.extra == 0 and self.error is not None and self.error <= 0.1

    def feedback(self) -> str:
        """What the tools returned, in order (the score is not revealed)."""
        return "; ".join(self.log) if self.log else "no commands"


class PdeEnv(Environment):
    """Packs of reaction-diffusion fields sharing a hidden sparse reaction term."""

    name = "pde"
    reward_range = (0.0, 1.0)
    description = "Discover a hidden sparse reaction term R(u) with sampling and regression tools."
    reveals_reward = False

    def rule(self, pack_seed: int) -> ReactionRule:
        """1-2 train-family terms (train) or 1-3 eval-family terms (eval), |c| in [0.3, 1.5]."""
        return draw_rule(self.name, self.setting, pack_seed)

    def task(self, pack_seed: int, task_index: int) -> PdeTask:
        rng = rng_for(self.name, "task", pack_seed, task_index, self.setting, self.size)
        length = round(rng.uniform(6.0, 10.0), 1)
        diffusivity = round(rng.uniform(0.05, 0.15), 2)
        # A few random Fourier modes scaled to max |u| = U_MAX: every task's data spans both
        # signs and the whole range, which the regression needs to tell u^2 from u^3.
        phase = np.arange(NX) * (2 * math.pi / NX)
        u0 = sum(
            rng.uniform(0.3, 1.0) * np.sin(k * phase + rng.uniform(0, 2 * math.pi))
            for k in range(1, 4)
        )
        u0 *= U_MAX / np.abs(u0).max()
        tiny = self.size == "tiny"
        budget, steps = (32, 4) if tiny else (40, 8)
        library = TRAIN_TERMS if self.setting == "train" else EVAL_TERMS
        seed = derive_seed(self.name, "data", pack_seed, task_index, self.setting, self.size)
        return PdeTask(
            pack_seed,
            task_index,
            self.rule(pack_seed),
            library,
            length,
            diffusivity,
            u0,
            budget,
            steps,
            tiny,
            seed,
        )

    def solver(self) -> Agent:
        return PdeSolver()

    def explorer(self) -> Agent:
        return PdeExplorer()


class PdeSolver(Agent):
    """Answers the hidden reaction term directly (the coefficients are drawn with 2 decimals)."""

    def start(self, task: Task, hints: str | None) -> None:
        assert isinstance(task, PdeTask)
        formula = format_formula(dict(zip(task.rule.terms, task.rule.coefficients, strict=True)))
        self.action = f"answer {formula}" if task.tiny else f"<answer>{formula}</answer>"

    def act(self, observation: str) -> str:
        return self.action


_FIT_RE = re.compile(rf"([^\s,=:]+)=({NUMBER})\+-({NUMBER})")
_HINT_RE = re.compile(rf"([^\s,=]+)=({NUMBER})(?:\+-({NUMBER}))?")
KEEP_T = 3.0
"""Backward elimination keeps a term while |coefficient| / standard error is at least this."""
ADD_T = 3.0
"""With hints, a term outside the carried support joins it when the full fit gives this |t|."""


def _estimates(text: str) -> dict[str, tuple[float, float | None]]:
    found = {}
    for name, value, error in _HINT_RE.findall(text):
        term = name.replace("**", "^")
        if term in BASIS:
            found[term] = (float(value), float(error) if error else None)
    return found


def parse_hints(hints: str | None) -> tuple[dict, dict]:
    """'u=0.52+-0.05 u^3=-1.18+-0.08; other u^2=0.01+-0.20' -> the support's pooled estimates
    {'u': (0.52, 0.05), 'u^3': (-1.18, 0.08)} and the pooled full-library estimates of the terms
    left out {'u^2': (0.01, 0.2)}. Tiny hints are just the formula ('0.52*u-1.2*u^3'), read
    with the safe parser and carrying no errors. Anything else reads as no hints."""
    text = hints or ""
    if "=" not in text:
        try:
            coef, _ = project(parse_expression(text, ["u"]))
        except ExpressionError:
            return {}, {}
        return {t: (float(c), None) for t, c in zip(BASIS, coef, strict=True) if abs(c) > 1e-6}, {}
    support, _, other = text.partition(";")
    return _estimates(support), _estimates(other)


class PdeExplorer(Agent):
    """Without hints: samples its budget at two times, fits the whole library and prunes the
    weakest term while it is insignificant. With hints (the support's pooled coefficients, and
    in full size the pooled full-library estimates of the terms left out): fits the whole
    library once to update the evidence for the left-out terms and adds one whose pooled
    estimate has become significant, then fits the support only (less variance than the whole
    library) and pools with the carried estimates."""

    def start(self, task: Task, hints: str | None) -> None:
        prompt = task.prompt()
        self.tiny = prompt.startswith("Find R")
        self.library = parse_terms(re.search(r"terms:? (.*?)\.(?:\s|$)", prompt)[1]) or []
        budget = int(re.search(r"(\d+) (?:points|pts)", prompt)[1])
        self.steps_left = int(re.search(r"(\d+) (?:responses|steps)", prompt)[1])
        t_end = float(re.search(rf"0\s*<\s*T\s*<\s*({NUMBER})", prompt)[1])
        self.prior, self.other = parse_hints(hints)
        self.support = [t for t in BASIS if t in self.prior] or list(self.library)
        self.check_library = bool(self.prior) and set(self.support) != set(self.library)
        times = [0.1 * t_end] if self.tiny else [0.1 * t_end, 0.5 * t_end]
        self.queue = [f"sample {t:g} {budget // len(times)}" for t in times]
        self.fits: dict[tuple[str, ...], dict[str, tuple[float, float]]] = {}
        self.answer: dict[str, tuple[float, float]] = {}

    def act(self, observation: str) -> str:
        found = _FIT_RE.findall(observation)
        if found:
            self.fits[tuple(t for t, _, _ in found)] = {
                t: (float(c), float(s)) for t, c, s in found
            }
        self.steps_left -= 1
        if self.queue:
            return self.queue.pop(0)
        full = self.fits.get(tuple(self.library))
        if self.check_library and self.steps_left >= 2:
            if full is None:
                return "regress " + " ".join(self.library)
            self.check_library = False
            for t in self.library:
                if t not in self.support:
                    self.other[t] = pool(self.other[t], full[t]) if t in self.other else full[t]
            missing = [t for t, (c, s) in self.other.items() if abs(c) >= ADD_T * (s or 0.0)]
            if missing:
                # The carried estimates assumed another support: start pooling afresh.
                self.support = [t for t in BASIS if t in self.support or t in missing]
                self.prior = {}
                self.other = {t: e for t, e in self.other.items() if t not in missing}
        fit = self.fits.get(tuple(self.support))
        if fit is None and self.steps_left >= 1:
            return "regress " + " ".join(self.support)
        if fit is None:  # out of responses: answer what the carried hints say
            fit = {t: (c, s or 0.0) for t, (c, s) in self.prior.items()}
        if not self.prior and len(fit) > 1 and self.steps_left >= 1:
            weakest = min(fit, key=lambda t: abs(fit[t][0]) / max(fit[t][1], 1e-9))
            if abs(fit[weakest][0]) < KEEP_T * fit[weakest][1]:
                self.support.remove(weakest)
                if full is not None and weakest not in self.other:
                    self.other[weakest] = full[weakest]
                return "regress " + " ".join(self.support)
        self.answer = {t: pool(self.prior[t], fit[t]) if t in self.prior else fit[t] for t in fit}
        formula = format_formula({t: c for t, (c, _) in self.answer.items()})
        return f"answer {formula}" if self.tiny else f"<answer>{formula}</answer>"

    def write_hints(self, task: Task, old_hints: str | None) -> str | None:
        kept = {t: (c, s) for t, (c, s) in self.answer.items() if abs(c) >= 0.005}
        if not kept:
            return old_hints
        if self.tiny:  # the formula itself, in 16 characters when two decimals would not fit
            coefficients = {t: c for t, (c, _) in kept.items()}
            formula = format_formula(coefficients)
            return formula if len(formula) <= 16 else format_formula(coefficients, digits=1)
        text = " ".join(f"{t}={c:.3f}+-{s:.3f}" for t, (c, s) in kept.items())
        other = " ".join(
            f"{t}={c:.3f}+-{s:.3f}"
            for t, (c, s) in self.other.items()
            if t not in kept and s is not None
        )
        return f"{text}; other {other}" if other else text
