"""The memory plan against the memory a real step and a real rollout use.

    python -m cod_fast.bench.plan [--device auto|cpu|cuda] [--shape tiny|29m] [--out DIR]

`cod-fast plan` (cod_fast.train.memory_plan) adds up the buffers of a phase from the model's
shape and the config; this checks the sum where the code runs. Cases, one process, float32:

- `training step`: one optimizer step of the trainer benchmark's model and batch
  (bench/train_workload.py; `29m` is its 29M Qwen3, `tiny` a 2-layer one), AdamW's state made by
  a first step, against the plan's training step at the batch's largest micro-batch and its
  share of trainable tokens;
- `sampling`: one `TorchSampler.generate()` of 6 prompts x 4 members, every response at its cap,
  compacting and with static shapes, against the weights and the plan's sampler terms.

Measured: on CUDA `torch.cuda.max_memory_allocated()` over the call (everything alive counts: the
plan counts the weights and the optimizer too); on the CPU the live storage bytes that
bench/live_memory.py counts. The plan's target is within 15% (the `--check` exit status).

Output: a table, rows appended to DIR/plan.csv, DIR/plan.json, and as the last line
on stdout one JSON object with everything.
"""

from __future__ import annotations

import argparse
import gc
import random
import types
from pathlib import Path

TOLERANCE = 0.15
TABLE = [
    ("case", "case", "s"),
    ("tokens", "tokens", "d"),
    ("planned_mib", "plan MiB", ".1f"),
    ("measured_mib", "measured MiB", ".1f"),
    ("ratio", "plan / measured", ".3f"),
]
SHAPES = {
    "tiny": dict(
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=160,
        vocab=2048,
        tokens=1500,
        micro_batches=2,
    ),
    "29m": dict(tokens=16384, micro_batches=3),
}


class Peak:
    """The peak bytes of tensors alive during a `with` block: CUDA's allocator statistics on a
    GPU, live storages (bench/live_memory.py) elsewhere, with `tensors` (made before the block)
    counted from the start."""

    def __init__(self, device: str, tensors=()):
        self.device, self.tensors, self.bytes = device, list(tensors), 0

    def __enter__(self) -> Peak:
        import torch

        from cod_fast.bench.live_memory import LiveBytes

        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._live = None
        else:
            self._live = LiveBytes()
            self._live.track(self.tensors)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self._live is None:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated()
        else:
            self._live.__exit__(*exc)
            self.bytes = self._live.peak


def measured_step(shape, device: str = "cpu") -> tuple[int, int, float, object]:
    """(peak bytes of one optimizer step, tokens of its largest micro-batch, the share of them
    the loss trains on, the model)."""
    import torch

    from cod_fast.bench.live_memory import optimizer_tensors
    from cod_fast.bench.train_workload import build_model, make_step, step_batch

    model = build_model(shape, device, torch.float32)
    mbs, denominator, _ = step_batch(shape)
    mbs = [mb.to(device) for mb in mbs]
    run, optimizer = make_step("fused", model, mbs, denominator)
    run()  # AdamW's moments exist from the first step on
    optimizer.zero_grad(set_to_none=True)
    with Peak(device, [*model.parameters(), *optimizer_tensors(optimizer)]) as peak:
        run()
    largest = max(mbs, key=lambda mb: mb.num_tokens)
    share = largest.trainable_idx.numel() / largest.num_tokens
    return peak.bytes, largest.num_tokens, share, model


def planned_step(model, tokens: int, share: float, device: str = "cpu") -> int:
    """The plan's training step for one process, float32, at `tokens` a micro-batch."""
    from cod_fast.config import Config
    from cod_fast.model.shapes import shape_of
    from cod_fast.train.memory_plan import plan_memory, with_setting

    cfg = with_setting(Config(), "train", token_budget=tokens, steps=1, warm_start_steps=0)
    cfg = with_setting(cfg, "model", dtype="float32")
    plan = plan_memory(cfg, shape_of(model.config, "step"), device=device, trainable_share=share)
    return plan.phase("training step").bytes


