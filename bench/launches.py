"""Launch-overhead proxy: dispatched aten ops, host syncs and host-to-device copies per step.

    python -m cod_fast.bench.launches [--tokens 512] [--prompts 4] [--device auto|cpu|cuda]
        [--out DIR] [--check]

On a GPU every dispatched aten op is at least one kernel launch and every host sync stalls the
CPU until the device has caught up, so a small model's step is bound by their number rather than
by its flops. Both are properties of the code, not of the device: `DispatchCounter`
(bench/dispatch_count.py) counts them as torch dispatches them, on any device. Cases, each
counted once after one warm-up call (AdamW's state, lazy initialisation and caches exist by then):

- `train_step`: one optimizer step of the trainer benchmark (bench/train.py; its tiny model,
  `--tokens` packed tokens in its micro-batches), forward, backward, clipping and AdamW, for its
  two contenders: `fused` (`train_step` over `Policy`, the fused loss on the hidden rows) and
  `logits+eager` (full logits, log_softmax, gather, the loss on log-probs).
- `loss`: the fused loss alone, forward and backward, on the first micro-batch's hidden rows,
  called as `Policy.forward` calls it: the part that should make no host sync at all.
- `decode`: one decode step of `TorchSampler` on a batch of `--prompts` prompts, compacting
  (`torch`, the CPU's default) and over static shapes (`torch-static`, CUDA's default, whose
  step CUDA replays as one graph): the sampling of one token and one step of the decoder, as
  the counts of a two-token call less a one-token call.

What is and is not the CUDA code path on a CPU (`--device cpu`, float32):
- Selected: the decoder's layer and attention kernels run their torch code (COD_FAST_IMPL=torch
  while counting), which is what CUDA runs, instead of the CPU's C++ kernels; the loss keeps its
  fused chunked driver, which CUDA also runs (its implementation is passed explicitly, so the
  variable does not select the unfused torch loss).
- Not selectable: the branches on `is_cuda` and on 16-bit operands. `_Gemms` in
  cod_fast/ops/chunked.py keeps bf16 operands native on CUDA, which adds one cast of dz per
  chunk there; the layer kernels widen 16-bit inputs to float32 inside; packed attention is one
  flash-attention varlen call per layer on CUDA (bf16) and one SDPA per sequence here.
- Not aten ops: the fused loss's row kernels (C++ here, Triton on CUDA: one launch per chunk
  there) are not dispatched, so they are in neither count.
- Not seen on a CPU: `tensor.tolist()` of a CPU tensor dispatches nothing (the decode loop's
  stop test is a host sync on CUDA), and no copy is host-to-device when every tensor is on the
  host, so `h2d_copies` is 0 here; `--device cuda` counts both.

Columns: `aten_ops` counts every dispatched op; `kernels` those that launch a kernel on a GPU
(not views such as the detach autograd dispatches for every saved tensor, nor bare
allocations); `host_syncs` the ops that wait for the device (AdamW's reads of its step counts are
left out: those are host tensors on a GPU too).

Targets (`--check` exits 1 when one is missed): 0 host syncs in the fused loss's forward and
backward; the fused step launches no more kernel ops than the logits+eager step.

Output: a table, rows appended to DIR/launches.csv, DIR/launches.json, and as the last line on
stdout one JSON object with everything.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

from cod_fast.bench.dispatch_count import DispatchCounter
from cod_fast.bench.harness import append_csv, emit_summary, print_table, resolve_device, run_meta
from cod_fast.bench.train_workload import (
    CONTENDERS,
    LOSS,
    SEED,
    TINY,
    build_model,
    make_step,
    set_rollout_logp,
    step_batch,
)

# Columns of the CSV and of the table where they have a header: (key, header, format).
# fmt: off
TABLE = (
    ("case", "case", ""), ("contender", "contender", ""), ("impl", "loss impl", ""),
    ("aten_ops", "aten ops", "d"), ("kernels", "kernel ops", "d"),
    ("host_syncs", "host syncs", "d"), ("h2d_copies", "h2d copies", "d"),
    ("sync_ops", "sync ops", ""), ("device", "device", ""), ("dtype", None, ""),
    ("model", None, ""),
    ("tokens", "tokens", ""), ("micro_batches", "micro-batches", ""), ("prompts", "prompts", ""),
)
# fmt: on
DECODE_PROMPTS = 4


@contextlib.contextmanager
def _torch_layers(device):
    """COD_FAST_IMPL=torch while counting on a CPU: the layer and attention kernels' torch code
    is what CUDA runs (cod_fast.ops.layers); the variable is put back afterwards."""
    from cod_fast.ops.dispatch import ENV_VAR

    if device.type == "cuda":
        yield
        return
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "torch"
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = old


def _counts(ops: Counter, kernels: Counter, syncs: list[str], h2d: int) -> dict:
    """A row's count columns; `sync_ops` names each syncing op with its count."""
    names = " ".join(f"{n.removeprefix('aten.')} x{syncs.count(n)}" for n in sorted(set(syncs)))
    return {
        "aten_ops": sum(ops.values()),
        "kernels": sum(kernels.values()),
        "host_syncs": len(syncs),
        "h2d_copies": h2d,
        "sync_ops": names,
    }


