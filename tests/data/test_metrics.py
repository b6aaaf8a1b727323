"""Per-position summaries, the CoD gain and the reward-by-position plot."""

from __future__ import annotations

import pytest

from cod_fast.data.metrics import PositionSummary, plot_positions, summarize, summarize_rollouts
from tests.rollout.test_rollout import run_guess


def test_summary_worked_example():
    """Mean per position over packs, gain = last - first, success rate where reported."""
    s = summarize([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]], [[False, True, True], [True, False, True]])
    assert s.mean_reward == [0.5, 0.5, 1.0]
    assert s.cod_gain == 0.5
    assert s.success_rate == [0.5, 0.5, 1.0]
    # sample std of {0, 1} is sqrt(1/2); over n = 2 packs the standard error is 0.5
    assert s.std_error == pytest.approx([0.5, 0.5, 0.0])
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


def test_plot_shows_integer_positions_error_bars_and_no_empty_pack_count(tmp_path, monkeypatch):
    """The x axis ticks are the pack positions 0..K-1; an eval curve carries its standard-error
    bars and pack count; a training curve (num_packs 0) is labelled without `n=0`."""
    import matplotlib.axes

    seen, axes = {}, []
    real = matplotlib.axes.Axes.errorbar

    def spy(self, x, y, yerr=None, **kw):
        seen[kw["label"]] = yerr
        axes.append(self)
        return real(self, x, y, yerr=yerr, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", spy)
    evals = summarize([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]])
    train = PositionSummary(mean_reward=[0.2, 0.4, 0.5, 0.6], success_rate=None, num_packs=0)
    path = plot_positions({"eval": evals, "train": train}, tmp_path / "p.png", "t")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert list(axes[0].get_xticks()) == [0, 1, 2, 3]
    (eval_label,) = [k for k in seen if k.startswith("eval")]
    (train_label,) = [k for k in seen if k.startswith("train")]
    assert "n=2" in eval_label and seen[eval_label] == evals.std_error
    assert "n=" not in train_label and seen[train_label] is None
