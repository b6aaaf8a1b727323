"""A run's training curves (`curves.png`): the warm start and RL on axes of their own.

The warm start's numbers are not RL's: its rewards are the scripted demonstrations', its loss a
supervised one. Drawn as one line, the switch to the policy's own rewards and the RL loss looks
like a collapse where RL begins, and 2000 warm-start steps squeeze 90 RL steps into the right
edge. So each phase is a column of panels with its own x-axis, the phase's step (`phase_step`),
and no series crosses the phase boundary. `curve_layout` decides what goes in which panel;
`plot_curves` only draws it, so the layout is tested without reading pixels.

Held-out evaluations are points (the policy is only measured there, so no line joins them), one
series per environment, with standard-error bars where the record has them. An evaluation before
the warm start's end (`start`, at step 0 of a run with a warm start) is on the warm-start axis;
one at or after it is on the RL axis at its RL step, so `after warm start` is at RL step 0 and,
in a run without a warm start, so is `start`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cod_fast.data.metrics import _pyplot, _save

CURVES = (
    ("reward_mean", "mean reward"),
    ("cod_gain", "CoD gain (last position - first)"),
    ("loss", "loss"),
    ("kl", "KL to the reference"),
    ("entropy", "entropy (nats per token)"),
    ("tokens_per_s_per_device", "tokens/s per device"),
)
"""The metrics.jsonl fields `plot_curves` draws, one row of panels each, with their titles."""
WARM_TITLES = {
    "reward_mean": "demonstrations' mean reward",
    "cod_gain": "demonstrations' CoD gain",
    "loss": "supervised loss (demonstrations' NLL)",
}
"""Titles of the warm-start panels that differ from RL's: what those numbers measure there."""
PHASES = {"warm_start": ("warm start", "warm-start step"), "rl": ("RL", "RL step")}
"""Each phase's column, left to right: its title prefix and its x-axis label."""
EVAL_CURVES: dict[str, Callable[[dict], float]] = {
    "reward_mean": lambda e: sum(e["mean_reward"]) / len(e["mean_reward"]),
    "cod_gain": lambda e: e["cod_gain"],
}
"""Panels that also show the held-out evaluations (eval.jsonl rows), and their value there."""
EVAL_ERRORS: dict[str, Callable[[dict], float | None]] = {
    # The mean of the positions' standard errors bounds the error of their mean from above
    # (a pack's positions move together, so the errors do not shrink by averaging).
    "reward_mean": lambda e: (
        sum(e["std_error"]) / len(e["std_error"]) if e.get("std_error") else None
    ),
    "cod_gain": lambda e: e.get("gain_std_error"),
}
"""The standard error of each `EVAL_CURVES` value, None where the record has none (runs
written before evaluations recorded it)."""
AVERAGE_ABOVE = 300
"""A training series with more points than this also gets a moving average, its raw points faint."""
AVERAGE_POINTS = 50
"""The moving average's window is the series' length over this (at least 5 steps)."""


@dataclass(frozen=True)
class Series:
    """One line or set of points of a panel, as `plot_curves` draws it."""

    label: str
    x: list[int]
    """The phase's step of each point (the panel's x-axis)."""
    y: list[float]
    steps: list[int]
    """The run's step of each point (metrics.jsonl's and eval.jsonl's `step`)."""
    yerr: list[float] | None = None
    """Standard errors, drawn as error bars; NaN where one point has none."""
    linestyle: str = "-"
    """"none" for evaluations: points measured far apart are not joined."""
    marker: str = "."
    alpha: float = 1.0
    color: str = "C0"


@dataclass(frozen=True)
class Panel:
    """One field of one phase: a panel of the figure."""

    phase: str
    """"warm_start" or "rl": the column, and the phase every point of the panel belongs to."""
    key: str
    title: str
    series: list[Series]
    note: str
    """What the panel says where it has no series."""


@dataclass(frozen=True)
class CurveLayout:
    """The figure `plot_curves` draws, panel by panel."""

    warm_steps: int
    """The warm start's length as far as the records tell (the first RL step's `step` minus its
    `phase_step`; while the warm start runs, its last step so far)."""
    columns: dict[str, list[Panel]]
    """The columns drawn, warm start first: one panel per row of `CURVES` each. A phase is drawn
    when it has something to show (steps logged, or an evaluation on its axis)."""


def curve_layout(steps: Sequence[dict], evals: Sequence[dict]) -> CurveLayout:
    """Which series go in which panel: metrics.jsonl records `steps` split by `phase` (a record
    without one is RL's, as in runs written before the warm start was logged), eval.jsonl
    records `evals` placed by their step (the module's docstring says where)."""
    warm_steps = _warm_steps(steps)
    groups = _eval_groups(evals)
    columns = {}
    for phase in PHASES:
        records = [r for r in steps if _phase(r) == phase]
        placed = {
            name: [e for e in mine if _eval_phase(e, warm_steps) == phase]
            for name, mine in groups.items()
        }
        if records or any(placed.values()) or (phase == "rl" and not columns):
            columns[phase] = [
                _panel(phase, key, title, records, placed, warm_steps) for key, title in CURVES
            ]
    return CurveLayout(warm_steps, columns)


