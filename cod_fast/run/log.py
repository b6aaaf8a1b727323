"""A run directory people can trust: resolved config, metrics.jsonl, evals, TensorBoard, plots.

Layout of `runtime.run_dir`:
- `config.yaml`: the resolved config (what `--config` reads back);
- `metrics.jsonl`: one JSON object per optimizer step (rewards per position, CoD gain, loss, KL,
  entropy, clip fraction, tokens/s, sampler vs trainer time); on resume, lines past the restored
  step are dropped, so the file always describes one run;
- `eval.jsonl`: one object per evaluation (label, step, per-position rewards on held-out packs);
- `rewards.png`: reward against pack position (recent training steps and every evaluation),
  rewritten atomically as the run goes (after each evaluation, at most every 30 s otherwise);
- `curves.png`: reward, CoD gain, loss, KL, entropy and tokens/s, the warm start's and RL's on
  axes of their own steps, evaluations as points, redrawn with `rewards.png`;
- `tb/`, `wandb/`, `trackers.json`: what the trackers of `runtime.report_to` keep in the run
  directory (cod_fast.run.trackers), which get every step's numbers and each evaluation too;
- `chat_template.jinja`: the text of `model.chat_template`, when the config names one (what
  `cod-fast export` puts in the exported tokenizer);
- `checkpoints/`, `tokenizer/`: see cod_fast.run.checkpoint and cod_fast.train.trainer.
Only the main rank writes, and nothing through a symbolic link (cod_fast.common.safe_write: a link
where a log, a plot or `tb/` goes is refused, naming it). A last line of a log torn by a full
disk or a power cut is dropped with a warning (a resume rewrites the file without it); a
damaged line before it stops the reader with the file and the line number.
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cod_fast.common.bounded_read import ReadRefused, read_bounded
from cod_fast.common.errors import CodFastError
from cod_fast.common.safe_write import open_append, write_atomic
from cod_fast.common.values import is_count
from cod_fast.config import Config, shown
from cod_fast.data.curves import CURVES, plot_curves
from cod_fast.data.metrics import PositionSummary, plot_positions
from cod_fast.run.trackers import Trackers, scalars

TEMPLATE = "chat_template.jinja"
"""The text of the run's `model.chat_template`, when it names one."""
MAX_LOG_BYTES = 2**30
"""The largest metrics.jsonl or eval.jsonl read back: half a million steps of a large run."""
RECENT_STEPS = 5
"""Training steps averaged into the plot's training curve."""
PLOT_EVERY_S = 30.0
"""A step redraws the plots at most this often (a redraw of both costs ~0.5 s; tiny steps take
less)."""


class RunLogError(ValueError, CodFastError):
    """A log of the run directory with a damaged line before its last; the message names the
    file, the line and the fix."""


def _read_jsonl(path: Path, problem: Problem) -> tuple[list[dict[str, Any]], bool]:
    """The records of a JSON-lines log, and whether the file holds more than those records'
    lines (then the next append must not follow it as it is: `truncate` rewrites it).

    A record is appended in one write, so a full disk or a power cut can only tear the last
    line: that line is dropped with a warning naming the file. A damaged line with whole records
    after it is no interrupted append but a damaged file, and guessing past it could hide lost
    steps: RunLogError naming the line. So is a whole record that its readers could not use
    (`problem`, given the record and the ones before it, says why): a file changed since it was
    written, never an interrupted append.
    """
    if not path.exists():
        return [], False
    text = read_log(path)
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    records: list[dict[str, Any]] = []
    for n, line in lines:
        record = _record(line)
        if record is not None and (why := problem(record, records)) is not None:
            raise RunLogError(
                f"{path}: line {n} is not a record of this log ({why}); repair or delete that "
                "line, then run again"
            )
        if record is not None:
            records.append(record)
        elif n < lines[-1][0]:
            raise RunLogError(
                f"{path}: line {n} is not a JSON record ({shown(line)}), and whole records "
                "follow it; repair or delete that line, then run again"
            )
        else:
            warnings.warn(
                f"{path}: dropped its last line, cut short by an interrupted write (a full "
                f"disk, a power cut): {shown(line)}; resuming the run rewrites the file without it",
                RuntimeWarning,
                stacklevel=3,
            )
            return records, True
    return records, not text.endswith("\n") and bool(text)


def read_log(path: Path) -> str:
    """The text of a log of the run (undecodable bytes replaced: a power cut can leave some),
    RunLogError for one over MAX_LOG_BYTES or that is no regular file."""
    try:
        return read_bounded(path, MAX_LOG_BYTES).decode(errors="replace")
    except ReadRefused as e:
        raise RunLogError(
            f"{path} is {e}, more than any run writes (about 2 KB a step); move it aside to "
            "resume without it"
        ) from None


