"""What `cod-fast train` shows of a run: its progress as it goes (bars on a terminal, plain lines
in a log) and, at its end, its evaluations, where its files are and the commands that use them."""

from __future__ import annotations

import datetime
import shlex
import time
from collections import deque
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cod_fast.config import Config

ETA_WINDOW_S = 1800.0
"""The ETA is the pace of the phase's steps over this window (rich's default, 30 s, is shorter
than one step of a real run, which would leave no ETA at all)."""
PACE_STEPS = 100
"""A phase's pace, for the run's ETA, is the mean `step_s` of its last this many steps: recent
enough to follow responses that grow longer in RL, long enough to smooth one slow step."""
PHASES = {"warm_start": "warm-start", "rl": "RL"}
"""The phases of a run (the `phase` of its step records), by the name a person reads."""
HEALTH = (
    ("kl", "KL", ".2g", ""),
    ("entropy", "ent", ".2f", ""),
    ("grad_norm", "gnorm", ".3g", ""),
    ("clip_frac", "clip", ".3f", ""),
    ("response_tokens_mean", "resp", ".0f", " tok"),
)
"""The step record's health numbers (cod_fast.train.record.step_record: the loss metrics of
cod_fast.ops.loss_terms, the gradient norm, the episodes' mean response length) a step's
status shows, as (key, label, format, unit). KL and the gradient norm in significant digits:
they span orders of magnitude over a run, and a fixed point would show an early KL as 0."""


def run_with_progress(trainer, resume: bool, console: Console) -> dict:
    """The run, shown as it goes (on the main rank; the others run silently), by a
    `_TrainingProgress` that also hears of the checkpoints written and taken back."""
    if not trainer.ctx.is_main:
        return trainer.run(resume)
    with _TrainingProgress(trainer, console) as shown:
        trainer.checkpointer.on_saved = shown.on_saved
        trainer.checkpointer.on_restored = shown.on_restored
        return trainer.run(resume, shown.on_step, shown.on_eval)


def _clock(seconds: float | None) -> str:
    """`seconds` as h:mm:ss, or `?` where there is no estimate yet (a phase's first step)."""
    return "?" if seconds is None else str(datetime.timedelta(seconds=int(seconds)))


def _num(value: float | None, spec: str) -> str:
    """`value` formatted, or `n/a` for a metric a step did not have (null in metrics.jsonl)."""
    return "n/a" if value is None else format(value, spec)


def _now() -> str:
    """The local time a printed line starts with, to the second."""
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")


def _step_status(record: dict) -> str:
    """A step's numbers for a person: a warm-start step's reward is the scripted
    demonstrations' (`demo reward`), an RL step's the policy's, with its CoD gain; then the
    loss, the health numbers (`_health`) and the tokens per second."""
    tokens_per_s = record["tokens"] / record["step_s"]
    warm = record["phase"] == "warm_start"
    if warm:
        reward = f"demo reward {_num(record['reward_mean'], '.3f')}"
    else:
        reward = (
            f"reward {_num(record['reward_mean'], '.3f')}  "
            f"CoD gain {_num(record['cod_gain'], '+.3f')}"
        )
    loss = f"loss {_num(record['loss'], '.4f')}"
    return "  ".join([reward, loss, *_health(record, warm), f"{tokens_per_s:,.0f} tok/s"])


def _health(record: dict, warm: bool) -> list[str]:
    """The `HEALTH` numbers of a step's record. One the record has no key for (no KL term; no
    loss metrics in a step that trained nothing) is left out; one that is null (a NaN, as in a
    skipped step) reads `n/a`, as reward and loss do. A warm-start step shows no clip fraction:
    its loss keeps every ratio (cod_fast.train.warm_start), so the fraction is 0 by
    construction."""
    shown = []
    for key, label, spec, unit in HEALTH:
        if key not in record or (warm and key == "clip_frac"):
            continue
        value = record[key]
        shown.append(f"{label} {_num(value, spec)}{'' if value is None else unit}")
    return shown


def run_eta(left: dict[str, int], pace: dict[str, float | None]) -> tuple[float, list[str]]:
    """The seconds a run has left, `left[phase]` steps of each phase at its `pace[phase]`
    (seconds per step), and the phases with steps left whose pace is unknown (None: none of
    their steps has run yet), which those seconds leave out: with any, they are a lower bound."""
    unknown = [phase for phase, steps in left.items() if steps and pace.get(phase) is None]
    known = sum(
        steps * pace[phase] for phase, steps in left.items() if steps and phase not in unknown
    )
    return known, unknown


def _run_eta_text(seconds: float, unknown: list[str]) -> str:
    """`run_eta`'s answer for a person: `run ETA 0:12:03`; `run ETA >0:12:03 (RL pace
    unknown)` while a phase with steps left has no pace yet; `run ETA ? (RL pace unknown)` when
    nothing of what is left has one."""
    if not unknown:
        return f"run ETA {_clock(seconds)}"
    bound = f">{_clock(seconds)}" if seconds > 0 else "?"
    return f"run ETA {bound} ({', '.join(PHASES[p] for p in unknown)} pace unknown)"


