"""The `cod-fast` command line: a thin typer layer over cod_fast.config and the trainer.

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

from cod_fast.config import DEFAULT_PRESET, PRESETS, Config, ConfigError, dump_yaml, load_config

app = typer.Typer(
    name="cod-fast",
    help="Train 'connect the dots' (CoD) agents with fused log-prob and policy-loss kernels.",
    no_args_is_help=True,
    add_completion=False,
)
config_app = typer.Typer(help="Inspect the resolved configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")
bench_app = typer.Typer(help="Benchmark the kernels (cod_fast.bench).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

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
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a field, e.g. --set algo.loss.kl=k3 (repeatable)."),
]


def _resolve_config(
    preset: str | None, config_file: Path | None, overrides: list[str] | None
) -> Config:
    """The config the options describe; a ConfigError becomes one red line and exit code 2."""
    try:
        return load_config(
            preset, None if config_file is None else str(config_file), overrides or ()
        )
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
    for module in OPTIONAL_EXTRAS:  # find_spec, not import: vllm alone takes seconds to import
        present = importlib.util.find_spec(module) is not None
        rows.append((f"extra {module}", "present" if present else "absent"))

    table = Table(title="cod-fast", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for what, value in rows:
        table.add_row(what, Text(value))  # Text: values are shown as-is, never parsed as markup
    Console().print(table)


@config_app.command("show")
def config_show(
    preset: PresetOption = None, config_file: ConfigFileOption = None, overrides: SetOption = None
) -> None:
    """Print the resolved config as YAML (a file that --config reads back)."""
    typer.echo(dump_yaml(_resolve_config(preset, config_file, overrides)), nl=False)


@app.command()
def train(
    preset: PresetOption = None, config_file: ConfigFileOption = None, overrides: SetOption = None
) -> None:
    """Train a policy with the resolved config."""
    cfg = _resolve_config(preset, config_file, overrides)
    typer.echo(dump_yaml(cfg), nl=False)
    typer.echo("The training loop arrives with a later issue (issue 5: the trainer); nothing ran.")


@bench_app.command("kernels")
def bench_kernels(
    cases: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated cases (dense, cod-packed, wide-vocab, h100); default all."
        ),
    ] = None,
    impls: Annotated[
        str | None,
        typer.Option(help="Comma-separated contenders (eager, torch, cpp, triton, liger, ...)."),
    ] = None,
    reps: Annotated[int | None, typer.Option(help="Timed repetitions (median, p20, p80).")] = None,
    warmup: Annotated[int | None, typer.Option(help="Untimed calls before timing.")] = None,
    scale: Annotated[float | None, typer.Option(help="Multiplies every case's N.")] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for kernels.csv/.json.")] = None,
) -> None:
    """Time the policy loss (fwd+bwd) against eager torch, Liger and CCE (cod_fast.bench.kernels)."""
    from cod_fast.bench import kernels

    options = dict(cases=cases, impls=impls, reps=reps, warmup=warmup, scale=scale, out=out)
    kernels.main([a for k, v in options.items() if v is not None for a in (f"--{k}", str(v))])