def sampling_case(static: bool, device: str = "cpu") -> tuple[int, int, int]:
    """(planned bytes, measured peak bytes, tokens a sequence) of one generate() of 6 groups of
    4 members, 60-token prompts and 40-token responses, on a random 2-layer Qwen3."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from cod_fast.model.shapes import shape_of
    from cod_fast.rollout.torch_sampler import TorchSampler
    from cod_fast.train.memory_terms import prefill_terms, torch_sampler_terms

    rng = random.Random(7)
    kv = rng.choice([1, 2, 3])
    config = Qwen3Config(
        vocab_size=1500, hidden_size=rng.choice([24, 40, 48]),
        intermediate_size=rng.randint(20, 90), num_hidden_layers=2,
        num_attention_heads=kv * rng.choice([1, 2]), num_key_value_heads=kv,
        head_dim=rng.choice([8, 16]), tie_word_embeddings=rng.random() < 0.5,
        max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device).eval()
    model.generation_config.eos_token_id = None  # every response runs to its cap
    tokenizer = types.SimpleNamespace(eos_token_id=None, pad_token_id=0)
    sampler = TorchSampler(model, tokenizer, temperature=1.0, seed=1, static_shapes=static)
    prompt, response, groups, members = 60, 40, 6, 4
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 1500, (prompt,), generator=g).tolist() for _ in range(groups)]
    batch = [p for p in prompts for _ in range(members)]
    with Peak(device, [*model.parameters(), *model.buffers()]) as peak:
        samples = sampler.generate(batch, [response] * len(batch))
    if any(len(s.token_ids) != response for s in samples):
        raise RuntimeError("a response stopped before its cap: the case measures full ones")
    shape = shape_of(config, "sampling")
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    graphs = sampler.cuda_graphs
    terms = torch_sampler_terms(shape, len(batch), prompt + response, 4, static, graphs)
    terms += prefill_terms(shape, groups, prompt, 4)
    return weights + sum(t.bytes for t in terms), peak.bytes, prompt + response


def measure(shape_name: str, device: str) -> list[dict]:
    from cod_fast.bench.train_workload import StepShape

    shape = StepShape(**SHAPES[shape_name])
    measured, tokens, share, model = measured_step(shape, device)
    rows = [
        _row(
            f"training step ({shape_name})",
            tokens,
            planned_step(model, tokens, share, device),
            measured,
        )
    ]
    for static in (False, True):
        planned, peak, tokens = sampling_case(static, device)
        rows.append(
            _row(f"sampling ({'static' if static else 'compacting'})", tokens, planned, peak)
        )
    return rows


def _row(case: str, tokens: int, planned: int, measured: int) -> dict:
    return {
        "case": case,
        "tokens": tokens,
        "planned_mib": planned / 2**20,
        "measured_mib": measured / 2**20,
        "ratio": planned / measured,
    }


def main(argv: list[str] | None = None) -> dict:
    from cod_fast.bench.harness import (
        append_csv,
        emit_summary,
        print_table,
        resolve_device,
        run_meta,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="29m")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--check", action="store_true", help="exit 1 when a case is off by >15%%")
    args = parser.parse_args(argv)
    device = resolve_device(args.device, parser)
    meta = run_meta()
    rows = measure(args.shape, device)
    append_csv(args.out / "plan.csv", TABLE, rows, meta)
    print_table(f"memory plan vs measured peak on {meta['machine']} ({device})", TABLE, rows)
    missed = [r["case"] for r in rows if abs(r["ratio"] - 1) > TOLERANCE]
    settings = {"device": device, "shape": args.shape, "tolerance": TOLERANCE}
    summary = emit_summary(
        {**meta, "settings": settings, "rows": rows, "targets_missed": missed},
        args.out / "plan.json",
    )
    if args.check and missed:
        raise SystemExit(f"plan off by more than 15%: {', '.join(missed)}")
    return summary


if __name__ == "__main__":
    main()
