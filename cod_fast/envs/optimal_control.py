"""Optimal control with hidden dynamics (docs/concepts.md section 6, "Optimal control").

Each pack hides a discrete-time double integrator with drag and a gain:

    v[t+1] = a v[t] + b u[t],   x[t+1] = x[t] + v[t+1],   u clipped to [-1, 1],

with a in [0.55, 1.2] (drag, or an unstable push when a > 1) and |b| in [0.35, 1.5] of random
sign: the hidden rule, drawn from pack_seed alone. A task gives a start (x0, v0), a target
(x*, v*), a horizon T and a control cost c; the agent answers with ONE feedback law u(x, v, t)
written as a formula (`<law>-0.8*(x-2) - 1.2*v</law>`), parsed by the safe evaluator in
`expr.py`. The law runs for T steps and scores

    loss = (x_T - x*)^2 + 2 (v_T - v*)^2 + c sum_t u_t^2,   reward = 1 / (1 + loss),

-0.1 for a law that does not parse and 0 for one that fails while running. One answer per task,
so nothing about a and b can be learnt inside a task; the feedback shows the first (x, v, u)
triples of the run, from which two transitions pin down a and b exactly (v[t+1] = a v[t] + b u[t]
is linear in the unknowns). That is the evidence a CoD agent carries to the next task.

Train vs eval (same hidden-rule ranges, as docs/concepts.md fixes them): eval starts farther from
the target (distance up to 8 instead of 4), with a faster start, a moving target (v* != 0, which a
constant-gain law cannot hold without a time-varying reference) and a control cost three times
higher. `tiny` uses integer starts and targets, v0 = v* = 0, a fixed horizon and short texts.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

from cod_fast.envs.base import NUMBER, Agent, Environment, StepOutcome, Tag, Task, rng_for, too_long
from cod_fast.envs.expr import ExpressionError, parse_expression

UNPARSABLE_REWARD = -0.1
FAILED_REWARD = 0.0
SUCCESS_TOLERANCE = 0.1
"""A run succeeds when it ends within this distance of both x* and v*."""
LAW_VARIABLES = ("x", "v", "t")
_LAW = Tag("law", spaced=True)


@dataclass(frozen=True)
class Dynamics:
    """The hidden rule of a pack."""

    a: float
    b: float


@dataclass(frozen=True)
class Setup:
    """What a task states: start, target, horizon and control cost."""

    x0: float
    v0: float
    x_target: float
    v_target: float
    horizon: int
    cost: float


@dataclass
class Run:
    """One roll-out of a law: states x_0..x_T, v_0..v_T, applied controls u_0..u_{T-1}."""

    xs: list[float]
    vs: list[float]
    us: list[float]
    loss: float


def simulate(law, dynamics: Dynamics, setup: Setup) -> Run:
    """Roll `law(x, v, t) -> float` out under the dynamics; the law's output is clipped."""
    x, v = setup.x0, setup.v0
    xs, vs, us = [x], [v], []
    for t in range(setup.horizon):
        u = min(1.0, max(-1.0, law(x, v, t)))
        v = dynamics.a * v + dynamics.b * u
        x = x + v
        xs.append(x)
        vs.append(v)
        us.append(u)
    loss = (x - setup.x_target) ** 2 + 2 * (v - setup.v_target) ** 2
    return Run(xs, vs, us, loss + setup.cost * sum(u * u for u in us))


def _fmt(value: float, digits: int) -> str:
    text = f"{value:.{digits}f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _signed(value: float, digits: int) -> str:
    text = _fmt(value, digits)
    return text if text.startswith("-") else "+" + text


# Closed-loop pole pairs tried by the law designer, as (trace, determinant) of the 2x2 error
# dynamics: real pairs p1 <= p2, and complex pairs r e^{+-i theta} that settle faster for the
# same control effort.
_REAL_POLES = [0.0, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9]
_POLE_PAIRS = [(p + q, p * q) for i, p in enumerate(_REAL_POLES) for q in _REAL_POLES[i:]] + [
    (2 * r * math.cos(th), r * r) for r in (0.3, 0.5, 0.7, 0.85) for th in (0.3, 0.6, 0.9)
]


