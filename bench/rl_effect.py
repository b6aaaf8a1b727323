"""What RL adds over the warm start: CoD RL and task-by-task RL from one shared checkpoint.

    python -m cod_fast.bench.rl_effect [--warm-steps 2000] [--rl-steps 150] [--seeds 0,1,2,3,4]
        [--eval-packs 1024] [--set KEY=VALUE ...] [--warm-set KEY=VALUE ...] [--out DIR]
                                               # or: cod-fast bench rl-effect ...

1. One warm start (`train.steps=0`; `--warm-set` overrides apply to it alone, e.g.
   `train.warm_start_hint_dropout=0.5`): supervised steps on scripted demonstrations, the
   checkpoint every arm starts from.
2. For each seed, a CoD-RL arm and a task-by-task-RL arm, both `--init-from` that checkpoint
   with the same compute (steps, packs, group), each with its own seed for sampling and packs.
3. Every run is evaluated with the same CoD protocol (update episodes, hints carried forward)
   on the same `--eval-packs` held-out packs before its first RL step and after its last, so an
   arm's change is paired with its own "before" row (same eval sampling seed).
4. The two arms of a seed share that seed's eval stream (packs and sampling keys), so their
   difference is paired too: per seed, CoD's gain after RL minus task-by-task's, and CoD's change
   minus task-by-task's, reported with their mean, standard deviation and standard error.

Every run is its own `cod-fast train` process (`--set` overrides go to all of them; the preset
is tiny-cpu). Output: a table of the last-minus-first gain (mean and standard deviation over
seeds, before and after RL) and the per-position rewards, DIR/rl_effect.png (per-position reward
after RL, mean over seeds, error bars one standard deviation over seeds, with the shared
checkpoint's curve), DIR/rl_effect.json, a CSV row per arm in DIR/rl_effect.csv, and as the last
stdout line one JSON object. The runs stay in DIR/runs/ (`cod-fast rollout --model` of an
exported run shows what its hints say).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cod_fast.bench.harness import append_csv, emit_summary, print_table, run_meta

ARMS = ("cod", "task_by_task")
PRESET = "tiny-cpu"


def train_process(
    preset: str,
    run_dir: Path,
    overrides: list[str],
    log: Path,
    *,
    ranks: int = 1,
    threads: int | None = None,
) -> None:
    """One `cod-fast train --preset PRESET` in its own process (under torchrun for `ranks` > 1,
    with OMP_NUM_THREADS=`threads` when given); its output goes to `log`."""
    launcher = [sys.executable, "-m"]
    if ranks > 1:
        launcher += ["torch.distributed.run", "--nproc_per_node", str(ranks), "--standalone", "-m"]
    cmd = [*launcher, "cod_fast.cli", "train", "--preset", preset]
    for override in [*overrides, f"runtime.run_dir={run_dir}"]:
        cmd += ["--set", override]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}; see {log}")


@dataclass(frozen=True)
class Arm:
    """One arm of a comparison from a shared checkpoint."""

    prefix: str
    """Its runs are DIR/runs/PREFIX-seedS."""
    overrides: tuple[str, ...] = ()
    """What sets the arm apart."""
    ranks: int = 1
    """Processes under torchrun (1: a plain process)."""
    threads: int | None = None
    """OMP_NUM_THREADS of its processes (None: inherited)."""


def warm_checkpoint(
    warm: Path, warm_steps: int, overrides: list[str], threads: int | None = None
) -> Path:
    """The shared warm start (`train.steps=0`, no evaluations: every arm's "start" row is
    one), trained unless `warm` already holds it."""
    if not (warm / "checkpoints" / "latest").exists():
        settings = ["train.steps=0", f"train.warm_start_steps={warm_steps}", "rollout.eval_packs=0"]
        train_process(
            PRESET, warm, [*overrides, *settings], warm.with_suffix(".log"), threads=threads
        )
    return warm


def run_arms(
    start: Path,
    arms: dict[str, Arm],
    seeds: list[int],
    rl_steps: int,
    eval_packs: int,
    common: list[str],
    runs: Path,
) -> dict[str, list[dict]]:
    """Per seed and arm, `rl_steps` RL steps from the checkpoint `start` (a run that already
    has its "end" evaluation is read, not rerun); per arm, its (seed, before, after) rows."""
    rows: dict[str, list[dict]] = {name: [] for name in arms}
    for seed in seeds:
        for name, arm in arms.items():
            run_dir = runs / f"{arm.prefix}-seed{seed}"
            if "end" not in evaluations(run_dir):
                overrides = [  # the bench's own flags win over --set
                    *common,
                    "train.warm_start_steps=0",
                    f"train.steps={rl_steps}",
                    f"train.seed={seed}",
                    f"train.init_from={start}",
                    f"rollout.eval_packs={eval_packs}",
                    *arm.overrides,
                ]
                log = run_dir.with_suffix(".log")
                train_process(PRESET, run_dir, overrides, log, ranks=arm.ranks, threads=arm.threads)
            evals = evaluations(run_dir)
            rows[name].append({"seed": seed, "before": evals["start"], "after": evals["end"]})
    return rows


def evaluations(run_dir: Path) -> dict[str, dict]:
    """A run's evaluations by label (none for a run not yet evaluated)."""
    path = run_dir / "eval.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {row["label"]: row for row in rows}


