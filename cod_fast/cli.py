"""The `cod-fast` command line: a thin typer layer over cod_fast.config and the trainer.

Heavy imports (torch, the kernel dispatcher) happen inside the commands that need them, so
`cod-fast config show` answers at once.
"""

from __future__ import annotations

import datetime
import gc
import importlib.metadata
import importlib.util
import platform
import shlex
import signal
import time
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cod_fast import __version__
from cod_fast.cli_bench import SetOption, bench_app
from cod_fast.cli_common import bad_model_input, fail
from cod_fast.cli_play import envs_app, eval_command, rollout_command
from cod_fast.config import DERIVED, Config, ConfigError
from cod_fast.config_doc import explain_config, sections
from cod_fast.config_io import dump_yaml, load_config
from cod_fast.presets import DEFAULT_PRESET, PRESETS

app = typer.Typer(
    name="cod-fast",
    help="Train 'connect the dots' (CoD) agents with fused log-prob and policy-loss kernels.",
    no_args_is_help=True,
    add_completion=False,
)
config_app = typer.Typer(help="Inspect the resolved configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(bench_app, name="bench")
app.add_typer(envs_app, name="envs")

OPTIONAL_EXTRAS = ("vllm", "flash_attn", "liger_kernel", "triton")


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"cod-fast {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_print_version, is_eager=True
        ),
    ] = False,
) -> None:
    """The options that come before a command (the app's help text is the Typer's)."""


PresetOption = Annotated[
    str | None,
    typer.Option(
        "--preset",
        help=f"Named preset ({', '.join(PRESETS)}); default: the config file's `preset:` key, "
        f"else {DEFAULT_PRESET}.",
    ),
]
ConfigFileOption = Annotated[
    Path | None,
    typer.Option("--config", help="YAML file deep-merged over the preset.", dir_okay=False),
]


def _resolve_config(
    preset: str | None,
    config_file: Path | None,
    overrides: list[str] | None,
    *,
    for_training: bool = False,
    cfg: Config | None = None,
) -> Config:
    """The config the options describe (or `cfg`, already resolved), `for_training` also
    checked against this machine before any compute (cod_fast.preflight); a ConfigError becomes
    one red line and exit code 2."""
    try:
        if cfg is None:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", FutureWarning)
                cfg = load_config(
                    preset, None if config_file is None else str(config_file), overrides or ()
                )
            _show_warnings(caught)
        if for_training:
            from cod_fast.preflight import preflight  # imports torch: only `train` pays for it

            preflight(cfg)
        return cfg
    except ConfigError as e:
        Console(stderr=True).print(
            f"error: {e}", style="red", markup=False, highlight=False, soft_wrap=True
        )
        raise typer.Exit(2) from None


