"""Shared-prefix packing: trainer tokens and step time with and without (cod_fast.data.prefix_tree).

    python -m cod_fast.bench.share [--envs frozenlake,...] [--size tiny|small] [--reps 5]
        [--packs P] [--group G] [--model ENV=DIR ...] [--out DIR]   # or: cod-fast bench share

For each environment (the `tiny-cpu` preset's settings with that environment, its own BPE
tokenizer), two sources of one step's sequences:
- `scripted`: the scripted explorer, one member per pack (the warm start's batches: its
  `warm_start_packs` packs); members of a group would be copies, so only the system and
  environment text that every episode begins with is shared;
- `policy`: an RL step's rollouts (`--packs` x `--group` members, the preset's 4 x 8) sampled by
  the torch sampler at the loss's temperature from a seeded random-weight Qwen3 of `--size` with
  that tokenizer, or from `--model ENV=DIR` (a trained run's export) for that environment.
Both are packed under the preset's token budget flat (`balance`) and as prefix trees
(`balance_shared`): trainer tokens (what the decoder runs over) of each, and their ratio, the
sharing factor. Then one `train_step` (Policy with the fused loss, AdamW) of each layout on the
same model, alternating, `--reps` timed after one untimed each: median seconds, and the speed-up
against the sharing factor. The first step's loss of both layouts must agree (checked here; the
tests check it in float64). Output: a table, rows appended to DIR/share.csv, DIR/share.json, and
as the last stdout line one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

from cod_fast.bench.harness import append_csv, comma_choices, emit_summary, print_table, run_meta

PRESET = "tiny-cpu"
# fmt: off
TABLE = (
    ("env", "env", ""), ("source", "source", ""), ("sequences", "sequences", "d"),
    ("flat_tokens", "flat tokens", "d"), ("shared_tokens", "tree tokens", "d"),
    ("factor", "sharing factor", ".2f"), ("flat_mbs", "flat mbs", "d"),
    ("shared_mbs", "tree mbs", "d"), ("flat_s", "flat step s", ".3f"),
    ("shared_s", "tree step s", ".3f"), ("speedup", "x step", ".2f"),
    ("speedup_vs_factor", "x step / factor", ".2f"), ("loss_diff", "|dloss|", ".1e"),
    ("model", "model", ""),
)
# fmt: on


def _config(env: str):
    from cod_fast.config.io import load_config

    return load_config(PRESET, overrides=[f"rollout.env={env}"])


def scripted_sequences(cfg) -> list:
    """One warm-start batch of the scripted explorer, advantages set (as the warm start does)."""
    from cod_fast.data.packing import rollout_sequences
    from cod_fast.envs import make_env
    from cod_fast.envs.packs import make_packs, pack_seeds
    from cod_fast.rollout.chat import ChatFormat
    from cod_fast.rollout.driver import DriverSettings
    from cod_fast.rollout.scripted import demonstrations
    from cod_fast.run.vocab import environment_tokenizer

    env = make_env(cfg.rollout.env, cfg.rollout.env_setting, cfg.rollout.env_size)
    settings = DriverSettings.from_config(cfg)
    tokenizer = environment_tokenizer(env, settings, cfg.model.vocab_size, cfg.train.seed)
    seeds = pack_seeds("bench-share", cfg.train.warm_start_packs, cfg.train.seed)
    packs = make_packs(seeds, cfg.rollout.tasks_per_pack, cfg.rollout.strategy)
    rollouts = demonstrations(env, ChatFormat(tokenizer), settings, packs)
    return rollout_sequences([e for r in rollouts for e in r.episodes])


def policy_sequences(cfg, folder: str, packs: int, group: int) -> list:
    """One RL step's rollouts sampled from the model in `folder`, advantages assigned."""
    from cod_fast.algo.assign import assign_advantages
    from cod_fast.bench.sampler_contenders import make_sampler
    from cod_fast.data.packing import rollout_sequences
    from cod_fast.envs import make_env
    from cod_fast.envs.packs import make_packs, pack_seeds
    from cod_fast.rollout.chat import ChatFormat
    from cod_fast.rollout.driver import DriverSettings, RolloutDriver

    env = make_env(cfg.rollout.env, cfg.rollout.env_setting, cfg.rollout.env_size)
    sampler, tokenizer = make_sampler("torch", folder, cfg)
    driver = RolloutDriver(env, sampler, ChatFormat(tokenizer), DriverSettings.from_config(cfg))
    seeds = pack_seeds("bench-share", packs, cfg.train.seed)
    rollouts = driver.run(
        make_packs(seeds, cfg.rollout.tasks_per_pack, cfg.rollout.strategy), group
    )
    assign_advantages(rollouts, cfg.algo)
    return rollout_sequences([e for r in rollouts for e in r.episodes])


