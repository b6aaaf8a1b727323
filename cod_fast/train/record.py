"""The step's record: the one line per step of metrics.jsonl (and of the progress display).

`step_record` gathers what a step measured into one flat dict, in a fixed order: the step and
its phase, the batch's episode metrics (reward by position, CoD gain, success, hints, lengths;
per environment in a mixed run), what the batch source and the advantages reported, the loss
metrics of the batch's optimizer steps, the teachers' gaps, then learning rate, tokens and
timings. A metric that does not exist in a step (a float NaN) is written as null, since JSON
has no NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cod_fast.data.metrics import summarize_rollouts
from cod_fast.data.records import Rollout
from cod_fast.ops.loss_terms import SAMPLER_GAP
from cod_fast.train.step import StepResult


@dataclass
class BatchSteps:
    """What one rollout batch's optimizer steps (one per mini-batch) produced."""

    steps: list[StepResult] = field(default_factory=list)
    tokens: int = 0
    """Packed tokens (prompts and responses) over every rank."""
    skipped: int = 0
    """Optimizer steps skipped for a NaN/inf loss or gradient (nothing updated)."""
    error: str = ""
    teacher: list[dict[str, float]] = field(default_factory=list)
    """The teachers' metrics of each mini-batch (cod_fast.train.teachers.Teachers.score)."""


def mean(values: list[float]) -> float:
    """The mean of `values`; NaN (null in the record) for none."""
    return sum(values) / len(values) if values else float("nan")


def episode_metrics(rollouts: list[Rollout], envs: list[str]) -> dict[str, Any]:
    """Per-position reward, CoD gain, success, hint validity, hint quality (cod_fast.data.diagnostics)
    and response lengths of a batch; in a mixed-domain run also reward by position, CoD gain and
    mean reward per environment (`ENV/reward_by_position`, ...; null for an environment without
    a pack this step)."""
    summary = summarize_rollouts(rollouts)
    episodes = [e for r in rollouts for e in r.episodes]
    updates = [e for e in episodes if e.kind == "update"]
    lengths = [sum(len(t.response_ids) for t in e.turns) for e in episodes]
    out: dict[str, Any] = {
        "reward_by_position": summary.mean_reward,
        "cod_gain": summary.cod_gain,
        "reward_mean": mean([x for row in [r.task_rewards for r in rollouts] for x in row]),
        "response_tokens_mean": mean(lengths),
        "cut_frac": mean([float(bool(e.info.get("cut"))) for e in episodes]),
    }
    if summary.success_rate is not None:
        out["success_rate"] = mean(summary.success_rate)
    if updates:
        out["hint_valid_frac"] = mean([float(e.info.get("hints") is not None) for e in updates])
    out.update(summary.hints)
    for env in envs if len(envs) > 1 else []:
        mine = [r for r in rollouts if r.env == env]
        part = summarize_rollouts(mine)
        out[f"{env}/reward_by_position"] = part.mean_reward or None
        out[f"{env}/cod_gain"] = part.cod_gain if mine else None
        out[f"{env}/reward_mean"] = mean([x for r in mine for x in r.task_rewards])
    return out


def teacher_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The teachers' metrics of a step: gaps averaged over its mini-batches, seconds summed."""
    out = {k: mean([p[k] for p in parts if k in p]) for k in {k for p in parts for k in p}}
    if parts:
        out["teacher_s"] = sum(p["teacher_s"] for p in parts)
    return out


def step_record(
    step: int,
    warm_steps: int,
    rollouts: list[Rollout],
    envs: list[str],
    extra: dict[str, Any],
    trained: BatchSteps,
    lr: float,
    times: tuple[float, float, float, float],
    world_size: int,
) -> dict[str, Any]:
    """The record of step `step` (steps completed, this one included; the first `warm_steps`
    are the warm start's): `rollouts` the batch sampled (or the demonstrations), `envs` the
    run's environment names, `extra` what the batch source and the advantages reported,
    `trained` the batch's optimizer steps, `times` perf_counter() at the step's start, after
    sampling, after training and at its end."""
    warm = step <= warm_steps
    start, sampled, done, end = times
    last = trained.steps[-1] if trained.steps else None
    metrics = dict(last.metrics) if last else {}
    # The sampler/trainer gap comes from the batch's first optimizer step, before any update:
    # there trainer and sampler hold the same weights. Warm-start demonstrations have no
    # sampler (their "gap" would be a log-likelihood), so warm steps report none.
    for name in [k for k in metrics if k.startswith(SAMPLER_GAP)]:
        if warm:
            del metrics[name]
        else:
            metrics[name] = trained.steps[0].metrics[name]
            if "staleness" in extra:  # the gap by how old the sampler's weights were
                metrics[f"staleness{extra['staleness']}/{name}"] = metrics[name]
    record: dict[str, Any] = {
        "step": step,
        "phase": "warm_start" if warm else "rl",
        "phase_step": step if warm else step - warm_steps,
        **episode_metrics(rollouts, envs),
        **extra,
        "loss": mean([s.loss for s in trained.steps]),
        "grad_norm": last.grad_norm if last else float("nan"),
        **metrics,
        **teacher_metrics(trained.teacher),
        "lr": lr,
        "tokens": trained.tokens,
        "trainable_tokens": sum(s.trainable_tokens for s in trained.steps),
        "sample_s": sampled - start,
        "train_s": done - sampled,
        "push_s": end - done,
        "step_s": end - start,
        "tokens_per_s_per_device": trained.tokens / (end - start) / world_size,
        "skipped": trained.skipped > 0,
    }
    if trained.skipped:
        record["error"] = trained.error
    # JSON has no NaN: a metric that does not exist this step is null.
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in record.items()}