def _counted(call, host=lambda: ()) -> DispatchCounter:
    """The counter of one `call()`, made after one uncounted warm-up call; `host()` gives the
    tensors that stay on the host on a GPU (see DispatchCounter)."""
    call()
    with DispatchCounter(tuple(host())) as counter:
        call()
    return counter


def _step_counts(step, optimizer) -> dict:
    """The count columns of one optimizer step after a warm-up step; AdamW's step counts are
    host tensors on a GPU too, so reading them is no device sync."""
    counter = _counted(step, lambda: [s["step"] for s in optimizer.state.values() if "step" in s])
    return _counts(counter.ops, counter.kernels, counter.syncs, counter.h2d)


def _loss_impl(device) -> str | None:
    """The fused loss's implementation: the device's default on CUDA; on a CPU the C++ row
    kernels (the fused driver, as on CUDA) when built, else torch."""
    from cod_fast.ops import cpp_rows

    if device.type == "cuda":
        return None
    return "cpp" if cpp_rows.HAS_CPP else "torch"


def _loss_counts(policy, mb, denominator: float) -> dict:
    """The counts of the loss's forward and backward as `Policy.forward` calls it (after one
    warm-up call): a hook on the decoder's output starts the counter once the decoder is done,
    and hands the loss a leaf copy of the hidden states, so the backward stops there."""
    counters: list[DispatchCounter] = []

    def start_counting(module, args, out):
        out.last_hidden_state = out.last_hidden_state.detach().requires_grad_()
        counters.append(DispatchCounter().__enter__())
        return out

    handle = policy.model.get_decoder().register_forward_hook(start_counting)
    try:
        for call in range(2):  # a warm-up call, then the counted one
            try:
                policy(mb, loss_config=LOSS, denominator=denominator).loss.backward()
            finally:
                if len(counters) > call:  # the hook ran: its counter is the innermost mode
                    counters[call].__exit__(None, None, None)
    finally:
        handle.remove()
    last = counters[-1]
    return _counts(last.ops, last.kernels, last.syncs, last.h2d)


def measure_step(shape, device, dtype) -> list[dict]:
    """The train_step rows (both contenders) and the fused loss's row."""
    from cod_fast.model.policy import Policy
    from cod_fast.train.step import runnable

    mbs, denominator, stats = step_batch(shape)
    batch = {"tokens": stats["tokens"], "micro_batches": stats["micro_batches"]}
    impl = _loss_impl(device)
    rows, models = [], {}
    for contender in CONTENDERS:
        model = models[contender] = build_model(shape, device, dtype)  # the same initial weights
        set_rollout_logp(model, mbs, device)
        step, optimizer = make_step(contender, model, mbs, denominator, impl=impl)
        name = (impl or "default") if contender == "fused" else "torch logits"
        rows.append({"case": "train_step", "contender": contender, "impl": name, **batch})
        rows[-1] |= _step_counts(step, optimizer)
    mb = runnable(mbs[0], LOSS).to(device)
    rows.append({"case": "loss", "contender": "fused", "impl": impl or "default"})
    rows[-1] |= {"tokens": mb.num_tokens, "micro_batches": 1}
    rows[-1] |= _loss_counts(Policy(models["fused"], impl=impl), mb, denominator)
    return rows


