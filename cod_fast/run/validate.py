"""A run's config checked against the world outside it: the names it gives exist.

`cod_fast.config` checks what a config says on its own (types, ranges, combinations) and
imports nothing; what needs the world is checked here, in one place, with the same one-line
errors and dotted keys: the environments (a registered name, an installed plugin, a path of
the right form; nothing is imported), the judge (a spec of the right form; nothing is
contacted), and, with `folders`, the model, teacher, tokenizer and init-from folders. The CLI
calls it for every config it resolves, and the preflight (cod_fast.train.preflight) with the
folders before a run; what fits this machine (devices, memory, kernels) is the preflight's.
"""

from __future__ import annotations

from pathlib import Path

from cod_fast.config import Config, ConfigError, EnvEntry, clipped, shown
from cod_fast.envs.registry import environment_problem
from cod_fast.rollout.judge_clients import judge_problem


def validate(cfg: Config, *, folders: bool = True) -> None:
    """Raise ConfigError (one line naming the dotted key) for a name in `cfg` that points at
    nothing: an environment, the judge, and with `folders` a model or tokenizer folder."""
    for key, _, entry in environment_keys(cfg):
        if problem := environment_problem(entry.name):  # type: ignore[arg-type]
            raise ConfigError(key, problem)
    if problem := judge_problem(cfg.rollout.judge):
        raise ConfigError("rollout.judge", problem)
    if folders:
        _check_folders(cfg)


def environment_keys(cfg: Config) -> list[tuple[str, str, EnvEntry]]:
    """(key of its name, key of its options, entry) for every environment `cfg` rolls out, the
    entries as `rollout.environments` resolves them (the keys of algo.teachers are among these
    environments: `Config` checks that)."""
    rollout = cfg.rollout
    if not rollout.envs:
        return [("rollout.env", "rollout.env_options", rollout.environments[0])]
    return [
        (f"rollout.envs[{i}].name", f"rollout.envs[{i}].options", entry)
        for i, entry in enumerate(rollout.environments)
    ]


def _check_folders(cfg: Config) -> None:
    from cod_fast.run.init_from import check_source  # imports torch: only the folders pay

    check_model_path(cfg.model.name_or_path)
    for name, path in cfg.algo.teachers.items():
        if not Path(path).exists():
            raise ConfigError(
                f"algo.teachers.{name}",
                f"got {shown(path)} (no such folder); expected a teacher model folder: "
                f"`cod-fast distill` trains and exports the teachers a config lacks, or write "
                f"one with `cod-fast export TEACHER_RUN --out {clipped(path)}`",
            )
        check_model_path(path, f"algo.teachers.{name}", builtin=False)
    tokenizer = cfg.model.tokenizer_path
    if tokenizer is not None and not (Path(tokenizer) / "tokenizer.json").is_file():
        raise ConfigError(
            "model.tokenizer_path",
            f"got {shown(tokenizer)}, not a folder with a tokenizer.json; expected a saved "
            "tokenizer folder such as another run's tokenizer/",
        )
    if cfg.train.init_from is not None and (problem := check_source(cfg.train.init_from)):
        raise ConfigError("train.init_from", problem)


def check_model_path(name: str, key: str = "model.name_or_path", builtin: bool = True) -> None:
    """Refuse a model that is meant as a local folder and is not a model folder (see
    `model_path_problem`); a hub id is left alone, since whether it exists is only known
    online. `key` is the config field; `builtin` whether the built-in model may be named there."""
    from cod_fast.model.loading import BUILTIN_TINY, model_path_problem  # imports torch

    if name == BUILTIN_TINY:
        if builtin:
            return
        raise ConfigError(
            key, f"got {shown(name)}; expected a model folder or a hub id (owner/name)"
        )
    if problem := model_path_problem(name):
        raise ConfigError(key, problem)
