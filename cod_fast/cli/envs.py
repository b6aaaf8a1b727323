"""`cod-fast envs ...`: list the environments, check one against the contract, and play packs
with the scripted solver and explorer or yourself (cod_fast.cli.app adds the group)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cod_fast.cli.common import fail, refuse
from cod_fast.cli.play import check_packs, print_positions, to_stderr

envs_app = typer.Typer(help="List, play and solve the CoD environments.", no_args_is_help=True)


SettingOption = Annotated[str, typer.Option("--setting", help="train or eval (harder).")]
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
        help=(
            "KEY=VALUE for the environment's constructor, repeatable (learn2ask: cases=FILE); "
            "the value is converted to the parameter's annotated type (tries=3 gives an int)."
        ),
    ),
]


def _make_env(name: str, setting: str, size: str, options: list[str] | None = None):
    """The environment the arguments name, with the `--option` KEY=VALUE pairs for its
    constructor (text, converted by `make_env` to the types its parameters are annotated with);
    a malformed pair, a value that does not convert or a name that makes no environment is one
    red line."""
    from cod_fast.envs import make_env

    given: dict[str, str] = {}
    for item in options or ():
        key, sep, value = item.partition("=")
        if not (sep and key.strip()):
            fail(f"--option: got {item!r}; expected KEY=VALUE, e.g. cases=my_cases.jsonl")
        given[key.strip()] = value
    try:
        return make_env(name, setting, size, given)  # type: ignore[arg-type]
    except ValueError as e:
        refuse(e)


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
    from cod_fast.data.metrics import summarize
    from cod_fast.envs.base import play_pack
    from cod_fast.envs.packs import pack_seeds

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
        to_stderr(f"{env} has no scripted {missing}: its rows are left out")
    rows = {}
    for label, factory, use_hints in agents:
        results = [play_pack(environment, factory(), seed, tasks, use_hints) for seed in seeds]
        rows[label] = summarize([r.rewards for r in results], [r.successes for r in results])
    print_positions(
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
    solver, its explorer (no worse late in a pack than first: a hidden rule per pack) and its
    hint entries read back from the hints it renders. One line per check; exit code 1 if any
    failed."""
    from cod_fast.envs import EnvironmentLookupError
    from cod_fast.envs.check import run_checks

    if size not in ("tiny", "full"):
        fail(f"--size: got {size!r}; expected tiny or full")
    check_packs(packs)
    try:
        results = run_checks(env, size, packs)  # type: ignore[arg-type]
    except EnvironmentLookupError as e:
        refuse(e)
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
