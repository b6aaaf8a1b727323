"""Multi-teacher on-policy distillation against mixed-domain CoD RL from the same start.

    python -m cod_fast.bench.distill [--seeds 0,1,2] [--jobs 2] [--set KEY=VALUE ...]
        [--out DIR]          # or: cod-fast bench distill ...

1. Teachers: `cod-fast distill` of the `tiny-cpu-opd` preset with the first seed trains one
   `tiny-cpu` teacher per environment (sharing the student's tokenizer; DIR/teachers/ENV, the
   runs in DIR/teachers/ENV-run), then that seed's student (DIR/opd-sSEED).
2. The other seeds' students: `cod-fast train --preset tiny-cpu-opd` with the same teachers and
   tokenizer. A student run is its mixed warm start, then `opd` steps scored by the teachers.
3. Mixed-domain CoD RL from the same start: each student's last warm-start checkpoint exported
   (DIR/warm-sSEED), then `cod-fast train --preset tiny-cpu-mixed --init-from` it with the same
   number of RL steps and seed (DIR/mixed-sSEED).
Every run evaluates each environment on the same held-out packs with the CoD protocol. The table
gives, per environment, the teacher's CoD gain (its own run's last evaluation; standard error
over packs), each arm's gain after the warm start and at the end (mean and standard deviation
over seeds), and the student's share of the teacher's gain; and the teacher scoring pass's share
of the student's RL step time. `--jobs` runs that many independent runs at once, each on
cores / jobs threads. Finished runs are read, not rerun. Output: DIR/distill.json, a CSV row per
(environment, arm) in DIR/distill.csv, and as the last stdout line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cod_fast.bench.harness import append_csv, emit_summary, print_table, run_meta
from cod_fast.bench.rl_effect import fmt_spread, spread
from cod_fast.config.io import load_config

STUDENT, MIXED = "tiny-cpu-opd", "tiny-cpu-mixed"


def _cli(args: list[str], log: Path, threads: int) -> None:
    """One `cod-fast` command in its own process, output to `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with log.open("w") as f:
        cmd = [sys.executable, "-m", "cod_fast.cli", *args]
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}; see {log}")


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def evaluations(run_dir: Path) -> dict[tuple[str, str], dict]:
    """A run's evaluations by (label, environment)."""
    path = run_dir / "eval.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {(row["label"], row["env"]): row for row in rows}


def _finished(run_dir: Path) -> bool:
    return any(label == "end" for label, _ in evaluations(run_dir))


def run(args) -> dict:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    envs = [e.name for e in load_config(STUDENT).rollout.environments]
    teachers = "{" + ", ".join(f"{e}: {out / 'teachers' / e}" for e in envs) + "}"
    first = args.seeds[0]
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    common = [*args.set, f"algo.teachers={teachers}"]

    def student(seed: int, extra: list[str]) -> list[str]:
        sets = [*common, f"train.seed={seed}", f"runtime.run_dir={out / f'opd-s{seed}'}", *extra]
        return _sets(sets)

    if not _finished(out / f"opd-s{first}"):  # the teachers, then the first student: alone
        log = out / f"opd-s{first}.log"
        teacher_sets = [a for o in args.set for a in ("--teacher-set", o)]
        _cli(["distill", *student(first, []), *teacher_sets], log, os.cpu_count() or 1)
    shared = [f"model.tokenizer_path={out / f'opd-s{first}' / 'tokenizer'}"]
    warm_step = str(load_config(STUDENT, overrides=args.set).train.warm_start_steps)

    def chain(seed: int) -> None:
        """The seed's student (but the first's), then mixed CoD RL from its warm start."""
        opd, warm, mixed = (out / f"{name}-s{seed}" for name in ("opd", "warm", "mixed"))
        if not _finished(opd):
            args_ = ["train", "--preset", STUDENT, *student(seed, shared)]
            _cli(args_, out / f"opd-s{seed}.log", threads)
        if _finished(mixed):
            return
        export = ["export", str(opd), "--out", str(warm), "--step", warm_step]
        _cli(export, out / f"warm-s{seed}.log", threads)
        sets = [
            *args.set,
            "train.warm_start_steps=0",
            f"train.seed={seed}",
            f"runtime.run_dir={mixed}",
        ]
        _cli(
            ["train", "--preset", MIXED, "--init-from", str(warm), *_sets(sets)],
            out / f"mixed-s{seed}.log",
            threads,
        )

    if args.jobs == 1:  # on this thread: a run installs signal handlers, which needs the main one
        for seed in args.seeds:
            chain(seed)
    else:
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(chain, args.seeds))
    return _summarize(out, envs, args.seeds)


def _teacher_gain(out: Path, env: str) -> dict:
    row = evaluations(out / "teachers" / f"{env}-run")[("end", env)]
    return {"gain": row["cod_gain"], "se": row.get("gain_std_error"), "packs": row["num_packs"]}


def _step_shares(run_dirs: list[Path]) -> dict:
    """The teacher scoring pass against the student's RL steps, pooled over the students' runs:
    its seconds, its share of the step and of the training phase (which it is part of), and the
    tokens it runs the teacher over per trainable token (the LM head runs at the latter only)."""
    rl = [
        row
        for run_dir in run_dirs
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if (row := json.loads(line))["phase"] == "rl" and row.get("teacher_s") is not None
    ]
    return {
        "teacher_s": spread([r["teacher_s"] for r in rl]),
        "step_s": spread([r["step_s"] for r in rl]),
        "share": spread([r["teacher_s"] / r["step_s"] for r in rl]),
        "share_of_train": spread([r["teacher_s"] / r["train_s"] for r in rl]),
        "teacher_tokens_per_trainable": spread([r["tokens"] / r["trainable_tokens"] for r in rl]),
    }


def _summarize(out: Path, envs: list[str], seeds: list[int]) -> dict:
    results: dict = {"envs": {}, "seeds": seeds}
    for env in envs:
        teacher = _teacher_gain(out, env)
        arms = {}
        for arm in ("opd", "mixed"):
            evals = [evaluations(out / f"{arm}-s{s}") for s in seeds]
            start = "after warm start" if arm == "opd" else "start"
            warm = [e[(start, env)]["cod_gain"] for e in evals]
            end = [e[("end", env)]["cod_gain"] for e in evals]
            arms[arm] = {
                "warm_gain": spread(warm),
                "end_gain": spread(end),
                "rl_adds": spread([b - a for a, b in zip(warm, end, strict=True)]),
                # None when the teacher gained nothing: no share of it to speak of.
                "share_of_teacher": spread([g / teacher["gain"] for g in end])
                if teacher["gain"]
                else None,
                "per_seed_end": end,
            }
        results["envs"][env] = {"teacher": teacher, **arms}
    results["scoring"] = _step_shares([out / f"opd-s{s}" for s in seeds])
    return results


TABLE = (
    ("env", "environment", ""),
    ("arm", "arm", ""),
    ("warm", "gain after warm start", ""),
    ("end", "gain at the end", ""),
    ("adds", "RL adds", ""),
    ("share", "end / teacher", ""),
)


def _rows(results: dict) -> list[dict]:
    rows = []
    for env, r in results["envs"].items():
        t = r["teacher"]
        se = f" (se {t['se']:.3f})" if t["se"] is not None else ""
        rows.append(
            {
                "env": env,
                "arm": "teacher",
                "warm": "",
                "end": f"{t['gain']:+.3f}{se}",
                "adds": "",
                "share": "1",
            }
        )
        for arm, name in (("opd", "student (opd)"), ("mixed", "mixed CoD RL")):
            a = r[arm]
            rows.append(
                {
                    "env": env,
                    "arm": name,
                    "warm": fmt_spread(a["warm_gain"]),
                    "end": fmt_spread(a["end_gain"]),
                    "adds": fmt_spread(a["rl_adds"]),
                    "share": fmt_spread(a["share_of_teacher"]) if a["share_of_teacher"] else "n/a",
                }
            )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument(
        "--set", action="append", default=[], help="KEY=VALUE for every run, teachers included"
    )
    parser.add_argument("--out", default="bench/results/distill")
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    results = run(args)
    rows = _rows(results)
    s = results["scoring"]
    title = (
        f"distillation vs mixed CoD RL over seeds {args.seeds} (gain = last position - first); "
        f"teacher scoring {s['share'][0]:.1%} of a student RL step "
        f"({s['share_of_train'][0]:.1%} of its training phase)"
    )
    print_table(title, TABLE, rows)
    meta = run_meta()
    out = Path(args.out)
    append_csv(out / "distill.csv", TABLE, rows, meta)
    settings = {"seeds": args.seeds, "set": args.set}
    return emit_summary({**meta, "settings": settings, **results}, out / "distill.json")


if __name__ == "__main__":
    main()