def _record(line: str) -> dict[str, Any] | None:
    """The JSON object on `line`, or None where it holds none."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: `[[[[...` nested past the stack
        return None
    return record if isinstance(record, dict) else None


Problem = Callable[[dict[str, Any], list[dict[str, Any]]], str | None]
"""Why a log's record (given the records before it) cannot be read as one, or None."""


def _is_number(value: Any) -> bool:
    """A value a plot can draw: a float (NaN too, which the logs write as JSON's NaN), or an
    int that converts to one."""
    return isinstance(value, float) or (type(value) is int and abs(value) < 2**63)


def _is_numbers(value: Any) -> bool:
    return isinstance(value, list) and all(map(_is_number, value))


_FieldCheck = tuple[Callable[[Any], bool], str]
_STEP: _FieldCheck = (is_count, "a step number")
_NUMBERS_OR_NULL: _FieldCheck = (lambda v: v is None or _is_numbers(v), "a list of numbers or null")
_METRICS: dict[str, _FieldCheck] = {
    "step": _STEP,
    **{key: (lambda v: v is None or _is_number(v), "a number or null") for key, _ in CURVES},
}
"""The fields of a metrics.jsonl record that its readers take (the curves, `--resume`), besides
each `...reward_by_position`: a list of numbers or null, as long as the ones before it."""
_EVALS: dict[str, _FieldCheck] = {
    "step": _STEP,
    "label": (lambda v: isinstance(v, str), "a string"),
    "env": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "mean_reward": (_is_numbers, "a list of numbers"),
    "std_error": _NUMBERS_OR_NULL,
    "cod_gain": (_is_number, "a number"),
    "num_packs": (lambda v: type(v) is int and v >= 0, "a count"),
}
"""The fields of an eval.jsonl record that its readers take (the plots, the run's summary,
`--resume`), `env` and `std_error` only in runs written since they exist."""


def _field_problem(record: dict[str, Any], checks: dict[str, _FieldCheck]) -> str | None:
    for key, (fits, what) in checks.items():
        if key in record and not fits(record[key]):
            return f"its {key} is {shown(record[key])}, not {what}"
    return None


def _metrics_problem(record: dict[str, Any], before: list[dict[str, Any]]) -> str | None:
    if "step" not in record:
        return "it has no step"
    if why := _field_problem(record, _METRICS):
        return why
    for key in (k for k in record if k.endswith("reward_by_position")):
        if why := _field_problem(record, {key: _NUMBERS_OR_NULL}):
            return why
        # The plot averages the last records' lists position by position: one length.
        last = next((r[key] for r in reversed(before) if r.get(key)), None)
        if record[key] and last and len(record[key]) != len(last):
            return f"its {key} has {len(record[key])} positions, the line before it {len(last)}"
    return None


def _eval_problem(record: dict[str, Any], before: list[dict[str, Any]]) -> str | None:
    missing = [
        key
        for key in ("step", "label", "mean_reward", "cod_gain", "num_packs")
        if key not in record
    ]
    if missing:
        return f"it has no {missing[0]}"
    if why := _field_problem(record, _EVALS):
        return why
    errors = record.get("std_error")
    if errors is not None and len(errors) != len(record["mean_reward"]):
        positions = len(record["mean_reward"])
        return f"its std_error has {len(errors)} positions, its mean_reward {positions}"
    return None


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


