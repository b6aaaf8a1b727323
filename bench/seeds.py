"""A preset's whole `cod-fast train` over seeds: what the warm start gives and what RL adds.

    python -m cod_fast.bench.seeds [--preset tiny-cpu ...] [--seeds 0,1,2] [--set KEY=VALUE ...]
        [--out DIR]          # or: cod-fast bench seeds ...

Each (preset, seed) is its own `cod-fast train --preset P --set train.seed=S` process, run to
the end with its evaluations on the held-out packs (the CoD protocol, whatever the preset trains
with): before anything ("start"), after the warm start and at the end. The table gives each
evaluation's per-position reward and last-minus-first gain as mean and standard deviation over
seeds, and the two parts of the final gain per seed, paired: what the warm start gave (its gain
minus the start's) and what RL added (the end's minus the warm start's). That spread is
run-to-run; an evaluation's standard error over packs is not. A run already finished in
DIR/runs/ is read, not rerun. Output: DIR/seeds.json, a CSV row per (preset, evaluation) in
DIR/seeds.csv, and as the last stdout line one JSON object.
"""

from __future__ import annotations

import argparse
import difflib
import time
from pathlib import Path

from cod_fast.bench.harness import append_csv, emit_summary, print_table, run_meta
from cod_fast.bench.rl_effect import evaluations, fmt_spread, spread, train_process
from cod_fast.config.presets import PRESETS

LABELS = ("start", "after warm start", "end")


def run(args) -> dict:
    runs = Path(args.out) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    results = {}
    for preset in args.presets:
        per_seed = []
        for seed in args.seeds:
            run_dir = runs / f"{preset}-seed{seed}"
            wall = None
            if "end" not in evaluations(run_dir):
                t0 = time.perf_counter()
                overrides = [*args.set, f"train.seed={seed}"]
                train_process(preset, run_dir, overrides, runs / f"{preset}-seed{seed}.log")
                wall = time.perf_counter() - t0
            per_seed.append({"seed": seed, "wall_s": wall, "evals": evaluations(run_dir)})
        results[preset] = _summarize(per_seed)
    return results


def _summarize(per_seed: list[dict]) -> dict:
    def gain(s, label):
        return s["evals"][label]["cod_gain"]

    summary: dict = {"seeds": [s["seed"] for s in per_seed]}
    for label in LABELS:
        rows = [s["evals"][label] for s in per_seed]
        summary[label] = {
            "step": rows[0]["step"],
            "gain": spread([r["cod_gain"] for r in rows]),
            "by_position": [
                spread(list(p)) for p in zip(*(r["mean_reward"] for r in rows), strict=True)
            ],
            "eval_packs": rows[0]["num_packs"],
        }
    summary["warm_start_gives"] = spread(
        [gain(s, "after warm start") - gain(s, "start") for s in per_seed]
    )
    summary["rl_adds"] = spread([gain(s, "end") - gain(s, "after warm start") for s in per_seed])
    walls = [s["wall_s"] for s in per_seed if s["wall_s"] is not None]
    summary["wall_s"] = spread(walls) if walls else None
    return summary


TABLE = (
    ("preset", "preset", ""),
    ("evaluation", "evaluation", ""),
    ("step", "step", ""),
    ("positions", "by position (mean +- std)", ""),
    ("gain", "last - first", ""),
    ("part", "part of the gain", ""),
)


def _rows(results: dict) -> list[dict]:
    rows = []
    for preset, r in results.items():
        parts = {"after warm start": ("warm start", "warm_start_gives"), "end": ("RL", "rl_adds")}
        for label in LABELS:
            e = r[label]
            part = parts.get(label)
            rows.append(
                {
                    "preset": preset,
                    "evaluation": label,
                    "step": e["step"],
                    "positions": " ".join(f"{m:.3f}+-{s:.3f}" for m, s in e["by_position"]),
                    "gain": fmt_spread(e["gain"]),
                    "part": f"{part[0]} {fmt_spread(r[part[1]])}" if part else "",
                }
            )
    return rows


def _check_presets(parser, presets: list[str]) -> None:
    """Every --preset a named preset: a typo ends the command before any run starts with one
    line naming the closest preset and the list, exit code 2 (as `cod-fast` reports bad input),
    not a failed train process per seed and a traceback."""
    for name in presets:
        if name not in PRESETS:
            close = difflib.get_close_matches(name, PRESETS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            choices = ", ".join(PRESETS)
            parser.exit(2, f"error: --preset: unknown {name!r}{hint}; choose from {choices}\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset",
        dest="presets",
        action="append",
        default=[],
        help=f"preset to run, repeatable: {', '.join(PRESETS)} (default tiny-cpu)",
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    parser.add_argument("--out", default="bench/results/seeds")
    args = parser.parse_args(argv)
    args.presets = args.presets or ["tiny-cpu"]
    _check_presets(parser, args.presets)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    results = run(args)
    rows = _rows(results)
    title = f"whole runs over seeds {args.seeds} (gain = last position - first)"
    print_table(title, TABLE, rows)
    meta = run_meta()
    out = Path(args.out)
    append_csv(out / "seeds.csv", TABLE, rows, meta)
    settings = {"presets": args.presets, "seeds": args.seeds, "set": args.set}
    return emit_summary({**meta, "settings": settings, "presets": results}, out / "seeds.json")


if __name__ == "__main__":
    main()
