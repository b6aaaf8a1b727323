"""Evaluation: a policy over fixed eval packs, per-position rewards, the CoD gain, and a plot.

In-domain is the eval setting of the training environment; cross-domain the other
environments; the Ralph loop the `ralph_sample` and `ralph_full` pack strategies. Eval pack seeds
are stable (`pack_seeds("eval", n)`), so every checkpoint sees the same packs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cod_fast.envs import make_env
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.metrics import PositionSummary, plot_positions, summarize_rollouts
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings, RolloutDriver
from cod_fast.rollout.sampler import Sampler


@dataclass(frozen=True)
class EvalPlan:
    envs: tuple[str, ...]
    strategies: tuple[str, ...] = ("cod",)
    setting: str = "eval"
    size: str = "full"
    packs: int = 32
    tasks: int = 4


def evaluate(
    sampler: Sampler,
    chat: ChatFormat,
    plan: EvalPlan,
    settings: DriverSettings,
    out_dir: str | Path | None = None,
) -> dict:
    """Run every (environment, strategy) of the plan; returns the report (written as JSON, with
    a plot, when `out_dir` is given) and, under "summaries", the PositionSummary objects."""
    summaries: dict[str, PositionSummary] = {}
    results: dict[str, dict] = {}
    by_env: dict[str, dict[str, PositionSummary]] = {}
    for name in plan.envs:
        env = make_env(name, plan.setting, plan.size)  # type: ignore[arg-type]
        driver = RolloutDriver(env, sampler, chat, settings)
        for strategy in plan.strategies:
            packs = make_packs(pack_seeds("eval", plan.packs), plan.tasks, strategy)  # type: ignore[arg-type]
            summary = summarize_rollouts(driver.run(packs, group_size=1))
            summaries[f"{name}/{strategy}"] = summary
            by_env.setdefault(name, {})[strategy] = summary
            results.setdefault(name, {})[strategy] = summary.to_dict()
    report = {
        "setting": plan.setting,
        "size": plan.size,
        "packs": plan.packs,
        "tasks": plan.tasks,
        "results": results,
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "eval.json.tmp"
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(out / "eval.json")
        plot_positions(
            summaries, out / "eval.png", f"reward by pack position ({plan.setting}, {plan.size})"
        )
    return {**report, "summaries": by_env}
