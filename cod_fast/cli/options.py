"""The options that choose a run's config (`--preset`, `--config`, `--set`) and the config they
resolve to: what `config show`, `train` and `distill` share (docs/cli.md, "Configuration")."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from cod_fast.cli.common import refuse
from cod_fast.config import Config, ConfigError
from cod_fast.config.io import load_config
from cod_fast.config.presets import DEFAULT_PRESET, PRESETS
from cod_fast.run.validate import validate

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
"""`--set KEY=VALUE`, repeatable: the run commands' config overrides, and the benchmarks' that
start runs."""


def resolve_config(
    preset: str | None,
    config_file: Path | None,
    overrides: list[str] | None,
    *,
    for_training: bool = False,
    cfg: Config | None = None,
) -> Config:
    """The config the options describe (or `cfg`, already resolved), `for_training` also
    checked against this machine before any compute (cod_fast.train.preflight); a ConfigError
    becomes one red line and exit code 2."""
    try:
        if cfg is None:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", FutureWarning)
                cfg = load_config(
                    preset,
                    None if config_file is None else str(config_file),
                    overrides or (),
                    choose_preset=_chosen_preset,
                )
            _show_warnings(caught)
        validate(cfg, folders=False)  # the folders are checked by the preflight
        if for_training:
            from cod_fast.train.preflight import (
                preflight,  # imports torch: only `train` pays for it
            )

            preflight(cfg)
        return cfg
    except ConfigError as e:
        refuse(e)


def _chosen_preset(model: str) -> str:
    """The preset for a config that names its own model and no preset
    (cod_fast.model.preset_choice), said in one line on stderr."""
    from cod_fast.model.preset_choice import preset_for  # imports transformers

    name, params = preset_for(model)
    Console(stderr=True).print(
        f"note: starting from preset {name} (sized nearest to {model}, {params / 1e9:.2f}B "
        "parameters); name another with --preset or a `preset:` key",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return name


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
