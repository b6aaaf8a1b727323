"""Asynchronous RL's throughput: the sampler on one core, the trainer on the other.

    python -m cod_fast.bench.async_rl [--models tiny,small] [--staleness 1,2] [--warm-steps 200]
        [--rl-steps 16] [--set KEY=VALUE ...] [--out DIR]   # or: cod-fast bench async ...

For each model (`tiny`: the tiny-cpu preset's; `small`: 4 layers, hidden 512, 8 heads, the
sampler benchmark's `small`), from one short warm start (the tiny-cpu preset, `train.steps=0`,
so rollouts look like trained ones), `--rl-steps` RL steps of the preset, no evaluations:
1. `one core`: the synchronous loop, one process, one thread: each step's sampling time S and
   training time T (train + push), and from them the ideal overlap speedup (S + T) / max(S, T)
   a two-stage pipeline on two cores could reach;
2. `K=0`: the synchronous loop, one process on both cores (two threads): today's `cod-fast train`;
3. `K=k` for each `--staleness`: `torchrun --nproc_per_node 2`, one trainer and one rollout
   worker (`runtime.rollout_ranks=1`, `train.max_staleness=k`), one thread each.
Per arm: the mean RL step time (the trainer's whole step, its waits for batches included; the
first two steps left out: start-up), training tokens per second (packed tokens over step time),
and the speedup over the one-core loop's S + T, with its fraction of the ideal. For the
asynchronous arms also each stage's time as measured there, with both cores busy (the
worker's sampling; the trainer's step less its wait for the batch), and `of pipeline`: the
slower stage over the step time, how close the overlap comes to what those stages allow.

With `--learn-seeds 0,1,2`, also what staleness does to learning: from one warm-started
checkpoint (`--learn-from RUN`, e.g. `cod-fast bench rl-effect`'s `runs/warm`; else a warm
start of `--learn-warm-steps` made here), per seed a synchronous arm (K=0, one process) and an
asynchronous one (K=`--learn-staleness`, a trainer and a worker), `--learn-steps` RL steps each,
evaluated with the CoD protocol on `--eval-packs` held-out packs before and after (the two arms
of a seed share the eval stream, so their difference is paired, as in `bench rl-effect`).

Runs in DIR/runs/ (a finished run is read, not rerun); a CSV row per arm in DIR/async.csv,
DIR/async.json, and as the last stdout line one JSON object. CPU only (the device is whatever
the preset picks: use it on a CPU machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from cod_fast.bench.harness import append_csv, emit_summary, print_table, run_meta
from cod_fast.bench.rl_effect import (
    PRESET,
    Arm,
    fmt_spread,
    run_arms,
    summarize_arms,
    train_process,
    warm_checkpoint,
)

MODELS = {
    "tiny": [],
    "small": [
        "model.num_layers=4",
        "model.hidden_size=512",
        "model.num_heads=8",
        "model.intermediate_size=1024",
    ],
}
SKIP = 2
"""RL steps at the start of each arm left out of its means (allocation, first weights)."""
TABLE = (
    ("model", "model", ""),
    ("arm", "arm", ""),
    ("step_s", "RL step s", ".3f"),
    ("sample_s", "S (sample) s", ".3f"),
    ("train_s", "T (train) s", ".3f"),
    ("tokens_per_s", "train tok/s", ".0f"),
    ("speedup", "x one core", ".2f"),
    ("ideal", "ideal x", ".2f"),
    ("of_ideal", "of ideal", ".2f"),
    ("staleness", "mean staleness", ".2f"),
    ("of_pipeline", "of pipeline", ".2f"),
)


def _train(run_dir: Path, overrides: list[str], *, threads: int, ranks: int = 1) -> list[dict]:
    """One `cod-fast train --preset tiny-cpu` (under torchrun for `ranks` > 1) into `run_dir`;
    its RL steps' metrics records. Output to run_dir.log."""
    log = run_dir.with_suffix(".log")
    train_process(PRESET, run_dir, overrides, log, ranks=ranks, threads=threads)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "rl"]


def _mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows[SKIP:])


def _arm(model: str, arm: str, rows: list[dict], sequential: float, ideal: float) -> dict:
    step = _mean(rows, "step_s")
    tokens = sum(r["tokens"] for r in rows[SKIP:]) / sum(r["step_s"] for r in rows[SKIP:])
    staleness = [r["staleness"] for r in rows[SKIP:] if r.get("staleness") is not None]
    stages = {}
    if staleness:  # each stage's time as measured in this arm, both cores busy
        sample = _mean(rows, "worker_sample_s")
        train = statistics.fmean(r["step_s"] - r["rollout_wait_s"] for r in rows[SKIP:])
        stages = {"sample_s": sample, "train_s": train, "of_pipeline": max(sample, train) / step}
    return {
        **stages,
        "model": model,
        "arm": arm,
        "step_s": step,
        "tokens_per_s": tokens,
        "speedup": sequential / step,
        "ideal": ideal,
        "of_ideal": (sequential / step - 1) / (ideal - 1) if ideal > 1 else None,
        "staleness": statistics.fmean(staleness) if staleness else None,
    }


