"""A run directory people can trust: resolved config, metrics.jsonl, evals, TensorBoard, plots.

Layout of `runtime.run_dir`:
- `config.yaml`: the resolved config (what `--config` reads back);
- `metrics.jsonl`: one JSON object per optimizer step (rewards per position, CoD gain, loss, KL,
  entropy, clip fraction, tokens/s, sampler vs trainer time); on resume, lines past the restored
  step are dropped, so the file always describes one run;
- `eval.jsonl`: one object per evaluation (label, step, per-position rewards on held-out packs);
- `rewards.png`: reward against pack position (recent training steps and every evaluation),
  rewritten atomically as the run goes (after each evaluation, at most every 30 s otherwise);
- `curves.png`: reward, CoD gain, loss, KL, entropy and tokens/s against step (the warm start
  shaded), redrawn with `rewards.png`;
- `tb/`: TensorBoard event files when `runtime.tensorboard` is on;
- `checkpoints/`, `tokenizer/`: see cod_fast.checkpoint and cod_fast.trainer.
Only the main rank writes. A last line of a log torn by a full disk or a power cut is dropped
with a warning (a resume rewrites the file without it); a damaged line before it stops the
reader with the file and the line number.
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from pathlib import Path
from typing import Any

from cod_fast.config import ConfigError, shown
from cod_fast.metrics import PositionSummary, plot_curves, plot_positions

RECENT_STEPS = 5
"""Training steps averaged into the plot's training curve."""
PLOT_EVERY_S = 30.0
"""A step redraws the plots at most this often (a redraw of both costs ~0.5 s; tiny steps take
less)."""


class RunLogError(ValueError):
    """A log of the run directory with a damaged line before its last; the message names the
    file, the line and the fix."""


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The records of a JSON-lines log, and whether the file holds more than those records'
    lines (then the next append must not follow it as it is: `truncate` rewrites it).

    A record is appended in one write, so a full disk or a power cut can only tear the last
    line: that line is dropped with a warning naming the file. A damaged line with whole records
    after it is no interrupted append but a damaged file, and guessing past it could hide lost
    steps: RunLogError naming the line.
    """
    if not path.exists():
        return [], False
    text = path.read_text(errors="replace")  # a power cut can leave bytes that are not UTF-8
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    records = []
    for n, line in lines:
        record = _record(line)
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


def _record(line: str) -> dict[str, Any] | None:
    """The JSON object on `line`, or None where it holds none."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


def summary_writer_class() -> type:
    """torch's TensorBoard SummaryWriter, for `runtime.tensorboard`; without the tensorboard
    package (an optional extra) a ConfigError naming both fixes, not an ImportError from inside
    torch."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            "runtime.tensorboard",
            f"true needs the tensorboard package ({e}); pip install tensorboard, "
            "or set runtime.tensorboard=false",
        ) from None
    return SummaryWriter


class RunLog:
    def __init__(self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool = False):
        self.dir = Path(run_dir)
        self.enabled = enabled
        self.metrics_path = self.dir / "metrics.jsonl"
        self.eval_path = self.dir / "eval.jsonl"
        self.writer = None
        self.plotted_at = -math.inf
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                self.writer = summary_writer_class()(str(self.dir / "tb"))

    def write_config(self, text: str) -> None:
        if self.enabled:
            tmp = self.dir / "config.yaml.tmp"
            tmp.write_text(text)
            tmp.replace(self.dir / "config.yaml")

    def truncate(self, step: int) -> None:
        """Forget what a run resumed from checkpoint `step` redoes: the metrics of later steps
        and the evaluations from `step` on (an evaluation always follows that step's
        checkpoint). -1 forgets everything."""
        if not self.enabled:
            return
        for path, keep in ((self.metrics_path, step), (self.eval_path, step - 1)):
            records, torn = _read_jsonl(path)
            kept = [r for r in records if r["step"] <= keep]
            if torn or len(kept) != len(records):
                _write_jsonl(path, kept)

    def step(self, record: dict[str, Any]) -> None:
        """Append one step's metrics (flat JSON: numbers, lists of numbers, strings)."""
        if not self.enabled:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(name, value, record["step"])
                elif isinstance(value, list) and name.endswith("reward_by_position"):
                    for k, v in enumerate(value):
                        self.writer.add_scalar(f"{name}/{k}", v, record["step"])
        if time.monotonic() - self.plotted_at >= PLOT_EVERY_S:
            self.plot()

    def evaluation(
        self, label: str, step: int, summary: PositionSummary, env: str | None = None
    ) -> None:
        """Append one evaluation (of environment `env`, in a run with several)."""
        if not self.enabled:
            return
        record = {"label": label, "step": step, "env": env, **summary.to_dict()}
        with self.eval_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            tag = f"eval/{env}" if env else "eval"
            self.writer.add_scalar(f"{tag}/cod_gain", summary.cod_gain, step)
            self.writer.add_scalar(f"{tag}/last_position", summary.mean_reward[-1], step)
        self.plot()

    def evaluations(self) -> list[dict[str, Any]]:
        return _read_jsonl(self.eval_path)[0]

    def plot(self) -> None:
        """Reward by pack position: the mean of the last few training steps, and each eval;
        in a run with several environments also one plot per environment (`rewards-ENV.png`);
        and the training curves against step (`curves.png`)."""
        self.plotted_at = time.monotonic()
        records = _read_jsonl(self.metrics_path)[0]
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
            where = f"{r['env']}, " if several else ""
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
        if self.writer is not None:
            self.writer.close()
