"""Playing a model, as `cod-fast eval` and `cod-fast rollout` do: their shared options, the
model loaded to play as its run played, the progress of the long calls, the table of rewards by
pack position (`cod-fast envs solve` prints it too); and `cod-fast rollout` itself
(cod_fast.cli.app registers it)."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from cod_fast.cli.common import bad_model_input, fail, refuse

ModelOption = Annotated[  # a str: a Path would turn ./name into name, which reads as a hub id
    str,
    typer.Option(
        "--model",
        help="A Hugging Face model folder (e.g. from cod-fast export), or an API model: "
        "openai:URL#MODEL (key in COD_FAST_EVAL_API_KEY, else OPENAI_API_KEY).",
    ),
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


def play_flags(options: dict) -> dict:
    """The options of `eval` / `rollout` that override how a model plays (None: not given)."""
    return {k: v for k, v in options.items() if k in PLAY_FLAGS}


def model_play(model: str, flags: dict) -> tuple[dict, object, object]:
    """(options, sampler, chat format) for playing `model` (cod_fast.eval.matrix.load_player): a
    model written by `cod-fast export`, or a run directory, plays as its run evaluated
    (environment, size, eval setting and packs, prompt style, token caps, temperature, seed),
    other models (an API model's `openai:URL#MODEL` too) with the defaults in brackets; a flag
    that is given overrides one of those, and says so."""
    from cod_fast.eval.matrix import load_player

    try:
        return load_player(model, flags, log=to_stderr)
    except bad_model_input() as e:
        refuse(e)


def check_packs(packs: int | None) -> None:
    """--packs within what an evaluation may play (a billion would build a billion seeds)."""
    from cod_fast.config import MAX_EVAL_PACKS

    if packs is not None and not 1 <= packs <= MAX_EVAL_PACKS:
        fail(f"--packs: got {packs}; expected an integer in [1, {MAX_EVAL_PACKS}]")


def to_stderr(line: str) -> None:
    """A note on stderr (what a model plays with, a stage): stdout stays the results."""
    typer.echo(line, err=True)


class Working:
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

    def __enter__(self) -> Working:
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
        """`tasks` as an evaluation reports them (cod_fast.eval.evaluate.evaluate's on_progress)."""
        self.tasks(done, total, part)

    def _line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)


def print_positions(title: str, label: str, rows: dict) -> None:
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

    from cod_fast.data.transcript import print_rollout, rollout_record
    from cod_fast.envs import make_env
    from cod_fast.envs.packs import make_packs, pack_seeds
    from cod_fast.rollout.chat_endpoint import EndpointError
    from cod_fast.rollout.driver import RolloutDriver

    check_packs(count)
    flags = play_flags(locals())
    with Working() as working:
        working.stage(f"loading {model}")
        o, sampler, chat = model_play(model, flags)
        environment = make_env(o["env"], o["setting"], o["size"], o["options"].get(o["env"]))
        played = make_packs(pack_seeds("eval", count), o["tasks"])
        working.stage(f"playing {count} packs of {o['tasks']} tasks in {o['env']}")
        driver = RolloutDriver(environment, sampler, chat, o["settings"])
        try:
            rollouts = driver.run(played, group_size=1, on_progress=working.tasks)
        except EndpointError as e:  # an API model's endpoint that failed, after its retries
            refuse(e)
    console = Console()
    for rollout in rollouts:
        record = rollout_record(rollout, chat.tokenizer)
        if as_json:
            typer.echo(json.dumps(record))
        else:
            print_rollout(record, console)
