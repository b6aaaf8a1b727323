"""The numerics of PDE discovery (cod_fast.envs.pde): the term basis, a pack's hidden reaction
rule, the reaction-diffusion simulator, least squares, pooled estimates and the answer's score.

The field obeys u_t = D u_xx + R(u) on a periodic grid of NX points and is simulated with
explicit Euler in time and a 3-point Laplacian, then measured at SNAPSHOTS times with Gaussian
noise of standard deviation NOISE. An answer is scored by projecting it onto BASIS on a probe grid
and comparing the coefficients with the rule's.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cod_fast.envs.base import rng_for
from cod_fast.envs.expr import Expression

TRAIN_TERMS = ("u", "u^2", "u^3")
EVAL_TERMS = ("sin(u)", "cos(u)", "u/(1+u^2)")
BASIS = TRAIN_TERMS + EVAL_TERMS
"""The canonical basis the answer is scored over."""
TERMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "u": lambda u: u,
    "u^2": lambda u: u * u,
    "u^3": lambda u: u * u * u,
    "sin(u)": np.sin,
    "cos(u)": np.cos,
    "u/(1+u^2)": lambda u: u / (1 + u * u),
}
"""The basis as numpy functions (the simulator's inner loop); each name also parses with
`expr.parse_expression` to the same function, which the tests check."""
EXTRA_PENALTY = 0.25
U_MAX = 1.5
"""Largest |u| of an initial condition; the stability check starts from [-U_MAX, U_MAX]."""
PROBE = np.linspace(-2.5, 2.5, 101)
"""Where an answer is compared with the basis (wide enough to tell sin(u) from u - u^3/6)."""
NOISE = 0.015
"""Standard deviation of the measurement noise on u."""
T_END = 0.5
SNAPSHOTS = 21
NX = 64


@dataclass(frozen=True)
class ReactionRule:
    """The hidden rule of a pack: R(u) = sum of coefficient * term."""

    terms: tuple[str, ...]
    coefficients: tuple[float, ...]

    def __call__(self, u: np.ndarray) -> np.ndarray:
        out = np.zeros_like(u)
        for t, c in zip(self.terms, self.coefficients, strict=True):
            out += c * TERMS[t](u)
        return out

    def vector(self) -> np.ndarray:
        """The coefficients over BASIS."""
        out = np.zeros(len(BASIS))
        for t, c in zip(self.terms, self.coefficients, strict=True):
            out[BASIS.index(t)] = c
        return out


def format_formula(coefficients: dict[str, float], digits: int = 2) -> str:
    """{'u': 0.5, 'u^3': -1.2} -> '0.5*u-1.2*u^3' (zero terms dropped; '0' when empty)."""
    parts = []
    for term, c in coefficients.items():
        text = f"{c:.{digits}f}".rstrip("0").rstrip(".")
        if text in ("0", "-0", ""):
            continue
        parts.append(("" if text.startswith("-") or not parts else "+") + f"{text}*{term}")
    return "".join(parts) or "0"


def _stable(terms: tuple[str, ...], coefficients: tuple[float, ...]) -> bool:
    """The ODE u' = R(u) from every start in [-U_MAX, U_MAX] stays within 2 U_MAX until T_END.
    By the comparison principle the PDE's solution lies between these ODE solutions."""
    rule, u = ReactionRule(terms, coefficients), np.linspace(-U_MAX, U_MAX, 31)
    for _ in range(100):
        u = u + (T_END / 100) * rule(u)
        if np.any(np.abs(u) > 2 * U_MAX):
            return False
    return True


@functools.lru_cache(maxsize=4096)
def draw_rule(name: str, setting: str, pack_seed: int) -> ReactionRule:
    """The hidden rule of a pack, from pack_seed alone, redrawn until u' = R(u) stays bounded (a
    blow-up would make the data meaningless); cached because every task of a pack asks for it
    and the stability check costs a little."""
    family, most = (TRAIN_TERMS, 2) if setting == "train" else (EVAL_TERMS, 3)
    rng = rng_for(name, "rule", pack_seed, setting)
    while True:
        terms = tuple(sorted(rng.sample(family, rng.randint(1, most)), key=family.index))
        coefficients = tuple(round(rng.choice((-1, 1)) * rng.uniform(0.3, 1.5), 2) for _ in terms)
        if _stable(terms, coefficients):
            return ReactionRule(terms, coefficients)


def project(formula: Expression) -> tuple[np.ndarray, bool]:
    """The coefficients of R(u) over BASIS (least squares on PROBE, exact for any formula in the
    span however it is written), and whether a part of it lies outside the span."""
    values = np.asarray(formula(u=PROBE)) * np.ones_like(PROBE)
    design = np.stack([TERMS[t](PROBE) for t in BASIS], axis=1)
    coef, *_ = np.linalg.lstsq(design, values, rcond=None)
    outside = np.linalg.norm(design @ coef - values) > 1e-6 * (1 + np.linalg.norm(values))
    return coef, bool(outside)


def score(answer: Expression, rule: ReactionRule) -> tuple[float, float, int]:
    """(reward, normalised L1 coefficient error, extra terms) of an answer R(u)."""
    coef, outside = project(answer)
    truth = rule.vector()
    error = float(np.abs(coef - truth).sum() / np.abs(truth).sum())
    extra = int(np.sum((truth == 0) & (np.abs(coef) > 1e-6))) + int(outside)
    return 1.0 / (1.0 + error + EXTRA_PENALTY * extra), error, extra


@dataclass
class Field:
    """A simulated task: the noisy measured field on a periodic grid at SNAPSHOTS times."""

    measured: np.ndarray  # (SNAPSHOTS, NX)
    dx: float
    gap: float
    """Time between snapshots."""

    def data(self, j: int, i: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """u, u_t, u_xx at snapshot j and grid points i, by central differences of the
        measurements (j must have a snapshot on each side)."""
        m = self.measured
        u_t = (m[j + 1, i] - m[j - 1, i]) / (2 * self.gap)
        u_xx = (m[j, (i + 1) % NX] - 2 * m[j, i] + m[j, (i - 1) % NX]) / self.dx**2
        return m[j, i], u_t, u_xx


def simulate(
    rule: ReactionRule, length: float, diffusivity: float, u0: np.ndarray, noise_seed: int
) -> Field:
    """Explicit Euler in time, 3-point Laplacian in space; dt well inside both the diffusion
    limit dx^2 / (2 D) and the reaction time scale, so the scheme is stable and accurate."""
    dx = length / NX
    gap = T_END / (SNAPSHOTS - 1)
    substeps = max(4, math.ceil(gap / min(0.005, 0.4 * dx * dx / diffusivity)))
    dt = gap / substeps
    left, right = np.roll(np.arange(NX), 1), np.roll(np.arange(NX), -1)
    u, snaps = u0.copy(), [u0.copy()]
    for _ in range(SNAPSHOTS - 1):
        for _ in range(substeps):
            lap = (u[left] - 2 * u + u[right]) / (dx * dx)
            u = u + dt * (diffusivity * lap + rule(u))
        snaps.append(u.copy())
    noise = np.random.default_rng(noise_seed).normal(0.0, NOISE, (SNAPSHOTS, NX))
    return Field(np.array(snaps) + noise, dx, gap)


def regress(u: list[float], y: list[float], terms: list[str]) -> tuple[np.ndarray, ...]:
    """Least squares of y on the terms at u: coefficients, standard errors, rms residual."""
    u, y = np.array(u), np.array(y)
    design = np.stack([TERMS[t](u) for t in terms], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    dof = max(1, len(y) - len(terms))
    sigma2 = float(resid @ resid) / dof
    cov = sigma2 * np.linalg.pinv(design.T @ design)
    return coef, np.sqrt(np.maximum(np.diag(cov), 0.0)), math.sqrt(float(resid @ resid) / len(y))


def parse_terms(text: str) -> list[str] | None:
    """'u, u^3' or 'u u**3' -> ['u', 'u^3']; None when something is not a library term.
    Spaces are ignored and the longest term name wins, so 'u/(1 + u^2)' reads as one term."""
    text = re.sub(r"\s+", "", text.replace("**", "^")).lower()
    names = sorted(BASIS, key=len, reverse=True)
    terms: list[str] = []
    at = 0  # an index, not a shrinking copy of the text: linear in a long run of commas
    while at < len(text):
        if text[at] == ",":
            at += 1
            continue
        match = next((n for n in names if text.startswith(n, at)), None)
        if match is None:
            return None
        if match not in terms:
            terms.append(match)
        at += len(match)
    return terms or None


def pool(prior: tuple[float, float | None], new: tuple[float, float]) -> tuple[float, float]:
    """Inverse-variance average of two estimates; equal weights when the prior has no error."""
    (c0, s0), (c1, s1) = prior, new
    if s0 is None or s0 <= 0 or s1 <= 0:
        return (c0 + c1) / 2, s1 / math.sqrt(2)
    w0, w1 = 1 / s0**2, 1 / s1**2
    return (w0 * c0 + w1 * c1) / (w0 + w1), 1 / math.sqrt(w0 + w1)