def design_law(model: Dynamics, setup: Setup, digits: int) -> str:
    """The best law of the form u = k1 (x - x_ref(t)) + k2 (v - v*) + u_ff for `model`.

    x_ref(t) = x* - v* (T - t) is the reference that arrives at x* with speed v* at T, and
    u_ff = (1 - a) v* / b holds the speed v*. The gains place the poles of the error dynamics
    e' = e + a w + b u_fb, w' = a w + b u_fb (e = x - x_ref, w = v - v*): with u_fb = k1 e + k2 w
    the determinant is a + b k2 and the trace 1 + b k1 + det. Clipping makes the best pole pair
    depend on the start, so every pair is simulated (with the rounded gains the text will carry)
    and the lowest loss wins. The solver calls this with the true dynamics, the explorer with its
    estimate.
    """
    a, b, s = model.a, model.b, setup
    feed = round((1 - a) * s.v_target / b, digits)
    best_text, best_loss = "", math.inf
    for trace, det in _POLE_PAIRS:
        k2 = round((det - a) / b, digits)
        k1 = round((trace - 1 - det) / b, digits)

        def law(x, v, t, k1=k1, k2=k2):
            x_ref = s.x_target - s.v_target * (s.horizon - t)
            return k1 * (x - x_ref) + k2 * (v - s.v_target) + feed

        loss = simulate(law, model, setup).loss
        if loss < best_loss:
            best_loss, best_text = loss, _law_text(k1, k2, feed, setup, digits)
    return best_text


def _law_text(k1: float, k2: float, feed: float, s: Setup, digits: int) -> str:
    f = lambda value: _fmt(value, digits)  # noqa: E731 - a local shorthand
    if s.v_target == 0:
        return f"{f(k1)}*(x{_signed(-s.x_target, digits)}){_signed(k2, digits)}*v"
    error = f"x{_signed(-s.x_target, digits)}{_signed(s.v_target, digits)}*({s.horizon}-t)"
    velocity = f"v{_signed(-s.v_target, digits)}"
    feed_text = _signed(feed, digits) if f(feed) != "0" else ""
    return f"{f(k1)}*({error}){_signed(k2, digits)}*({velocity}){feed_text}"


