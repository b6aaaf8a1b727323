"""Trainer benchmark: one training step (fused loss vs logits + eager loss), and prefix merging.

    python -m cod_fast.bench.train [--sections step,merge] [--reps 5] [--warmup 1]
        [--tokens 16384] [--packs 50] [--device auto|cpu|cuda] [--out DIR] [--tiny] [--jobs 1]

1. `step`: one optimizer step of a Qwen3-architecture model (random weights, no download) over
   a packed CoD-shaped batch: multi-turn solve episodes prefix-merged into one sequence each and
   long-prompt update episodes, in 2-4 micro-batches (model, batch and both steps:
   cod_fast.bench.train_workload). Two contenders, each in its own process:
   - `fused`: what the trainer runs, `train_step` over `Policy`: the decoder without its LM
     head, then the fused loss on the trainable hidden rows and the LM head weight (the C++
     kernels on the CPU when built).
   - `logits+eager`: what a plain PyTorch user writes: the causal LM's full [T, V] logits,
     log_softmax, gather at the trainable positions, then `ops.policy_loss_from_logp`, the
     library's vectorised loss on log-probs (the `torch` implementation's head, which the tests
     check against the float64 oracle), so the contenders differ only in where the log-probs
     come from. Not `ops.eager.eager_policy_loss`: that oracle loops over segments (and for REC
     over tokens) in Python, and timing it would time the interpreter.
   Same packed attention (cod_fast.model.attention), batch, initial weights, global denominator, clip
   and AdamW: the first step's loss and gradient norm must agree, which checks the benchmark.
   Peak memory is the growth over a baseline taken before the model and the batch exist (after
   one tiny step that puts imports and thread pools behind it), so for both contenders it holds
   the weights, their gradients and AdamW's state (`static MiB`, also shown alone) plus the step.
   On a GPU it is torch.cuda.max_memory_allocated. On the CPU there are two: `peak MiB`, the
   peak resident set of the timed worker, which also holds what glibc's heap keeps after the
   step freed it, and `live peak MiB`, the peak resident set of a one-step worker whose every
   block of 64 KiB or more is its own mapping (LIVE_MALLOC): the peak of memory in use, as on
   the GPU. The memory target is on the live peak.
   The rate is the step's useful work (6 x decoder weights x T, causal attention per sequence,
   the LM head on the trainable rows only) per median second, against the GEMM ceiling measured
   in the same worker (harness.measure_ceiling: fp32 on the CPU, bf16 on a GPU).
2. `merge`: trainer tokens per CoD rollout with prefix merging (one sequence per multi-turn
   episode) vs one sequence per turn, for the scripted explorer run through the real rollout
   driver on every environment; also sum(len^2) over sequences, the attention cost.

Output: tables, DIR/train_step.csv and DIR/prefix_merge.csv (rows appended), DIR/train.json, and
as the last line on stdout one JSON object with everything.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from cod_fast.bench.harness import (
    OthersCPU,
    append_csv,
    emit_summary,
    fmt,
    measure_ceiling,
    percentile,
    print_table,
    resolve_device,
    rss_mib,
    rss_peak_mib,
    run_json_worker,
    run_meta,
    timed,
    with_live_peak,
)
from cod_fast.bench.train_workload import (
    CONTENDERS,
    GRAD_CLIP,
    LOSS,
    LR,
    TINY,
    K,
    StepShape,
    build_model,
    make_step,
    set_rollout_logp,
    step_batch,
)
from cod_fast.envs import ENVIRONMENTS

TARGETS = {"speed": 1.5, "memory": 3.0}  # the CPU targets, fused vs logits+eager
AGREE_RTOL = {"float32": 1e-4, "bfloat16": 3e-2}  # bf16: HF rounds the logits to bf16
# Every registered environment at its full (specified) size, and FrozenLake's tiny size (the CPU
# presets').
MERGE_ENVS = (*((name, "full") for name in ENVIRONMENTS), ("frozenlake", "tiny"))
# Columns of the CSVs, and of the tables where they have a header: (key, header, format).
# fmt: off
STEP_TABLE = (
    ("contender", "contender", ""), ("impl", "impl", ""), ("dtype", "dtype", ""),
    ("model", None, ""), ("device", None, ""), ("grad_ckpt", "grad ckpt", ""),
    ("lean", "lean modules", ""),
    ("tokens", None, ""), ("trainable", None, ""),
    ("sequences", None, ""), ("segments", None, ""), ("micro_batches", None, ""),
    ("median_s", "median s", ".3f"), ("p20_s", "p20 s", ".3f"), ("p80_s", "p80 s", ".3f"),
    ("peak_mib", "peak MiB", ".0f"), ("live_peak_mib", "live peak MiB", ".0f"),
    ("static_mib", "static MiB", ".0f"),
    ("tokens_per_s", "tokens/s", ".0f"), ("gflops", "GFLOP/s", ".1f"),
    ("ceiling_gflops", "ceil GFLOP/s", ".1f"), ("frac_ceiling", "frac ceil", ".3f"),
    ("speedup", "x speed", ".2f"), ("mem_ratio", "x peak MiB", ".2f"),
    ("live_mem_ratio", "x live peak", ".2f"),
    ("others_cpu", "others' CPU", ".0%"),
    ("loss0", "loss step 0", ".7g"), ("grad_norm0", "grad norm 0", ".7g"), ("note", "note", ""),
)
MERGE_TABLE = (
    ("env", "env", ""), ("size", "size", ""), ("packs", None, ""), ("K", None, ""),
    ("rollouts", None, ""), ("mean_solve_turns", "turns/solve", ".2f"),
    ("merged_tokens", None, ""), ("per_turn_tokens", None, ""),
    ("merged_per_rollout", "tokens/rollout merged", ".0f"),
    ("per_turn_per_rollout", "per turn", ".0f"), ("token_ratio", "x tokens", ".2f"),
    ("merged_attn", "sum len^2 merged", ".3g"), ("per_turn_attn", "per turn", ".3g"),
    ("attn_ratio", "x attention", ".2f"), ("note", "note", ""),
)
# fmt: on


# --------------------------------------------------------------------------------------------
# The step: one contender per worker process, then the ratios.


def _useful_flops(model, shape: StepShape, stats: dict) -> float:
    """Forward + backward of the decoder's GEMMs over every token, causal attention per
    sequence, and the LM head on the trainable rows only: the work the step must do."""
    import torch

    linears = (m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    decoder = sum(m.weight.numel() for m in linears)
    attention = shape.layers * shape.heads * shape.head_dim * stats["attn_pairs"]
    head = stats["trainable"] * shape.hidden * shape.vocab
    return 6 * (decoder * stats["tokens"] + attention + head)


def _setup(contender: str, shape: StepShape, device, dtype, **modules):
    """(model, optimizer, step, batch stats) of one contender, ready to time; `modules` go to
    build_model."""
    model = build_model(shape, device, dtype, **modules)
    mbs, denominator, stats = step_batch(shape)
    set_rollout_logp(model, mbs, device)
    step, optimizer = make_step(contender, model, mbs, denominator)
    return model, optimizer, step, stats


def _step_worker(spec: dict) -> dict:
    """One contender in this process: time its steps, read its peak, then the ceiling."""
    import torch

    from cod_fast.ops.dispatch import resolve_impl

    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = StepShape(**spec["shape"])
    # One tiny step first puts extension loading, thread pools and cuBLAS handles behind the
    # baseline, which is then taken before this run's model and batch exist.
    _setup(spec["contender"], replace(TINY, tokens=256), device, dtype)[2]()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mib()
    model, optimizer, step, stats = _setup(
        spec["contender"], shape, device, dtype, **spec["modules"]
    )
    results: list[tuple[float, float]] = []
    # What the machine's other processes took while we were timed: this benchmark's numbers
    # only mean something when that share is small.
    others = OthersCPU()
    times = sorted(timed(lambda: results.append(step()), spec["reps"], spec["warmup"], cuda))
    others_cpu = others.share()
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_peak_mib()) - base
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    median, flops = statistics.median(times), _useful_flops(model, shape, stats)
    ceiling = measure_ceiling()  # after the peak was read: the same moment, the same process
    if spec["contender"] == "fused":
        impl = f"{resolve_impl(None, device, dtype)[0]} fused loss"
    else:
        impl = "torch logits"
    return {
        "status": "ok",
        **stats,
        "impl": f"{impl}, {model.config._attn_implementation}",
        "dtype": str(dtype).removeprefix("torch."),
        "times_s": times,
        "median_s": median,
        "p20_s": percentile(times, 0.2),
        "p80_s": percentile(times, 0.8),
        "peak_mib": peak,
        "static_mib": (2 * weights + state) / 2**20,  # weights, their gradients, AdamW state
        "tokens_per_s": stats["tokens"] / median,
        "gflops": flops / median / 1e9,
        "ceiling_gflops": ceiling["gflops"],
        "ceiling_kind": ceiling["kind"],
        "frac_ceiling": flops / median / 1e9 / ceiling["gflops"],
        "others_cpu": others_cpu,  # fraction of all cores other processes used meanwhile
        "losses": [loss for loss, _ in results],
        "loss0": results[0][0],  # the first step, from the shared initial weights
        "grad_norm0": results[0][1],
    }


def _run_worker(spec: dict, timeout: float, log_dir: Path, env_extra: dict | None = None) -> dict:
    """One contender in a fresh process; a failure keeps its output in log_dir."""
    env = dict(os.environ) | (env_extra or {})
    if spec["device"] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # so the worker's ceiling and timer are the CPU's too
    cmd = [sys.executable, "-m", "cod_fast.bench.train", "--worker", json.dumps(spec)]
    log = log_dir / f"train_step__{spec['contender']}{'__live' if env_extra else ''}.log"
    return run_json_worker(cmd, timeout, log, env)


def _measure(spec: dict, timeout: float, log_dir: Path) -> dict:
    """A contender's timing worker and, on the CPU, a one-step worker for its live peak."""
    run = functools.partial(_run_worker, timeout=timeout, log_dir=log_dir)
    return with_live_peak(run, spec, on_cpu=spec["device"] == "cpu")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def run_step(shape: StepShape, args, progress) -> dict:
    """Both contenders, one process each, then their ratios, agreement and the targets."""
    stats = step_batch(shape)[2]
    progress.print(
        f"step batch: {stats['tokens']} tokens, {stats['trainable']} trainable "
        f"({stats['trainable'] / stats['tokens']:.0%}), {stats['sequences']} sequences, "
        f"{stats['segments']} segments, {stats['micro_batches']} micro-batches",
        highlight=False,
    )
    modules = {"grad_ckpt": args.grad_ckpt, "lean": not args.plain_modules}  # build_model's
    specs = [
        {"contender": contender, "shape": asdict(shape), "device": args.device}
        | {"reps": args.reps, "warmup": args.warmup, "modules": modules}
        for contender in CONTENDERS
    ]
    # One at a time unless --jobs says otherwise (a smoke test's timings mean nothing).
    with progress.status(f"step: {', '.join(CONTENDERS)}"), ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda spec: _measure(spec, args.timeout, args.out), specs))
    rows = []
    for contender, result in zip(CONTENDERS, results, strict=True):
        rows.append({"contender": contender, "model": shape.describe(), "device": args.device})
        rows[-1] |= modules
        rows[-1] |= result | {"note": "" if result["status"] == "ok" else result["status"]}
        progress.print(f"step / {contender}: {result['status']}", markup=False, highlight=False)
    section = {"model": shape.describe(), "shape": asdict(shape), "batch": stats, "rows": rows}
    fused, eager = rows
    if fused["status"] != "ok" or eager["status"] != "ok":
        return section
    for r in rows:
        r["speedup"] = eager["median_s"] / r["median_s"]
        r["mem_ratio"] = _ratio(eager["peak_mib"], r["peak_mib"])
        r["live_mem_ratio"] = _ratio(eager["live_peak_mib"], r["live_peak_mib"])
    rtol = AGREE_RTOL[fused["dtype"]]
    keys = ("loss0", "grad_norm0")
    section["agree_rtol"] = rtol
    section["losses_agree"] = all(math.isclose(fused[k], eager[k], rel_tol=rtol) for k in keys)
    step_only = [r["live_peak_mib"] - r["static_mib"] for r in (eager, fused)]
    section["mem_ratio_without_static"] = _ratio(*step_only)
    measured = {"speed": fused["speedup"], "memory": fused["live_mem_ratio"]}
    section["targets"] = {
        name: {"target": t, "measured": measured[name], "met": (measured[name] or 0) >= t}
        for name, t in TARGETS.items()
    }
    return section


