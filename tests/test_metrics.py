"""Per-position summaries, the CoD gain and the reward-by-position plot."""

from __future__ import annotations

import pytest

from cod_fast.metrics import plot_positions, summarize, summarize_rollouts
from tests.test_rollout import run_guess


def test_summary_worked_example():
    """Mean per position over packs, gain = last - first, success rate where reported."""
    s = summarize([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]], [[False, True, True], [True, False, True]])
    assert s.mean_reward == [0.5, 0.5, 1.0]
    assert s.cod_gain == 0.5
    assert s.success_rate == [0.5, 0.5, 1.0]
    assert summarize([[1.0]], [[None]]).success_rate is None
    with pytest.raises(ValueError, match="same number of positions"):
        summarize([[1.0], [1.0, 0.0]])


def test_rollout_summary_and_plot(tmp_path):
    """Driver rollouts summarise by position; the plot is a PNG file written atomically."""
    rollouts, _ = run_guess()
    summary = summarize_rollouts(rollouts)
    assert summary.num_packs == 6 and summary.mean_reward == [1.0, 1.0, 1.0]
    path = plot_positions({"guess": summary}, tmp_path / "plot.png", "toy")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp.png"))
