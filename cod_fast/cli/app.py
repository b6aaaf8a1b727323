"""The `cod-fast` command line: a thin typer layer over cod_fast.config and the trainer. This
module is the app (the console script `cod-fast` runs `cod_fast.cli.app:app`), its global
options and its small commands (`info`, `config show`, `export`); the others live beside it:
train (`train`, `distill`), evaluate (`eval`), play (`rollout`), envs, bench.

Heavy imports (torch, the kernel dispatcher) happen inside the commands that need them, so
`cod-fast config show` answers at once.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cod_fast import __version__
from cod_fast.cli.bench import bench_app
from cod_fast.cli.common import fail, refuse, show_tracebacks
from cod_fast.cli.envs import envs_app
from cod_fast.cli.evaluate import eval_command
from cod_fast.cli.options import ConfigFileOption, PresetOption, SetOption, resolve_config
from cod_fast.cli.plan import plan
from cod_fast.cli.play import rollout_command
from cod_fast.cli.train import distill, train
from cod_fast.config import DERIVED
from cod_fast.config.doc import explain_config, sections
from cod_fast.config.io import dump_yaml, load_config
from cod_fast.config.presets import DEFAULT_PRESET

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
    traceback: Annotated[
        bool,
        typer.Option(
            "--traceback",
            help="Show the full traceback of an error that is otherwise one red line "
            "(as COD_FAST_TRACEBACK=1 does).",
        ),
    ] = False,
) -> None:
    """The options that come before a command (the app's help text is the Typer's)."""
    if traceback:
        show_tracebacks()


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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
    cfg = resolve_config(preset, config_file, overrides)
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

    from cod_fast.run.checkpoint import CheckpointError
    from cod_fast.run.export import ExportDtype, export_model

    choices = get_args(ExportDtype)
    if dtype not in choices:
        fail(f"--dtype: got {dtype!r}; expected one of {', '.join(choices)}")
    try:
        ckpt = export_model(run_dir, out, step, dtype)  # type: ignore[arg-type]
    # ValueError: a bad config.yaml (ConfigError), weights that do not fit the run's model.
    except (OSError, ValueError, CheckpointError) as e:
        refuse(e)
    typer.echo(f"wrote step {ckpt.step} of {run_dir} to {out}")


# In this order in `--help`: the training commands, then those that play models.
app.command()(info)
app.command()(train)
app.command()(distill)
app.command()(plan)
app.command("export")(export_command)
app.command("eval")(eval_command)
app.command("rollout")(rollout_command)


if __name__ == "__main__":  # python -m cod_fast.cli (what torchrun -m runs)
    app()
