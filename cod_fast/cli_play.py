"""`cod-fast envs ...`, `cod-fast eval` and `cod-fast rollout`: playing environments and models
(cod_fast.cli registers these commands)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cod_fast.cli_common import bad_model_input, fail

envs_app = typer.Typer(help="List, play and solve the CoD environments.", no_args_is_help=True)


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
        gain = f"{summary.cod_gain:+.3f}"
        if summary.gain_std_error is not None:  # over packs
            gain += f" +- {summary.gain_std_error:.3f}"
        table.add_row(name, *(f"{x:.3f}" for x in summary.mean_reward), gain)
    Console().print(table)


EnvSizeOption = Annotated[str, typer.Option("--size", help="full (the specified sizes) or tiny.")]
EnvArgument = Annotated[
    str,
    typer.Argument(
        help="Environment name (see `cod-fast envs list`) or path (module:Class, file.py:Class)."
    ),
]


EnvOptions = Annotated[
    list[str] | None,
    typer.Option(
        "--option",
        help="KEY=VALUE for the environment's constructor, repeatable (learn2ask: cases=FILE).",
    ),
]


def _make_env(name: str, setting: str, size: str, options: list[str] | None = None):
    from cod_fast.envs import make_env

    given = {}
    for item in options or ():
        key, sep, value = item.partition("=")
        if not (sep and key.strip()):
            fail(f"--option: got {item!r}; expected KEY=VALUE, e.g. cases=my_cases.jsonl")
        given[key.strip()] = value
    try:
        return make_env(name, setting, size, given)  # type: ignore[arg-type]
    except ValueError as e:
        fail(str(e))


@envs_app.command("list")
def envs_list() -> None:
    """The environments and what each asks of the agent: the built-in ones, those registered
    with @cod_fast.envs.register and those of installed packages' entry points."""
    from cod_fast.envs import EnvironmentLookupError, env_class, known_environments

    table = Table(title="CoD environments")
    for column in ("name", "description", "reward shown to update episode"):
        table.add_column(column)
    for name in known_environments():
        try:
            cls = env_class(name)
        except EnvironmentLookupError as e:  # one broken plugin leaves the others listed
            table.add_row(name, Text(str(e)), "")
            continue
        shows = "yes" if cls.reveals_reward else "no"
        table.add_row(name, Text(getattr(cls, "description", "")), shows)
    Console().print(table)


@envs_app.command("solve")
def envs_solve(
    env: EnvArgument,
    packs: Annotated[int, typer.Option(help="Packs to play.")] = 100,
    tasks: Annotated[int, typer.Option(help="Tasks per pack (K).")] = 4,
    setting: SettingOption = "train",
    size: EnvSizeOption = "full",
    option: EnvOptions = None,
) -> None:
    """Per-position rewards of the scripted solver and explorer (with and without hints)."""
    from cod_fast.envs.base import play_pack
    from cod_fast.envs.packs import pack_seeds
    from cod_fast.metrics import summarize

    environment = _make_env(env, setting, size, option)
    seeds = pack_seeds("eval" if setting == "eval" else "train", packs)
    agents = [("solver", environment.solver, True)] * environment.has_solver()
    agents += [
        ("explorer, hints", environment.explorer, True),
        ("explorer, no hints", environment.explorer, False),
    ] * environment.has_explorer()
    if not agents:
        fail(f"{env} has neither a scripted solver nor an explorer: there is nothing to play")
    if len(agents) < 3:
        missing = "explorer" if environment.has_solver() else "solver"
        _to_stderr(f"{env} has no scripted {missing}: its rows are left out")
    rows = {}
    for label, factory, use_hints in agents:
        results = [play_pack(environment, factory(), seed, tasks, use_hints) for seed in seeds]
        rows[label] = summarize([r.rewards for r in results], [r.successes for r in results])
    _print_positions(
        f"{env} ({setting}, {size}): mean reward by pack position, {packs} packs", "agent", rows
    )


