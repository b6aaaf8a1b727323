"""Per-position rewards, CoD gain, success rates and plots (docs/concepts.md section 6, Metrics).

The capability cod-fast trains shows as reward rising with the task's position in a pack; the
CoD gain is the mean reward at the last position minus the mean reward at position 0.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cod_fast.common.safe_write import write_atomic
from cod_fast.data.diagnostics import hint_checks, hint_metrics
from cod_fast.data.records import Rollout


@dataclass
class PositionSummary:
    """Means over packs (and group members) at each pack position."""

    mean_reward: list[float]
    success_rate: list[float] | None
    """Share of solved tasks per position, where the environment reports success."""
    num_packs: int
    std_error: list[float] | None = None
    """Standard error of each position's mean over the packs (sample std / sqrt(n)); None for a
    curve that is not a mean over packs."""
    gain_std_error: float | None = None
    """Standard error of the CoD gain over the packs: sample std of each pack's own gain (last
    position minus position 0) / sqrt(n). Smaller than the two positions' errors combined when a
    pack's positions move together (a hard pack is hard at every position)."""
    hints: dict[str, float] = field(default_factory=dict)
    """Hint quality by update episode (`hint_correct_u0`, ...; cod_fast.data.diagnostics.hint_metrics),
    empty where the environment declares no hint entries or no update episode ran."""

    @property
    def cod_gain(self) -> float:
        return self.mean_reward[-1] - self.mean_reward[0] if self.mean_reward else 0.0

    def to_dict(self) -> dict:
        return {
            "mean_reward": self.mean_reward,
            "success_rate": self.success_rate,
            "cod_gain": self.cod_gain,
            "num_packs": self.num_packs,
            "std_error": self.std_error,
            "gain_std_error": self.gain_std_error,
            **self.hints,
        }


def summarize(
    rewards: Sequence[Sequence[float]], successes: Sequence[Sequence[bool | None]] | None = None
) -> PositionSummary:
    """rewards[p][k]: pack p's reward at position k (every pack the same length)."""
    if not rewards:
        return PositionSummary(mean_reward=[], success_rate=None, num_packs=0)
    lengths = {len(row) for row in rewards}
    if len(lengths) != 1:
        raise ValueError(f"every pack must have the same number of positions, got {lengths}")
    (k,) = lengths
    n = len(rewards)
    mean = [sum(row[i] for row in rewards) / n for i in range(k)]
    var = [sum((row[i] - mean[i]) ** 2 for row in rewards) / max(n - 1, 1) for i in range(k)]
    gain_std_error = None
    if k:
        gains = [row[-1] - row[0] for row in rewards]
        gain = sum(gains) / n
        gain_std_error = math.sqrt(sum((g - gain) ** 2 for g in gains) / max(n - 1, 1) / n)
    rate = None
    if successes and all(s is not None for row in successes for s in row):
        rate = [sum(bool(row[i]) for row in successes) / len(successes) for i in range(k)]
    return PositionSummary(
        mean_reward=mean,
        success_rate=rate,
        num_packs=n,
        std_error=[math.sqrt(v / n) for v in var],
        gain_std_error=gain_std_error,
    )


def solve_results(rollout: Rollout) -> tuple[list[float], list[bool | None]]:
    """(rewards, successes) of a rollout's solve episodes, by position."""
    solves = sorted((e for e in rollout.episodes if e.kind == "solve"), key=lambda e: e.task_index)
    return [e.reward for e in solves], [e.info.get("success") for e in solves]


def summarize_rollouts(rollouts: Sequence[Rollout]) -> PositionSummary:
    """The same summary over driver rollouts (solve episodes, by position), with the hint
    quality of their update episodes."""
    results = [solve_results(rollout) for rollout in rollouts]
    summary = summarize([r for r, _ in results], [s for _, s in results])
    summary.hints = hint_metrics([hint_checks(rollout) for rollout in rollouts])
    return summary


def plot_positions(
    curves: dict[str, PositionSummary],
    path: str | Path,
    title: str,
    errors: str = "one standard error over packs",
) -> Path:
    """A PNG of mean reward against pack position, one line per curve; `errors` says what the
    error bars (each curve's `std_error`) are."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for label, summary in curves.items():
        packs = f", n={summary.num_packs}" if summary.num_packs else ""
        ax.errorbar(
            range(len(summary.mean_reward)),
            summary.mean_reward,
            yerr=summary.std_error,
            marker="o",
            capsize=3,
            label=f"{label} (gain {summary.cod_gain:+.2f}{packs})",
        )
    positions = max((len(c.mean_reward) for c in curves.values()), default=0)
    ax.set_xticks(range(positions))  # positions are tasks: integers only
    ax.set_xlabel(f"position in pack (error bars: {errors})")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    """Write `fig` to `path` as a PNG and close it; atomic, so a reader never sees half a PNG,
    and never through a symbolic link (cod_fast.common.safe_write)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_atomic(path, png.getvalue())
    return path
