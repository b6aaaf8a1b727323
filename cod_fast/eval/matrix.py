"""The cross-domain matrix (`cod-fast eval --matrix`): models x environments x pack strategies,
one JSON and one heatmap.

Each model plays as `cod-fast eval --model` plays it (`load_player`, the one code path of both):
a folder written by `cod-fast export` with its run's own evaluation (eval setting, size, packs,
prompt style, token caps, temperature, seed); a run directory of `cod-fast train`, exported to a
temporary folder first and then the same; any other Hugging Face causal LM with fixed defaults;
an API model, `openai:URL#MODEL` (cod_fast.rollout.endpoint_player), with the same defaults, its
row labelled `MODEL@host`.
Only the environment and the pack strategy vary along a row. Every cell starts from the model's
fresh eval sampling stream, so a cell is what `cod-fast eval --model M --env E` reports for it
(one strategy), and a run's cell of any of its environments is that run's own evaluation (as
the trainer evaluates each environment of a mixed run from the same stream). The heatmap shows per
cell the CoD gain (docs/concepts.md section 6, Metrics) and the reward at the last position, each
with one standard error over packs.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from cod_fast.common.safe_write import write_atomic
from cod_fast.config import Config, ModelConfig, clipped, shown
from cod_fast.data.metrics import PositionSummary
from cod_fast.envs import env_class, make_env
from cod_fast.envs.packs import STRATEGIES
from cod_fast.envs.registry import is_path
from cod_fast.eval.evaluate import EvalPlan, eval_defaults, evaluate
from cod_fast.model.loading import (
    ModelFolderError,
    load_model_files,
    load_policy,
    model_path_problem,
    resolve_dtype,
)
from cod_fast.rollout.chat import ChatFormat, names_file
from cod_fast.rollout.endpoint_player import (
    EndpointSampler,
    TextChat,
    parse_player_spec,
    player_label,
    player_spec_shown,
)
from cod_fast.rollout.judge_clients import judge_problem
from cod_fast.rollout.sampler import Sampler
from cod_fast.rollout.torch_sampler import TorchSampler
from cod_fast.run.export import RUN_CONFIG, export_model, read_run_config

Log = Callable[[str], None]


def model_location(model: str | Path) -> Path:
    """`model` (a model folder, run directory or hub id) as a Path, refused at once when it names
    a local folder that does not exist: as a Path, `./name` becomes `name`, which reads as a hub
    id, and transformers would answer with the hub's complaint instead."""
    name = str(model)
    if not Path(name).exists() and (problem := model_path_problem(name)):
        raise ModelFolderError(problem)
    return Path(name)


def is_run_dir(path: Path) -> bool:
    """A run directory of `cod-fast train` (not a model folder): its config and checkpoints."""
    return (path / "config.yaml").is_file() and (path / "checkpoints").is_dir()


@contextmanager
def _model_folder(model: Path) -> Iterator[Path]:
    """`model`, or for a run directory its latest checkpoint exported to a temporary folder
    (removed once the model is loaded: the weights then live in memory)."""
    if not is_run_dir(model):
        yield model
        return
    with tempfile.TemporaryDirectory(prefix="cod-fast-export-") as tmp:
        export_model(model, tmp)
        yield Path(tmp)


def load_player(
    model: str | Path,
    flags: dict | None = None,
    log: Log | None = None,
    *,
    columns: Sequence[str] = (),
) -> tuple[dict, Sampler, ChatFormat | TextChat]:
    """(options, sampler, chat format) for playing `model`: a run's model (exported, or its run
    directory) as its run evaluated, any other model with `eval_defaults(None)`, an API model
    (`openai:URL#MODEL`, cod_fast.rollout.endpoint_player) like any other model, through its
    endpoint and the text chat format. `flags` (keys of those options; None: not given)
    override them; `log` hears of each override of a run's own value; `columns`, the
    environments a matrix plays, stand for the environment. Raises ValueError for an unknown
    flag or environment name before the model loads, and for what the folder's own config may
    not choose (`received_problem`)."""
    endpoint = parse_player_spec(str(model))
    if endpoint is not None:
        o = _options(None, flags, log, columns)
        sampler = EndpointSampler(
            *endpoint, temperature=o["temperature"], top_p=o["top_p"], seed=o["seed"]
        )
        return o, sampler, sampler.chat
    model = model_location(model)
    with _model_folder(model) as folder:
        run = read_run_config(folder)
        o = _options(run, flags, log, columns, model)
        model_cfg, device = _policy_config(folder, run)
        policy, tokenizer = load_policy(model_cfg, device)
    sampler = TorchSampler(
        policy, tokenizer, temperature=o["temperature"], top_p=o["top_p"], seed=o["seed"]
    )
    return o, sampler, ChatFormat.for_model(tokenizer, model_cfg)


