"""Kernel benchmark: the fused policy loss (fwd+bwd) against eager torch, Liger and CCE.

    python -m cod_fast.bench.kernels [--cases dense,cod-packed,wide-vocab,h100]
        [--impls eager,torch,cpp,...] [--reps N] [--warmup N] [--scale F] [--out DIR]

Every (case, contender) pair runs in its own subprocess (`--worker`), so each peak-memory figure
starts from a clean process: on the CPU the growth of ru_maxrss over the worker's baseline taken
just before the case's inputs exist, on a GPU torch.cuda.max_memory_allocated after a reset.
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
import csv
import datetime
import importlib.util
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEED = 1234
CONTENDERS = ("eager", "torch", "cpp", "triton", "liger", "liger-compiled", "cce")
DEFAULT_CASES = ("dense", "cod-packed", "wide-vocab", "h100")
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
    "gflops",
    "ceiling_gflops",
    "frac_ceiling",
    "speedup_vs_eager",
    "mem_vs_eager",
    "note",
)
# Logits one chunk of the rollout-log-prob pre-pass may hold: small, so that the pre-pass (run
# after the memory baseline, like everything that touches the inputs) never sets the peak.
_REF_CHUNK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Case:
    """A benchmark shape: packed sequences (one segment each) of which a fraction is trainable."""

    seq_lens: tuple[int, ...]
    hidden: int
    vocab: int
    trainable: float = 1.0
    gpu_only: bool = False

    def lengths(self, scale: float) -> list[int]:
        return [max(1, round(length * scale)) for length in self.seq_lens]


CASES = {
    # N = 4096 trainable tokens, all of them: four 1024-token sequences.
    "dense": Case(seq_lens=(1024,) * 4, hidden=1024, vocab=32768),
    # A CoD pack: three ~5000-token sequences, 30% of positions trainable (~4500 tokens).
    "cod-packed": Case(seq_lens=(4800, 5000, 5200), hidden=1024, vocab=32768, trainable=0.3),
    # Qwen2.5-0.5B's head: H = 896, V = 151936; N = 2048.
    "wide-vocab": Case(seq_lens=(1024,) * 2, hidden=896, vocab=151936),
    # An 8B-class head on a GPU: N = 16384, H = 4096, V = 151936, bf16.
    "h100": Case(seq_lens=(1024,) * 16, hidden=4096, vocab=151936, gpu_only=True),
    # Smoke test only (tests/test_bench.py): seconds, not a measurement.
    "tiny": Case(seq_lens=(40, 24), hidden=32, vocab=128, trainable=0.5),
}


# --------------------------------------------------------------------------------------------
# Worker side: one (case, contender) per process.


def _rss_mib() -> float:
    """Peak resident set of this process so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _reference_logp(hidden, weight, targets):
    """Per-token log-probs by the library's chunked torch path, in chunks small enough that
    this pre-pass never sets the memory peak."""
    import torch

    from cod_fast.ops import linear_logprobs

    rows = max(1, _REF_CHUNK_BYTES // (4 * weight.shape[0]))
    with torch.no_grad():
        return linear_logprobs(hidden, weight, targets, impl="torch", chunk_size=rows)


@dataclass
class Inputs:
    """One contender's view of a case; `hidden` and `weight` are the leaves that get gradients."""

    hidden: Any
    weight: Any
    targets: Any
    advantages: Any
    segment_ids: Any
    rollout_logp: Any
    mask: Any  # padded layout only: [B, T] float, 1 at trainable positions
    n_trainable: int
    n_computed: int  # positions whose logits the contender computes


def make_inputs(case: Case, scale: float, layout: str, device, dtype) -> Inputs:
    """The case's tensors from a fixed seed, in one of three layouts.

    The model produces hidden states for the whole packed row; which rows a contender gets is
    the point of the `cod-packed` case:
    - `gathered` (cod-fast impls, CCE): only the trainable rows, as cod-fast's trainer passes.
    - `full` (eager): every position of the packed row. Untrainable positions get advantage 0
      and the token-mean denominator is the trainable count, so they add exactly nothing to the
      loss or the gradients, but their logits are computed, as a plain implementation would.
    - `padded` (Liger): Liger's GRPO loss takes [B, T, H] with an attention mask and one
      advantage per sequence, so each packed sequence becomes a row of a batch padded to the
      longest, and the mask marks the trainable positions (padding and untrainable positions
      are 0); its chunks are whole sequences, so it computes logits for all B x T positions.
    Peaked logits as in a trained model: weight entries ~ N(0, 16/H), so logits have std ~4.
    """
    import torch

    g = torch.Generator(device=device).manual_seed(SEED)
    lens = case.lengths(scale)
    total, h, v = sum(lens), case.hidden, case.vocab
    weight = torch.randn(v, h, generator=g, device=device, dtype=dtype).mul_(4 / math.sqrt(h))
    hidden = torch.randn(total, h, generator=g, device=device, dtype=dtype)
    targets = torch.randint(0, v, (total,), generator=g, device=device)
    lens_t = torch.tensor(lens, device=device)
    segment_ids = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t)
    seq_adv = torch.randn(len(lens), generator=g, device=device)
    trainable = torch.rand(total, generator=g, device=device) < case.trainable
    idx = trainable.nonzero().squeeze(1)
    n = idx.numel()
    all_trainable = n == total
    hidden_t = hidden if all_trainable else hidden[idx]
    # Rollout log-probs near the current policy's (sampler noise of ~0.1 nats): the clip is
    # active on some tokens and not others, as in training.
    roll = _reference_logp(hidden_t, weight, targets[idx])
    roll += 0.1 * torch.randn(n, generator=g, device=device)

    if layout == "gathered":
        if not all_trainable:
            del hidden
        return Inputs(
            hidden=hidden_t.requires_grad_(),
            weight=weight.requires_grad_(),
            targets=targets[idx],
            advantages=seq_adv[segment_ids[idx]],
            segment_ids=segment_ids[idx],
            rollout_logp=roll,
            mask=None,
            n_trainable=n,
            n_computed=n,
        )
    del hidden_t
    if layout == "full":
        full_roll = torch.zeros(total, device=device).index_copy_(0, idx, roll)
        return Inputs(
            hidden=hidden.requires_grad_(),
            weight=weight.requires_grad_(),
            targets=targets,
            advantages=torch.where(trainable, seq_adv[segment_ids], 0.0),
            segment_ids=segment_ids,
            rollout_logp=full_roll,
            mask=None,
            n_trainable=n,
            n_computed=total,
        )
    if layout != "padded":
        raise ValueError(f"unknown layout {layout!r}")
    b, t = len(lens), max(lens)
    pad_hidden = hidden.new_zeros(b, t, h)
    pad_targets = targets.new_zeros(b, t)
    pad_mask = torch.zeros(b, t, device=device)
    pad_roll = torch.zeros(b, t, device=device)
    full_roll = torch.zeros(total, device=device).index_copy_(0, idx, roll)
    start = 0
    for row, length in enumerate(lens):
        rows = slice(start, start + length)
        pad_hidden[row, :length] = hidden[rows]
        pad_targets[row, :length] = targets[rows]
        pad_mask[row, :length] = trainable[rows].float()
        pad_roll[row, :length] = full_roll[rows]
        start += length
    del hidden, full_roll
    return Inputs(
        hidden=pad_hidden.requires_grad_(),
        weight=weight.requires_grad_(),
        targets=pad_targets,
        advantages=seq_adv,
        segment_ids=None,
        rollout_logp=pad_roll,
        mask=pad_mask,
        n_trainable=n,
        n_computed=b * t,
    )