class OptimalControlTask(Task):
    """One start/target pair under the pack's hidden dynamics; a single answer (the law)."""

    env_name = "optimal_control"
    max_steps = 1

    def __init__(
        self, pack_seed: int, task_index: int, dynamics: Dynamics, setup: Setup, tiny: bool
    ):
        super().__init__(pack_seed, task_index)
        self.dynamics = dynamics
        self.setup = setup
        self.tiny = tiny
        self.digits = 1 if tiny else 2
        self.law_text: str | None = None
        self.run: Run | None = None
        self.error: str | None = None
        self._reward = 0.0
        self._done = False

    def prompt(self) -> str:
        if self.tiny:
            return (
                "Hidden v'=a*v+b*u, x'=x+v', u in [-1,1]. Reach x* at T. "
                "Send <law>f(x,v,t)</law>, e.g. <law>-0.5*(x-2)-v</law>"
            )
        return (
            "Optimal control with hidden dynamics. A point moves by\n"
            "  v[t+1] = a*v[t] + b*u[t],  x[t+1] = x[t] + v[t+1],  t = 0..T-1,\n"
            "with unknown a in [0.55, 1.2] and b with 0.35 <= |b| <= 1.5 (sign unknown); the "
            "same a and b hold for every task of this series. u is clipped to [-1, 1].\n"
            "Submit ONE feedback law u(x, v, t); it is applied at every step. Loss = "
            "(x[T]-x*)^2 + 2*(v[T]-v*)^2 + c*sum(u^2); reward = 1/(1+loss).\n"
            "A law may use numbers, x, v, t, + - * / **, and abs min max clip sign tanh sin cos "
            "exp log sqrt.\n"
            "Answer format: <law>FORMULA</law>, e.g. <law>-0.8*(x-2) - 1.2*v</law>\n"
            "A law that does not parse scores -0.1; one that fails while running scores 0."
        )

    def reset(self) -> str:
        self.law_text, self.run, self.error = None, None, None
        self._reward, self._done = 0.0, False
        s, f = self.setup, lambda value: _fmt(value, self.digits)
        if self.tiny:
            return f"x={f(s.x0)} v={f(s.v0)} x*={f(s.x_target)} T={s.horizon}"
        return (
            f"Start x={f(s.x0)} v={f(s.v0)}; target x*={f(s.x_target)} v*={f(s.v_target)} "
            f"at T={s.horizon}; cost c={s.cost:g}."
        )

    def step(self, action: str) -> StepOutcome:
        if self._done:
            return StepOutcome("The task is over.", done=True)
        self._done = True
        problem = too_long(action)
        if problem is not None:
            return self._unparsable(f"{problem}; expected one <law>FORMULA</law>")
        block = _LAW.last_block(action)
        if block is None:
            return self._unparsable(
                "no <law>...</law> block; expected e.g. <law>-0.8*(x-2) - 1.2*v</law>"
            )
        try:
            law = parse_expression(block, LAW_VARIABLES)
        except ExpressionError as err:
            return self._unparsable(
                f"the law does not parse: {err}; expected <law>FORMULA in x, v, t</law>"
            )
        self.law_text = law.text
        try:
            self.run = simulate(lambda x, v, t: law(x=x, v=v, t=t), self.dynamics, self.setup)
        except ExpressionError as err:
            self._reward = FAILED_REWARD
            self.error = f"the law failed while running: {err}"
            return StepOutcome(f"Run failed: {err}.", done=True)
        self._reward = 1.0 / (1.0 + self.run.loss)
        return StepOutcome(self._outcome_line(), done=True)

    def _unparsable(self, error: str) -> StepOutcome:
        self._reward = UNPARSABLE_REWARD
        self.error = error
        return StepOutcome(f"Invalid answer: {error}.", done=True, valid=False)

    def _outcome_line(self) -> str:
        assert self.run is not None
        s, f = self.setup, lambda value: _fmt(value, self.digits)
        dx, dv = self.run.xs[-1] - s.x_target, self.run.vs[-1] - s.v_target
        if self.tiny:
            return f"end dx={f(dx)} dv={f(dv)}"
        return (
            f"Final x={f(self.run.xs[-1])} v={f(self.run.vs[-1])}; residuals x-x*={f(dx)} "
            f"v-v*={f(dv)}; loss {self.run.loss:.3f}."
        )

    @property
    def reward(self) -> float:
        return self._reward

    @property
    def success(self) -> bool:
        if self.run is None:
            return False
        return (
            abs(self.run.xs[-1] - self.setup.x_target) <= SUCCESS_TOLERANCE
            and abs(self.run.vs[-1] - self.setup.v_target) <= SUCCESS_TOLERANCE
        )

    def feedback(self) -> str:
        """The law, its first (x, v, u) triples (the evidence about a and b) and the residuals."""
        if self.run is None:
            return f"No run: {self.error or 'no law submitted'}."
        f = lambda value: _fmt(value, self.digits + 1)  # noqa: E731 - one more digit for the fit
        shown = 3 if self.tiny else 5
        triples = list(zip(self.run.xs, self.run.vs, self.run.us, strict=False))[:shown]
        if self.tiny:
            steps = "; ".join(f"{f(x)},{f(v)},{f(u)}" for x, v, u in triples)
            return f"x,v,u: {steps}. {self._outcome_line()}"
        steps = " ".join(f"({f(x)}, {f(v)}, {f(u)})" for x, v, u in triples)
        return f"Law {self.law_text}. First steps (x, v, u): {steps}. {self._outcome_line()}"


class OptimalControlEnv(Environment):
    """Packs of control tasks sharing hidden dynamics (a, b)."""

    name = "optimal_control"
    reward_range = (-0.1, 1.0)  # -0.1 for a law that does not parse
    description = "Submit one feedback law u(x, v, t) for hidden linear dynamics."

    def rule(self, pack_seed: int) -> Dynamics:
        """The hidden dynamics of a pack (docs/concepts.md ranges, the same in both settings)."""
        rng = rng_for(self.name, "rule", pack_seed, self.setting)
        magnitude = rng.uniform(0.35, 1.5)
        return Dynamics(
            a=round(rng.uniform(0.55, 1.2), 3),
            b=round(magnitude if rng.random() < 0.5 else -magnitude, 3),
        )

    def task(self, pack_seed: int, task_index: int) -> OptimalControlTask:
        rng = rng_for(self.name, "task", pack_seed, task_index, self.setting, self.size)
        tiny, train = self.size == "tiny", self.setting == "train"
        span, gap = (3, 1) if train else (5, 2)
        while True:
            if tiny:
                x0, x_target = float(rng.randint(-span, span)), float(rng.randint(-span, span))
            else:
                x0, x_target = (round(rng.uniform(-span, span), 2) for _ in range(2))
            if abs(x_target - x0) >= gap:
                break
        if tiny:
            v0 = v_target = 0.0
            horizon = 10 if train else 12
        else:
            v0 = round(rng.uniform(-0.5, 0.5) if train else rng.uniform(-1, 1), 2)
            v_target = 0.0 if train else round(rng.uniform(-0.3, 0.3), 2)
            horizon = rng.randint(10, 14) if train else rng.randint(12, 18)
        setup = Setup(x0, v0, x_target, v_target, horizon, cost=0.01 if train else 0.03)
        return OptimalControlTask(pack_seed, task_index, self.rule(pack_seed), setup, tiny)

    def solver(self) -> Agent:
        return OptimalControlSolver()

    def explorer(self) -> Agent:
        return OptimalControlExplorer()