def spread(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; 0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def fmt_spread(pair: tuple[float, float]) -> str:
    """A gain's (mean, standard deviation) as `+0.123 +- 0.045`."""
    return f"{pair[0]:+.3f} +- {pair[1]:.3f}"


def run(args) -> dict:
    runs = Path(args.out) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    warm = warm_checkpoint(runs / "warm", args.warm_steps, [*args.set, *args.warm_set])
    arms = {arm: Arm(arm, (f"algo.algorithm={arm}",)) for arm in ARMS}
    rows = run_arms(warm, arms, args.seeds, args.rl_steps, args.eval_packs, args.set, runs)
    return summarize_arms(rows)


def summarize_arms(arms: dict[str, list[dict]], pair: tuple[str, str] = ARMS) -> dict:
    """Each arm's gains over seeds (before RL, after, the change) with its per-position rewards
    and hint diagnostics, and the per-seed paired difference of the two arms of `pair`.
    `arms`: per arm, one {"seed", "before", "after"} per seed (eval.jsonl rows)."""
    results: dict[str, dict] = {}
    for arm, seeds in arms.items():
        before = [s["before"]["cod_gain"] for s in seeds]
        after = [s["after"]["cod_gain"] for s in seeds]
        positions = list(zip(*(s["after"]["mean_reward"] for s in seeds), strict=True))
        results[arm] = {
            "seeds": [s["seed"] for s in seeds],
            "gain_before": spread(before),
            "gain_after": spread(after),
            "gain_change": spread([a - b for a, b in zip(after, before, strict=True)]),
            "after_by_position": [spread(list(p)) for p in positions],
            "before_by_position": [
                spread(list(p))
                for p in zip(*(s["before"]["mean_reward"] for s in seeds), strict=True)
            ],
            "eval_packs": seeds[0]["after"]["num_packs"],
            "diagnostics": _diagnostics([s["after"] for s in seeds]),
        }
    return {"arms": results, "paired": _paired(arms, *pair)}


def _paired(arms: dict[str, list[dict]], first: str, second: str) -> dict:
    """Per seed, arm `first` minus arm `second` (CoD minus task-by-task here): the gain after RL
    and the change RL made (each arm's after minus its own before); each as per-seed values,
    mean, standard deviation and standard error of the mean."""
    by_seed = {arm: {s["seed"]: s for s in seeds} for arm, seeds in arms.items()}
    seeds = sorted(by_seed[first].keys() & by_seed[second].keys())

    def difference(value) -> dict:
        diffs = [value(by_seed[first][s]) - value(by_seed[second][s]) for s in seeds]
        mean, std = spread(diffs)
        return {"per_seed": diffs, "mean": mean, "std": std, "sem": std / len(diffs) ** 0.5}

    return {
        "seeds": seeds,
        "gain_after": difference(lambda s: s["after"]["cod_gain"]),
        "gain_change": difference(lambda s: s["after"]["cod_gain"] - s["before"]["cod_gain"]),
    }


def _diagnostics(rows: list[dict]) -> dict[str, float]:
    """The mean over seeds of every hint-quality field of the final evaluations (the fields an
    environment with a ground truth reports, docs/run-directory.md)."""
    keys = sorted({k for row in rows for k, v in row.items() if k.startswith("hint_")
                   and isinstance(v, int | float)})  # fmt: skip
    return {k: statistics.fmean(row[k] for row in rows if k in row) for k in keys}


def _plot(results: dict, path: Path) -> None:
    from cod_fast.data.metrics import PositionSummary, plot_positions

    curves = {}
    first = next(iter(results["arms"].values()))
    curves["shared checkpoint (before RL)"] = PositionSummary(
        mean_reward=[m for m, _ in first["before_by_position"]],
        success_rate=None,
        num_packs=first["eval_packs"],
        std_error=[s for _, s in first["before_by_position"]],
    )
    for arm, r in results["arms"].items():
        curves[f"after {arm} RL"] = PositionSummary(
            mean_reward=[m for m, _ in r["after_by_position"]],
            success_rate=None,
            num_packs=r["eval_packs"],
            std_error=[s for _, s in r["after_by_position"]],
        )
    plot_positions(
        curves,
        path,
        "CoD-protocol eval, mean over seeds",
        errors=f"one standard deviation over {len(first['seeds'])} seeds",
    )


TABLE = (
    ("arm", "arm", ""),
    ("seeds", "seeds", ""),
    ("gain_before", "gain before RL", ""),
    ("gain_after", "gain after RL", ""),
    ("gain_change", "change", ""),
    ("positions", "after RL, by position", ""),
)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-steps", type=int, default=2000)
    parser.add_argument("--rl-steps", type=int, default=150)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated train.seed values")
    parser.add_argument("--eval-packs", type=int, default=1024, help="held-out packs per eval")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    parser.add_argument(
        "--warm-set", action="append", default=[], help="KEY=VALUE for the warm start only"
    )
    parser.add_argument("--out", default="bench/results/rl_effect")
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    results = run(args)
    out = Path(args.out)
    _plot(results, out / "rl_effect.png")

    rows = [
        {
            "arm": arm,
            "seeds": ",".join(map(str, r["seeds"])),
            "gain_before": fmt_spread(r["gain_before"]),
            "gain_after": fmt_spread(r["gain_after"]),
            "gain_change": fmt_spread(r["gain_change"]),
            "positions": " ".join(f"{m:.3f}" for m, _ in r["after_by_position"]),
        }
        for arm, r in results["arms"].items()
    ]
    paired = results["paired"]
    rows.append(
        {
            "arm": "cod - task_by_task",
            "seeds": ",".join(map(str, paired["seeds"])),
            "gain_before": "",
            "gain_after": _fmt_paired(paired["gain_after"]),
            "gain_change": _fmt_paired(paired["gain_change"]),
            "positions": "(paired per seed)",
        }
    )
    print_table("RL effect (gain = last position - first, mean +- std over seeds)", TABLE, rows)
    meta = run_meta()
    append_csv(out / "rl_effect.csv", TABLE, rows, meta)
    settings = {
        "warm_steps": args.warm_steps,
        "rl_steps": args.rl_steps,
        "eval_packs": args.eval_packs,
        "set": args.set,
        "warm_set": args.warm_set,
    }
    return emit_summary({**meta, "settings": settings, **results}, out / "rl_effect.json")


def _fmt_paired(d: dict) -> str:
    """A paired difference as `+0.123 +- 0.045 (se 0.020)`."""
    return f"{fmt_spread((d['mean'], d['std']))} (se {d['sem']:.3f})"


if __name__ == "__main__":
    main()