@envs_app.command("check")
def envs_check(
    env: EnvArgument,
    size: EnvSizeOption = "full",
    packs: Annotated[
        int, typer.Option(help="Packs per setting for the solver and the explorer.")
    ] = 8,
) -> None:
    """Check an environment against the contract the built-in ones pass (cod_fast.envs.check):
    its declarations, both settings, determinism, hostile actions, rewards in its range, its
    solver and explorer. One line per check; exit code 1 if any failed."""
    from cod_fast.envs import EnvironmentLookupError
    from cod_fast.envs.check import run_checks

    if size not in ("tiny", "full"):
        fail(f"--size: got {size!r}; expected tiny or full")
    _check_packs(packs)
    try:
        results = run_checks(env, size, packs)  # type: ignore[arg-type]
    except EnvironmentLookupError as e:
        fail(str(e))
    typer.echo(f"{env} ({size})")
    for result in results:
        typer.echo(result.line())
    if any(r.status == "FAILED" for r in results):
        raise typer.Exit(1)


@envs_app.command("play")
def envs_play(
    env: EnvArgument,
    tasks: Annotated[int, typer.Option(help="Tasks in the pack.")] = 3,
    seed: Annotated[int, typer.Option(help="Pack number (the same number, the same pack).")] = 0,
    setting: SettingOption = "train",
    size: EnvSizeOption = "tiny",
    option: EnvOptions = None,
) -> None:
    """Play a pack in the terminal: actions at the prompt, your own hints between tasks."""
    from cod_fast.envs.packs import pack_seeds
    from cod_fast.rollout.hints import context_line
    from cod_fast.rollout.prompts import PROMPT_STYLES

    environment = _make_env(env, setting, size, option)
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


ModelOption = Annotated[  # a str: a Path would turn ./name into name, which reads as a hub id
    str, typer.Option("--model", help="A Hugging Face model folder (e.g. from cod-fast export).")
]
EnvOption = Annotated[
    str | None, typer.Option(help="The training environment (in-domain) [frozenlake].")
]
PacksOption = Annotated[int | None, typer.Option(help="Packs per environment and strategy [32].")]
TasksOption = Annotated[int | None, typer.Option(help="Tasks per pack (K) [4].")]
SizeOption = Annotated[str | None, typer.Option(help="full (the specified sizes) or tiny [full].")]
EvalSettingOption = Annotated[str | None, typer.Option(help="train or eval (harder) [eval].")]
MaxTokensOption = Annotated[int | None, typer.Option(help="Cap per response [512].")]
TemperatureOption = Annotated[float | None, typer.Option(help="Sampling temperature [1].")]
TopPOption = Annotated[float | None, typer.Option(help="Nucleus sampling threshold [1].")]
SeedOption = Annotated[int | None, typer.Option(help="Sampling seed [0].")]
JudgeOption = Annotated[
    str | None,
    typer.Option(
        help="Who scores the environments that ask for a judge: rule, the http(s):// URL of an "
        "OpenAI-compatible endpoint, or a model folder [rule; a model folder's own judge is "
        "used only when named here]."
    ),
]


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
    "judge",
)


def _play_flags(options: dict) -> dict:
    """The options of `eval` / `rollout` that override how a model plays (None: not given)."""
    return {k: v for k, v in options.items() if k in PLAY_FLAGS}


def _model_play(model: str, flags: dict) -> tuple[dict, object, object]:
    """(options, sampler, chat format) for playing `model` (cod_fast.matrix.load_player): a
    model written by `cod-fast export`, or a run directory, plays as its run evaluated
    (environment, size, eval setting and packs, prompt style, token caps, temperature, seed),
    other models with the defaults in brackets; a flag that is given overrides one of those, and
    says so."""
    from cod_fast.matrix import load_player

    try:
        return load_player(model, flags, log=_to_stderr)
    except bad_model_input() as e:
        fail(str(e))