def _pace(seconds: deque[float]) -> float | None:
    """Mean seconds per step of the steps in `seconds`; None for none."""
    return sum(seconds) / len(seconds) if seconds else None


class _TrainingProgress:
    """What `cod-fast train` shows while it runs. On a terminal: a bar per phase ("warm-start
    step i/N", "RL step j/M") with elapsed time, the phase's ETA and the last step's numbers,
    and a bar of its own for each evaluation. Elsewhere (a batch job's log file, a pipe, CI),
    where a bar would print nothing until the end: plain lines, one every `runtime.log_every`
    steps, one as each evaluation part starts and one as it ends. Either way a line for each
    checkpoint written and for the checkpoint a resumed run took back; every printed line starts
    with the local time (`2026-12-07 05:01:33`). Warm-start steps train on scripted
    demonstrations, so their reward is labelled `demo reward`, never the model's.

    A step's numbers (`_step_status`) come with the whole run's ETA (`run_eta`): the warm-start
    steps left at the warm start's pace plus the RL steps left at RL's, each pace the mean
    measured `step_s` of the phase's last `PACE_STEPS` steps in this process. Before the first
    RL step RL's pace is unknown, and the ETA says so: `run ETA >0:12:03 (RL pace unknown)` is
    at least the warm start's 12 minutes, `run ETA ? (RL pace unknown)` once no warm-start step
    is left. The ETA counts steps only: evaluations and checkpoints come on top."""

    def __init__(self, trainer, console: Console):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = console
        self.plain = not console.is_terminal
        self.every = trainer.cfg.runtime.log_every
        self.warm, self.total = trainer.warm_steps, trainer.total_steps
        self.started = time.monotonic()
        columns = (
            TextColumn("{task.description}"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
        )
        # Disabled, the bars still keep time: the plain lines take their phase's ETA from them.
        self.progress = Progress(
            *columns, console=console, disable=self.plain, speed_estimate_period=ETA_WINDOW_S
        )
        self.phases = {}
        if self.warm:
            self.phases["warm_start"] = self.progress.add_task(
                "warm-start step", total=self.warm, status=""
            )
        self.phases["rl"] = self.progress.add_task(
            "RL step", total=self.total - self.warm, status="", start=not self.warm
        )
        self.step_seconds = {phase: deque(maxlen=PACE_STEPS) for phase in PHASES}
        self.warm_numbers = ""
        """The last warm-start step's numbers, which its bar keeps once RL runs (without the
        run's ETA, which RL's bar then carries)."""
        self.evaluation = None
        self.eval_started = self.started

    def __enter__(self) -> _TrainingProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def on_step(self, record: dict) -> None:
        step, warm = record["step"], record["phase"] == "warm_start"
        done = step if warm else step - self.warm
        total = self.warm if warm else self.total - self.warm
        label = f"{'warm-start' if warm else 'RL'} step {done}/{total}"
        self.step_seconds[record["phase"]].append(record["step_s"])
        numbers, run_eta = _step_status(record), self._run_eta(step)
        self.warm_numbers = numbers if warm else self.warm_numbers
        task = self.phases[record["phase"]]
        self.progress.start_task(task)
        if not warm and self.warm:  # a resumed run may never see a warm-start step
            self.progress.update(
                self.phases["warm_start"], completed=self.warm, status=self.warm_numbers
            )
        self.progress.update(task, completed=done, status=f"{numbers}  {run_eta}")
        if step == self.warm:  # RL begins with the next step (after an evaluation)
            self.progress.start_task(self.phases["rl"])
        if self.plain and (step % self.every == 0 or step == self.total):
            elapsed = _clock(time.monotonic() - self.started)
            eta = _clock(self.progress.tasks[task].time_remaining)
            phase_eta = f"warm start ETA {eta}" if warm else f"RL ETA {eta}"
            self._line(f"{label}  {numbers}  elapsed {elapsed}  {phase_eta}  {run_eta}")

    def _run_eta(self, step: int) -> str:
        """The whole run's ETA after step `step` (the class docstring)."""
        left = {"warm_start": max(self.warm - step, 0), "rl": self.total - max(step, self.warm)}
        pace = {phase: _pace(seconds) for phase, seconds in self.step_seconds.items()}
        return _run_eta_text(*run_eta(left, pace))

    def on_eval(self, progress) -> None:
        """An evaluation's part starting (a bar on a terminal, a line elsewhere) or finished
        (a line)."""
        what = f"evaluating {progress.label}"
        if progress.summary is None:
            self.eval_started = time.monotonic()
            if self.evaluation is None:
                self.evaluation = self.progress.add_task(what, total=progress.parts, status="")
            self.progress.update(
                self.evaluation,
                description=what,
                status=f"{progress.env}: {progress.packs} packs",
            )
            if self.plain:
                self._line(
                    f"eval {progress.label} (step {progress.step}) {progress.env}: started on "
                    f"{progress.packs} packs (part {progress.done + 1}/{progress.parts})"
                )
            return
        summary = progress.summary
        rewards = " ".join(f"{x:.3f}" for x in summary.mean_reward)
        self._line(
            f"eval {progress.label} (step {progress.step}) {progress.env}: reward by position "
            f"[{rewards}]  CoD gain {summary.cod_gain:+.3f}  ({summary.num_packs} packs, "
            f"{time.monotonic() - self.eval_started:.1f} s)"
        )
        self.progress.update(self.evaluation, completed=progress.done)
        if progress.done == progress.parts:
            self.progress.remove_task(self.evaluation)
            self.evaluation = None

    def on_saved(self, step: int, folder: Path, seconds: float) -> None:
        """A checkpoint written (cod_fast.train.checkpointer.Checkpointer.on_saved)."""
        self._line(f"checkpoint {_step_name(step, self.warm)} saved in {seconds:.1f} s ({folder})")

    def on_restored(self, step: int, folder: Path) -> None:
        """The checkpoint a resumed run took back (Checkpointer.on_restored)."""
        self._line(f"resumed from checkpoint step {step} ({folder})")

    def _line(self, text: str) -> None:
        self.progress.console.print(
            f"{_now()}  {text}", markup=False, highlight=False, soft_wrap=True
        )


def print_summary(summary: dict, console: Console, cfg: Config | None = None) -> None:
    """Every evaluation of the run (held-out packs), how the run ended, where its files are
    and the commands that use them."""
    evals = summary["evals"]
    if evals:
        width = max(len(e["mean_reward"]) for e in evals)
        several = len({e.get("env") for e in evals}) > 1  # a mixed-domain run: one row per env
        table = Table(title="held-out eval packs: mean reward by pack position")
        names = ("when", *(["env"] if several else []), "step")
        for column in (*names, *(f"pos {k}" for k in range(width)), "CoD gain"):
            table.add_column(column, justify="left" if column in ("when", "env") else "right")
        for e in evals:
            table.add_row(
                e["label"],
                *([e["env"]] if several else []),
                str(e["step"]),
                *(f"{x:.3f}" for x in e["mean_reward"]),
                f"{e['cod_gain']:+.3f}",
            )
        console.print(table)
    run = shlex.quote(str(summary["run_dir"]))
    state = f"stopped early (cod-fast train --resume {run} continues it)"
    state = state if summary["stopped"] else "finished"
    at = _step_name(summary["steps"], summary["warm_steps"])
    console.print(f"{state} at {at} in {summary['seconds']:.0f} s")
    console.print(_where_and_next(summary, cfg), markup=False, highlight=False, soft_wrap=True)


def _step_name(step: int, warm: int) -> str:
    """A step by its combined index (checkpoints and metrics.jsonl count warm-start and RL
    steps together) and by its phase: `step 2050 (warm start 2000 + RL 50)`."""
    if not warm:
        return f"step {step}"
    if step <= warm:
        return f"step {step} (warm start)"
    return f"step {step} (warm start {warm} + RL {step - warm})"


RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "eval.jsonl",
    "curves.png",
    "rewards.png",
    "tb",
    "wandb",
    "trackers.json",
)
"""What the summary lists of a run directory (cod_fast.run.log), where present."""