def _loss_config():
    from cod_fast.config import LossConfig

    return LossConfig(policy="ppo", ratio_level="token", agg="token-mean")


def make_step(contender: str):
    """(layout, step): step(inputs) runs one forward and backward and returns the loss."""
    cfg = _loss_config()

    if contender == "eager":
        from cod_fast.ops.eager import eager_policy_loss

        def step(x: Inputs):
            loss, _ = eager_policy_loss(
                x.hidden,
                x.weight,
                x.targets,
                x.advantages,
                x.segment_ids,
                cfg,
                roll=x.rollout_logp,
                denominator=x.n_trainable,
                dtype=x.hidden.dtype,
            )
            loss.backward()
            return loss

        return "full", step

    if contender in ("torch", "cpp", "triton"):
        from cod_fast.ops.linear_loss import linear_policy_loss

        def step(x: Inputs):
            out = linear_policy_loss(
                x.hidden,
                x.weight,
                x.targets,
                x.advantages,
                x.segment_ids,
                rollout_logp=x.rollout_logp,
                config=cfg,
                impl=contender,
            )
            out.loss.backward()
            return out.loss

        return "gathered", step

    if contender in ("liger", "liger-compiled"):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        # loss_type="dapo" normalises by the mask's sum: token-mean over trainable positions.
        # beta=0 and no reference model: no KL term. old_per_token_logps = the rollout's
        # log-probs, which is cod-fast's bypass mode. `compiled` compiles only Liger's loss
        # math (its log-prob chunks are a custom autograd.Function outside torch.compile).
        liger_loss = LigerFusedLinearGRPOLoss(
            beta=0.0,
            compiled=contender == "liger-compiled",
            use_ref_model=False,
            epsilon_low=cfg.eps_low,
            epsilon_high=cfg.eps_high,
            loss_type="dapo",
            temperature=cfg.temperature,
        )

        def step(x: Inputs):
            loss, _metrics = liger_loss(
                x.hidden,
                x.weight,
                x.targets,
                x.mask,
                x.advantages,
                old_per_token_logps=x.rollout_logp,
            )
            loss.backward()
            return loss

        return "padded", step

    if contender == "cce":
        from cut_cross_entropy import linear_cross_entropy

        from cod_fast.ops.policy_loss import policy_loss_from_logp

        # CCE is a cross-entropy kernel: its per-token losses are -logp, and cod-fast's
        # policy_loss_from_logp (differentiated by autograd) turns them into the loss. It takes
        # any [N, H] rows, so it gets the gathered trainable rows like cod-fast (its own
        # ignore_index path would drop the same rows). CCE's default gradient filtering stays on.
        def step(x: Inputs):
            logp = -linear_cross_entropy(x.hidden, x.weight, x.targets, reduction="none").float()
            loss, _ = policy_loss_from_logp(
                logp,
                x.advantages,
                x.segment_ids,
                config=cfg,
                rollout_logp=x.rollout_logp,
                denominator=x.n_trainable,
            )
            loss.backward()
            return loss

        return "gathered", step

    raise ValueError(f"unknown contender {contender!r}; choose from {CONTENDERS}")


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation percentile (q in [0, 1]) of an ascending list."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _timed(fn, reps: int, warmup: int, cuda: bool) -> list[float]:
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
    times = _timed(lambda: a @ b, reps, warmup, cuda)
    return {"kind": kind, "gflops": 2 * m * k * n / statistics.median(times) / 1e9}


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
        base = _rss_mib()
    case = CASES[spec["case"]]
    x = make_inputs(case, spec["scale"], layout, device, dtype)
    losses = []
    times = sorted(
        _timed(lambda: losses.append(run(x).detach()), spec["reps"], spec["warmup"], cuda)
    )
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else _rss_mib()) - base
    return {
        "status": "ok",
        "N": x.n_trainable,
        "rows_computed": x.n_computed,
        "H": case.hidden,
        "V": case.vocab,
        "dtype": str(dtype).removeprefix("torch."),
        "times_s": times,
        "median_s": statistics.median(times),
        "p20_s": _percentile(times, 0.2),
        "p80_s": _percentile(times, 0.8),
        "peak_mib": peak,
        "loss": float(losses[-1]),
    }


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