def _check_packs(packs: int | None) -> None:
    """--packs within what an evaluation may play (a billion would build a billion seeds)."""
    from cod_fast.config import MAX_EVAL_PACKS

    if packs is not None and not 1 <= packs <= MAX_EVAL_PACKS:
        fail(f"--packs: got {packs}; expected an integer in [1, {MAX_EVAL_PACKS}]")


def _to_stderr(line: str) -> None:
    typer.echo(line, err=True)


class _Working:
    """Progress of the long calls of `eval` and `rollout` (loading a model, evaluating, playing
    packs). On stderr, so that stdout stays the results (a pipe of `rollout --json`): on a
    terminal a bar labelled with the stage and the time so far (log lines print above it),
    pulsing until the stage counts its tasks (`tasks`), elsewhere one line per stage, one per
    quarter of its tasks, and one when all is done."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.plain = not self.console.is_terminal
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=self.console,
            disable=self.plain,
            transient=True,
            redirect_stdout=False,
        )
        self.task = self.progress.add_task("", total=None)
        self.what, self.part, self.shown = "", "", 0  # the stage, its part, quarters shown
        self.started = time.monotonic()

    def __enter__(self) -> _Working:
        self.progress.start()
        return self

    def __exit__(self, kind, *exc) -> None:
        self.progress.stop()
        if kind is None:
            self._line(f"done in {time.monotonic() - self.started:.1f} s")

    def stage(self, what: str) -> None:
        """The work turns to `what` (loading a model, evaluating, ...)."""
        self.progress.reset(self.task, total=None, description=what)
        self.what, self.part, self.shown = what, "", 0
        if self.plain:
            self._line(f"{what}...")

    def tasks(self, done: int, total: int, part: str = "") -> None:
        """`done` of the stage's `total` tasks are played (of `part`, when it has several; a
        new part counts afresh)."""
        if part != self.part:
            self.part, self.shown = part, 0
        what = f"{self.what}: {part}" if part else self.what
        self.progress.update(self.task, description=what, completed=done, total=total)
        quarter = 4 * done // max(total, 1)
        if self.plain and quarter > self.shown:
            self.shown = quarter
            self._line(f"{what}: {done}/{total} tasks")

    def part_tasks(self, part: str, done: int, total: int) -> None:
        """`tasks` as an evaluation reports them (cod_fast.evaluate.evaluate's on_progress)."""
        self.tasks(done, total, part)

    def _line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)


ModelsOption = Annotated[
    list[str],
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
        help="The training environment (in-domain) \\[frozenlake], a name or a path "
        "(module:Class, file.py:Class); with --matrix the columns (repeatable) \\[the built-in "
        "environments].",
    ),
]


