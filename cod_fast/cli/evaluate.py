"""`cod-fast eval`: a model over fixed eval packs, or several models side by side (`--matrix`);
per-position rewards as a table, a JSON file and a plot (cod_fast.cli.app registers it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cod_fast.cli.common import bad_model_input, fail, refuse
from cod_fast.cli.play import (
    EvalSettingOption,
    JudgeOption,
    MaxTokensOption,
    PacksOption,
    SeedOption,
    SizeOption,
    TasksOption,
    TemperatureOption,
    TopPOption,
    Working,
    check_packs,
    model_play,
    play_flags,
    print_positions,
    to_stderr,
)

ModelsOption = Annotated[
    list[str],
    typer.Option(
        "--model",
        help="A model folder (cod-fast export, any Hugging Face causal LM), a run directory "
        "(cod-fast train), or an API model: openai:URL#MODEL, an OpenAI-compatible endpoint "
        "(key in COD_FAST_EVAL_API_KEY, else OPENAI_API_KEY); repeatable with --matrix.",
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
    from cod_fast.eval.evaluate import EvalPlan, evaluate
    from cod_fast.rollout.chat_endpoint import EndpointError
    from cod_fast.rollout.driver import HINT_SOURCES, check_hint_source

    flags = play_flags(locals())
    check_packs(packs)
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
    with Working() as working:
        working.stage(f"loading {model[0]}")
        o, sampler, chat = model_play(model[0], flags | {"env": env[0] if env else None})
        envs = (
            (o["env"], *(n for n in ENVIRONMENTS if n != o["env"])) if cross_domain else (o["env"],)
        )
        settings = dataclasses.replace(o["settings"], hint_source=hints)
        try:
            made = [make_env(n, o["setting"], o["size"], o["options"].get(n)) for n in envs]
            check_hint_source(settings, made)
        except ValueError as e:
            refuse(e)
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
        except EndpointError as e:  # an API model's endpoint that failed, after its retries
            refuse(e)
        except OSError as e:  # --out not writable, or an entry there that is a link
            refuse(e, f"--out {out}: {e}")
    rows = {
        f"{name} / {strategy}": summary
        for name, by_strategy in report["summaries"].items()
        for strategy, summary in by_strategy.items()
    }
    title = f"eval ({o['setting']}, {o['size']}): mean reward by pack position, {o['packs']} packs"
    print_positions(title, "env / strategy", rows)
    typer.echo(f"wrote {out / 'eval.json'} and {out / 'eval.png'}")


def _eval_matrix(
    models: list[str], envs: list[str], strategies: tuple[str, ...], flags: dict, out: Path
) -> None:
    """`eval --matrix`: evaluate, print one row per (model, env / strategy), write the files."""
    from cod_fast.eval.matrix import evaluate_matrix

    play = {k: v for k, v in flags.items() if k != "env"}
    cells = f"{len(envs)} environment(s) x {len(strategies)} strategies"
    with Working() as working:
        working.stage(f"evaluating {len(models)} model(s) on {cells}")
        try:
            result = evaluate_matrix(
                models,
                envs,
                strategies,
                out_dir=out,
                log=to_stderr,
                on_progress=working.part_tasks,
                **play,
            )
        except bad_model_input() as e:
            refuse(e)
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