def _options(
    run: Config | None,
    flags: dict | None,
    log: Log | None,
    columns: Sequence[str],
    model: Path | None = None,
) -> dict:
    """The play options of a model whose folder holds the run config `run` (None: another
    model), checked as `load_player` says, before any model loads."""
    base = eval_defaults(run)
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown = set(given) - (base.keys() - {"settings", "options"})
    if unknown:
        raise ValueError(f"unknown play options {sorted(unknown)}")
    if run is not None and log is not None:
        for key, value in given.items():
            if value != base[key]:
                log(f"overriding the run's {key}={base[key]!r} with {value!r}")
    o = base | given | ({"env": columns[0]} if columns else {})
    received = run is not None and received_problem(model, run, o, set(given), columns)
    if received:
        raise ValueError(received)
    if problem := judge_problem(o["judge"]):
        raise ValueError(f"--judge: {problem}")
    # A bad name, size or option fails before the model loads.
    make_env(o["env"], o["setting"], o["size"], o["options"].get(o["env"]))
    o["settings"] = o["settings"].with_rollout(
        max_response_tokens=o["max_response_tokens"], judge=o["judge"]
    )
    return o


def received_problem(
    model: Path, run: Config, options: dict, given: set[str], columns: Sequence[str] = ()
) -> str | None:
    """Why a model folder's own run config (`run`) may not choose what it is played with (one
    line), or None. The folder may come from anyone, so what it names that would run code,
    reach another machine or read a file elsewhere is used only when the user names it too: an
    environment given as a path (`--env`, or a matrix column) and a judge other than `rule`
    (`--judge`; an endpoint would receive the episodes and the user's API key). A chat template
    it names as a file is refused outright: an export carries its template in its tokenizer."""
    env, judge = options["env"], options["judge"]
    if is_path(env) and "env" not in given and env not in columns:
        return (
            f"{model} names the environment {shown(env)}, a path to code, which cod-fast does "
            f"not import for a model folder: if you trust that code, name it yourself with "
            f"--env {clipped(env)}"
        )
    if judge != "rule" and "judge" not in given:
        return (
            f"{model} names the judge {shown(judge)}, which cod-fast does not call for a model "
            "folder (an endpoint would receive the episodes and your API key): name the judge "
            f"yourself with --judge {clipped(judge)} if you trust it, or --judge rule"
        )
    template = run.model.chat_template
    if template is not None and names_file(template):
        return (
            f"{model} names the chat template file {shown(template)}, outside the folder, "
            f"which cod-fast does not read for a model folder: delete model.chat_template from "
            f"{model / RUN_CONFIG} (cod-fast export writes the run's template into the "
            "folder's tokenizer)"
        )
    return None


def _policy_config(folder: Path, run) -> tuple[ModelConfig, str]:
    """(model config, device) that a player of the model in `folder` loads it with: its run's
    model settings (`run`: the run's config, None for another model) on this machine's device."""
    model_cfg = ModelConfig() if run is None else run.model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return dataclasses.replace(model_cfg, name_or_path=str(folder)), device


def check_model_folder(model: str | Path) -> None:
    """Raise ModelFolderError where `model`, a model folder, could not be played: its config.json
    against its tokenizer and this machine's memory, as load_player will load it (a run
    directory's own checkpoint is left to its export); an API model's spec is only read (its
    endpoint answers when it plays). ValueError for a malformed spec."""
    if parse_player_spec(str(model)) is not None:
        return
    model = model_location(model)
    if is_run_dir(model):
        return
    cfg, device = _policy_config(model, read_run_config(model))
    load_model_files(cfg.name_or_path, device, resolve_dtype(cfg, torch.device(device)))


def model_labels(models: Sequence[str | Path]) -> list[str]:
    """Each model's folder name, with as many parent folders as it takes to tell them apart; an
    API model's `MODEL@host` (cod_fast.rollout.endpoint_player.player_label)."""
    endpoints = [parse_player_spec(str(m)) for m in models]
    names = [None if e is None else player_label(*e) for e in endpoints]
    folders = [Path(m).resolve().parts for m, e in zip(models, endpoints, strict=True) if not e]
    for depth in range(1, max(map(len, folders), default=1) + 1):
        labels = iter(["/".join(p[-depth:]) for p in folders])
        every = [name or next(labels) for name in names]
        if len(set(every)) == len(every):
            return every
    raise ValueError(f"a model is given twice: {', '.join(map(player_shown, models))}")


def player_shown(model: str | Path) -> str:
    """`model` as matrix.json and the log show it: an API model's spec without credentials or
    query, a folder as given."""
    endpoint = parse_player_spec(str(model))
    return str(model) if endpoint is None else player_spec_shown(*endpoint)


def _cell(model: str, env: str, strategy: str, summary: PositionSummary) -> dict:
    return {
        "model": model,
        "env": env,
        "strategy": strategy,
        "mean_reward": summary.mean_reward,
        "std_error": summary.std_error,
        "cod_gain": summary.cod_gain,
        "cod_gain_se": summary.gain_std_error,
        "last_reward": summary.mean_reward[-1],
        "last_reward_se": summary.std_error[-1],
        "num_packs": summary.num_packs,
    }


def _check_columns(envs: Sequence[str], strategies: Sequence[str]) -> None:
    for kind, names in (("environment", envs), ("strategy", strategies)):
        if not names or len(set(names)) != len(names):
            raise ValueError(f"the matrix needs distinct {kind} names, got {list(names)}")
    for name in envs:
        env_class(name)  # ValueError naming the known environments
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown pack strategy {unknown}; choose from {', '.join(STRATEGIES)}")