def plot_curves(steps: Sequence[dict], evals: Sequence[dict], path: str | Path) -> Path:
    """A PNG of a run's training curves (`curve_layout`): a row of panels per field of `CURVES`,
    the warm start's column left of RL's, each against its own phase's step."""
    layout = curve_layout(steps, evals)
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    ratios = [1, 2] if len(layout.columns) == 2 else [1]  # RL is what the run is for
    fig, axes = plt.subplots(
        len(CURVES),
        len(ratios),
        figsize=(4 + 4 * len(ratios), 2.2 * len(CURVES)),
        dpi=100,
        sharex="col",
        squeeze=False,
        gridspec_kw={"width_ratios": ratios},
    )
    for column, (phase, panels) in enumerate(layout.columns.items()):
        # A series keeps its color in every panel: one legend per column, where most are.
        keyed = max(panels, key=lambda p: len(p.series))
        for ax, panel in zip(axes[:, column], panels, strict=True):
            _draw(ax, panel, legend=panel is keyed and len(panel.series) > 1)
        axes[-1, column].set_xlabel(PHASES[phase][1])
        axes[-1, column].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are counts
    fig.tight_layout()
    return _save(fig, path)


def _draw(ax, panel: Panel, legend: bool) -> None:
    for s in panel.series:
        if s.linestyle == "none":
            ax.errorbar(
                s.x,
                s.y,
                yerr=s.yerr,
                linestyle="none",
                marker=s.marker,
                capsize=3,
                color=s.color,
                label=s.label,
            )
        else:
            ax.plot(
                s.x,
                s.y,
                linestyle=s.linestyle,
                marker=s.marker,
                alpha=s.alpha,
                color=s.color,
                label=s.label,
            )
    if not panel.series:
        ax.text(0.5, 0.5, panel.note, ha="center", va="center", transform=ax.transAxes)
    ax.set_title(panel.title, fontsize=10)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)


def _phase(record: dict) -> str:
    return record.get("phase") or "rl"


def _warm_steps(steps: Sequence[dict]) -> int:
    for r in steps:
        if _phase(r) == "rl" and r.get("phase_step") is not None:
            return r["step"] - r["phase_step"]
    return max((r["step"] for r in steps if _phase(r) == "warm_start"), default=0)


def _phase_step(record: dict, warm_steps: int) -> int:
    if record.get("phase_step") is not None:
        return record["phase_step"]
    return record["step"] if _phase(record) == "warm_start" else record["step"] - warm_steps


def _eval_phase(record: dict, warm_steps: int) -> str:
    return "warm_start" if record["step"] < warm_steps else "rl"


def _panel(
    phase: str,
    key: str,
    title: str,
    records: list[dict],
    evals: dict[str, list[dict]],
    warm_steps: int,
) -> Panel:
    what, _ = PHASES[phase]
    if phase == "warm_start":
        title = WARM_TITLES.get(key, title)
    series = _training(phase, key, records, warm_steps)
    if key in EVAL_CURVES:
        series += _evaluations(phase, key, evals, warm_steps)
    if not records:
        note = f"{what} not started" if phase == "rl" else "no warm-start steps logged"
    else:
        note = f"not logged in the {what}" if phase == "warm_start" else "not logged"
    return Panel(phase, key, f"{what}: {title}", series, note)


def _training(phase: str, key: str, records: list[dict], warm_steps: int) -> list[Series]:
    """The phase's logged values of `key`, and their moving average where there are many."""
    points = [
        (_phase_step(r, warm_steps), r[key], r["step"]) for r in records if r.get(key) is not None
    ]
    if not points:
        return []
    x, y, steps = (list(column) for column in zip(*points, strict=True))
    label = "demonstrations" if phase == "warm_start" else "training batches"
    if len(points) <= AVERAGE_ABOVE:
        return [Series(label, x, y, steps)]
    window = max(5, len(points) // AVERAGE_POINTS)
    return [
        Series(label, x, y, steps, marker="", alpha=0.3),
        Series(f"moving average ({window} steps)", x, _moving_average(y, window), steps, marker=""),
    ]


def _moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each value and the `window - 1` before it (fewer at the start): it never
    reads ahead, so the last point is the latest steps' level."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _eval_groups(evals: Sequence[dict]) -> dict[str, list[dict]]:
    """The evaluations with rewards by environment (and mode: a task-by-task run also evaluates
    its own mode), in step order; the name says which ("" in a run that logs neither)."""
    groups: dict[str, list[dict]] = {}
    for e in sorted(evals, key=lambda e: e["step"]):
        where = [e.get("env") or "", "own mode" if e["label"].endswith("(own mode)") else ""]
        if e["mean_reward"]:
            groups.setdefault(", ".join(filter(None, where)), []).append(e)
    return groups


def _evaluations(
    phase: str, key: str, groups: dict[str, list[dict]], warm_steps: int
) -> list[Series]:
    """A series of points per group of `_eval_groups` with evaluations in this phase, each
    group in its own color in every panel."""
    offset = warm_steps if phase == "rl" else 0
    what = "held-out eval" if phase == "rl" else "held-out eval of the policy"
    series = []
    for i, (where, mine) in enumerate(groups.items()):
        if not mine:
            continue
        errors = [EVAL_ERRORS[key](e) for e in mine]
        series.append(
            Series(
                f"{what} ({where})" if where else what,
                [e["step"] - offset for e in mine],
                [EVAL_CURVES[key](e) for e in mine],
                [e["step"] for e in mine],
                yerr=None
                if all(err is None for err in errors)
                else [float("nan") if err is None else err for err in errors],
                linestyle="none",
                marker="o",
                color=f"C{i + 1}",  # C0 is the training series'
            )
        )
    return series
