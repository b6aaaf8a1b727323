"""What every benchmark of cod_fast.bench shares: how it measures, how it runs its workers and
how it reports.

- Measuring: wall-time quantiles after a warm-up, the peak resident set (or the GPU's peak
  allocation), the dense-GEMM ceiling of the machine at that moment, and the share of the CPUs
  that other processes took meanwhile.
- Workers: a benchmark runs each contender in a process of its own, which prints its result as
  one JSON line; on the CPU a second, one-call worker under LIVE_MALLOC reads the live peak.
- Reporting: the run's metadata (time, commit, machine, versions), CSV rows appended under a
  fixed header, a rich table, and the summary as the last stdout line (JSON).
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

# glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold in its heap, so the
# peak resident set also counts memory the step had already freed. With a fixed 64 KiB threshold
# every tensor of 64 KiB or more is a mapping of its own, unmapped when freed: the peak resident
# set is then the peak of memory in use, what torch.cuda.max_memory_allocated is on a GPU.
LIVE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}

META = ("timestamp", "commit", "machine", "torch", "transformers")
"""The first columns of a benchmark's CSV: run_meta's keys."""


# --------------------------------------------------------------------------------------------
# Measuring.


def _proc_status_mib(field: str) -> float | None:
    """A `kB` field of /proc/self/status in MiB (None where there is no such file)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 2**10 for line in f if line.startswith(field))
    except (OSError, StopIteration):
        return None


def _ru_maxrss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def rss_mib() -> float:
    """Resident set of this process now (Linux: VmRSS; elsewhere the peak, ru_maxrss)."""
    return _proc_status_mib("VmRSS:") or _ru_maxrss_mib()


def rss_peak_mib() -> float:
    """Peak resident set of this process (Linux: VmHWM). Not ru_maxrss where VmHWM exists: a
    child's ru_maxrss starts at its parent's resident set at the fork, so a worker's baseline
    taken from it can exceed what the worker holds."""
    return _proc_status_mib("VmHWM:") or _ru_maxrss_mib()


def reset_rss_peak() -> None:
    """Start this process's peak resident set (VmHWM) over from its resident set now (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation percentile (q in [0, 1]) of an ascending list."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def timed(fn, reps: int, warmup: int, cuda: bool) -> list[float]:
    """Wall seconds of `fn` per repetition, after `warmup` untimed calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def measure_ceiling() -> dict:
    """Dense-GEMM ceiling of this machine now: fp32 GFLOP/s on the CPU, bf16 on a GPU."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        m = k = n = 8192
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        reps, warmup, kind = 10, 3, "bf16 matmul 8192^3"
    else:
        # Square-ish and as large as the benchmark's own GEMMs, so the BLAS runs at its best.
        m, k, n = 2048, 1024, 4096
        a, b = torch.randn(m, k), torch.randn(k, n)
        reps, warmup, kind = 5, 1, "fp32 matmul 2048x1024x4096"
    times = timed(lambda: a @ b, reps, warmup, cuda)
    return {"kind": kind, "gflops": 2 * m * k * n / statistics.median(times) / 1e9}


def _busy_cpu_s() -> float | None:
    """CPU seconds every process on this machine has used (Linux /proc/stat; else None)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = f.readline().split()[1:9]
    except (OSError, ValueError):
        return None
    ticks = sum(int(x) for x in (user, nice, system, irq, softirq, steal))
    return ticks / os.sysconf("SC_CLK_TCK")


class OthersCPU:
    """The share of all cores that other processes (hypervisor steal included) took from its
    creation to `share()`: a benchmark's numbers mean little unless it is small."""

    def __init__(self):
        self.busy, self.own = _busy_cpu_s(), sum(os.times()[:2])
        self.wall = time.perf_counter()

    def share(self) -> float | None:
        if self.busy is None:
            return None
        others = _busy_cpu_s() - self.busy - (sum(os.times()[:2]) - self.own)
        capacity = (time.perf_counter() - self.wall) * (os.cpu_count() or 1)
        return min(1.0, max(0.0, others) / capacity)  # clock ticks: +-10 ms each


# --------------------------------------------------------------------------------------------
# Workers: one process per contender, its result the last stdout line.