class OptimalControlSolver(Agent):
    """Designs the law for the true (a, b): an upper bound on a constant-gain tracking law."""

    def start(self, task: Task, hints: str | None) -> None:
        assert isinstance(task, OptimalControlTask)
        self.law = design_law(task.dynamics, task.setup, digits=3)

    def act(self, observation: str) -> str:
        return f"<law>{self.law}</law>"


PRIOR = Dynamics(a=0.9, b=0.8)
"""The explorer's guess before any evidence (mid-range a, b assumed positive)."""
_HINT_RE = re.compile(rf"a\s*=\s*({NUMBER}).*?b\s*=\s*({NUMBER})", re.DOTALL)


def parse_dynamics_hint(hints: str | None) -> Dynamics | None:
    """`a=0.93 b=-0.71` -> Dynamics(0.93, -0.71); None when the hints hold no estimate."""
    match = _HINT_RE.search(hints or "")
    return Dynamics(float(match[1]), float(match[2])) if match else None


def estimate_dynamics(triples: list[tuple[float, float, float]]) -> Dynamics | None:
    """Least squares for v[t+1] = a v[t] + b u[t] over consecutive (x, v, u) triples; None when
    the transitions do not separate a from b (v and u proportional, or too few)."""
    rows = [(v, u, v_next) for (_, v, u), (_, v_next, _) in itertools.pairwise(triples)]
    svv = sum(v * v for v, _, _ in rows)
    suu = sum(u * u for _, u, _ in rows)
    svu = sum(v * u for v, u, _ in rows)
    svy = sum(v * y for v, _, y in rows)
    suy = sum(u * y for _, u, y in rows)
    det = svv * suu - svu * svu
    if len(rows) < 2 or det < 1e-4 * max(svv * suu, 1e-12):
        return None
    return Dynamics(a=(svy * suu - suy * svu) / det, b=(suy * svv - svy * svu) / det)


def _numbers(pattern: str, text: str) -> list[float]:
    match = re.search(pattern, text)
    return [float(g) for g in match.groups()] if match else []


class OptimalControlExplorer(Agent):
    """Starts from a generic guess; after each task fits (a, b) to the shown transitions, writes
    `a=.. b=..` into the hints and designs the next law for that estimate."""

    def start(self, task: Task, hints: str | None) -> None:
        self.model = parse_dynamics_hint(hints) or PRIOR

    def act(self, observation: str) -> str:
        n = NUMBER
        full = _numbers(
            rf"x=({n}) v=({n}); target x\*=({n}) v\*=({n}) at T=({n}); "
            rf"cost c=({n})",
            observation,
        )
        tiny = not full
        if tiny:
            # The tiny observation leaves out v* (always 0) and c; assume the train cost.
            x0, v0, x_target, horizon = _numbers(rf"x=({n}) v=({n}) x\*=({n}) T=({n})", observation)
            setup = Setup(x0, v0, x_target, 0.0, int(horizon), cost=0.01)
        else:
            x0, v0, x_target, v_target, horizon, cost = full
            setup = Setup(x0, v0, x_target, v_target, int(horizon), cost)
        # A guessed b of near zero would ask for infinite gains; keep it in the stated range.
        b = math.copysign(min(1.5, max(0.35, abs(self.model.b))), self.model.b)
        a = min(1.2, max(0.55, self.model.a))
        return f"<law>{design_law(Dynamics(a, b), setup, digits=1 if tiny else 2)}</law>"

    def write_hints(self, task: Task, old_hints: str | None) -> str | None:
        n = NUMBER
        text = task.feedback()
        found = re.findall(rf"\(({n}), ({n}), ({n})\)", text) or re.findall(
            rf"({n}),({n}),({n})", text
        )
        estimate = estimate_dynamics([tuple(map(float, t)) for t in found])
        if estimate is None:
            return old_hints
        return f"a={estimate.a:.2f} b={estimate.b:.2f}"
