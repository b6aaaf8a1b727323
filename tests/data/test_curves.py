"""The training curves (cod_fast/data/curves.py): the warm start and RL in panels of their own,
each against its own phase's step, evaluations as points with standard-error bars, a moving
average over long runs; checked on the layout `plot_curves` draws, and on the PNG it writes."""

from __future__ import annotations

import random

import matplotlib.image
import pytest

from cod_fast.data import curves
from cod_fast.data.curves import AVERAGE_ABOVE, CURVES, EVAL_CURVES, curve_layout, plot_curves

PNG = b"\x89PNG\r\n\x1a\n"
WARM, RL = 20, 7


def steps(warm: int, rl: int, rng: random.Random, kl: bool = True) -> list[dict]:
    """metrics.jsonl records of `warm` warm-start then `rl` RL steps, random values (the warm
    start's reward high, the scripted explorer's; RL's low, the policy's own)."""
    out = []
    for step in range(1, warm + rl + 1):
        phase = "warm_start" if step <= warm else "rl"
        out.append(
            {
                "step": step,
                "phase": phase,
                "phase_step": step if phase == "warm_start" else step - warm,
                "reward_mean": rng.uniform(0.8, 1.0) if phase == "warm_start" else rng.random() / 4,
                "cod_gain": rng.uniform(-0.5, 0.5),
                "loss": rng.uniform(0.5, 2.0),
                "kl": rng.random() / 100 if phase == "rl" and kl else None,
                "entropy": rng.uniform(0.5, 1.5),
                "tokens_per_s_per_device": rng.uniform(1e3, 2e3),
            }
        )
    return out


def evaluation(label: str, step: int, rng: random.Random, env: str = "frozenlake", se=True):
    """An eval.jsonl record over 3 positions, with standard errors unless `se` is False (runs
    written before evaluations recorded them)."""
    mean = [rng.random() for _ in range(3)]
    return {
        "label": label,
        "step": step,
        "env": env,
        "mean_reward": mean,
        "cod_gain": mean[-1] - mean[0],
        "num_packs": 8,
        **({"std_error": [rng.random() / 10 for _ in mean]} if se else {}),
        **({"gain_std_error": rng.random() / 10} if se else {}),
    }


def run_evals(rng: random.Random, warm: int = WARM, rl: int = RL, envs=("frozenlake",)):
    """The evaluations of a run: start, after warm start, RL step 4 and end, per environment."""
    labels = [("start", 0), ("after warm start", warm), ("rl step 4", warm + 4), ("end", warm + rl)]
    return [evaluation(label, step, rng, env) for label, step in labels for env in envs]


def phase_of(step: int, records: list[dict], warm: int, is_eval: bool) -> str:
    """The phase a point belongs to: a training point its record's, an evaluation's RL's from
    the warm start's end on (`after warm start` measures the policy RL starts from)."""
    if is_eval:
        return "warm_start" if step < warm else "rl"
    (record,) = [r for r in records if r["step"] == step]
    return record["phase"]


def phases_of(points: list[int], records: list[dict], warm: int, is_eval: bool) -> set[str]:
    """The phases a series' points (their run steps) fall in: one, unless it crosses from the
    warm start into RL. Given a drawn line's x data as run steps, it judges the old
    single-axis layout too (whose training and evaluation lines both crossed)."""
    return {phase_of(step, records, warm, is_eval) for step in points}


def test_no_series_spans_both_phases():
    """Every series of a panel has all its points in the panel's phase: none runs from the warm
    start into RL (a demonstrations' reward falling into the policy's looks like a collapse)."""
    rng = random.Random(0)
    records, evals = steps(WARM, RL, rng), run_evals(rng)
    layout = curve_layout(records, evals)
    assert layout.warm_steps == WARM and list(layout.columns) == ["warm_start", "rl"]
    for phase, panels in layout.columns.items():
        assert [p.key for p in panels] == [key for key, _ in CURVES]
        for panel in panels:
            assert panel.phase == phase
            for s in panel.series:
                phases = phases_of(s.steps, records, WARM, s.linestyle == "none")
                assert phases == {phase}, (panel.title, s.label, phases)


def test_each_phase_is_drawn_against_its_own_steps():
    """RL's training series run over RL steps 1..7 (its panels span RL alone), the warm
    start's over 1..20; the warm-start panels say they show demonstrations and a supervised
    loss; a field the warm start did not log (KL) leaves its panel saying so."""
    rng = random.Random(1)
    layout = curve_layout(steps(WARM, RL, rng), run_evals(rng))
    for key, _ in CURVES:
        rl = {p.key: p for p in layout.columns["rl"]}[key]
        warm = {p.key: p for p in layout.columns["warm_start"]}[key]
        assert rl.series[0].x == list(range(1, RL + 1)) and rl.title.startswith("RL: ")
        assert rl.series[0].linestyle == "-"
        if key == "kl":
            assert warm.series == [] and "not logged" in warm.note
        else:
            assert warm.series[0].x == list(range(1, WARM + 1))
    titles = [p.title for p in layout.columns["warm_start"]]
    assert "demonstrations" in titles[0] and "demonstrations" in titles[1]
    assert "supervised loss" in titles[2]


