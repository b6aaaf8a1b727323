"""`cod-fast train` and `cod-fast distill`: a run's directory locked and checked, the run shown
as it goes (cod_fast.cli.train_display), and how it ends: a refusal in one line (exit code 2),
a stop on a signal as a shell reports it (128 + signal). cod_fast.cli.app registers the
commands."""

from __future__ import annotations

import gc
import signal
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from cod_fast.cli.common import bad_model_input, fail, refuse, report
from cod_fast.cli.options import ConfigFileOption, PresetOption, SetOption, resolve_config
from cod_fast.cli.resume import resumed_config
from cod_fast.cli.train_display import print_summary, run_with_progress
from cod_fast.config import Config, ConfigError
from cod_fast.config.io import dump_yaml


def train(
    run: Annotated[
        Path | None,
        typer.Argument(
            help="With --resume: the run directory to continue (default: runtime.run_dir).",
            show_default=False,
        ),
    ] = None,
    preset: PresetOption = None,
    config_file: ConfigFileOption = None,
    overrides: SetOption = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue a run from its latest checkpoint, with its own config (RUN/config.yaml"
            "; --config and --set change it, checked against the checkpoint).",
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

    Without arguments: the tiny-cpu preset, a tiny model on the CPU; a config that names its own
    model and no preset starts from the GPU preset sized nearest to it. Ctrl-C or SIGTERM
    finishes the step, saves a checkpoint and exits (code 128 + signal); a third signal exits at
    once, saying how many steps are lost. `--resume RUN` continues the run in RUN.
    """
    if init_from is not None:
        overrides = [*(overrides or []), f"train.init_from={init_from}"]
    if run is not None and not resume:
        fail(
            f"a run directory ({run}) without --resume: pass --resume to continue it, or "
            f"--set runtime.run_dir={run} to start a run there"
        )
    if resume:
        cfg = resumed_config(run, preset, config_file, overrides or [])
    else:
        cfg = resolve_config(preset, config_file, overrides)
    _checked_run(cfg, resume, Console())


def _checked_run(cfg: Config, resume: bool, console: Console, *, last: bool = True) -> None:
    """A run as `cod-fast train` makes it: its run directory locked for this process (the main
    rank's) before anything is written there, then --resume's rules (cod_fast.run.directory) and
    the preflight checked, then the run; a refusal is one red line and exit code 2."""
    import os

    from cod_fast.run.checkpoint import CheckpointError
    from cod_fast.run.directory import RunDirError, check_resume, lock_run_dir, unlock_run_dir

    run_dir = Path(cfg.runtime.run_dir)
    if resume and not run_dir.is_dir():
        fail(f"--resume, but {run_dir} does not exist; drop --resume to start a run there")
    main = os.environ.get("RANK", "0") == "0"  # torchrun's; the main rank alone writes
    try:
        if main:
            lock_run_dir(run_dir)
    except RunDirError as e:
        refuse(e)
    try:
        try:
            check_resume(cfg, resume)
        except (RunDirError, CheckpointError) as e:
            refuse(e)
        resolve_config(None, None, None, for_training=True, cfg=cfg)
        _train_run(cfg, resume, console, last=last)
    finally:
        if main:
            unlock_run_dir(run_dir)


def _train_run(cfg: Config, resume: bool, console: Console, *, last: bool = True) -> None:
    """One training run with progress and its summary; bad input is one red line (exit 2), a
    signal ends it as a shell reports it (128 + signal). However it ends, the trainer is closed
    (a vLLM engine shut down), so that a next run can start in this process; the process group
    is left after the command's `last` run (or a stop), once: the runs before share it."""
    from cod_fast.train.trainer import Trainer

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
            ctx, budget = trainer.ctx, cfg.train.token_budget
            split = (
                f" in sequence-parallel groups of {ctx.sequence_parallel} (micro-batches up to "
                f"{budget * ctx.sequence_parallel:,} tokens, {budget:,} a rank)"
                if ctx.sequence_parallel > 1
                else ""
            )
            console.print(
                f"run dir {cfg.runtime.run_dir}; device {trainer.device}; "
                f"{ctx.world_size} process(es){split}; sampler {trainer.samplers.kind} "
                f"({trainer.samplers.reason})"
            )
        if trainer.ctx.is_main:
            trainer.on_signal = lambda count: _say_stopping(trainer, count)
        summary = run_with_progress(trainer, resume, console)
    except _run_errors() as e:
        report(e)
        if _lost_workers(e) and trainer is not None:
            _exit_without_groups(trainer)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        if trainer is not None and trainer.ctx.is_main:
            _red(f"stopped at once, without a checkpoint: {_unsaved(trainer)}")
        stop = trainer.stop_signal if trainer is not None else None
        raise typer.Exit(128 + (stop or signal.SIGINT)) from None
    finally:
        if trainer is not None:
            trainer.close()
    if trainer.ctx.is_main:
        print_summary(summary, console, cfg)
    if last or summary["signal"] is not None:
        from cod_fast.distributed.context import shutdown

        shutdown(trainer.ctx)
    if summary["signal"] is not None:  # stopped on request: 128 + signal, as a shell reports it
        raise typer.Exit(128 + summary["signal"])


def _unsaved(trainer) -> str:
    """What a stop at once loses: the steps finished since the run's latest checkpoint, and
    the one in progress."""
    from cod_fast.run.checkpoint import latest_checkpoint

    saved = latest_checkpoint(trainer.run_dir)
    at = 0 if saved is None else saved.step
    since = f"the checkpoint of step {at}" if saved is not None else "the start (no checkpoint)"
    lost = f"the {trainer.step - at} step(s) finished since {since} and the one in progress"
    resume = f"; --resume {trainer.run_dir} continues from step {at}" if saved is not None else ""
    return f"{lost} are lost{resume}"


def _say_stopping(trainer, count: int) -> None:
    """What a stop signal does, said as it arrives (a signal handler: one short write)."""
    if count == 1:
        text = (
            "stopping: the step in progress finishes, then a checkpoint is written and the run "
            "ends (--resume continues it); to exit at once, press Ctrl-C twice more"
        )
    else:
        text = (
            "still finishing the step in progress to checkpoint it; one more Ctrl-C exits at "
            f"once and loses it: {_unsaved(trainer)}"
        )
    _red(text)


def _red(text: str) -> None:
    Console(stderr=True).print(text, style="red", markup=False, highlight=False, soft_wrap=True)


def _lost_workers(error: BaseException) -> bool:
    from cod_fast.distributed.channel import RolloutWorkerError

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
    from cod_fast.distributed.context import shutdown

    try:
        worker.run()
    except (RolloutWorkerError, RuntimeError) as e:
        refuse(e, f"rollout worker {worker.index}: {str(e).splitlines()[0] if str(e) else e!r}")
    finally:
        worker.close()
    shutdown(worker.ctx)


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
    from cod_fast.distributed.context import barrier, init_distributed
    from cod_fast.envs import make_envs
    from cod_fast.rollout.driver import DriverSettings
    from cod_fast.run.checkpoint import latest_checkpoint
    from cod_fast.run.export import export_model
    from cod_fast.run.vocab import run_tokenizer
    from cod_fast.train.distill import teacher_jobs

    student = resolve_config(preset or "tiny-cpu-opd", config_file, overrides)
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
        refuse(e)
    barrier(ctx)
    try:
        jobs = teacher_jobs(student, teacher_preset, teacher_overrides or ())
    except ConfigError as e:
        refuse(e, f"{e} (a teacher run's config)")
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
                refuse(e)
        barrier(ctx)
        console.print(f"teacher for {job.env}: exported to {job.folder}")
    _checked_run(student, resume, console)


def _run_errors() -> tuple[type[BaseException], ...]:
    from cod_fast.distributed.channel import RolloutWorkerError
    from cod_fast.run.checkpoint import CheckpointError
    from cod_fast.run.directory import RunDirError
    from cod_fast.train.step import NonFiniteError

    # What bad input and a bad machine raise (each message names the cause and the fix, an
    # OSError its path and errno: a full disk, a read-only folder); the rest are bugs and keep
    # their traceback. ValueError covers ConfigError and SequenceTooLongError.
    return (ValueError, RunDirError, NonFiniteError, CheckpointError, OSError, RolloutWorkerError)
