"""Profile of the trainer benchmark's step: where its time goes, on the device and on the host.

    python -m cod_fast.bench.profile_step [--tokens N] [--steps 3] [--device auto|cpu|cuda]
        [--out DIR] [--tiny]

For each contender of bench/train.py (`fused`: the trainer's step with the fused loss;
`logits+eager`: full logits and the loss on log-probs), on the same seeded model and batch: one
warm-up step, then `--steps` steps under torch.profiler (host activity and, on CUDA, the
device's). Per contender:

- `step_ms`: wall time per profiled step (the profiler adds its own overhead: compare the
  contenders with each other, the speeds with `cod-fast bench train`);
- `device_busy`: the share of the profiled wall time during which at least one kernel ran (the
  union of the kernels' intervals); far below 1 means the step waits on the host (launches,
  syncs, Python), not on the GPU;
- `kernels` and `device_ms`: kernels and their summed time per step;
- `syncs`: CUDA runtime calls per step that block the host (device, stream and event
  synchronisations, and synchronous cudaMemcpy), `memcpy_async`: asynchronous copies per step;
- `top_device` / `top_host`: the five ops with the most self time on the device / the host.

Files: DIR/profile.csv (rows appended), DIR/profile.json, DIR/profile_<contender>.txt (the
profiler's tables: top 20 ops by device and by host self time) and
DIR/profile_<contender>.json.gz (a Chrome trace of the profiled steps; chrome://tracing or
Perfetto). On a CPU there is no device activity: the device columns are empty.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

from cod_fast.bench.harness import append_csv, emit_summary, print_table, resolve_device, run_meta
from cod_fast.bench.train_workload import (
    CONTENDERS,
    TINY,
    StepShape,
    build_model,
    make_step,
    set_rollout_logp,
    step_batch,
)

# fmt: off
TABLE = (
    ("contender", "contender", ""), ("step_ms", "step ms", ".1f"),
    ("device_busy", "device busy", ".0%"), ("kernels", "kernels/step", ".0f"),
    ("device_ms", "device ms/step", ".1f"), ("syncs", "syncs/step", ".1f"),
    ("memcpy_async", "async copies/step", ".1f"), ("top_device", "top device ops", ""),
    ("top_host", None, ""), ("device", "device", ""), ("dtype", None, ""), ("model", None, ""),
    ("tokens", "tokens", ""),
)
# fmt: on
BLOCKING_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
"""CUDA runtime calls that make the host wait (besides the synchronous cudaMemcpy)."""


def busy_share(intervals: list[tuple[float, float]], span: float) -> float | None:
    """The share of `span` covered by the union of the (start, end) `intervals`."""
    if span <= 0 or not intervals:
        return None
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered / span


def _device_events(events) -> list:
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA]


def _top(averages, key: str, count: int) -> str:
    """The `count` op names with the most `key` self time, with their milliseconds."""
    ranked = sorted(averages, key=lambda e: getattr(e, key, 0) or 0, reverse=True)[:count]
    return ", ".join(f"{e.key} {getattr(e, key) / 1e3:.1f}" for e in ranked if getattr(e, key))


def _tables(prof, cuda: bool) -> str:
    """The profiler's own tables: top 20 ops by device self time (CUDA) and by host self time."""
    averages = prof.key_averages()
    parts = []
    if cuda:
        parts.append(averages.table(sort_by="self_device_time_total", row_limit=20))
    parts.append(averages.table(sort_by="self_cpu_time_total", row_limit=20))
    return "\n\n".join(parts)


def profile_contender(step, steps: int, cuda: bool, trace: Path) -> tuple[dict, str]:
    """(the row's measurements, the tables' text) of `steps` calls of `step` (warmed up)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()
    sync()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall_s = time.perf_counter() - started
    events = prof.events()
    row = {
        "step_ms": 1e3 * wall_s / steps,
        "top_host": _top(prof.key_averages(), "self_cpu_time_total", 5),
    }
    if cuda:
        kernels = _device_events(events)
        starts = [e.time_range.start for e in events]
        ends = [e.time_range.end for e in events]
        span = max(ends) - min(starts) if events else 0.0
        names = [e.name for e in events]
        row |= {
            "device_busy": busy_share(
                [(k.time_range.start, k.time_range.end) for k in kernels], span
            ),
            "kernels": len(kernels) / steps,
            "device_ms": sum(k.time_range.elapsed_us() for k in kernels) / 1e3 / steps,
            "syncs": sum(names.count(c) for c in (*BLOCKING_CALLS, "cudaMemcpy")) / steps,
            "memcpy_async": names.count("cudaMemcpyAsync") / steps,
            "top_device": _top(prof.key_averages(), "self_device_time_total", 5),
        }
    raw = trace.with_suffix("")  # profile_<contender>.json, compressed into .json.gz
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return row, _tables(prof, cuda)


def measure(shape: StepShape, device: str, steps: int, out: Path) -> list[dict]:
    """One row per contender (see the module docstring); writes the tables and traces."""
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    mbs, denominator, stats = step_batch(shape)
    common = {
        "device": dev.type,
        "dtype": str(dtype).removeprefix("torch."),
        "model": shape.describe(),
    }
    common["tokens"] = stats["tokens"]
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for contender in CONTENDERS:
        model = build_model(shape, dev, dtype)  # the same seeded weights for both
        set_rollout_logp(model, mbs, dev)
        step = make_step(contender, model, mbs, denominator)[0]
        name = contender.replace("+", "_")
        row, tables = profile_contender(step, steps, cuda, out / f"profile_{name}.json.gz")
        (out / f"profile_{name}.txt").write_text(tables + "\n")
        rows.append(common | {"contender": contender} | row)
        del model, step
        if cuda:
            torch.cuda.empty_cache()
    return rows


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m cod_fast.bench.profile_step",
        description="Profile the trainer benchmark's step (fused vs logits+eager).",
    )
    p.add_argument("--tokens", type=int, help="packed tokens of the step (default 16384)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps after one warm-up step")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for results")
    p.add_argument("--tiny", action="store_true", help="a tiny model and batch (smoke test)")
    args = p.parse_args(argv)
    if args.steps < 1 or (args.tokens is not None and args.tokens < 64):
        p.error("--steps must be >= 1 and --tokens >= 64")
    return args, p


def main(argv: list[str] | None = None) -> dict:
    """Profile both contenders; returns the summary that the last printed line holds as JSON."""

    args, parser = _parse_args(argv)
    args.device = resolve_device(args.device, parser)
    shape = TINY if args.tiny else StepShape()
    shape = replace(shape, **({"tokens": args.tokens} if args.tokens else {}))
    meta = run_meta()
    rows = measure(shape, args.device, args.steps, args.out)
    append_csv(args.out / "profile.csv", TABLE, rows, meta)
    print_table(f"profiled train step on {meta['machine']} ({shape.describe()})", TABLE, rows)
    settings = {"device": args.device, "steps": args.steps, "shape": asdict(shape)}
    return emit_summary({**meta, "settings": settings, "rows": rows}, args.out / "profile.json")


if __name__ == "__main__":
    main()
