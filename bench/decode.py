"""Decode benchmark of the torch sampler: milliseconds per decode step, by decode path and batch.

    python -m cod_fast.bench.decode [--batches 32,128] [--new-tokens 32] [--prompt 128]
        [--reps 2] [--device auto|cpu|cuda] [--out DIR] [--tiny]

A Qwen3-0.6B-shaped decoder (28 layers, H=1024, 16 query / 8 key-value heads of 128, I=3072,
V=151936, tied; random seeded weights, bf16 on CUDA, float32 on a CPU) samples `--batches`
prompts of `--prompt` random tokens each. Contenders, `TorchSampler` switches:
- `compacting`: fast decode with finished rows dropped from the batch (the CPU's default);
- `static`: fast decode over one (batch bucket, width bucket) shape, finished rows masked, one
  device read per step (`static_shapes=True, cuda_graphs=False`);
- `static+graphs`: the same step replayed as a CUDA graph (CUDA only; the default there).

Per contender and batch: one warm-up call of each length, then `--reps` timed calls of
`--new-tokens` tokens and of 1 token (prefill and the first draw); a decode step is their
difference over the extra tokens (median calls), and tokens/s = batch / step time. With random
weights a row almost never draws its end token, so every row decodes every step. Ratios are
against `compacting` in the same run.

Output: a table, rows appended to DIR/decode.csv, DIR/decode.json, and as the last line on stdout
one JSON object with everything.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from cod_fast.bench.harness import append_csv, emit_summary, print_table, resolve_device, run_meta
from cod_fast.bench.train_workload import StepShape

SEED = 0
CONTENDERS = {  # name: (static_shapes, cuda_graphs)
    "compacting": (False, False),
    "static": (True, False),
    "static+graphs": (True, True),
}
# fmt: off
TABLE = (
    ("contender", "contender", ""), ("batch", "batch", "d"), ("step_ms", "ms / step", ".2f"),
    ("tokens_per_s", "tokens/s", ".0f"), ("speedup", "vs compacting", ".2f"),
    ("prefill_ms", "prefill ms", ".1f"), ("device", "device", ""), ("dtype", None, ""),
    ("model", None, ""), ("new_tokens", "new tokens", "d"), ("prompt", "prompt", "d"),
)
# fmt: on


QWEN3_0_6B = StepShape(
    layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936
)
TINY = StepShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512)


def build_model(shape: StepShape, device, dtype, eos: int):
    """The seeded Qwen3ForCausalLM of `shape`, made on `device` in `dtype`."""
    import torch

    with torch.device(device):
        model = shape.seeded_model(eos_token_id=eos, pad_token_id=eos)
    return model.to(dtype=dtype).eval()


def _median_s(call, reps: int, sync) -> float:
    times = []
    for _ in range(reps):
        sync()
        started = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_contender(model, tokenizer, prompts, name: str, args, sync) -> dict:
    """One row: decode ms per step and prefill ms of `name` on `prompts`."""
    from cod_fast.rollout.torch_sampler import TorchSampler

    static, graphs = CONTENDERS[name]
    sampler = TorchSampler(
        model, tokenizer, temperature=1.0, seed=SEED, static_shapes=static, cuda_graphs=graphs
    )
    batch = len(prompts)

    def call(tokens: int):
        return lambda: sampler.generate(prompts, [tokens] * batch)

    for tokens in (args.new_tokens, 1):  # warm-up: caches, a graph per bucket
        call(tokens)()
    long_s = _median_s(call(args.new_tokens), args.reps, sync)
    short_s = _median_s(call(1), args.reps, sync)
    step_s = (long_s - short_s) / (args.new_tokens - 1)
    return {
        "contender": name,
        "batch": batch,
        "step_ms": 1e3 * step_s,
        "tokens_per_s": batch / step_s if step_s > 0 else None,
        "prefill_ms": 1e3 * short_s,
        "decode_steps": sampler.decode_steps,
    }


def measure(shape: StepShape, device: str, args) -> list[dict]:
    import random

    import torch

    from cod_fast.model.tokenizer import CHATML, char_tokenizer

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    tokenizer = char_tokenizer(CHATML)
    eos = tokenizer.eos_token_id
    model = build_model(shape, dev, dtype, eos)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    names = [n for n in CONTENDERS if cuda or not CONTENDERS[n][1]]
    common = {
        "device": dev.type,
        "dtype": str(dtype).removeprefix("torch."),
        "model": shape.describe(),
    }
    common |= {"new_tokens": args.new_tokens, "prompt": args.prompt}
    rng = random.Random(SEED)
    rows = []
    for batch in args.batches:
        prompts = [
            [rng.randrange(eos + 1, shape.vocab) for _ in range(args.prompt)] for _ in range(batch)
        ]
        base = None
        for name in names:
            row = common | measure_contender(model, tokenizer, prompts, name, args, sync)
            base = base or row["step_ms"]
            row["speedup"] = base / row["step_ms"] if row["step_ms"] > 0 else None
            rows.append(row)
            if cuda:
                torch.cuda.empty_cache()
    return rows


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m cod_fast.bench.decode",
        description="Milliseconds per decode step of the torch sampler, by decode path.",
    )
    p.add_argument("--batches", default="32,128", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per timed call (>= 2)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    p.add_argument("--reps", type=int, default=2, help="timed calls per length (median)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for results")
    p.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if min(args.batches) < 1 or args.new_tokens < 2 or args.prompt < 1 or args.reps < 1:
        p.error("--batches >= 1 each, --new-tokens >= 2, --prompt >= 1, --reps >= 1")
    return args, p


def main(argv: list[str] | None = None) -> dict:
    """Every contender at every batch size; returns the summary the last printed line holds."""

    args, parser = _parse_args(argv)
    args.device = resolve_device(args.device, parser)
    shape = TINY if args.tiny else QWEN3_0_6B
    meta = run_meta()
    rows = measure(shape, args.device, args)
    append_csv(args.out / "decode.csv", TABLE, rows, meta)
    print_table(
        f"torch sampler decode steps on {meta['machine']} ({shape.describe()})", TABLE, rows
    )
    settings = {k: v for k, v in vars(args).items() if k != "out"} | {"shape": asdict(shape)}
    return emit_summary({**meta, "settings": settings, "rows": rows}, args.out / "decode.json")


if __name__ == "__main__":
    main()
