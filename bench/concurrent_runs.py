"""Runs that share cores: N `cod-fast train` warm starts one after another, then all at once.

    python -m cod_fast.bench.concurrent_runs [--runs 3] [--steps 150] [--threads N] [--compare]
        [--set KEY=VALUE ...] [--out FILE]          # or: cod-fast bench concurrent ...

Each run is `cod-fast train --preset tiny-cpu` in a process and a temporary run directory of its
own, set to S supervised warm-start steps and little else: `train.steps=0` (no RL),
`rollout.eval_packs=0` (no evaluations), `runtime.checkpoint_every=0` (one checkpoint, at the
end). The rest of a run's wall time (starting Python and torch, training the run's tokenizer,
writing its checkpoint and plots: 5-8 s on a 2-vCPU machine) is not the steps', so each run
also reports its steps' own seconds (the sum of `step_s` in its metrics.jsonl).

For each wait policy the N runs go one after another (serial), then all start at once
(concurrent). The ratio concurrent / serial is about 1 when the runs share the cores well (one
run alone already keeps every core busy) and grows when idle OpenMP workers spin on cores that
other runs' threads need. The runs' wait policy, by name:

- `cod-fast`: neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT set, so cod-fast's default applies
  (cod_fast/__init__.py): a short spin (GOMP_SPINCOUNT=10000) before an idle worker sleeps;
- `passive` (`--compare`): OMP_WAIT_POLICY=PASSIVE, idle workers sleep at once;
- `active` (`--compare`): ACTIVE, idle workers spin up to minutes before they sleep (libgomp's
  spin count 3e10);
- `libgomp` (`--compare`): an empty OMP_WAIT_POLICY, which libgomp refuses (one line on each
  run's stderr) and replaces by its own default, a spin of ~3 ms per wait (spin count 3e5):
  what a run got before cod-fast set the policy.

With `--compare` the table also gives one run alone under `cod-fast` against each other policy
(its serial runs' median): the policy should cost a run alone nothing (within 5%).

The runs get torch's default threads (OMP_NUM_THREADS and MKL_NUM_THREADS are removed from their
environment: one thread per core, which is what contends), or `--threads N` as
`runtime.threads=N`. Output: FILE (default bench/results/DATE-COMMIT-concurrent.json), a table,
and as the last stdout line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cod_fast.bench.harness import OthersCPU, emit_summary, print_table, run_meta

PRESET = "tiny-cpu"
POLICIES = {"cod-fast": None, "passive": "PASSIVE", "active": "ACTIVE", "libgomp": ""}
"""Each policy's OMP_WAIT_POLICY for the runs (None: unset, cod-fast's default)."""
BASELINE = "cod-fast"
POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""What the bench's own process inherited or cod-fast set in it: never passed on to the runs."""
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
ALONE_TOLERANCE = 0.05
"""How much slower than under another policy one run alone may be under `cod-fast`."""


def run_command(run_dir: Path, steps: int, threads: int | None, overrides: list[str]) -> list[str]:
    """One run's `cod-fast train`: `steps` warm-start steps, no RL, no evaluations, one
    checkpoint (the bench's settings win over `overrides`)."""
    settings = [
        *overrides,
        "train.steps=0",
        f"train.warm_start_steps={steps}",
        "rollout.eval_packs=0",
        "runtime.checkpoint_every=0",
        f"runtime.run_dir={run_dir}",
        *([f"runtime.threads={threads}"] if threads is not None else []),
    ]
    cmd = [sys.executable, "-m", "cod_fast.cli", "train", "--preset", PRESET]
    return cmd + [a for s in settings for a in ("--set", s)]


def run_env(policy: str, threads: int | None) -> dict[str, str]:
    """The runs' environment under `policy`: OMP_WAIT_POLICY per POLICIES and, without
    `threads`, no thread-count variables (torch's default: one thread per core)."""
    env = {k: v for k, v in os.environ.items() if k not in POLICY_VARIABLES}
    if threads is None:
        env = {k: v for k, v in env.items() if k not in THREAD_VARIABLES}
    if POLICIES[policy] is not None:
        env["OMP_WAIT_POLICY"] = POLICIES[policy]
    return env


def run_together(cmds: list[list[str]], env: dict, logs: list[Path], timeout: float) -> list[float]:
    """Start every command at once; each one's wall seconds, from the common start to its exit.
    A run that fails or outlives `timeout` ends the bench with one line naming its log."""
    start = time.perf_counter()
    procs = []
    for cmd, log in zip(cmds, logs, strict=True):
        with log.open("w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
    ends: list[float | None] = [None] * len(procs)
    try:
        while None in ends:
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"a run took over {timeout:.0f} s; see {logs[ends.index(None)]}")
            for i, proc in enumerate(procs):
                if ends[i] is None and proc.poll() is not None:
                    ends[i] = time.perf_counter() - start
                    if proc.returncode != 0:
                        raise RuntimeError(f"a run exited {proc.returncode}; see {logs[i]}")
            time.sleep(0.02)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return ends  # type: ignore[return-value]