def _show_warnings(caught: list[warnings.WarningMessage]) -> None:
    """Deprecations (FutureWarning) as one yellow line each on stderr, as errors are; any other
    warning as Python shows it."""
    for w in caught:
        if issubclass(w.category, FutureWarning):
            Console(stderr=True).print(
                f"warning: {w.message}",
                style="yellow",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@app.command()
def info() -> None:
    """Versions, device, kernel implementations and optional extras of this installation."""
    import torch

    import cod_fast
    from cod_fast.ops import dispatch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rows = [
        ("python", platform.python_version()),
        ("cod_fast", cod_fast.__version__),
        ("torch", torch.__version__),
        ("transformers", _version("transformers")),
        ("triton", _version("triton")),
        ("device", f"cuda: {torch.cuda.get_device_name(0)}" if cuda else "cpu (no CUDA)"),
    ]
    rows += [(f"kernel impl {name}", why) for name, why in dispatch.available_impls().items()]
    try:
        picked, why = dispatch.resolve_impl(None, device)
        rows.append(("kernel impl chosen", f"{picked} ({why})"))
    except (ValueError, RuntimeError) as e:  # a bad COD_FAST_IMPL is worth showing, not a crash
        rows.append(("kernel impl chosen", f"error: {e}"))
    rows.append(("sampler (auto)", _auto_sampler(device)))
    for module in OPTIONAL_EXTRAS:  # find_spec, not import: vllm alone takes seconds to import
        present = importlib.util.find_spec(module) is not None
        rows.append((f"extra {module}", "present" if present else "absent"))

    table = Table(title="cod-fast", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for what, value in rows:
        table.add_row(what, Text(value))  # Text: values are shown as-is, never parsed as markup
    Console().print(table)


def _auto_sampler(device: str) -> str:
    """What `rollout.sampler=auto` picks on this device for the default preset's model."""
    from cod_fast.rollout.choice import choose_sampler

    model = load_config(DEFAULT_PRESET).model
    kind, why = choose_sampler("auto", device, model.hidden_size // model.num_heads)
    return f"{kind} for the {DEFAULT_PRESET} model ({why})"


@config_app.command("show")
def config_show(
    preset: PresetOption = None,
    config_file: ConfigFileOption = None,
    overrides: SetOption = None,
    explain: Annotated[
        bool,
        typer.Option(
            "--explain",
            help="Instead of YAML, every key with its value, type, default (* where the value "
            "differs) and meaning (docs/configuration.md).",
        ),
    ] = False,
    key: Annotated[
        str | None,
        typer.Option("--key", help="With --explain: only this key or the keys under it."),
    ] = None,
) -> None:
    """Print the resolved config as YAML (a file that --config reads back), or explained."""
    if key is not None and not explain:
        fail("--key: only with --explain")
    cfg = _resolve_config(preset, config_file, overrides)
    if not explain:
        typer.echo(dump_yaml(cfg), nl=False)
        return
    text = explain_config(cfg, key or "")
    if not text and key in DERIVED:
        fail(
            f"--key: {key} is deprecated; it sets {DERIVED[key]}, explained by --key {DERIVED[key]}"
        )
    if not text:
        fail(f"--key: no config key {key} or keys under it; the sections: {', '.join(sections())}")
    typer.echo(text, nl=False)


@app.command()
def train(
    preset: PresetOption = None,
    config_file: ConfigFileOption = None,
    overrides: SetOption = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="Continue the run in runtime.run_dir from its latest checkpoint."
        ),
    ] = False,
    init_from: Annotated[
        Path | None,
        typer.Option(
            "--init-from",
            help="Start from these weights: a run directory (its latest checkpoint) or an "
            "exported model folder; same as --set train.init_from=PATH.",
        ),
    ] = None,
) -> None:
    """Train a policy: warm start (if configured), then CoD (or task-by-task) RL.

    Without arguments: the tiny-cpu preset, a tiny model on the CPU. Ctrl-C or SIGTERM finishes
    the step, saves a checkpoint and exits (code 128 + signal); `--resume` continues from it.
    """
    if init_from is not None:
        overrides = [*(overrides or []), f"train.init_from={init_from}"]
    _checked_run(_resolve_config(preset, config_file, overrides), resume, Console())


def _checked_run(cfg: Config, resume: bool, console: Console, *, last: bool = True) -> None:
    """A run as `cod-fast train` makes it: its run directory locked for this process (the main
    rank's) before anything is written there, then --resume's rules (cod_fast.run_dir) and the
    preflight checked, then the run; a refusal is one red line and exit code 2."""
    import os

    from cod_fast.checkpoint import CheckpointError
    from cod_fast.run_dir import RunDirError, check_resume, lock_run_dir, unlock_run_dir

    run_dir = Path(cfg.runtime.run_dir)
    if resume and not run_dir.is_dir():
        fail(f"--resume, but {run_dir} does not exist; drop --resume to start a run there")
    main = os.environ.get("RANK", "0") == "0"  # torchrun's; the main rank alone writes
    try:
        if main:
            lock_run_dir(run_dir)
    except RunDirError as e:
        fail(str(e))
    try:
        try:
            check_resume(cfg, resume)
        except (RunDirError, CheckpointError) as e:
            fail(str(e))
        _resolve_config(None, None, None, for_training=True, cfg=cfg)
        _train_run(cfg, resume, console, last=last)
    finally:
        if main:
            unlock_run_dir(run_dir)


def _train_run(cfg: Config, resume: bool, console: Console, *, last: bool = True) -> None:
    """One training run with progress and its summary; bad input is one red line (exit 2), a
    signal ends it as a shell reports it (128 + signal). However it ends, the trainer is closed
    (a vLLM engine shut down), so that a next run can start in this process; the process group
    is left after the command's `last` run (or a stop), once: the runs before share it."""
    from cod_fast.trainer import Trainer

    trainer = None
    try:
        if cfg.runtime.rollout_ranks:  # rollout workers and trainers (docs/async.md)
            from cod_fast.async_rl import RolloutWorker, start_roles

            role = start_roles(cfg)
            if isinstance(role, RolloutWorker):
                _rollout_worker_run(role)
                return
            trainer = role
        else:
            trainer = Trainer(cfg)
        if trainer.ctx.is_main:
            console.print(Text(dump_yaml(cfg)), highlight=False)
            console.print(
                f"run dir {cfg.runtime.run_dir}; device {trainer.device}; "
                f"{trainer.ctx.world_size} process(es); sampler {trainer.samplers.kind} "
                f"({trainer.samplers.reason})"
            )
        summary = _run_with_progress(trainer, resume, console)
    except _run_errors() as e:
        Console(stderr=True).print(
            f"error: {e}", style="red", markup=False, highlight=False, soft_wrap=True
        )
        if _lost_workers(e) and trainer is not None:
            _exit_without_groups(trainer)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        Console(stderr=True).print(
            "interrupted (no checkpoint of the unfinished step)", style="red"
        )
        stop = trainer.stop_signal if trainer is not None else None
        raise typer.Exit(128 + (stop or signal.SIGINT)) from None
    finally:
        if trainer is not None:
            trainer.close()
    if trainer.ctx.is_main:
        _print_summary(summary, console, cfg)
    if last or summary["signal"] is not None:
        from cod_fast.distributed import shutdown

        shutdown(trainer.ctx)
    if summary["signal"] is not None:  # stopped on request: 128 + signal, as a shell reports it
        raise typer.Exit(128 + summary["signal"])


def _lost_workers(error: BaseException) -> bool:
    from cod_fast.async_rl.channel import RolloutWorkerError

    return isinstance(error, RolloutWorkerError)


def _exit_without_groups(trainer) -> None:
    """End a trainer whose rollout workers hung or died, once its checkpoint and logs are
    written: leaving the process groups would wait for the lost peers (a receive they never
    finish), so the process exits without the interpreter's exit handlers."""
    import os
    import sys

    trainer.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


def _rollout_worker_run(worker) -> None:
    """A rollout rank's whole run: it samples until the trainer's last batch; a failure is one
    line (the trainer reports it too, and stops with a checkpoint)."""
    from cod_fast.async_rl import RolloutWorkerError
    from cod_fast.distributed import shutdown

    try:
        worker.run()
    except (RolloutWorkerError, RuntimeError) as e:
        fail(f"rollout worker {worker.index}: {str(e).splitlines()[0] if str(e) else e!r}")
    finally:
        worker.close()
    shutdown(worker.ctx)


@app.command()
def distill(
    preset: PresetOption = None,
    config_file: ConfigFileOption = None,
    overrides: SetOption = None,
    teacher_preset: Annotated[
        str, typer.Option(help="Preset of the teacher runs (one per environment).")
    ] = "tiny-cpu",
    teacher_overrides: Annotated[
        list[str] | None,
        typer.Option("--teacher-set", help="Override a field of every teacher run (repeatable)."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the student's run from its checkpoint.")
    ] = False,
) -> None:
    """Distil single-domain teachers into one student on mixed packs (default preset:
    tiny-cpu-opd): first a teacher run for every environment whose `algo.teachers` folder holds
    no model yet (the teacher preset on that environment alone, with the student's tokenizer;
    exported to that folder), then the student's run. Rerun after a stop: finished teachers are
    kept, an unfinished teacher run resumes. Under torchrun every rank takes part in every run;
    the main rank alone writes the shared tokenizer and the exports, the others wait for them."""
    from cod_fast.checkpoint import latest_checkpoint
    from cod_fast.distill import teacher_jobs
    from cod_fast.distributed import barrier, init_distributed
    from cod_fast.envs import make_envs
    from cod_fast.export import export_model
    from cod_fast.rollout.driver import DriverSettings
    from cod_fast.warmstart import run_tokenizer

    student = _resolve_config(preset or "tiny-cpu-opd", config_file, overrides)
    if not student.algo.teachers:
        fail("algo.teachers: the student config names no teachers (algo.loss.policy=opd)")
    console = Console()
    # The runs' process group (under torchrun), made here so that the ranks can wait for the
    # main rank's files between runs; every run joins it.
    runtime = student.runtime
    ctx = init_distributed(runtime.device, runtime.hsdp_replicate, timeout_s=runtime.dist_timeout_s)
    try:
        envs = make_envs(student.rollout.environments)  # imports a path, reads a cases file
        run_tokenizer(student, envs, DriverSettings.from_config(student), is_main=ctx.is_main)
    except (ValueError, OSError) as e:  # a path that does not import, a link in the run folder
        fail(str(e))
    barrier(ctx)
    try:
        jobs = teacher_jobs(student, teacher_preset, teacher_overrides or ())
    except ConfigError as e:
        fail(f"{e} (a teacher run's config)")
    for job in jobs:
        console.print(f"teacher for {job.env}: training {job.config.runtime.run_dir}")
        done = latest_checkpoint(Path(job.config.runtime.run_dir))
        total = job.config.train.warm_start_steps + job.config.train.steps
        if done is None or done.step < total:
            _checked_run(job.config, resume=done is not None, console=console, last=False)
            # The finished run's model, optimizer and FSDP state hold reference cycles: free
            # them here, at the same point on every rank, not at a random moment of the next.
            gc.collect()
        if ctx.is_main:
            try:
                export_model(job.config.runtime.run_dir, job.folder)
            except bad_model_input() as e:  # a damaged checkpoint, a folder of other files
                fail(str(e))
        barrier(ctx)
        console.print(f"teacher for {job.env}: exported to {job.folder}")
    _checked_run(student, resume, console)


def _run_errors() -> tuple[type[BaseException], ...]:
    from cod_fast.async_rl.channel import RolloutWorkerError
    from cod_fast.checkpoint import CheckpointError
    from cod_fast.run_dir import RunDirError
    from cod_fast.train_step import NonFiniteError

    # What bad input and a bad machine raise (each message names the cause and the fix, an
    # OSError its path and errno: a full disk, a read-only folder); the rest are bugs and keep
    # their traceback. ValueError covers ConfigError and SequenceTooLongError.
    return (ValueError, RunDirError, NonFiniteError, CheckpointError, OSError, RolloutWorkerError)


ETA_WINDOW_S = 1800.0
"""The ETA is the pace of the phase's steps over this window (rich's default, 30 s, is shorter
than one step of a real run, which would leave no ETA at all)."""


def _run_with_progress(trainer, resume: bool, console: Console) -> dict:
    """The run, shown as it goes (on the main rank; the others run silently), by a
    `_TrainingProgress`."""
    if not trainer.ctx.is_main:
        return trainer.run(resume)
    with _TrainingProgress(trainer, console) as shown:
        return trainer.run(resume, shown.on_step, shown.on_eval)


def _clock(seconds: float | None) -> str:
    """`seconds` as h:mm:ss, or `?` where there is no estimate yet (a phase's first step)."""
    return "?" if seconds is None else str(datetime.timedelta(seconds=int(seconds)))


def _num(value: float | None, spec: str) -> str:
    """`value` formatted, or `n/a` for a metric a step did not have (null in metrics.jsonl)."""
    return "n/a" if value is None else format(value, spec)


def _step_status(record: dict) -> str:
    """A step's numbers for a person: a warm-start step's reward is the scripted
    demonstrations' (`demo reward`), an RL step's the policy's, with its CoD gain."""
    tokens_per_s = record["tokens"] / record["step_s"]
    if record["phase"] == "warm_start":
        reward = f"demo reward {_num(record['reward_mean'], '.3f')}"
    else:
        reward = (
            f"reward {_num(record['reward_mean'], '.3f')}  "
            f"CoD gain {_num(record['cod_gain'], '+.3f')}"
        )
    return f"{reward}  loss {_num(record['loss'], '.4f')}  {tokens_per_s:,.0f} tok/s"


class _TrainingProgress:
    """What `cod-fast train` shows while it runs. On a terminal: a bar per phase ("warm-start
    step i/N", "RL step j/M") with elapsed time, ETA and the last step's numbers, and a bar of
    its own for each evaluation. Elsewhere (a batch job's log file, a pipe, CI), where a bar
    would print nothing until the end: plain lines, one every `runtime.log_every` steps and one
    per evaluation. Warm-start steps train on scripted demonstrations, so their reward is
    labelled `demo reward`, never the model's."""

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
        # Disabled, the bars still keep time: the plain lines take their ETA from them.
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
        status = _step_status(record)
        task = self.phases[record["phase"]]
        self.progress.start_task(task)
        if not warm and self.warm:  # a resumed run may never see a warm-start step
            self.progress.update(self.phases["warm_start"], completed=self.warm)
        self.progress.update(task, completed=done, status=status)
        if step == self.warm:  # RL begins with the next step (after an evaluation)
            self.progress.start_task(self.phases["rl"])
        if self.plain and (step % self.every == 0 or step == self.total):
            elapsed = _clock(time.monotonic() - self.started)
            eta = _clock(self.progress.tasks[task].time_remaining)
            phase_eta = f"warm start ETA {eta}" if warm else f"ETA {eta}"
            self._line(f"{label}  {status}  elapsed {elapsed}  {phase_eta}")

    def on_eval(self, progress) -> None:
        """An evaluation's part starting (a bar, on a terminal) or finished (a line)."""
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

    def _line(self, text: str) -> None:
        self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)


def _print_summary(summary: dict, console: Console, cfg: Config | None = None) -> None:
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
    state = "stopped early (resume with --resume)" if summary["stopped"] else "finished"
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


RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.jsonl", "curves.png", "rewards.png", "tb")
"""What the summary lists of a run directory (cod_fast.run_log), where present."""


def _where_and_next(summary: dict, cfg: Config | None = None) -> str:
    """Where the run's files are (cod_fast.run_log) and what to run next: export the latest
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
    (cod_fast.matrix.received_problem)."""
    from cod_fast.envs.registry import is_path

    if cfg is None:
        return ""
    env, judge = cfg.rollout.environments[0].name, cfg.rollout.judge
    flags = f" --env {shlex.quote(env)}" if env is not None and is_path(env) else ""
    return flags + (f" --judge {shlex.quote(judge)}" if judge != "rule" else "")


@app.command("export")
def export_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `cod-fast train`.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for the Hugging Face model.")],
    step: Annotated[int | None, typer.Option(help="Checkpoint step (default: the latest).")] = None,
    dtype: Annotated[
        str,
        typer.Option(
            help="Weights dtype: float32, bfloat16, float16, or auto (the dtype the run "
            "computed in; a mixed-precision run's float32 masters are rounded to it)."
        ),
    ] = "auto",
) -> None:
    """Write a run's checkpoint as a Hugging Face model folder (from_pretrained loads it).

    The folder is replaced as a whole: --out must be new, empty, or an earlier export."""
    from typing import get_args

    from cod_fast.checkpoint import CheckpointError
    from cod_fast.export import ExportDtype, export_model

    choices = get_args(ExportDtype)
    if dtype not in choices:
        fail(f"--dtype: got {dtype!r}; expected one of {', '.join(choices)}")
    try:
        ckpt = export_model(run_dir, out, step, dtype)  # type: ignore[arg-type]
    # ValueError: a bad config.yaml (ConfigError), weights that do not fit the run's model.
    except (OSError, ValueError, CheckpointError) as e:
        fail(str(e))
    typer.echo(f"wrote step {ckpt.step} of {run_dir} to {out}")


# Playing models (cod_fast.cli_play), after the training commands in `--help`.
app.command("eval")(eval_command)
app.command("rollout")(rollout_command)


if __name__ == "__main__":  # python -m cod_fast.cli (what torchrun -m runs)
    app()