def _where_and_next(summary: dict, cfg: Config | None = None) -> str:
    """Where the run's files are (cod_fast.run.log) and what to run next: export the latest
    checkpoint (the run always saves one as it ends), then evaluate the exported model, naming
    what an exported folder may not choose itself (`_own_choices`)."""
    run_dir = Path(summary["run_dir"])
    model = run_dir.with_name(f"{run_dir.name}-model")
    run, out = shlex.quote(str(run_dir)), shlex.quote(str(model))
    files = [name for name in RUN_FILES if (run_dir / name).exists()]
    return "\n".join(
        (
            f"run directory {run_dir}: {', '.join(files)}",
            f"checkpoints   {run_dir / 'checkpoints'}, the latest at "
            f"{_step_name(summary['steps'], summary['warm_steps'])}",
            "next:",
            f"  cod-fast export {run} --out {out}    # a Hugging Face model folder",
            f"  cod-fast eval --model {out}{_own_choices(cfg)}    # its held-out evaluation, "
            "as the run's",
        )
    )


def _own_choices(cfg: Config | None) -> str:
    """The flags that `cod-fast eval` of this run's exported model needs to play it as the run
    did: an environment path and a judge, which a model folder names but may not choose
    (cod_fast.eval.matrix.received_problem)."""
    from cod_fast.envs.registry import is_path

    if cfg is None:
        return ""
    env, judge = cfg.rollout.environments[0].name, cfg.rollout.judge
    flags = f" --env {shlex.quote(env)}" if env is not None and is_path(env) else ""
    return flags + (f" --judge {shlex.quote(judge)}" if judge != "rule" else "")