def _prefixed(on_progress: Callable[[str, int, int], None], prefix: str, part: str, *n: int):
    """`on_progress` of one model's evaluation: its parts named after the model."""
    on_progress(prefix + part, *n)


def evaluate_matrix(
    models: Sequence[str | Path],
    envs: Sequence[str],
    strategies: Sequence[str] = STRATEGIES,
    packs: int | None = None,
    tasks: int | None = None,
    out_dir: str | Path | None = None,
    *,
    log: Log | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
    **flags,
) -> dict:
    """Evaluate every model on every (environment, strategy); returns the matrix (written as
    matrix.json with matrix.png when `out_dir` is given). `packs`, `tasks` and `flags` (other
    play options: size, setting, max_response_tokens, temperature, top_p, seed, judge; None: each
    model's own) apply to every model; the environments are the columns, never a flag."""
    if "env" in flags:
        raise ValueError("the matrix's environments are its columns: pass them as `envs`")
    _check_columns(envs, strategies)
    labels = model_labels(models)  # before any loading: a model given twice fails at once
    for model in models:  # a bad last model fails before the first one plays
        check_model_folder(model)
    flags = {**flags, "packs": packs, "tasks": tasks}
    rows, cells = [], []
    for i, (label, model) in enumerate(zip(labels, models, strict=True)):
        if log is not None:
            log(f"model {i + 1}/{len(labels)}: {label} ({player_shown(model)})")
        o, sampler, chat = load_player(model, flags, log, columns=envs)
        if o["packs"] < 1:  # a run may evaluate no packs (rollout.eval_packs=0)
            raise ValueError(f"{label} would play {o['packs']} packs; give packs >= 1")
        stream = sampler.state_dict()
        heard = None
        if on_progress is not None:  # the model's label before the part, when there are several
            prefix = f"{label} " if len(labels) > 1 else ""
            heard = functools.partial(_prefixed, on_progress, prefix)
        for env in envs:
            for strategy in strategies:
                plan = EvalPlan(
                    (env,),
                    (strategy,),
                    o["setting"],
                    o["size"],
                    o["packs"],
                    o["tasks"],
                    o["options"],
                )
                sampler.load_state_dict(stream)  # every cell from the model's fresh eval stream
                report = evaluate(sampler, chat, plan, o["settings"], on_progress=heard)
                summary = report["summaries"][env][strategy]
                cells.append(_cell(label, env, strategy, summary))
        played = {k: v for k, v in o.items() if k not in ("env", "settings", "options")}
        settings = dataclasses.asdict(o["settings"])
        rows.append({"label": label, "path": player_shown(model), **played, "settings": settings})
    matrix = {"models": rows, "envs": list(envs), "strategies": list(strategies), "cells": cells}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "matrix.json", json.dumps(matrix, indent=2))
        plot_matrix(matrix, out / "matrix.png")
    return matrix


def plot_matrix(matrix: dict, path: str | Path) -> Path:
    """Two heatmaps side by side, models by `env/strategy`: the CoD gain (diverging colours,
    white at 0) and the reward at the last position; each cell reads "value ± se"."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import Normalize

    models = [m["label"] for m in matrix["models"]]
    columns = [(e, s) for e in matrix["envs"] for s in matrix["strategies"]]
    cells = {(c["model"], c["env"], c["strategy"]): c for c in matrix["cells"]}

    def grid(key: str) -> np.ndarray:
        return np.array([[cells[(m, *col)][key] for col in columns] for m in models], dtype=float)

    gain, last = grid("cod_gain"), grid("last_reward")
    half = float(np.abs(gain).max()) or 1.0  # a symmetric range puts 0 at the middle colour
    panels = (
        ("CoD gain (last position - position 0)", gain, grid("cod_gain_se"), "RdBu", -half, half),
        ("mean reward at the last position", last, grid("last_reward_se"), "viridis", None, None),
    )
    width, height = 2 + 0.85 * len(columns), 2.2 + 0.5 * len(models)
    fig, axes = plt.subplots(1, 2, figsize=(2 * width, height), dpi=120, layout="constrained")
    for ax, (title, values, errors, cmap, vmin, vmax) in zip(axes, panels, strict=True):
        norm = Normalize(vmin, vmax)
        image = ax.imshow(values, cmap=cmap, norm=norm, aspect="auto")
        fig.colorbar(image, ax=ax, shrink=0.9)
        ax.set_xticks(range(len(columns)), [f"{e}/{s}" for e, s in columns], rotation=30)
        ax.set_yticks(range(len(models)), models)
        ax.tick_params(labelsize=8)
        ax.set_title(title, fontsize=10)
        for (i, j), value in np.ndenumerate(values):
            r, g, b, _ = image.cmap(norm(value))
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5  # white text on a dark cell
            text = f"{value:.3f}\n± {errors[i, j]:.3f}"
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="w" if dark else "k")
    fig.suptitle("cross-domain matrix (± one standard error over packs)", fontsize=11)
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, png.getvalue())
    return path