def test_evaluations_are_points_on_their_phase_axis_with_error_bars():
    """Evaluations are markers with no connecting line: `start` (step 0) at warm-start step 0,
    `after warm start` at RL step 0, then RL steps 4 and 7; error bars are the mean of the
    positions' standard errors (the CoD gain's own standard error) where the record has them,
    and none where it has not."""
    rng = random.Random(2)
    records, evals = steps(WARM, RL, rng), run_evals(rng)
    layout = curve_layout(records, evals)
    for phase, expected in (("warm_start", [0]), ("rl", [0, 4, 7])):
        for panel in layout.columns[phase]:
            points = [s for s in panel.series if s.linestyle == "none"]
            if panel.key not in EVAL_CURVES:
                assert points == []
                continue
            (s,) = points
            assert s.marker == "o" and s.x == expected
            mine = [e for e in evals if e["step"] in s.steps]
            assert s.y == pytest.approx([EVAL_CURVES[panel.key](e) for e in mine])
            errors = [
                sum(e["std_error"]) / 3 if panel.key == "reward_mean" else e["gain_std_error"]
                for e in mine
            ]
            assert s.yerr == pytest.approx(errors)
    bare = [evaluation("end", WARM + RL, rng, se=False)]
    for panel in curve_layout(records, bare).columns["rl"][:2]:
        assert [s.yerr for s in panel.series if s.linestyle == "none"] == [None]


def test_several_environments_get_one_point_series_each():
    """A run over two environments: each evaluation panel holds one point series per
    environment, each at the same RL steps."""
    rng = random.Random(3)
    envs = ("frozenlake", "sokoban")
    layout = curve_layout(steps(WARM, RL, rng), run_evals(rng, envs=envs))
    for panel in layout.columns["rl"][:2]:
        points = [s for s in panel.series if s.linestyle == "none"]
        assert [s.label for s in points] == [f"held-out eval ({env})" for env in envs]
        assert all(s.x == [0, 4, 7] for s in points)


@pytest.mark.parametrize(
    ("warm", "rl", "labels", "columns"),
    [
        (WARM, 0, [("start", 0)], ["warm_start"]),  # still in the warm start
        (WARM, 0, [("start", 0), ("after warm start", WARM)], ["warm_start", "rl"]),
        (0, RL, [("start", 0), ("end", RL)], ["rl"]),  # no warm start
    ],
)
def test_a_phase_is_drawn_once_it_has_something_to_show(warm, rl, labels, columns):
    """A run still in the warm start shows only the warm start; once the warm start's
    evaluation is in, the RL column shows it at RL step 0 and its training panels say RL has
    not started; a run without a warm start shows only RL, with `start` at RL step 0."""
    rng = random.Random(4)
    evals = [evaluation(label, step, rng) for label, step in labels]
    layout = curve_layout(steps(warm, rl, rng), evals)
    assert list(layout.columns) == columns
    if "rl" in columns:
        reward = layout.columns["rl"][0]
        (points,) = [s for s in reward.series if s.linestyle == "none"]
        assert points.x[0] == 0
        if not rl:
            loss = layout.columns["rl"][2]
            assert loss.series == [] and loss.note == "RL not started"


def test_long_runs_get_a_moving_average():
    """Past `AVERAGE_ABOVE` points a panel also draws a moving average of the same steps (the
    raw points faint); the average of the last window is the mean of its values."""
    rng = random.Random(5)
    layout = curve_layout(steps(0, 1000, rng), [])
    raw, average = layout.columns["rl"][2].series
    assert raw.alpha < 1 and average.label.startswith("moving average") and average.x == raw.x
    window = int(average.label.split("(")[1].split()[0])
    assert average.y[-1] == pytest.approx(sum(raw.y[-window:]) / window)
    short = curve_layout(steps(0, AVERAGE_ABOVE, rng), [])
    assert len(short.columns["rl"][2].series) == 1


@pytest.mark.slow  # 1-2 s: left to the full suite
def test_the_figure_draws_the_layout(tmp_path, monkeypatch):
    """plot_curves draws what curve_layout says: a panel per row and phase, and each
    evaluation series as markers with no connecting line, with error bars."""
    drawn = []
    save = curves._save
    monkeypatch.setattr(curves, "_save", lambda fig, path: drawn.append(fig) or save(fig, path))
    rng = random.Random(6)
    plot_curves(steps(WARM, RL, rng), run_evals(rng), tmp_path / "curves.png")
    (fig,) = drawn
    axes = fig.get_axes()
    assert len(axes) == 2 * len(CURVES)
    rl_reward = next(ax for ax in axes if ax.get_title() == "RL: mean reward")
    points = [line for line in rl_reward.get_lines() if line.get_marker() == "o"]
    assert [line.get_linestyle() for line in points] == ["None"]
    assert list(points[0].get_xdata()) == [0, 4, 7] and rl_reward.containers


def scenario(name: str) -> tuple[list[dict], list[dict]]:
    rng = random.Random(name)
    if name == "warm only":
        return steps(WARM, 0, rng), [evaluation("start", 0, rng)]
    if name == "RL only":
        return steps(0, RL, rng), [evaluation("start", 0, rng), evaluation("end", RL, rng)]
    if name == "several envs":
        return steps(WARM, RL, rng), run_evals(rng, envs=("frozenlake", "sokoban"))
    if name == "1000 steps":
        return steps(WARM, 1000, rng), run_evals(rng, rl=1000)
    return steps(WARM, RL, rng), run_evals(rng)


@pytest.mark.slow  # about a second each: the figures are drawn and read back
@pytest.mark.parametrize("name", ["warm only", "RL only", "both", "several envs", "1000 steps"])
def test_curves_png_is_a_valid_png(tmp_path, name):
    """curves.png is written, and matplotlib reads it back as an image of the figure's size."""
    path = plot_curves(*scenario(name), tmp_path / "curves.png")
    assert path.read_bytes()[:8] == PNG
    height, width, _ = matplotlib.image.imread(path).shape
    assert height == round(100 * 2.2 * len(CURVES)) and width == (800 if "only" in name else 1200)
