"""The `cod-fast` command line: a thin typer layer over cod_fast.config and the trainer.

Heavy imports (torch, the kernel dispatcher) happen inside the commands that need them, so
`cod-fast config show` answers at once.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import signal
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cod_fast.cli_bench import SetOption, bench_app
from cod_fast.config import DEFAULT_PRESET, PRESETS, Config, ConfigError
from cod_fast.config_io import dump_yaml, load_config

app = typer.Typer(
    name="cod-fast",
    help="Train 'connect the dots' (CoD) agents with fused log-prob and policy-loss kernels.",
    no_args_is_help=True,
    add_completion=False,
)
config_app = typer.Typer(help="Inspect the resolved configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(bench_app, name="bench")
envs_app = typer.Typer(help="List, play and solve the CoD environments.", no_args_is_help=True)
app.add_typer(envs_app, name="envs")

OPTIONAL_EXTRAS = ("vllm", "flash_attn", "liger_kernel", "triton")

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
            cfg = load_config(
                preset, None if config_file is None else str(config_file), overrides or ()
            )
        if for_training:
            from cod_fast.preflight import preflight  # imports torch: only `train` pays for it

            preflight(cfg)
        return cfg
    except ConfigError as e:
        Console(stderr=True).print(
            f"error: {e}", style="red", markup=False, highlight=False, soft_wrap=True
        )
        raise typer.Exit(2) from None


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
    preset: PresetOption = None, config_file: ConfigFileOption = None, overrides: SetOption = None
) -> None:
    """Print the resolved config as YAML (a file that --config reads back)."""
    typer.echo(dump_yaml(_resolve_config(preset, config_file, overrides)), nl=False)


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
        _fail(f"--resume, but {run_dir} does not exist; drop --resume to start a run there")
    main = os.environ.get("RANK", "0") == "0"  # torchrun's; the main rank alone writes
    try:
        if main:
            lock_run_dir(run_dir)
    except RunDirError as e:
        _fail(str(e))
    try:
        try:
            check_resume(cfg, resume)
        except (RunDirError, CheckpointError) as e:
            _fail(str(e))
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
        _print_summary(summary, console)
    if last or summary["signal"] is not None:
        from cod_fast.distributed import shutdown

        shutdown(trainer.ctx)
    if summary["signal"] is not None:  # stopped on request: 128 + signal, as a shell reports it
        raise typer.Exit(128 + summary["signal"])


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
    from cod_fast.envs import make_env
    from cod_fast.export import export_model
    from cod_fast.rollout.driver import DriverSettings
    from cod_fast.warmstart import run_tokenizer

    student = _resolve_config(preset or "tiny-cpu-opd", config_file, overrides)
    if not student.algo.teachers:
        _fail("algo.teachers: the student config names no teachers (algo.loss.policy=opd)")
    console = Console()
    # The runs' process group (under torchrun), made here so that the ranks can wait for the
    # main rank's files between runs; every run joins it.
    runtime = student.runtime
    ctx = init_distributed(runtime.device, runtime.hsdp_replicate, timeout_s=runtime.dist_timeout_s)
    envs = [make_env(e.name, e.setting, e.size) for e in student.rollout.environments]  # type: ignore[arg-type]
    run_tokenizer(student, envs, DriverSettings.from_config(student), is_main=ctx.is_main)
    barrier(ctx)
    try:
        jobs = teacher_jobs(student, teacher_preset, teacher_overrides or ())
    except ConfigError as e:
        _fail(f"{e} (a teacher run's config)")
    for job in jobs:
        console.print(f"teacher for {job.env}: training {job.config.runtime.run_dir}")
        done = latest_checkpoint(Path(job.config.runtime.run_dir))
        total = job.config.train.warm_start_steps + job.config.train.steps
        if done is None or done.step < total:
            _checked_run(job.config, resume=done is not None, console=console, last=False)
        if ctx.is_main:
            try:
                export_model(job.config.runtime.run_dir, job.folder)
            except _bad_model_input() as e:  # a damaged checkpoint, a folder of other files
                _fail(str(e))
        barrier(ctx)
        console.print(f"teacher for {job.env}: exported to {job.folder}")
    _checked_run(student, resume, console)


def _fail(message: str) -> None:
    Console(stderr=True).print(
        f"error: {message}", style="red", markup=False, highlight=False, soft_wrap=True
    )
    raise typer.Exit(2)


def _run_errors() -> tuple[type[BaseException], ...]:
    from cod_fast.checkpoint import CheckpointError
    from cod_fast.run_dir import RunDirError
    from cod_fast.train_step import NonFiniteError

    # What bad input and a bad machine raise (each message names the cause and the fix, an
    # OSError its path and errno: a full disk, a read-only folder); the rest are bugs and keep
    # their traceback. ValueError covers ConfigError and SequenceTooLongError.
    return (ValueError, RunDirError, NonFiniteError, CheckpointError, OSError)


def _run_with_progress(trainer, resume: bool, console: Console) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not trainer.ctx.is_main:
        return trainer.run(resume)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("training", total=trainer.total_steps, status="")

        def on_step(record: dict) -> None:
            rewards = " ".join(f"{x:.2f}" for x in record["reward_by_position"])
            loss = record["loss"]
            status = (
                f"reward by position [{rewards}]  loss {loss:.4f}" if loss is not None else ""
            ) + f"  {record['step_s']:.1f} s/step"
            progress.update(
                task, completed=record["step"], description=record["phase"], status=status
            )

        return trainer.run(resume, on_step)


def _print_summary(summary: dict, console: Console) -> None:
    """Every evaluation of the run (held-out packs), and how the run ended."""
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
    console.print(f"{state} at step {summary['steps']} in {summary['seconds']:.0f} s")


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
        _fail(f"--dtype: got {dtype!r}; expected one of {', '.join(choices)}")
    try:
        ckpt = export_model(run_dir, out, step, dtype)  # type: ignore[arg-type]
    # ValueError: a bad config.yaml (ConfigError), weights that do not fit the run's model.
    except (OSError, ValueError, CheckpointError) as e:
        _fail(str(e))
    typer.echo(f"wrote step {ckpt.step} of {run_dir} to {out}")


SettingOption = Annotated[str, typer.Option("--setting", help="train or eval (harder).")]


def _print_positions(title: str, label: str, rows: dict) -> None:
    """A table of mean reward per pack position and the CoD gain, one row per summary."""
    table = Table(title=title)
    table.add_column(label)
    width = max((len(summary.mean_reward) for summary in rows.values()), default=0)
    for k in range(width):
        table.add_column(f"pos {k}", justify="right")
    table.add_column("CoD gain", justify="right")
    for name, summary in rows.items():
        table.add_row(name, *(f"{x:.3f}" for x in summary.mean_reward), f"{summary.cod_gain:+.3f}")
    Console().print(table)


SizeOption = Annotated[str, typer.Option("--size", help="full (SPEC sizes) or tiny.")]


def _make_env(name: str, setting: str, size: str):
    from cod_fast.envs import make_env

    try:
        return make_env(name, setting, size)  # type: ignore[arg-type]
    except ValueError as e:
        Console(stderr=True).print(f"error: {e}", style="red", markup=False, highlight=False)
        raise typer.Exit(2) from None


@envs_app.command("list")
def envs_list() -> None:
    """The environments and what each asks of the agent."""
    from cod_fast.envs import ENVIRONMENTS, env_class

    table = Table(title="CoD environments")
    for column in ("name", "description", "reward shown to update episode"):
        table.add_column(column)
    for name in ENVIRONMENTS:
        cls = env_class(name)
        table.add_row(name, Text(cls.description), "yes" if cls.reveals_reward else "no")
    Console().print(table)


@envs_app.command("solve")
def envs_solve(
    env: Annotated[str, typer.Argument(help="Environment name (see `cod-fast envs list`).")],
    packs: Annotated[int, typer.Option(help="Packs to play.")] = 100,
    tasks: Annotated[int, typer.Option(help="Tasks per pack (K).")] = 4,
    setting: SettingOption = "train",
    size: SizeOption = "full",
) -> None:
    """Per-position rewards of the scripted solver and explorer (with and without hints)."""
    from cod_fast.envs.base import play_pack
    from cod_fast.envs.packs import pack_seeds
    from cod_fast.metrics import summarize

    environment = _make_env(env, setting, size)
    seeds = pack_seeds("eval" if setting == "eval" else "train", packs)
    agents = (
        ("solver", environment.solver, True),
        ("explorer, hints", environment.explorer, True),
        ("explorer, no hints", environment.explorer, False),
    )
    rows = {}
    for label, factory, use_hints in agents:
        results = [play_pack(environment, factory(), seed, tasks, use_hints) for seed in seeds]
        rows[label] = summarize([r.rewards for r in results], [r.successes for r in results])
    _print_positions(
        f"{env} ({setting}, {size}): mean reward by pack position, {packs} packs", "agent", rows
    )


@envs_app.command("play")
def envs_play(
    env: Annotated[str, typer.Argument(help="Environment name (see `cod-fast envs list`).")],
    tasks: Annotated[int, typer.Option(help="Tasks in the pack.")] = 3,
    seed: Annotated[int, typer.Option(help="Pack number (the same number, the same pack).")] = 0,
    setting: SettingOption = "train",
    size: SizeOption = "tiny",
) -> None:
    """Play a pack in the terminal: actions at the prompt, your own hints between tasks."""
    from cod_fast.envs.packs import pack_seeds
    from cod_fast.rollout.hints import context_line
    from cod_fast.rollout.prompts import PROMPT_STYLES

    environment = _make_env(env, setting, size)
    (pack_seed,) = pack_seeds("play", 1, start=seed)
    hints: str | None = None
    console = Console()
    for k in range(tasks):
        task = environment.task(pack_seed, k)
        console.rule(f"task {k}")
        console.print(
            Text(PROMPT_STYLES["full"].solve_system(task.prompt(), context_line(hints, k == 0)))
        )
        observation = task.reset()
        for _ in range(task.max_steps):
            console.print(Text(observation), style="cyan")
            outcome = task.step(typer.prompt("action"))
            observation = outcome.observation
            if outcome.done:
                break
        console.print(Text(observation), style="cyan")
        console.print(f"reward {task.reward:.3f}; feedback: {task.feedback()}", markup=False)
        if k < tasks - 1:
            hints = typer.prompt("your hints for the next task (empty: none)", default="") or None


ModelOption = Annotated[
    Path, typer.Option("--model", help="A Hugging Face model folder (e.g. from cod-fast export).")
]
EnvOption = Annotated[
    str | None, typer.Option(help="The training environment (in-domain) [frozenlake].")
]
PacksOption = Annotated[int | None, typer.Option(help="Packs per environment and strategy [32].")]
TasksOption = Annotated[int | None, typer.Option(help="Tasks per pack (K) [4].")]
SizeOption = Annotated[str | None, typer.Option(help="full (SPEC sizes) or tiny [full].")]
EvalSettingOption = Annotated[str | None, typer.Option(help="train or eval (harder) [eval].")]
MaxTokensOption = Annotated[int | None, typer.Option(help="Cap per response [512].")]
TemperatureOption = Annotated[float | None, typer.Option(help="Sampling temperature [1].")]
TopPOption = Annotated[float | None, typer.Option(help="Nucleus sampling threshold [1].")]
SeedOption = Annotated[int | None, typer.Option(help="Sampling seed [0].")]


PLAY_FLAGS = (
    "env",
    "size",
    "setting",
    "packs",
    "tasks",
    "max_response_tokens",
    "temperature",
    "top_p",
    "seed",
)


def _play_flags(options: dict) -> dict:
    """The options of `eval` / `rollout` that override how a model plays (None: not given)."""
    return {k: v for k, v in options.items() if k in PLAY_FLAGS}


def _model_play(model: Path, flags: dict) -> tuple[dict, object, object]:
    """(options, sampler, chat format) for playing `model` (cod_fast.matrix.load_player): a
    model written by `cod-fast export`, or a run directory, plays as its run evaluated
    (environment, size, eval setting and packs, prompt style, token caps, temperature, seed),
    other models with the defaults in brackets; a flag that is given overrides one of those, and
    says so."""
    from cod_fast.matrix import load_player

    try:
        return load_player(model, flags, log=_to_stderr)
    except _bad_model_input() as e:
        _fail(str(e))


def _check_packs(packs: int | None) -> None:
    """--packs within what an evaluation may play (a billion would build a billion seeds)."""
    from cod_fast.config import MAX_EVAL_PACKS

    if packs is not None and not 1 <= packs <= MAX_EVAL_PACKS:
        _fail(f"--packs: got {packs}; expected an integer in [1, {MAX_EVAL_PACKS}]")


def _bad_model_input() -> tuple[type[Exception], ...]:
    """What a bad model folder, run directory, name or value raises: one red line, no traceback."""
    from cod_fast.checkpoint import CheckpointError

    return (ValueError, OSError, CheckpointError)


def _to_stderr(line: str) -> None:
    typer.echo(line, err=True)


ModelsOption = Annotated[
    list[Path],
    typer.Option(
        "--model",
        help="A model folder (cod-fast export, any Hugging Face causal LM) or a run directory "
        "(cod-fast train); repeatable with --matrix.",
    ),
]
EnvsOption = Annotated[
    list[str] | None,
    typer.Option(
        "--env",
        help="The training environment (in-domain) \\[frozenlake]; with --matrix the columns "
        "(repeatable) \\[every environment].",
    ),
]


@app.command("eval")
def eval_command(
    model: ModelsOption,
    env: EnvsOption = None,
    cross_domain: Annotated[bool, typer.Option(help="Also every other environment.")] = False,
    ralph: Annotated[
        bool, typer.Option(help="Also the Ralph-loop pack strategies (always in a --matrix).")
    ] = False,
    strategy: Annotated[
        list[str] | None,
        typer.Option(
            "--strategy",
            help="Only these pack strategies (repeatable): cod, ralph_sample, ralph_full.",
        ),
    ] = None,
    matrix: Annotated[
        bool,
        typer.Option(
            "--matrix",
            help="Every --model on every --env and strategy: matrix.json and matrix.png. "
            "The flags below apply to every model alike.",
        ),
    ] = False,
    packs: PacksOption = None,
    tasks: TasksOption = None,
    size: SizeOption = None,
    setting: EvalSettingOption = None,
    max_response_tokens: MaxTokensOption = None,
    temperature: TemperatureOption = None,
    top_p: TopPOption = None,
    seed: SeedOption = None,
    out: Annotated[
        Path, typer.Option(help="Folder for eval.json and eval.png (matrix.json, matrix.png).")
    ] = Path("runs/eval"),
) -> None:
    """Run a model over fixed eval packs; write per-position rewards (JSON) and a plot (PNG).

    A model written by `cod-fast export` (or its run directory) is evaluated as its run
    evaluated it: with no flag but --model the result is the run's last eval row. Every run is
    evaluated with the CoD protocol (update episodes, hints carried forward). `--matrix` puts
    several models side by side, each with its own settings but the environment."""
    from cod_fast.envs import ENVIRONMENTS
    from cod_fast.envs.packs import STRATEGIES
    from cod_fast.evaluate import EvalPlan, evaluate

    flags = _play_flags(locals())
    _check_packs(packs)
    strategies = tuple(strategy or (STRATEGIES if ralph or matrix else ("cod",)))
    if unknown := [s for s in strategies if s not in STRATEGIES]:
        _fail(f"unknown --strategy {unknown}; choose from {', '.join(STRATEGIES)}")
    if matrix:
        envs = list(env or ENVIRONMENTS)
        envs += [n for n in ENVIRONMENTS if cross_domain and n not in envs]
        _eval_matrix(model, envs, strategies, flags, out)
        return
    if len(model) > 1 or len(env or ()) > 1:
        _fail("several --model or --env need --matrix; without it: one model, one environment")
    o, sampler, chat = _model_play(model[0], flags | {"env": env[0] if env else None})
    envs = (o["env"], *(n for n in ENVIRONMENTS if n != o["env"])) if cross_domain else (o["env"],)
    plan = EvalPlan(
        envs=envs,
        strategies=strategies,
        setting=o["setting"],
        size=o["size"],
        packs=o["packs"],
        tasks=o["tasks"],
    )
    report = evaluate(sampler, chat, plan, o["settings"], out)
    rows = {
        f"{name} / {strategy}": summary
        for name, by_strategy in report["summaries"].items()
        for strategy, summary in by_strategy.items()
    }
    title = f"eval ({o['setting']}, {o['size']}): mean reward by pack position, {o['packs']} packs"
    _print_positions(title, "env / strategy", rows)
    typer.echo(f"wrote {out / 'eval.json'} and {out / 'eval.png'}")


def _eval_matrix(
    models: list[Path], envs: list[str], strategies: tuple[str, ...], flags: dict, out: Path
) -> None:
    """`eval --matrix`: evaluate, print one row per (model, env / strategy), write the files."""
    from cod_fast.matrix import evaluate_matrix

    play = {k: v for k, v in flags.items() if k != "env"}
    try:
        result = evaluate_matrix(models, envs, strategies, out_dir=out, log=_to_stderr, **play)
    except _bad_model_input() as e:
        _fail(str(e))
    table = Table(title="cross-domain matrix (± one standard error over packs)")
    for column in ("model", "env / strategy", "CoD gain ± se", "last position ± se"):
        table.add_column(column, justify="right" if "±" in column else "left")
    for row in result["models"]:
        cells = [c for c in result["cells"] if c["model"] == row["label"]]
        for i, c in enumerate(cells):
            table.add_row(
                Text(row["label"] if i == 0 else ""),
                f"{c['env']} / {c['strategy']}",
                f"{c['cod_gain']:+.3f} ± {c['cod_gain_se']:.3f}",
                f"{c['last_reward']:.3f} ± {c['last_reward_se']:.3f}",
                end_section=i == len(cells) - 1,
            )
    Console().print(table)
    typer.echo(f"wrote {out / 'matrix.json'} and {out / 'matrix.png'}")


@app.command("rollout")
def rollout_command(
    model: ModelOption,
    env: EnvOption = None,
    count: Annotated[
        int, typer.Option("--packs", help="Packs to play (the first eval packs).")
    ] = 2,
    tasks: TasksOption = None,
    size: SizeOption = None,
    setting: EvalSettingOption = None,
    max_response_tokens: MaxTokensOption = None,
    temperature: TemperatureOption = None,
    top_p: TopPOption = None,
    seed: SeedOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object per pack on stdout, for tools.")
    ] = False,
) -> None:
    """Print whole packs as a model plays them: each task's context, actions and observations,
    the hint blocks it writes and reads on the next task, and the rewards (CoD protocol; the
    same eval packs and settings as `cod-fast eval`)."""
    import json

    from cod_fast.envs import make_env
    from cod_fast.envs.packs import make_packs, pack_seeds
    from cod_fast.rollout.driver import RolloutDriver
    from cod_fast.transcript import print_rollout, rollout_record

    _check_packs(count)
    o, sampler, chat = _model_play(model, _play_flags(locals()))
    environment = make_env(o["env"], o["setting"], o["size"])
    played = make_packs(pack_seeds("eval", count), o["tasks"])
    rollouts = RolloutDriver(environment, sampler, chat, o["settings"]).run(played, group_size=1)
    console = Console()
    for rollout in rollouts:
        record = rollout_record(rollout, chat.tokenizer)
        if as_json:
            typer.echo(json.dumps(record))
        else:
            print_rollout(record, console)


if __name__ == "__main__":  # python -m cod_fast.cli (what torchrun -m runs)
    app()
