"""The run directory's logs (cod_fast/run/log.py): metrics and evals, resume truncation, plot,
TensorBoard."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from cod_fast.data.metrics import PositionSummary
from cod_fast.run.log import RunLog, RunLogError


def summary(values):
    return PositionSummary(mean_reward=values, success_rate=None, num_packs=4)


@pytest.mark.slow  # 1-2 s: left to the full suite
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


@pytest.mark.slow  # 1-2 s: left to the full suite
def test_plot_and_tensorboard_are_written(tmp_path):
    """Each record refreshes rewards.png; with tensorboard on, scalars (per-position rewards
    included) land in event files under tb/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLog(tmp_path, trackers=["tensorboard"])
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


def _logged_run(run_dir) -> RunLog:
    """A log with four steps and two evaluations, as a run leaves it."""
    log = RunLog(run_dir)
    log.evaluation("start", 0, summary([0.1, 0.2]))
    for step in range(1, 5):
        log.step({"step": step, "reward_by_position": [0.1 * step, 0.2], "loss": 1.0 / step})
    log.evaluation("after warm start", 2, summary([0.2, 0.4]))
    return log


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # 0.5-1 s: left to the full suite
def test_a_torn_last_line_is_dropped_with_a_warning_and_rewritten_on_resume(tmp_path):
    """A record cut short by a full disk or a power cut (the last line, no newline) is
    dropped: evaluations() and truncate() warn naming the file and the dropped text, truncate
    rewrites the file without it, and the next append starts a line of its own."""
    log = _logged_run(tmp_path)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "reward_by_position": [0.5, 0.')
    with (tmp_path / "eval.jsonl").open("a") as f:
        f.write('{"label": "end", "step": 5, "mean_re')
    with pytest.warns(RuntimeWarning, match=r"eval\.jsonl: dropped its last line.*mean_re"):
        assert [e["label"] for e in log.evaluations()] == ["start", "after warm start"]
    with pytest.warns(RuntimeWarning) as caught:
        log.truncate(4)
    assert sorted(str(w.message).split(":")[0] for w in caught) == [
        str(tmp_path / "eval.jsonl"),
        str(tmp_path / "metrics.jsonl"),
    ]
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["label"] for r in _lines(tmp_path / "eval.jsonl")] == ["start", "after warm start"]
    log.step({"step": 5, "reward_by_position": [0.5, 0.2], "loss": 0.2})
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]


@pytest.mark.slow  # 0.5-1 s: left to the full suite
def test_a_damaged_line_before_the_last_is_refused_naming_file_line_and_fix(tmp_path):
    """A line that is no JSON record with whole records after it is no torn append: truncate()
    and evaluations() raise RunLogError (a ValueError: one line from the CLI) naming the file,
    the line number and the fix, and leave the file as it was."""
    log = _logged_run(tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    lines[1] = '{"step": 2, "reward_by\x00\x00\n'
    metrics.write_text("".join(lines))
    before = metrics.read_bytes()
    pattern = rf"^{re.escape(str(metrics))}: line 2 is not a JSON record .*delete that line"
    with pytest.raises(RunLogError, match=pattern):
        log.truncate(4)
    assert metrics.read_bytes() == before
    evals = tmp_path / "eval.jsonl"
    evals.write_text("[]\n" + evals.read_text())  # JSON, but not a record
    with pytest.raises(RunLogError, match=rf"^{re.escape(str(evals))}: line 1 .*repair or delete"):
        log.evaluations()


@pytest.mark.slow  # 0.5-1 s: left to the full suite
def test_a_log_over_its_bound_or_no_file_is_refused_unread(tmp_path, monkeypatch):
    """A log larger than any run writes, or a log that is /dev/zero or a named pipe (a run
    directory from elsewhere), is one RunLogError naming the file and the fix, without reading
    it whole or waiting for a writer."""
    import os

    from cod_fast.run import log as run_log
    from cod_fast.run.directory import _logged_steps

    log = _logged_run(tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    monkeypatch.setattr(run_log, "MAX_LOG_BYTES", metrics.stat().st_size - 1)
    with pytest.raises(RunLogError, match=rf"^{re.escape(str(metrics))} is more than \d+ bytes"):
        log.truncate(4)
    with pytest.raises(RunLogError, match="move it aside to resume without it"):
        _logged_steps(tmp_path)
    monkeypatch.undo()
    metrics.unlink()
    metrics.symlink_to("/dev/zero")
    with pytest.raises(RunLogError, match="a character device such as /dev/zero"):
        log.metrics()
    metrics.unlink()
    os.mkfifo(metrics)
    with pytest.raises(RunLogError, match="a named pipe, not a regular file"):
        log.truncate(4)


@pytest.mark.slow
def test_a_resumed_run_drops_a_torn_last_line_and_refuses_a_damaged_one(tmp_path):
    """A real run stopped after step 3, then a power cut's torn line at the end of metrics.jsonl
    and of eval.jsonl: resume warns for each file and finishes with whole logs (every step and
    evaluation once). The same run with a damaged line in the middle of metrics.jsonl: resume
    raises RunLogError naming the file and the line, and the file is left as it was."""
    from cod_fast.train.trainer import Trainer
    from tests.train.test_trainer import config

    run = tmp_path / "torn"
    first = Trainer(config(run))
    stop = first.run(on_step=lambda record: setattr(first, "stop_requested", record["step"] == 3))
    assert stop["steps"] == 3
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged)
    for name in ("metrics.jsonl", "eval.jsonl"):
        with (run / name).open("a") as f:
            f.write('{"step": 4, "phase": "rl", "reward_by_po')
    with pytest.warns(RuntimeWarning) as caught:
        Trainer(config(run)).run(resume=True)
    dropped = {str(w.message).split(":")[0] for w in caught if "dropped" in str(w.message)}
    assert dropped == {str(run / "metrics.jsonl"), str(run / "eval.jsonl")}
    assert [r["step"] for r in _lines(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["label"] for r in _lines(run / "eval.jsonl")] == ["start", "after warm start", "end"]

    metrics = damaged / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join([*lines[:1], lines[1][:20] + "\n", *lines[2:]]))
    before = metrics.read_bytes()
    pattern = rf"^{re.escape(str(metrics))}: line 2 is not a JSON record"
    with pytest.raises(RunLogError, match=pattern):
        Trainer(config(damaged)).run(resume=True)
    assert metrics.read_bytes() == before