def time_layouts(folder: str, sequences: list, cfg, reps: int) -> dict:
    """Median seconds of one train_step over each layout, alternating, same model and state."""
    import torch

    from cod_fast.config import ModelConfig
    from cod_fast.data.packing import pack_microbatches, step_totals
    from cod_fast.model.loading import load_policy
    from cod_fast.model.policy import Policy
    from cod_fast.ops import aggregation_denominator
    from cod_fast.train.step import train_step

    model, _ = load_policy(ModelConfig(name_or_path=folder, dtype="float32"))
    budget, loss = cfg.train.token_budget, cfg.algo.loss
    out: dict = {}
    runs = {}
    for share in (False, True):
        batches = pack_microbatches(sequences, budget, 1, share_prefix=share)
        policy = Policy(copy.deepcopy(model))
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
        denominator = aggregation_denominator(loss, *step_totals(batches))
        runs[share] = (policy, optimizer, batches[0], denominator)
        key = "shared" if share else "flat"
        out[f"{key}_tokens"] = sum(mb.num_tokens for mb in batches[0])
        out[f"{key}_mbs"] = len(batches[0])
    times: dict[bool, list[float]] = {False: [], True: []}
    losses = {}
    for rep in range(reps + 1):
        for share in (False, True) if rep % 2 == 0 else (True, False):
            policy, optimizer, mbs, denominator = runs[share]
            t0 = time.perf_counter()
            result = train_step(
                policy, optimizer, mbs, denominator=denominator, loss_config=loss, grad_clip=1.0
            )
            if rep == 0:
                losses[share] = result.loss  # the first step: same weights in both layouts
            else:
                times[share].append(time.perf_counter() - t0)
    out["flat_s"], out["shared_s"] = (statistics.median(times[s]) for s in (False, True))
    out["loss_diff"] = abs(losses[True] - losses[False])
    return out


def _row(env: str, source: str, model: str, sequences: list, timing: dict) -> dict:
    factor = timing["flat_tokens"] / timing["shared_tokens"]
    speedup = timing["flat_s"] / timing["shared_s"]
    return {
        "env": env,
        "source": source,
        "model": model,
        "sequences": len(sequences),
        **timing,
        "factor": factor,
        "speedup": speedup,
        "speedup_vs_factor": speedup / factor,
    }


def run(args) -> list[dict]:
    from cod_fast.bench.sampler_contenders import describe_model, save_model

    models = dict(item.split("=", 1) for item in args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for env in args.envs:
            cfg = _config(env)
            folder = models.get(env) or str(save_model(args.size, Path(tmp) / env, cfg))
            name = describe_model(folder) + ("" if env in models else " (random weights)")
            for source in ("scripted", "policy"):
                if source == "scripted":
                    sequences = scripted_sequences(cfg)
                else:
                    sequences = policy_sequences(cfg, folder, args.packs, args.group)
                timing = time_layouts(folder, sequences, cfg, args.reps)
                rows.append(_row(env, source, name, sequences, timing))
                print(f"{env} / {source}: factor {rows[-1]['factor']:.2f}", flush=True)
    return rows


def _parse_args(argv):
    from cod_fast.envs import ENVIRONMENTS

    p = argparse.ArgumentParser(prog="python -m cod_fast.bench.share", description=__doc__)
    p.add_argument("--envs", default=",".join(ENVIRONMENTS), help="comma-separated")
    p.add_argument("--size", default="tiny", choices=("tiny", "small"), help="random model size")
    p.add_argument("--reps", type=int, default=5, help="timed steps per layout")
    p.add_argument("--packs", type=int, default=4, help="packs of the policy's step")
    p.add_argument("--group", type=int, default=8, help="members per pack")
    p.add_argument("--model", action="append", default=[], help="ENV=DIR: a trained policy")
    p.add_argument("--out", default="bench/results", help="folder for share.csv/share.json")
    args = p.parse_args(argv)
    args.envs = comma_choices(p, "envs", args.envs, ENVIRONMENTS)
    if bad := [m for m in args.model if "=" not in m or m.split("=")[0] not in ENVIRONMENTS]:
        p.error(f"--model takes ENV=DIR with ENV one of {', '.join(ENVIRONMENTS)}; got {bad}")
    if args.reps < 1 or args.packs < 1 or args.group < 1:
        p.error("--reps, --packs and --group must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    meta = run_meta()
    rows = run(args)
    out = Path(args.out)
    append_csv(out / "share.csv", TABLE, rows, meta)
    print_table(f"cod-fast shared-prefix packing on {meta['machine']}", TABLE, rows)
    summary = {**meta, "settings": {k: v for k, v in vars(args).items()}, "rows": rows}
    return emit_summary(summary, out / "share.json")


if __name__ == "__main__":
    main()