# --------------------------------------------------------------------------------------------
# Prefix merging on the environments' scripted rollouts.


def run_merge(packs: int) -> list[dict]:
    """Trainer tokens of the scripted explorer's rollouts, merged vs one sequence per turn."""
    from cod_fast.config import RolloutConfig
    from cod_fast.data.packing import rollout_sequences
    from cod_fast.envs import make_env
    from cod_fast.envs.packs import make_packs, pack_seeds
    from cod_fast.model.tokenizer import CHATML, char_tokenizer
    from cod_fast.rollout.chat import ChatFormat
    from cod_fast.rollout.driver import DriverSettings
    from cod_fast.rollout.scripted import demonstrations

    chat = ChatFormat(char_tokenizer(CHATML))
    settings = DriverSettings(rollout=RolloutConfig(prompt_style="full", env_timeout_s=None))
    specs = make_packs(pack_seeds("bench", packs), K)
    rows = []
    for name, size in MERGE_ENVS:
        rollouts = demonstrations(make_env(name, "train", size), chat, settings, specs)
        episodes = [e for r in rollouts for e in r.episodes]
        turns = [len(e.turns) for e in episodes if e.kind == "solve"]
        merged, per_turn = (rollout_sequences(episodes, merge_prefix=m) for m in (True, False))
        tokens = [sum(len(s) for s in seqs) for seqs in (merged, per_turn)]
        attn = [sum(len(s) ** 2 for s in seqs) for seqs in (merged, per_turn)]
        rows.append(
            {"env": name, "size": size, "packs": packs, "K": K, "rollouts": len(rollouts)}
            | {"mean_solve_turns": statistics.mean(turns), "merged_tokens": tokens[0]}
            | {"per_turn_tokens": tokens[1], "merged_per_rollout": tokens[0] / len(rollouts)}
            | {"per_turn_per_rollout": tokens[1] / len(rollouts)}
            | {"token_ratio": tokens[1] / tokens[0], "merged_attn": attn[0]}
            | {"per_turn_attn": attn[1], "attn_ratio": attn[1] / attn[0]}
            | {"note": "" if max(turns) > 1 else "single-turn: nothing to merge"}
        )
    return rows


