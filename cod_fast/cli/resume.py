"""The config `cod-fast train --resume [RUN]` continues with: the run's own.

A resumed run continues with the config it was started with, `RUN/config.yaml` (written by
the run), so `--resume RUN` alone is enough, however the run was started (a preset, a config
file, overrides). What the user gives besides is merged over it: `--config FILE` and `--set
KEY=VALUE`, and only what those change is compared with the checkpoint (cod_fast.run.directory:
how a run executes may change, what it computes may not). Without RUN, the run is the one in
`runtime.run_dir` of the config the other options describe. With `--preset`, the run continues
with the whole config the options describe (preset, file, overrides), compared in full with the
checkpoint: the command that started the run, rerun with `--resume`.

A run directory may come from someone else, so what its config names that would run code,
reach another machine or read a file elsewhere is used only when the user names it too: an
environment given as a path, a judge other than `rule` (an endpoint would receive the episodes
and the user's API key), a chat template given as a file. The run writes only into RUN.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cod_fast.cli.common import fail, refuse
from cod_fast.cli.options import resolve_config
from cod_fast.config import Config, ConfigError, clipped, shown
from cod_fast.config.io import load_config, load_run_config, named_keys
from cod_fast.config.presets import DEFAULT_PRESET
from cod_fast.envs.registry import is_path
from cod_fast.rollout.chat import names_file

RUN_CONFIG = "config.yaml"


def resumed_config(
    run: Path | None, preset: str | None, config_file: Path | None, overrides: list[str]
) -> Config:
    """The config of `--resume` (module docstring); a refusal is one red line, exit code 2."""
    given = None if config_file is None else str(config_file)
    if run is not None:
        named = resolve_run_dir(given, overrides)
        if named is not None and Path(named) != run:
            fail(
                f"--resume {run} with runtime.run_dir={named}: a resumed run writes only into "
                "its own folder; drop runtime.run_dir (or resume that folder)"
            )
    if preset is not None or run is None:
        cfg = resolve_config(preset, config_file, overrides)
        if preset is not None:  # the whole config the options describe, as the run began
            return cfg if run is None else _in(cfg, run)
        run = Path(cfg.runtime.run_dir)
    if not (run / RUN_CONFIG).is_file():  # --resume's own rules name what is missing
        return _in(resolve_config(None, config_file, overrides), run)
    try:
        cfg = _in(load_run_config(run / RUN_CONFIG, given, overrides), run)
    except ConfigError as e:
        refuse(e)
    if problem := received_problem(run, cfg, named_keys(given, overrides)):
        fail(problem)
    return resolve_config(None, None, None, cfg=cfg)


def _in(cfg: Config, run: Path) -> Config:
    """`cfg` writing into `run`."""
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, run_dir=str(run)))


def resolve_run_dir(config_file: str | None, overrides: list[str]) -> str | None:
    """The runtime.run_dir the user's own config file or overrides set, if any (the last)."""
    for override in reversed(overrides):
        key, _, value = override.partition("=")
        if key.strip() == "runtime.run_dir":
            return value.strip()
    if config_file is not None and "runtime.run_dir" in named_keys(config_file, ()):
        try:
            return load_config(DEFAULT_PRESET, config_file).runtime.run_dir
        except ConfigError as e:
            refuse(e)
    return None


def received_problem(run: Path, cfg: Config, given: set[str]) -> str | None:
    """Why the run's own config may not choose something it names (one line), or None: an
    environment path, a judge endpoint or a chat template file the user did not name."""
    where = f"{run / RUN_CONFIG}"
    for entry in cfg.rollout.environments:
        if entry.name is not None and is_path(entry.name) and not given & _ENV_KEYS:
            return (
                f"{where} names the environment {shown(entry.name)}, a path to code, which "
                "cod-fast does not import from a run directory: if you trust that code, name "
                f"it yourself with --set rollout.env={clipped(entry.name)} (or rollout.envs)"
            )
    if cfg.rollout.judge != "rule" and "rollout.judge" not in given:
        return (
            f"{where} names the judge {shown(cfg.rollout.judge)}, which cod-fast does not call "
            "for a run directory (an endpoint would receive the episodes and your API key): "
            f"name it yourself with --set rollout.judge={clipped(cfg.rollout.judge)} if you "
            "trust it"
        )
    template = cfg.model.chat_template
    if template is not None and names_file(template) and "model.chat_template" not in given:
        return (
            f"{where} names the chat template file {shown(template)}, which cod-fast does not "
            "read for a run directory: name it yourself with --set model.chat_template=PATH"
        )
    return None


_ENV_KEYS = {"rollout.env", "rollout.envs"}