def eval_command(
    model: ModelsOption,
    env: EnvsOption = None,
    cross_domain: Annotated[
        bool, typer.Option(help="Also every other built-in environment.")
    ] = False,
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
    judge: JudgeOption = None,
    hints: Annotated[
        str,
        typer.Option(
            help="The hints before each task after the first: own (the model's update "
            "episodes), oracle (the hidden rule), explorer (what the scripted explorer reads "
            "from the model's own moves) or none. Only own samples update episodes.",
        ),
    ] = "own",
    out: Annotated[
        Path, typer.Option(help="Folder for eval.json and eval.png (matrix.json, matrix.png).")
    ] = Path("runs/eval"),
) -> None:
    """Run a model over fixed eval packs; write per-position rewards (JSON) and a plot (PNG).

    A model written by `cod-fast export` (or its run directory) is evaluated as its run
    evaluated it: with no flag but --model the result is the run's last eval row. Every run is
    evaluated with the CoD protocol (update episodes, hints carried forward); `--hints` puts
    other hints in place of the model's. `--matrix` puts several models side by side, each with
    its own settings but the environment."""
    import dataclasses

    from cod_fast.envs import ENVIRONMENTS, make_env
    from cod_fast.envs.packs import STRATEGIES
    from cod_fast.evaluate import EvalPlan, evaluate
    from cod_fast.rollout.driver import HINT_SOURCES, check_hint_source

    flags = _play_flags(locals())
    _check_packs(packs)
    strategies = tuple(strategy or (STRATEGIES if ralph or matrix else ("cod",)))
    if unknown := [s for s in strategies if s not in STRATEGIES]:
        fail(f"unknown --strategy {unknown}; choose from {', '.join(STRATEGIES)}")
    if hints not in HINT_SOURCES:
        fail(f"unknown --hints {hints!r}; choose from {', '.join(HINT_SOURCES)}")
    if matrix and hints != "own":
        fail("--hints evaluates one model; --matrix plays every model with its own hints")
    if matrix:
        envs = list(env or ENVIRONMENTS)
        envs += [n for n in ENVIRONMENTS if cross_domain and n not in envs]
        _eval_matrix(model, envs, strategies, flags, out)
        return
    if len(model) > 1 or len(env or ()) > 1:
        fail("several --model or --env need --matrix; without it: one model, one environment")
    with _Working() as working:
        working.stage(f"loading {model[0]}")
        o, sampler, chat = _model_play(model[0], flags | {"env": env[0] if env else None})
        envs = (
            (o["env"], *(n for n in ENVIRONMENTS if n != o["env"])) if cross_domain else (o["env"],)
        )
        settings = dataclasses.replace(o["settings"], hint_source=hints)
        try:
            made = [make_env(n, o["setting"], o["size"], o["options"].get(n)) for n in envs]
            check_hint_source(settings, made)
        except ValueError as e:
            fail(str(e))
        plan = EvalPlan(
            envs=envs,
            strategies=strategies,
            setting=o["setting"],
            size=o["size"],
            packs=o["packs"],
            tasks=o["tasks"],
            options=o["options"],
        )
        working.stage(
            f"evaluating on {', '.join(envs)} ({', '.join(strategies)}): {o['packs']} packs "
            f"of {o['tasks']} tasks each"
        )
        try:
            report = evaluate(sampler, chat, plan, settings, out, on_progress=working.part_tasks)
        except OSError as e:  # --out not writable, or an entry there that is a link
            fail(f"--out {out}: {e}")
    rows = {
        f"{name} / {strategy}": summary
        for name, by_strategy in report["summaries"].items()
        for strategy, summary in by_strategy.items()
    }
    title = f"eval ({o['setting']}, {o['size']}): mean reward by pack position, {o['packs']} packs"
    _print_positions(title, "env / strategy", rows)
    typer.echo(f"wrote {out / 'eval.json'} and {out / 'eval.png'}")


def _eval_matrix(
    models: list[str], envs: list[str], strategies: tuple[str, ...], flags: dict, out: Path
) -> None:
    """`eval --matrix`: evaluate, print one row per (model, env / strategy), write the files."""
    from cod_fast.matrix import evaluate_matrix

    play = {k: v for k, v in flags.items() if k != "env"}
    cells = f"{len(envs)} environment(s) x {len(strategies)} strategies"
    with _Working() as working:
        working.stage(f"evaluating {len(models)} model(s) on {cells}")
        try:
            result = evaluate_matrix(
                models,
                envs,
                strategies,
                out_dir=out,
                log=_to_stderr,
                on_progress=working.part_tasks,
                **play,
            )
        except bad_model_input() as e:
            fail(str(e))
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
    judge: JudgeOption = None,
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
    flags = _play_flags(locals())
    with _Working() as working:
        working.stage(f"loading {model}")
        o, sampler, chat = _model_play(model, flags)
        environment = make_env(o["env"], o["setting"], o["size"], o["options"].get(o["env"]))
        played = make_packs(pack_seeds("eval", count), o["tasks"])
        working.stage(f"playing {count} packs of {o['tasks']} tasks in {o['env']}")
        driver = RolloutDriver(environment, sampler, chat, o["settings"])
        rollouts = driver.run(played, group_size=1, on_progress=working.tasks)
    console = Console()
    for rollout in rollouts:
        record = rollout_record(rollout, chat.tokenizer)
        if as_json:
            typer.echo(json.dumps(record))
        else:
            print_rollout(record, console)