def run_json_worker(cmd: list[str], timeout: float, log: Path, env: dict | None = None) -> dict:
    """Run a worker process whose last stdout line is a JSON result; a failure keeps the
    command and its output in `log` and returns a `failed: ...` status naming it."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    why = err[-1].strip()[:300] if err else f"exit code {proc.returncode}"
    return {"status": f"failed: {why} (log: {log})"}


def with_live_peak(run_worker, spec: dict, on_cpu: bool) -> dict:
    """The timed worker's result (`run_worker(spec, env_extra=...)`) and its `live_peak_mib`: on the
    CPU the peak of a one-call worker under LIVE_MALLOC (its own process: a mapping per block
    costs page faults that must not be timed), on a GPU the timed worker's own peak (already
    max_memory_allocated)."""
    result = run_worker(spec)
    if result["status"] != "ok":
        return result
    if not on_cpu:
        return result | {"live_peak_mib": result["peak_mib"]}
    live = run_worker(spec | {"reps": 1, "warmup": 0}, env_extra=LIVE_MALLOC)
    if live["status"] != "ok":
        return {"status": f"live peak {live['status']}"}
    return result | {"live_peak_mib": live["peak_mib"]}


# --------------------------------------------------------------------------------------------
# Reporting: metadata, CSV rows, tables and the last-line JSON.


def git_commit() -> str:
    """HEAD's short hash, with `-dirty` when tracked files differ from it (the numbers then
    belong to uncommitted code)."""
    if os.environ.get("COD_FAST_GIT_COMMIT"):  # set by gpu_check.sh where the copy has no .git
        return os.environ["COD_FAST_GIT_COMMIT"]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args],
                cwd=Path(__file__).resolve().parent,
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> str:
    """This machine in a few words: its CPU model, CPU count and GPU (`no GPU` without one)."""
    import torch

    cpu = platform.processor()
    if not cpu or cpu == platform.machine():
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next(
                    (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                    cpu,
                )
        except OSError:
            pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu or platform.machine()} / {os.cpu_count()} cpus / {gpu}"


def resolve_device(choice: str, parser) -> str:
    """A benchmark's --device: `auto` is cuda when there is one; cuda without one is a usage
    error of `parser`."""
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    return choice


def run_meta() -> dict[str, str]:
    """The META columns of a benchmark run: when, which commit, which machine and versions."""
    import torch

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {
        "timestamp": now,
        "commit": git_commit(),
        "machine": machine(),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
    }


def comma_choices(parser, flag: str, text: str, allowed) -> list[str]:
    """The comma-separated items of a command-line `text`; an item not in `allowed` is a usage
    error naming the flag and the choices."""
    items = text.split(",")
    if bad := [item for item in items if item not in allowed]:
        parser.error(f"--{flag}: unknown {bad}; choose from {', '.join(allowed)}")
    return items


def append_csv_rows(path: Path, columns, rows: list[dict]) -> None:
    """Append `rows` (dicts; missing keys blank) under `columns`; a file written before a column
    was added is rewritten with the new header, its old rows blank in the new columns."""
    old, header = [], None
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            old, header = list(reader), reader.fieldnames
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(columns)
    with path.open("a" if header == columns else "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        if header != columns:
            writer.writeheader()
            writer.writerows(old)
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)


def append_csv(path: Path, table, rows: list[dict], meta: dict) -> None:
    """Append `rows` under META and the table's columns (see append_csv_rows)."""
    columns = [*META, *(c for c, _, _ in table)]
    append_csv_rows(path, columns, [{**meta, **row} for row in rows])


def print_table(title: str, table, rows: list[dict]) -> None:
    """`rows` as a rich table of the `table` columns that have a header."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    shown = [(key, header, spec) for key, header, spec in table if header]
    out = Table(title=title)
    for _, header, spec in shown:
        out.add_column(header, justify="right" if spec else "left")
    for row in rows:
        out.add_row(*(Text(fmt(row.get(key), spec)) for key, _, spec in shown))
    Console(width=max(240, Console().width)).print(out)


def fmt(value, spec: str) -> str:
    """`value` as a table cell in the format `spec`; `-` for None."""
    return "-" if value is None else format(value, spec)


def emit_summary(summary: dict, path: Path) -> dict:
    """Write a benchmark's summary to `path` and print it as the last stdout line (JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return summary