def measure_decode(shape, device, dtype, prompts: int) -> list[dict]:
    """One decode step of TorchSampler, compacting (`torch`) and over static shapes
    (`torch-static`, the CUDA default): a two-token call's counts less a one-token call's, on
    `prompts` prompts of different lengths (a seeded model, so the counts repeat)."""
    import random

    from cod_fast.model.tokenizer import CHATML, char_tokenizer
    from cod_fast.rollout.torch_sampler import TorchSampler

    tokenizer = char_tokenizer(CHATML)
    eos = tokenizer.eos_token_id
    shape = replace(shape, vocab=len(tokenizer))
    model = shape.seeded_model(eos_token_id=eos, pad_token_id=eos).to(device=device, dtype=dtype)
    rng = random.Random(SEED)
    batch = [
        [rng.randrange(eos + 1, shape.vocab) for _ in range(8 + 5 * i)] for i in range(prompts)
    ]
    rows = []
    for contender, static in (("torch", False), ("torch-static", True)):

        def count(new_tokens: int, static=static) -> DispatchCounter:
            sampler = TorchSampler(
                model, tokenizer, temperature=LOSS.temperature, seed=SEED, static_shapes=static
            )
            return _counted(lambda: sampler.generate(batch, [new_tokens] * prompts))

        one, two = count(1), count(2)
        # The two calls run the same code up to the second token: what the longer one adds is
        # one decoder step, one more draw, and its syncs come after the shorter call's.
        step = _counts(
            two.ops - one.ops,
            two.kernels - one.kernels,
            two.syncs[len(one.syncs) :],
            two.h2d - one.h2d,
        )
        rows.append({"case": "decode", "contender": contender, "impl": "", "prompts": prompts})
        rows[-1] |= step
    return rows


def measure(shape=TINY, device: str = "cpu", prompts: int = DECODE_PROMPTS) -> list[dict]:
    """Every case's rows: train_step (fused, logits+eager), loss (fused), decode (torch)."""
    import torch

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    common = {"device": device.type, "dtype": str(dtype).removeprefix("torch.")}
    common["model"] = shape.describe()
    with _torch_layers(device):
        steps = measure_step(shape, device, dtype)
        rows = [*steps, *measure_decode(shape, device, dtype, prompts)]
    return [common | row for row in rows]


def check(rows: list[dict]) -> list[str]:
    """The targets this run misses, one message each (empty: all met)."""
    by = {(r["case"], r["contender"]): r for r in rows}
    fused, eager, loss = (
        by["train_step", "fused"],
        by["train_step", "logits+eager"],
        by["loss", "fused"],
    )
    missed = []
    if loss["host_syncs"] > 0:
        missed.append(
            f"the fused loss's forward + backward makes {loss['host_syncs']} host syncs "
            f"({loss['sync_ops']}); target 0"
        )
    if fused["kernels"] > eager["kernels"]:
        missed.append(
            f"the fused step dispatches {fused['kernels']} kernel ops, more than the "
            f"logits+eager step's {eager['kernels']}"
        )
    return missed


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m cod_fast.bench.launches",
        description="Count dispatched aten ops, host syncs and host-to-device copies per step.",
    )
    p.add_argument("--tokens", type=int, help=f"packed tokens of the step (default {TINY.tokens})")
    p.add_argument(
        "--prompts", type=int, default=DECODE_PROMPTS, help="prompts in the decode batch"
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for results")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed (for CI)")
    args = p.parse_args(argv)
    if (args.tokens or 64) < 64 or args.prompts < 1:
        p.error("--tokens must be >= 64, --prompts >= 1")
    return args, p


def main(argv: list[str] | None = None) -> dict:
    """Count every case; returns the summary that the last printed line holds as JSON. With
    `--check`, a missed target ends the process with exit status 1 after the output."""

    args, parser = _parse_args(argv)
    args.device = resolve_device(args.device, parser)
    shape = replace(TINY, **({"tokens": args.tokens} if args.tokens else {}))
    meta = run_meta()
    rows = measure(shape, args.device, args.prompts)
    missed = check(rows)
    append_csv(args.out / "launches.csv", TABLE, rows, meta)
    print_table(
        f"dispatched aten ops, host syncs and host-to-device copies per step on "
        f"{meta['machine']} ({shape.describe()}); counted after one warm-up call",
        TABLE,
        rows,
    )
    settings = {"device": args.device, "prompts": args.prompts, "shape": asdict(shape)}
    summary = emit_summary(
        {**meta, "settings": settings, "rows": rows, "targets_missed": missed},
        args.out / "launches.json",
    )
    if args.check and missed:
        raise SystemExit("launch targets missed:\n  " + "\n  ".join(missed))
    return summary


if __name__ == "__main__":
    main()