def _run_worker(spec: dict, timeout: float, log_dir: Path) -> dict:
    """Run one worker; a failure keeps its output in log_dir/<case>__<contender>.log."""
    cmd = [sys.executable, "-m", "cod_fast.bench.kernels", "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{spec['case']}__{spec['contender']}.log"
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    why = err[-1].strip()[:300] if err else f"exit code {proc.returncode}"
    return {"status": f"failed: {why} (log: {log})"}


def _git_commit() -> str:
    if os.environ.get("COD_FAST_GIT_COMMIT"):  # set by gpu_check.sh where the copy has no .git
        return os.environ["COD_FAST_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def _machine() -> str:
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


def _append_csv(path: Path, row: dict, meta: dict) -> None:
    new = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    values = {**meta, **row, "note": row["status"]}
    with path.open("a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(CSV_COLUMNS)
        writer.writerow(["" if values.get(c) is None else values.get(c, "") for c in CSV_COLUMNS])


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_table(summary: dict, cuda: bool) -> None:
    ceiling = summary["ceiling"]
    unit, div = ("TFLOP/s", 1e3) if cuda else ("GFLOP/s", 1.0)
    title = f"cod-fast kernels: policy loss fwd+bwd on {summary['machine']}"
    if ceiling:
        title += f"; ceiling {ceiling['kind']}, {ceiling['min'] / div:.1f}-{ceiling['max'] / div:.1f} {unit}"
    headers = ["case", "contender", "N", "rows", "H", "V", "dtype", "median s", "p20-p80 s"]
    headers += ["peak MiB", f"GEMM-eq {unit}", f"ceil {unit}", "% ceil"]
    headers += ["% ceil 8NHV"] if cuda else []
    headers += ["x eager", "mem/eager", "loss", "note"]
    rows = []
    for r in summary["results"]:
        ok = r["status"] == "ok"
        cells = [r["case"], r["contender"]]
        if ok:
            cells += [str(r["N"]), str(r["rows_computed"]), str(r["H"]), str(r["V"]), r["dtype"]]
            cells += [f"{r['median_s']:.4g}", f"{r['p20_s']:.4g}-{r['p80_s']:.4g}"]
            cells += [f"{r['peak_mib']:.0f}", f"{r['gflops'] / div:.1f}"]
            cells += [f"{r['ceiling_gflops'] / div:.1f}", f"{100 * r['frac_ceiling']:.0f}"]
            cells += [f"{100 * r['frac_ceiling_8nhv']:.0f}"] if cuda else []
            cells += [_fmt(r["speedup_vs_eager"], ".2f"), _fmt(r["mem_vs_eager"], ".2f")]
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
    for name, given, allowed in (("cases", args.cases, CASES), ("impls", args.impls, CONTENDERS)):
        bad = [item for item in given.split(",") if item not in allowed]
        if bad:
            p.error(f"--{name}: unknown {bad}; choose from {', '.join(allowed)}")
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
        "commit": _git_commit(),
        "machine": _machine(),
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
                    result = _run_worker(spec, args.timeout, out / "logs")
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
    (out / "kernels.json").write_text(json.dumps(summary, indent=1) + "\n")
    _print_table(summary, cuda)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