# --------------------------------------------------------------------------------------------
# Output and the command line.


def _print_step(section: dict, machine: str) -> None:
    b = section["batch"]
    print_table(
        f"one training step on {machine}: {section['model']}; {b['tokens']} tokens, "
        f"{b['trainable']} trainable, {b['sequences']} sequences, {b['segments']} segments, "
        f"{b['micro_batches']} micro-batches; peak MiB = growth over a baseline taken before "
        "the model and the batch existed: it includes the static MiB (weights, gradients, AdamW); "
        "live peak MiB = the same without memory the allocator kept after it was freed (CPU)",
        STEP_TABLE,
        section["rows"],
    )
    if "targets" in section:
        print(
            f"losses and grad norms agree (rtol {section['agree_rtol']:g}): "
            f"{section['losses_agree']}; live memory ratio without the static MiB: "
            f"{fmt(section['mem_ratio_without_static'], '.2f')}"
        )
        for name, t in section["targets"].items():
            verdict = "met" if t["met"] else "NOT met"
            measured = fmt(t["measured"], ".2f")
            print(f"target fused >= {t['target']}x on {name}: {verdict} (measured {measured})")


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m cod_fast.bench.train",
        description="Benchmark a training step (fused loss vs logits + eager) and prefix merging.",
    )
    p.add_argument("--sections", default="step,merge", help="from step, merge")
    p.add_argument("--reps", type=int, default=5, help="timed steps (median, p20, p80)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing")
    p.add_argument("--tokens", type=int, help="packed tokens of the step (default 16384)")
    p.add_argument("--packs", type=int, default=50, help="packs per environment (merge)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for results")
    p.add_argument("--tiny", action="store_true", help="a tiny model and batch (smoke test)")
    p.add_argument("--jobs", type=int, default=1, help="workers side by side (smoke tests)")
    p.add_argument(
        "--grad-ckpt", action="store_true", help="gradient checkpointing per layer (both sides)"
    )
    p.add_argument(
        "--plain-modules",
        action="store_true",
        help="transformers' own MLPs and norms instead of cod_fast.model.lean's (both sides)",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per worker process")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sections = args.sections.split(",")
    if bad := [s for s in args.sections if s not in ("step", "merge")]:
        p.error(f"--sections: unknown {bad}; choose from step, merge")
    if min(args.reps, args.packs, args.jobs) < 1 or args.warmup < 0 or (args.tokens or 64) < 64:
        p.error("--reps, --packs and --jobs must be >= 1, --warmup >= 0, --tokens >= 64")
    return args, p


def main(argv: list[str] | None = None) -> dict | None:
    """Run the benchmark; returns the summary that the last printed line holds as JSON."""
    args, parser = _parse_args(argv)
    if args.worker is not None:
        print(json.dumps(_step_worker(json.loads(args.worker))))
        return None

    from rich.console import Console

    args.device = resolve_device(args.device, parser)
    progress = Console(stderr=True)
    meta = run_meta()
    shape = replace(
        TINY if args.tiny else StepShape(), **({"tokens": args.tokens} if args.tokens else {})
    )
    names = ("sections", "reps", "warmup", "packs", "device", "jobs", "grad_ckpt", "plain_modules")
    settings = {k: getattr(args, k) for k in names}
    settings |= {"tiny": args.tiny, "loss": asdict(LOSS), "grad_clip": GRAD_CLIP, "lr": LR}
    summary: dict = {**meta, "settings": settings}
    if "step" in args.sections:
        summary["step"] = run_step(shape, args, progress)
        append_csv(args.out / "train_step.csv", STEP_TABLE, summary["step"]["rows"], meta)
        _print_step(summary["step"], meta["machine"])
    if "merge" in args.sections:
        with progress.status("prefix merging"):
            summary["merge"] = run_merge(args.packs)
        append_csv(args.out / "prefix_merge.csv", MERGE_TABLE, summary["merge"], meta)
        title = "trainer tokens per CoD rollout, prefix merging vs one sequence per turn"
        title += f" ({args.packs} packs, K={K}, scripted explorer, char tokenizer)"
        print_table(title, MERGE_TABLE, summary["merge"])
    return emit_summary(summary, args.out / "train.json")


if __name__ == "__main__":
    main()
