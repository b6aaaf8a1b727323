"""The run directory's logs (cod_fast/run_log.py): metrics and evals, resume truncation, plot,
TensorBoard."""

from __future__ import annotations

import json

import pytest

from cod_fast.metrics import PositionSummary
from cod_fast.run_log import RunLog


def summary(values):
    return PositionSummary(mean_reward=values, success_rate=None, num_packs=4)


def test_truncate_keeps_what_a_resumed_run_does_not_redo(tmp_path):
    """Resuming from checkpoint N keeps metrics of steps <= N and evaluations before step N
    (an evaluation at N follows that checkpoint, so the resumed run redoes it); -1 keeps none."""
    log = RunLog(tmp_path)
    log.evaluation("start", 0, summary([0.1, 0.2]))
    for step in range(1, 5):
        log.step({"step": step, "reward_by_position": [0.1 * step, 0.2], "loss": 1.0 / step})
    log.evaluation("after warm start", 2, summary([0.2, 0.4]))
    log.evaluation("end", 4, summary([0.3, 0.5]))
    log.truncate(2)
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2]
    assert [(e["label"], e["step"]) for e in log.evaluations()] == [("start", 0)]
    log.truncate(-1)
    assert (tmp_path / "metrics.jsonl").read_text() == "" and log.evaluations() == []


def test_plot_and_tensorboard_are_written(tmp_path):
    """Each record refreshes rewards.png; with tensorboard on, scalars (per-position rewards
    included) land in event files under tb/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLog(tmp_path, tensorboard=True)
    log.step({"step": 1, "reward_by_position": [0.1, 0.3], "loss": 0.5, "phase": "rl"})
    log.evaluation("end", 1, summary([0.2, 0.6]))
    log.close()
    assert (tmp_path / "rewards.png").stat().st_size > 0
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "reward_by_position/0", "reward_by_position/1", "eval/cod_gain"} <= tags
    assert events.Scalars("reward_by_position/1")[0].value == pytest.approx(0.3)


def test_a_disabled_log_writes_nothing(tmp_path):
    """Ranks other than the main one get a disabled log: no files at all."""
    log = RunLog(tmp_path / "run", enabled=False)
    log.step({"step": 1, "reward_by_position": [0.0]})
    log.evaluation("start", 0, summary([0.0]))
    assert not (tmp_path / "run").exists()