def steps_seconds(run_dir: Path) -> float:
    """The seconds of a run's own steps: the sum of `step_s` over its metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return sum(json.loads(line)["step_s"] for line in lines if line.strip())


def measure_policy(policy: str, args, scratch: Path) -> dict:
    """The N runs under `policy`, serial then concurrent: per run its wall and steps' seconds."""
    env = run_env(policy, args.threads)
    result = {"omp_wait_policy": POLICIES[policy]}
    for phase in ("serial", "concurrent"):
        dirs = [scratch / f"{policy}-{phase}-{i}" for i in range(args.runs)]
        cmds = [run_command(d, args.steps, args.threads, args.set) for d in dirs]
        logs = [d.with_suffix(".log") for d in dirs]
        if phase == "serial":
            pairs = zip(cmds, logs, strict=True)
            walls = [run_together([c], env, [log], args.timeout)[0] for c, log in pairs]
        else:
            walls = run_together(cmds, env, logs, args.timeout)
        result[phase] = {"wall_s": walls, "steps_s": [steps_seconds(d) for d in dirs]}
    return summarize(result)


def summarize(result: dict) -> dict:
    """A policy's phases, summed up: serial wall (the runs' sum), concurrent wall (the last
    run's exit), their ratio, and one run alone (the serial runs' median)."""
    serial, concurrent = result["serial"], result["concurrent"]
    serial_s, concurrent_s = sum(serial["wall_s"]), max(concurrent["wall_s"])
    return result | {
        "alone_s": statistics.median(serial["wall_s"]),
        "serial_s": serial_s,
        "concurrent_s": concurrent_s,
        "ratio": concurrent_s / serial_s,
        "steps_alone_s": statistics.median(serial["steps_s"]),
        "steps_concurrent_s": statistics.median(concurrent["steps_s"]),
    }


def alone_against(policies: dict[str, dict]) -> dict[str, dict]:
    """One run alone under BASELINE against each other policy: the ratio of their medians and
    whether BASELINE is at most ALONE_TOLERANCE slower."""
    base = policies[BASELINE]["alone_s"]
    ratios = {name: base / r["alone_s"] for name, r in policies.items() if name != BASELINE}
    return {
        name: {"ratio": ratio, "at_most_5pct_slower": ratio <= 1 + ALONE_TOLERANCE}
        for name, ratio in ratios.items()
    }


def others_share(others: OthersCPU, children_cpu_s: float) -> float | None:
    """The share of the cores that processes other than this bench and its runs took: OthersCPU
    counts the runs (child processes) as others, so their CPU seconds are taken off."""
    share = others.share()
    if share is None:
        return None
    capacity = (time.perf_counter() - others.wall) * (os.cpu_count() or 1)
    return max(0.0, share - (sum(os.times()[2:4]) - children_cpu_s) / capacity)


def default_out(meta: dict) -> Path:
    """bench/results/DATE-COMMIT-concurrent.json (DATE as YYYYMMDD, UTC)."""
    date = meta["timestamp"][:10].replace("-", "")
    return Path("bench/results") / f"{date}-{meta['commit']}-concurrent.json"


TABLE = (
    ("policy", "OMP_WAIT_POLICY", ""),
    ("alone_s", "one run s", ".2f"),
    ("serial_s", "serial s", ".2f"),
    ("concurrent_s", "concurrent s", ".2f"),
    ("ratio", "concurrent / serial", ".2f"),
    ("steps_alone_s", "steps alone s", ".2f"),
    ("steps_concurrent_s", "steps concurrent s", ".2f"),
    ("alone_vs", "cod-fast alone / this", ".3f"),
)


def _rows(policies: dict[str, dict], against: dict[str, dict]) -> list[dict]:
    return [
        r | {"policy": name, "alone_vs": against.get(name, {}).get("ratio")}
        for name, r in policies.items()
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs side by side")
    parser.add_argument("--steps", type=int, default=150, help="warm-start steps per run")
    parser.add_argument("--threads", type=int, help="runtime.threads of every run")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also under PASSIVE, ACTIVE and libgomp's own default",
    )
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per phase")
    parser.add_argument("--out", type=Path, help="the JSON file")
    args = parser.parse_args(argv)
    for flag in ("runs", "steps", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag}: got {getattr(args, flag)}; expected an integer >= 1")
    names = list(POLICIES) if args.compare else [BASELINE]
    others, children_cpu_s = OthersCPU(), sum(os.times()[2:4])
    scratch = Path(tempfile.mkdtemp(prefix="cod-fast-concurrent-"))
    policies = {name: measure_policy(name, args, scratch) for name in names}
    shutil.rmtree(scratch)  # kept, with the runs' logs, when a run failed
    against = alone_against(policies)
    title = f"{args.runs} tiny-cpu runs of {args.steps} warm-start steps, serial vs concurrent"
    print_table(title, TABLE, _rows(policies, against))
    meta = run_meta()
    settings = {"runs": args.runs, "steps": args.steps, "threads": args.threads, "set": args.set}
    summary = {**meta, "settings": settings, "others_cpu": others_share(others, children_cpu_s)}
    summary |= {"policies": policies, "alone_vs_cod_fast": against}
    return emit_summary(summary, args.out or default_out(meta))


if __name__ == "__main__":
    main()
