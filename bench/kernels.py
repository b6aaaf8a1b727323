"""Kernel benchmark: the fused policy loss (fwd+bwd) against eager torch, Liger and CCE.

    python -m cod_fast.bench.kernels [--cases dense,cod-packed,wide-vocab,h100]
        [--impls eager,torch,cpp,...] [--reps N] [--warmup N] [--scale F] [--out DIR]

Every (case, contender) pair runs in its own subprocess (`--worker`), so each peak-memory figure
starts from a clean process: on the CPU the growth of the peak resident set over the worker's
resident set just before the case's inputs exist (the peak restarts once they are built, so what
building them held briefly is not counted), on a GPU torch.cuda.max_memory_allocated after a
reset. On the CPU a second, one-call worker runs under LIVE_MALLOC for the live peak (memory in
use, as on a GPU). `static` is what every contender holds whatever its loss does: the inputs'
tensors and the two leaves' gradients; `work` = live peak - static is what the loss itself adds,
and `work/eager` compares it with eager's.
Each worker also measures the ceiling (fp32 GEMM GFLOP/s on the CPU, bf16 8192^3 matmul TFLOP/s
on a GPU) right after its timed loop: on a shared machine the GEMM rate drifts by 2x within a
run, and a ceiling taken at the same moment, in the same process, is the honest yardstick. Rates are "GEMM-equivalent": 6 N H V flops (one logits GEMM
forward, two backward, N = trainable tokens) divided by the median wall time, whatever the
contender actually computes, so skipping untrainable positions or recomputing logits shows up in
the rate. On a GPU the fraction for 8 N H V (a backward that recomputes the logits, as Liger and
CCE do) is reported too.

The loss compared is token-level `ppo` (GRPO clipping), token-mean, bypass mode (the rollout
log-probs are the behaviour policy), one segment per sequence; every contender is given the
same values, so the `loss` column must agree across a case's rows.

Output: a table, CSV rows appended to DIR/kernels.csv (one per contender as it finishes, so an
interrupted run keeps what it measured), DIR/kernels.json, and as the last line on stdout one
JSON object with every result.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from cod_fast.bench.contenders import CASES, CONTENDERS, SEED, Inputs, make_inputs, make_step
from cod_fast.bench.harness import LIVE_MALLOC as LIVE_MALLOC  # for the tests
from cod_fast.bench.harness import (
    append_csv_rows,
    comma_choices,
    emit_summary,
    fmt,
    git_commit,
    machine,
    measure_ceiling,
    percentile,
    reset_rss_peak,
    rss_mib,
    rss_peak_mib,
    run_json_worker,
    timed,
    with_live_peak,
)

DEFAULT_CASES = (
    "dense",
    "cod-packed",
    "wide-vocab",
    "packed-2k-v16k",
    "packed-6k-v32k",
    "packed-2k-v152k",
    "packed-4k-v152k",
    "h100",
)
CSV_COLUMNS = (
    "timestamp",
    "commit",
    "machine",
    "torch",
    "case",
    "contender",
    "N",
    "H",
    "V",
    "dtype",
    "median_s",
    "p20_s",
    "p80_s",
    "peak_mib",
    "live_peak_mib",
    "static_mib",
    "work_mib",
    "gflops",
    "ceiling_gflops",
    "frac_ceiling",
    "speedup_vs_eager",
    "mem_vs_eager",
    "work_vs_eager",
    "note",
)


# --------------------------------------------------------------------------------------------
# Worker side: one (case, contender) per process.


def _measure(step, spec: dict, layout: str, device, dtype) -> dict:
    """Time one contender on the case and read its peak memory; the inputs die on return."""
    import torch

    cuda = device.type == "cuda"

    def run(x: Inputs):
        x.hidden.grad = None  # drop the last step's gradients before the peak, not after
        x.weight.grad = None
        return step(x)

    if not cuda:
        # The CPU peak is the process's RSS: one tiny call first puts lazy imports, extension
        # loading and torch.compile's machinery behind the baseline. (A GPU peak counts only
        # the caching allocator, which none of that touches, so the GPU skips this.)
        run(make_inputs(CASES["tiny"], 1.0, layout, device, dtype))
        # Forget what torch.compile traced for the tiny shapes: compiled Liger (torch 2.13)
        # fails building dynamic-shape guards when H and V change between calls in a process.
        torch.compiler.reset()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = rss_mib()
    case = CASES[spec["case"]]
    x = make_inputs(case, spec["scale"], layout, device, dtype)
    if not cuda:
        reset_rss_peak()  # what building the inputs held transiently is not the loss's
    losses = []
    times = sorted(
        timed(lambda: losses.append(run(x).detach()), spec["reps"], spec["warmup"], cuda)
    )
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_peak_mib()) - base
    return {
        "static_mib": static_mib(x),
        "status": "ok",
        "N": x.n_trainable,
        "rows_computed": x.n_computed,
        "H": case.hidden,
        "V": case.vocab,
        "dtype": str(dtype).removeprefix("torch."),
        "times_s": times,
        "median_s": statistics.median(times),
        "p20_s": percentile(times, 0.2),
        "p80_s": percentile(times, 0.8),
        "peak_mib": peak,
        "loss": float(losses[-1]),
    }


def static_mib(x: Inputs) -> float:
    """MiB that every contender holds whatever its loss does: the inputs' tensors and the
    gradients of the two leaves (hidden and the LM head weight)."""
    import torch

    tensors = [v for v in vars(x).values() if isinstance(v, torch.Tensor)]
    leaves = (x.hidden, x.weight)
    return sum(t.nbytes for t in (*tensors, *leaves)) / 2**20


def _case_worker(spec: dict) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    try:
        layout, step = make_step(spec["contender"])
    except ImportError as e:
        return {"status": f"skipped: {spec['contender']} not importable ({e})"}
    result = _measure(step, spec, layout, device, dtype)
    # After the peak was read, with the inputs freed: the same moment, the same process.
    ceiling = measure_ceiling()
    return {**result, "ceiling_gflops": ceiling["gflops"], "ceiling_kind": ceiling["kind"]}


def _worker_main(spec: dict) -> None:
    print(json.dumps(_case_worker(spec)))


# --------------------------------------------------------------------------------------------
# Driver side: one subprocess per (case, contender), then the table, CSV and JSON.


def _run_worker(spec: dict, timeout: float, log_dir: Path, env_extra: dict | None = None) -> dict:
    """Run one worker; a failure keeps its output in log_dir/<case>__<contender>[__live].log."""
    cmd = [sys.executable, "-m", "cod_fast.bench.kernels", "--worker", json.dumps(spec)]
    live = "__live" if env_extra else ""
    log = log_dir / f"{spec['case']}__{spec['contender']}{live}.log"
    return run_json_worker(cmd, timeout, log, dict(os.environ) | (env_extra or {}))


def _contenders(asked: list[str], cuda: bool) -> list[tuple[str, str | None]]:
    """(contender, reason it is skipped or None) in run order; eager first (the baseline)."""
    from cod_fast.ops import dispatch

    def cod_fast_impl(name: str) -> str | None:
        if name == "triton" and not cuda:
            return "skipped: needs a GPU (the CPU interpreter is too slow)"
        try:
            if dispatch.is_available(name):
                return None
        except ImportError as e:  # an extension module still being written or built
            return f"skipped: {name} not importable ({e})"
        return f"skipped: {dispatch.available_impls()[name]}"

    def installed(module: str, pip: str) -> str | None:
        found = importlib.util.find_spec(module) is not None
        return None if found else f"skipped: {pip} is not installed"

    why = {
        "eager": lambda: None,
        "torch": lambda: None,
        "cpp": lambda: cod_fast_impl("cpp"),
        "cpp-fixed64": lambda: cod_fast_impl("cpp"),
        "triton": lambda: cod_fast_impl("triton"),
        "liger": lambda: installed("liger_kernel", "liger-kernel"),
        "liger-compiled": lambda: installed("liger_kernel", "liger-kernel"),
        "cce": lambda: (
            installed("cut_cross_entropy", "cut-cross-entropy")
            if cuda
            else "skipped: cut-cross-entropy runs on a GPU only"
        ),
    }
    return [(name, why[name]()) for name in CONTENDERS if name in asked]


def _derive(row: dict, eager: dict | None) -> None:
    """Add the rates and the ratios to a finished row, in place."""
    if row["status"] != "ok":
        return
    flops = row["N"] * row["H"] * row["V"]
    row["gflops"] = 6 * flops / row["median_s"] / 1e9
    row["frac_ceiling"] = row["gflops"] / row["ceiling_gflops"]
    row["frac_ceiling_8nhv"] = 8 * flops / row["median_s"] / 1e9 / row["ceiling_gflops"]
    ok = eager is not None and eager["status"] == "ok"
    row["speedup_vs_eager"] = eager["median_s"] / row["median_s"] if ok else None
    row["mem_vs_eager"] = row["peak_mib"] / eager["peak_mib"] if ok and eager["peak_mib"] else None
    row["work_mib"] = row["live_peak_mib"] - row["static_mib"]
    eager_work = eager["live_peak_mib"] - eager["static_mib"] if ok else None
    row["work_vs_eager"] = row["work_mib"] / eager_work if eager_work and eager_work > 0 else None


def _append_csv(path: Path, row: dict, meta: dict) -> None:
    append_csv_rows(path, CSV_COLUMNS, [{**meta, **row, "note": row["status"]}])


def _print_table(summary: dict, cuda: bool) -> None:
    ceiling = summary["ceiling"]
    unit, div = ("TFLOP/s", 1e3) if cuda else ("GFLOP/s", 1.0)
    title = f"cod-fast kernels: policy loss fwd+bwd on {summary['machine']}"
    if ceiling:
        title += f"; ceiling {ceiling['kind']}, {ceiling['min'] / div:.1f}-{ceiling['max'] / div:.1f} {unit}"
    headers = ["case", "contender", "N", "rows", "H", "V", "dtype", "median s", "p20-p80 s"]
    headers += ["peak MiB", "live MiB", "static MiB", "work MiB"]
    headers += [f"GEMM-eq {unit}", f"ceil {unit}", "% ceil"]
    headers += ["% ceil 8NHV"] if cuda else []
    headers += ["x eager", "mem/eager", "work/eager", "loss", "note"]
    rows = []
    for r in summary["results"]:
        ok = r["status"] == "ok"
        cells = [r["case"], r["contender"]]
        if ok:
            cells += [str(r["N"]), str(r["rows_computed"]), str(r["H"]), str(r["V"]), r["dtype"]]
            cells += [f"{r['median_s']:.4g}", f"{r['p20_s']:.4g}-{r['p80_s']:.4g}"]
            cells += [
                f"{r[k]:.0f}" for k in ("peak_mib", "live_peak_mib", "static_mib", "work_mib")
            ]
            cells += [f"{r['gflops'] / div:.1f}"]
            cells += [f"{r['ceiling_gflops'] / div:.1f}", f"{100 * r['frac_ceiling']:.0f}"]
            cells += [f"{100 * r['frac_ceiling_8nhv']:.0f}"] if cuda else []
            cells += [fmt(r["speedup_vs_eager"], ".2f"), fmt(r["mem_vs_eager"], ".2f")]
            cells += [fmt(r["work_vs_eager"], ".3f")]
            cells += [f"{r['loss']:.6g}", ""]
        else:
            cells += ["-"] * (len(headers) - 3) + [r["status"]]
        rows.append(cells)
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="left" if h in ("case", "contender", "note") else "right")
    for cells in rows:
        table.add_row(*(Text(c) for c in cells))
    Console(width=max(240, Console().width)).print(table)


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m cod_fast.bench.kernels",
        description="Benchmark the fused policy loss (fwd+bwd) against eager torch, Liger, CCE.",
    )
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"from {', '.join(CASES)}")
    p.add_argument("--impls", default=",".join(CONTENDERS), help=f"from {', '.join(CONTENDERS)}")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median, p20, p80)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every case's N")
    p.add_argument("--out", default="bench/results", help="folder for kernels.csv/kernels.json")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per worker process")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    comma_choices(p, "cases", args.cases, CASES)
    comma_choices(p, "impls", args.impls, CONTENDERS)
    if args.reps < 1 or args.warmup < 0 or args.scale <= 0:
        p.error("--reps must be >= 1, --warmup >= 0 and --scale > 0")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    """Run the benchmark; returns the summary that the last printed line holds as JSON."""
    args = _parse_args(argv)
    if args.worker is not None:
        _worker_main(json.loads(args.worker))
        return None

    import torch
    from rich.console import Console

    progress = Console(stderr=True)
    cuda = torch.cuda.is_available()
    cases = args.cases.split(",")
    asked = args.impls.split(",")
    out = Path(args.out)
    csv_path = out / "kernels.csv"
    meta = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine(),
        "torch": torch.__version__,
    }
    summary: dict[str, Any] = {
        **meta,
        "device": "cuda" if cuda else "cpu",
        "settings": {
            "reps": args.reps,
            "warmup": args.warmup,
            "scale": args.scale,
            "seed": SEED,
            "loss": "ppo, token-level ratio, token-mean, bypass (rollout_logp)",
        },
        "results": [],
    }
    for case_name in cases:
        case = CASES[case_name]
        if case.gpu_only and not cuda:
            row = {"case": case_name, "contender": "all", "status": "skipped: GPU-only case"}
            summary["results"].append(row)
            _append_csv(csv_path, row, meta)
            progress.print(f"{case_name}: skipped (GPU-only case, no CUDA device)")
            continue
        eager = None
        for contender, skip in _contenders(asked, cuda):
            spec = {
                "case": case_name,
                "contender": contender,
                "scale": args.scale,
                "reps": args.reps,
                "warmup": args.warmup,
            }
            if skip is None:
                with progress.status(f"{case_name} / {contender}"):
                    run = functools.partial(_run_worker, timeout=args.timeout, log_dir=out / "logs")
                    result = with_live_peak(run, spec, on_cpu=not cuda)
            else:
                result = {"status": skip}
            row = {"case": case_name, "contender": contender, **result}
            if contender == "eager":
                eager = row
            _derive(row, eager)
            summary["results"].append(row)
            _append_csv(csv_path, row, meta)
            shown = f"{row['median_s']:.4g} s median" if row["status"] == "ok" else row["status"]
            progress.print(f"{case_name} / {contender}: {shown}", markup=False, highlight=False)
    ceilings = [r["ceiling_gflops"] for r in summary["results"] if r["status"] == "ok"]
    summary["ceiling"] = ceilings and {
        "kind": next(r["ceiling_kind"] for r in summary["results"] if r["status"] == "ok"),
        "median": statistics.median(ceilings),
        "min": min(ceilings),
        "max": max(ceilings),
    }
    _print_table(summary, cuda)
    return emit_summary(summary, out / "kernels.json")


if __name__ == "__main__":
    main()
