"""Evaluation: a policy over fixed eval packs, per-position rewards, the CoD gain, and a plot.

In-domain is the eval setting of the training environment; cross-domain the other
environments; the Ralph loop the `ralph_sample` and `ralph_full` pack strategies. Eval pack seeds
are stable (`pack_seeds("eval", n)`), so every checkpoint sees the same packs.

A run evaluates with `run_eval_plan`, `run_eval_settings` and `run_eval_sampling` of its config,
and so does `cod-fast eval` of a model exported from it: the same packs, settings and sampling
noise, so the two agree. Evaluation always plays the CoD protocol (see `run_eval_settings`).

Sampling is keyed (cod_fast.rollout.sampler): each response's noise comes from its pack, task
and turn, so a run under torchrun splits the eval packs over its ranks, each rolls out its
share, and the summary over all of them is the one a single rank would compute (to the
rounding of the forward passes, which batch composition can change).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cod_fast.common.safe_write import write_atomic
from cod_fast.config import Config, RolloutConfig
from cod_fast.data.diagnostics import hint_checks, hint_metrics
from cod_fast.data.metrics import PositionSummary, plot_positions, solve_results, summarize
from cod_fast.distributed.context import DistContext, gather_objects
from cod_fast.envs import make_env
from cod_fast.envs.packs import PackSpec, make_packs, pack_seeds
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings, RolloutDriver
from cod_fast.rollout.sampler import Sampler

EVAL_SEED = 7_919
"""A run's eval sampler seed is train.seed + this: its own stream, the same at every evaluation."""


@dataclass(frozen=True)
class EvalPlan:
    envs: tuple[str, ...]
    strategies: tuple[str, ...] = ("cod",)
    setting: str = "eval"
    size: str = "full"
    packs: int = 32
    tasks: int = 4
    options: dict[str, dict[str, str | int | float | bool | None]] = field(default_factory=dict)
    """Constructor options by environment name (a run's `rollout.env_options`); an environment
    not named here is made without any."""


def run_eval_plans(cfg: Config) -> list[EvalPlan]:
    """A run's held-out evaluation: each environment's eval packs at its size, in the run's eval
    setting (one plan per environment: sizes may differ)."""
    rollout = cfg.rollout
    return [
        EvalPlan(
            envs=(entry.name,),  # type: ignore[arg-type]
            setting=rollout.eval_setting,
            size=entry.size,  # type: ignore[arg-type]
            packs=rollout.eval_packs,
            tasks=rollout.tasks_per_pack,
            options={entry.name: entry.options},  # type: ignore[dict-item]
        )
        for entry in rollout.environments
    ]


def run_eval_sampling(cfg: Config) -> dict[str, float | int]:
    """The eval sampler's temperature, top_p and seed for a run."""
    temperature = cfg.rollout.eval_temperature or cfg.rollout.temperature
    return {
        "temperature": temperature,
        "top_p": cfg.rollout.top_p,
        "seed": cfg.train.seed + EVAL_SEED,
    }


def run_eval_settings(cfg: Config) -> DriverSettings:
    """A run's evaluation rollouts: its driver settings with the CoD protocol (update episodes,
    hints carried from task to task), whatever the run trained with. A task-by-task arm then
    measures what its policy does when it may write hints, as the CoD arm is measured; in its
    own mode every task starts from null hints and the curve is flat by construction."""
    return dataclasses.replace(DriverSettings.from_config(cfg), mode="cod")


def eval_defaults(cfg: Config | None) -> dict:
    """What `cod-fast eval` uses where no flag says otherwise: for a model exported from a run
    (`cfg`, its resolved config) the run's own evaluation; for any other model fixed defaults."""
    if cfg is None:
        return {
            "env": "frozenlake",
            "size": "full",
            "setting": "eval",
            "packs": 32,
            "tasks": 4,
            "max_response_tokens": 512,
            "temperature": 1.0,
            "top_p": 1.0,
            "seed": 0,
            "judge": "rule",
            "settings": DriverSettings(rollout=RolloutConfig(env_timeout_s=None)),
            "options": {},
        }
    plan = run_eval_plans(cfg)[0]  # a mixed-domain run: its first environment
    return {
        "env": plan.envs[0],
        "size": plan.size,
        "setting": plan.setting,
        "packs": plan.packs,
        "tasks": plan.tasks,
        "max_response_tokens": cfg.rollout.max_response_tokens,
        **run_eval_sampling(cfg),
        "judge": cfg.rollout.judge,
        "settings": run_eval_settings(cfg),
        "options": {e.name: e.options for e in cfg.rollout.environments},
    }


def _rolled_out(
    driver: RolloutDriver,
    packs: list[PackSpec],
    ctx: DistContext | None,
    on_progress: Callable[[int, int], None] | None,
) -> PositionSummary:
    """The summary of `packs` rolled out once each with keyed sampling, with the hint quality of
    their update episodes; with `ctx`, each rank plays every world_size-th pack and every rank
    gets the summary over all of them, in pack order."""
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    mine = driver.run(packs[rank::world], group_size=1, keyed=True, on_progress=on_progress)
    rows = [(r.pack_id, *solve_results(r), hint_checks(r)) for r in mine]
    if ctx is not None:
        parts = gather_objects(rows, ctx)
        rows = sorted((row for part in parts for row in part), key=lambda row: row[0])
    summary = summarize([row[1] for row in rows], [row[2] for row in rows])
    summary.hints = hint_metrics([row[3] for row in rows])
    return summary


def evaluate(
    sampler: Sampler,
    chat: ChatFormat,
    plan: EvalPlan,
    settings: DriverSettings,
    out_dir: str | Path | None = None,
    ctx: DistContext | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    """Run every (environment, strategy) of the plan; returns the report (written as JSON, with
    a plot, when `out_dir` is given) and, under "summaries", the PositionSummary objects. Under
    `ctx` every rank calls this with its own sampler and plays its share of the packs.
    `on_progress(part, done, total)` hears the finished tasks of each (environment, strategy)
    part as it plays (this rank's share)."""
    summaries: dict[str, PositionSummary] = {}
    results: dict[str, dict] = {}
    by_env: dict[str, dict[str, PositionSummary]] = {}
    for name in plan.envs:
        env = make_env(name, plan.setting, plan.size, plan.options.get(name))  # type: ignore[arg-type]
        driver = RolloutDriver(env, sampler, chat, settings)
        for strategy in plan.strategies:
            packs = make_packs(pack_seeds("eval", plan.packs), plan.tasks, strategy)  # type: ignore[arg-type]
            part = f"{name}/{strategy}"
            heard = None if on_progress is None else functools.partial(on_progress, part)
            summary = _rolled_out(driver, packs, ctx, heard)
            summaries[f"{name}/{strategy}"] = summary
            by_env.setdefault(name, {})[strategy] = summary
            results.setdefault(name, {})[strategy] = summary.to_dict()
    report = {
        "setting": plan.setting,
        "size": plan.size,
        "packs": plan.packs,
        "tasks": plan.tasks,
        "hint_source": settings.hint_source,
        "results": results,
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "eval.json", json.dumps(report, indent=2))
        plot_positions(
            summaries, out / "eval.png", f"reward by pack position ({plan.setting}, {plan.size})"
        )
    return {**report, "summaries": by_env}
