"""`cod-fast plan`: will this config fit, per GPU and per phase, and what is the most that fits
(cod_fast.train.memory_plan; docs/gpu.md, "Sizing a run")."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from cod_fast.cli.common import refuse
from cod_fast.cli.options import ConfigFileOption, PresetOption, SetOption, resolve_config
from cod_fast.config import Config, ConfigError, ModelConfig
from cod_fast.model.loading import ModelFolderError
from cod_fast.model.shapes import KNOWN_CONFIGS, ModelShape, model_shape
from cod_fast.rollout.choice import choose_sampler
from cod_fast.train.memory_plan import (
    GIB,
    MemoryPlan,
    check_fits,
    largest_fitting,
    plan_memory,
    with_setting,
)


def plan(
    preset: PresetOption = None,
    config_file: ConfigFileOption = None,
    overrides: SetOption = None,
    gpus: Annotated[
        int, typer.Option("--gpus", help="GPUs of the run (torchrun's world size).")
    ] = 1,
    gpu_memory: Annotated[
        float | None,
        typer.Option("--gpu-memory", help="GiB of each GPU; default this machine's GPU, if any."),
    ] = None,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(
            "--prompt-tokens",
            help="A rollout's longest prompt; default rollout.max_hint_tokens + "
            "rollout.max_response_tokens.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Peak memory per GPU of each phase of a run, by component, from the model's config alone
    (no weights are loaded), the longest sequence a micro-batch holds, and the largest token
    budget a GPU, group size and model that fit."""
    cfg = resolve_config(preset, config_file, overrides)
    if gpus < 1:
        refuse(ConfigError("--gpus", f"got {gpus}; give the number of GPUs of the run (>= 1)"))
    memory = _gpu_memory(gpu_memory)
    try:
        shape = model_shape(cfg.model)
        teachers = [model_shape(ModelConfig(name_or_path=p)) for p in cfg.algo.teachers.values()]
        sampler, _ = choose_sampler(cfg.rollout.sampler, "cuda", shape.head_dim)
    except (ModelFolderError, ValueError) as e:
        refuse(ConfigError("model.name_or_path", str(e)))

    def plan_of(c: Config, s: ModelShape = shape) -> MemoryPlan:
        return plan_memory(
            c,
            s,
            gpus=gpus,
            memory=memory,
            sampler=sampler,
            prompt_tokens=prompt_tokens,
            teachers=teachers,
        )

    try:
        result = plan_of(cfg)
    except ConfigError as e:  # train.sequence_parallel against the GPUs or the model's heads
        refuse(e)
    except ValueError as e:
        refuse(ConfigError("--gpus", str(e)))
    limits = _limits(cfg, plan_of) if memory is not None else {}
    if as_json:
        print(json.dumps(_as_dict(result, sampler, limits), indent=1))
        return
    _show(result, sampler, limits)


def _gpu_memory(gib: float | None) -> int | None:
    if gib is not None:
        if gib <= 0:
            refuse(ConfigError("--gpu-memory", f"got {gib}; give each GPU's memory in GiB (> 0)"))
        return int(gib * GIB)
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def _limits(cfg: Config, plan_of) -> dict:
    """The largest token budget (a GPU's), group size and known model that fit, the rest as
    configured; a known model whose heads train.sequence_parallel does not split is left out."""
    rollout = cfg.rollout
    budget = largest_fitting(
        lambda t: plan_of(with_setting(cfg, "train", token_budget=t)), 256, 1 << 22
    )
    group = (
        largest_fitting(lambda g: plan_of(with_setting(cfg, "rollout", group_size=g)), 2, 1024)
        if cfg.train.steps
        else None
    )
    models = [name for name in KNOWN_CONFIGS if _fits(plan_of, cfg, name)]
    return {
        "train.token_budget": budget,
        "rollout.group_size": group,
        "model": models[-1] if models else None,
        "_now": {
            "train.token_budget": cfg.train.token_budget,
            "rollout.group_size": rollout.group_size,
        },
    }


def _fits(plan_of, cfg: Config, name: str) -> bool:
    try:
        return bool(plan_of(cfg, model_shape(ModelConfig(name_or_path=name))).fits())
    except ConfigError:  # train.sequence_parallel does not split its attention heads
        return False


def _why_not(result: MemoryPlan) -> str | None:
    """The refusal the preflight would give this plan on its device (None: it fits)."""
    try:
        check_fits(result)
    except ConfigError as e:
        return str(e)
    return None


def _as_dict(result: MemoryPlan, sampler: str, limits: dict) -> dict:
    return {
        "model": result.model,
        "gpus": result.gpus,
        "sequence_parallel": result.sequence_parallel,
        "longest_sequence": result.longest_sequence,
        "sampler": sampler,
        "gpu_memory": result.memory,
        "fits": result.fits(),
        "peak_phase": result.peak.name,
        "phases": {
            p.name: {"bytes": p.bytes, "terms": [dataclasses.asdict(t) for t in p.terms]}
            for p in result.phases
        },
        "vllm_need_and_share": result.engine,
        "why_not": _why_not(result),
        "host_per_node": [dataclasses.asdict(t) for t in result.host],
        "largest_fitting": {k: v for k, v in limits.items() if not k.startswith("_")},
        "notes": result.notes,
    }


def _show(result: MemoryPlan, sampler: str, limits: dict) -> None:
    console = Console()
    sp = result.sequence_parallel
    where = f"{result.model} on {result.gpus} GPU(s)"
    if sp > 1:
        where += f", sequence parallel over {sp}"
    table = Table(title=f"{where}, {sampler} sampler: GiB per GPU")
    table.add_column("component")
    for phase in result.phases:
        table.add_column(phase.name, justify="right")
    names = list(dict.fromkeys(t.name for p in result.phases for t in p.terms))
    for name in names:
        cells = []
        for phase in result.phases:
            found = [t.bytes for t in phase.terms if t.name == name]
            cells.append(f"{sum(found) / GIB:.2f}" if found else "")
        table.add_row(name, *cells)
    table.add_row("total", *(f"{p.bytes / GIB:.2f}" for p in result.phases), style="bold")
    console.print(table)
    split = f" (train.token_budget x train.sequence_parallel={sp})" if sp > 1 else ""
    console.print(f"longest sequence: {result.longest_sequence:,} tokens{split}")
    peak = result.peak
    if result.memory is None:
        console.print(f"peak: {peak.name}, {peak.bytes / GIB:.2f} GiB a GPU (give --gpu-memory)")
    else:
        verdict = "fits" if result.fits() else "does not fit"
        console.print(
            f"peak: {peak.name}, {peak.bytes / GIB:.2f} GiB of {result.usable / GIB:.2f} usable "
            f"GiB a GPU: {verdict}"
        )
        if why := _why_not(result):
            console.print(f"why: {why}", markup=False, highlight=False)
        now = limits["_now"]
        for key in ("train.token_budget", "rollout.group_size", "model"):
            if key in limits and limits[key] is not None:
                current = f" (now {now[key]})" if key in now else ""
                if key == "train.token_budget":
                    current = f" a GPU{current}"
                    if sp > 1:
                        current += f": sequences of up to {limits[key] * sp:,} tokens"
                console.print(f"largest that fits: {key}={limits[key]}{current}")
    for term in result.host:
        console.print(
            f"host memory of a node, {term.name}: {term.bytes / GIB:.2f} GiB ({term.what})"
        )
    for note in result.notes:
        console.print(f"[dim]{note}[/dim]")