def run(args) -> list[dict]:
    runs = Path(args.out) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        warm = runs / f"{model}-warm"
        if not (warm / "checkpoints" / "latest").exists():
            sizes = [*MODELS[model], "train.steps=0", f"train.warm_start_steps={args.warm_steps}"]
            _train(warm, [*sizes, "rollout.eval_packs=0", *args.set], threads=2)
        common = [
            *MODELS[model],
            f"train.init_from={warm}",
            "train.warm_start_steps=0",
            f"train.steps={args.rl_steps}",
            "rollout.eval_packs=0",
            "runtime.checkpoint_every=0",
            *args.set,
        ]
        one = _train(runs / f"{model}-one-core", common, threads=1)
        sample, train = _mean(one, "sample_s"), _mean(one, "step_s") - _mean(one, "sample_s")
        sequential, ideal = sample + train, (sample + train) / max(sample, train)
        first = _arm(model, "one core (S + T)", one, sequential, ideal)
        rows.append({**first, "sample_s": sample, "train_s": train})
        both = _train(runs / f"{model}-k0", common, threads=2)
        rows.append(_arm(model, "K=0, 2 threads", both, sequential, ideal))
        for k in args.staleness:
            split = [*common, "runtime.rollout_ranks=1", f"train.max_staleness={k}"]
            rows.append(
                _arm(
                    model,
                    f"K={k}, 2 processes",
                    _train(runs / f"{model}-k{k}", split, threads=1, ranks=2),
                    sequential,
                    ideal,
                )
            )
    return rows


def learn(args) -> dict:
    """K=0 against K=`--learn-staleness` from one checkpoint over `--learn-seeds`."""
    runs = Path(args.out) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    if args.learn_from:
        start = Path(args.learn_from)
    else:
        start = warm_checkpoint(runs / "learn-warm", args.learn_warm_steps, args.set, threads=2)
    k = args.learn_staleness
    arms = {
        "K=0": Arm("learn-K0", threads=1),
        f"K={k}": Arm(
            f"learn-K{k}", ("runtime.rollout_ranks=1", f"train.max_staleness={k}"), 2, threads=1
        ),
    }
    rows = run_arms(
        start, arms, args.learn_seeds, args.learn_steps, args.eval_packs, args.set, runs
    )
    return {"start": str(start), **summarize_arms(rows, pair=(f"K={k}", "K=0"))}


LEARN_TABLE = (
    ("arm", "arm", ""),
    ("seeds", "seeds", ""),
    ("gain_before", "gain before RL", ""),
    ("gain_after", "gain after RL", ""),
    ("gain_change", "change (RL)", ""),
)


def _learn_rows(result: dict) -> list[dict]:
    rows = [
        {
            "arm": arm,
            "seeds": ",".join(map(str, r["seeds"])),
            "gain_before": fmt_spread(r["gain_before"]),
            "gain_after": fmt_spread(r["gain_after"]),
            "gain_change": fmt_spread(r["gain_change"]),
        }
        for arm, r in result["arms"].items()
    ]
    paired = result["paired"]["gain_change"]
    first, second = result["arms"]
    rows.append(
        {
            "arm": f"{second} - {first}",
            "seeds": ",".join(map(str, result["paired"]["seeds"])),
            "gain_change": f"{fmt_spread((paired['mean'], paired['std']))} (se {paired['sem']:.3f})",
        }
    )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small", help=f"comma-separated: {list(MODELS)}")
    parser.add_argument("--staleness", default="1,2", help="comma-separated K of the async arms")
    parser.add_argument("--warm-steps", type=int, default=200)
    parser.add_argument("--rl-steps", type=int, default=16)
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    parser.add_argument("--out", default="bench/results/async")
    parser.add_argument(
        "--learn-seeds", default="", help="comma-separated; empty: no learning arms"
    )
    parser.add_argument("--learn-from", default=None, help="a warm-started run directory")
    parser.add_argument("--learn-warm-steps", type=int, default=2000)
    parser.add_argument("--learn-steps", type=int, default=90)
    parser.add_argument("--learn-staleness", type=int, default=2)
    parser.add_argument("--eval-packs", type=int, default=256)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    args.staleness = [int(k) for k in args.staleness.split(",") if k]
    args.learn_seeds = [int(s) for s in args.learn_seeds.split(",") if s]
    if args.rl_steps <= SKIP:
        parser.error(f"--rl-steps must be above {SKIP} (the first {SKIP} are start-up)")
    rows = run(args) if args.models else []
    meta, out = run_meta(), Path(args.out)
    if rows:
        print_table("asynchronous RL on the CPU (trainer and sampler one core each)", TABLE, rows)
        append_csv(out / "async.csv", TABLE, rows, meta)
    summary = {**meta, "settings": vars(args), "rows": rows}
    if args.learn_seeds:
        summary["learning"] = learn(args)
        learn_rows = _learn_rows(summary["learning"])
        print_table(
            "CoD gain with and without staleness (mean +- std over seeds)", LEARN_TABLE, learn_rows
        )
        append_csv(out / "async_learning.csv", LEARN_TABLE, learn_rows, meta)
    return emit_summary(summary, out / "async.json")


if __name__ == "__main__":
    main()