class RunLog:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool = True,
        trackers: Sequence[str] = (),
        config: Config | None = None,
    ):
        """`trackers`: names of runtime.report_to (their libraries are imported here, a missing
        one a ConfigError); `config`: the run's, their runs' config."""
        self.dir = Path(run_dir)
        self.enabled = enabled
        self.metrics_path = self.dir / "metrics.jsonl"
        self.eval_path = self.dir / "eval.jsonl"
        self.trackers = Trackers(trackers if enabled else (), config)
        self.plotted_at = -math.inf
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)

    def write_config(self, text: str, template: str | None = None) -> None:
        """Write the resolved config and, when `model.chat_template` gave one, the template's
        text (TEMPLATE): the run then holds what its export needs, and nothing reads the file
        the config names again."""
        if self.enabled:
            write_atomic(self.dir / "config.yaml", text)
            if template is not None:
                write_atomic(self.dir / TEMPLATE, template)

    def truncate(self, step: int) -> None:
        """Forget what a run resumed from checkpoint `step` redoes: the metrics of later steps
        and the evaluations from `step` on (an evaluation always follows that step's
        checkpoint). -1 forgets everything. Then the trackers start: new tracker runs (-1), or
        the ones the resumed run began."""
        if not self.enabled:
            return
        logs = (
            (self.metrics_path, step, _metrics_problem),
            (self.eval_path, step - 1, _eval_problem),
        )
        for path, keep, problem in logs:
            records, torn = _read_jsonl(path, problem)
            kept = [r for r in records if r["step"] <= keep]
            if torn or len(kept) != len(records):
                _write_jsonl(path, kept)
        self.trackers.start(self.dir, None if step < 0 else step)

    def step(self, record: dict[str, Any]) -> None:
        """Append one step's metrics (flat JSON: numbers, lists of numbers, strings)."""
        if not self.enabled:
            return
        with open_append(self.metrics_path) as f:
            f.write(json.dumps(record) + "\n")
        self.trackers.start(self.dir, None)  # a log that was not truncated: a new run
        self.trackers.log(scalars(record), record["step"])
        if time.monotonic() - self.plotted_at >= PLOT_EVERY_S:
            self.plot()

    def evaluation(
        self, label: str, step: int, summary: PositionSummary, env: str | None = None
    ) -> None:
        """Append one evaluation (of environment `env`, in a run with several)."""
        if not self.enabled:
            return
        record = {"label": label, "step": step, "env": env, **summary.to_dict()}
        with open_append(self.eval_path) as f:
            f.write(json.dumps(record) + "\n")
        tag = f"eval/{env}" if env else "eval"
        self.trackers.start(self.dir, None)
        self.trackers.log(
            {f"{tag}/cod_gain": summary.cod_gain, f"{tag}/last_position": summary.mean_reward[-1]},
            step,
        )
        self.plot()

    def metrics(self) -> list[dict[str, Any]]:
        """The records of metrics.jsonl (a torn last line dropped, with a warning)."""
        return _read_jsonl(self.metrics_path, _metrics_problem)[0]

    def evaluations(self) -> list[dict[str, Any]]:
        """The records of eval.jsonl (a torn last line dropped, with a warning)."""
        return _read_jsonl(self.eval_path, _eval_problem)[0]

    def plot(self) -> None:
        """Reward by pack position: the mean of the last few training steps, and each eval;
        in a run with several environments also one plot per environment (`rewards-ENV.png`);
        and the training curves against step (`curves.png`)."""
        self.plotted_at = time.monotonic()
        records = self.metrics()
        evals = self.evaluations()
        if records or evals:
            plot_curves(records, evals, self.dir / "curves.png")
        steps = [r for r in records if "reward_by_position" in r]
        envs = sorted({r["env"] for r in evals if r.get("env")})
        self._plot(steps, evals, "", self.dir / "rewards.png")
        for env in envs if len(envs) > 1 else []:
            mine = [r for r in evals if r.get("env") == env]
            # a plugin's name may be a path (`envs/mine.py:Mine`): a file name of its own
            safe = re.sub(r"[^\w.-]+", "_", env)
            self._plot(steps, mine, f"{env}/", self.dir / f"rewards-{safe}.png")

    @staticmethod
    def _plot(steps: list[dict], evals: list[dict], prefix: str, path: Path) -> None:
        curves: dict[str, PositionSummary] = {}
        # The latest phase only: warm-start steps show the scripted explorer, not the policy.
        phase = steps[-1].get("phase") if steps else None
        key = f"{prefix}reward_by_position"
        recent = [r for r in steps if r.get("phase") == phase and r.get(key)][-RECENT_STEPS:]
        if recent:
            rows = [r[key] for r in recent]
            mean = [sum(col) / len(col) for col in zip(*rows, strict=True)]
            what = "warm-start demonstrations" if phase == "warm_start" else "training rollouts"
            label = f"{what}, steps {recent[0]['step']}-{recent[-1]['step']}"
            curves[label] = PositionSummary(mean_reward=mean, success_rate=None, num_packs=0)
        several = len({r.get("env") for r in evals}) > 1
        for r in evals:
            where = f"{r.get('env')}, " if several else ""
            curves[f"eval: {where}{r['label']} (step {r['step']})"] = PositionSummary(
                mean_reward=r["mean_reward"],
                success_rate=None,
                num_packs=r["num_packs"],
                std_error=r.get("std_error"),  # absent in runs written before it existed
            )
        if curves and all(not any(map(math.isnan, c.mean_reward)) for c in curves.values()):
            title = (
                f"reward by pack position ({prefix[:-1]})" if prefix else "reward by pack position"
            )
            plot_positions(curves, path, title)

    def close(self) -> None:
        if self.enabled:
            self.plot()
        self.trackers.close()
