"""`cod-fast bench ...`: each command passes the options it was given to a benchmark module's
`main` (cod_fast.bench.*), which owns the defaults, the checks and the output."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cod_fast.bench.contenders import CASES, CONTENDERS
from cod_fast.bench.kernels import DEFAULT_CASES
from cod_fast.cli.options import SetOption
from cod_fast.config.presets import PRESETS

bench_app = typer.Typer(help="Benchmark the kernels and a training step.", no_args_is_help=True)


def _bench_argv(options: dict, **repeated: list[str] | None) -> list[str]:
    """A bench module's argv: `--KEY VALUE` for each option given (not None), and `--FLAG V` once
    per value of each repeatable flag (`set`, `preset`)."""
    argv = [a for k, v in options.items() if v is not None for a in (f"--{k}", str(v))]
    for flag, values in repeated.items():
        argv += [a for v in values or () for a in (f"--{flag}", v)]
    return argv


@bench_app.command("kernels")
def bench_kernels(
    cases: Annotated[
        str | None,
        typer.Option(
            help=f"Comma-separated cases ({', '.join(CASES)}); default all but "
            f"{', '.join(c for c in CASES if c not in DEFAULT_CASES)}."
        ),
    ] = None,
    impls: Annotated[
        str | None,
        typer.Option(help=f"Comma-separated contenders ({', '.join(CONTENDERS)}); default all."),
    ] = None,
    reps: Annotated[int | None, typer.Option(help="Timed repetitions (median, p20, p80).")] = None,
    warmup: Annotated[int | None, typer.Option(help="Untimed calls before timing.")] = None,
    scale: Annotated[float | None, typer.Option(help="Multiplies every case's N.")] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for kernels.csv/.json.")] = None,
) -> None:
    """Time the policy loss (fwd+bwd) against eager torch, Liger and CCE (cod_fast.bench.kernels)."""
    from cod_fast.bench import kernels

    options = dict(cases=cases, impls=impls, reps=reps, warmup=warmup, scale=scale, out=out)
    kernels.main(_bench_argv(options))


@bench_app.command("train")
def bench_train(
    sections: Annotated[
        str | None, typer.Option(help="Comma-separated sections (step, merge); default both.")
    ] = None,
    reps: Annotated[int | None, typer.Option(help="Timed steps (median, p20, p80).")] = None,
    warmup: Annotated[int | None, typer.Option(help="Untimed steps before timing.")] = None,
    tokens: Annotated[int | None, typer.Option(help="Packed tokens of the step batch.")] = None,
    packs: Annotated[int | None, typer.Option(help="Packs per environment (merge).")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda.")] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for the CSVs and train.json.")] = None,
    tiny: Annotated[bool, typer.Option("--tiny", help="A tiny model and batch (smoke).")] = False,
    jobs: Annotated[int | None, typer.Option(help="Step workers side by side (smoke).")] = None,
    grad_ckpt: Annotated[
        bool, typer.Option("--grad-ckpt", help="Gradient checkpointing per layer, both sides.")
    ] = False,
    plain_modules: Annotated[
        bool,
        typer.Option(
            "--plain-modules",
            help="transformers' own MLPs and norms instead of cod_fast.model.lean's, both sides.",
        ),
    ] = False,
) -> None:
    """Time a training step (fused loss vs logits + eager) and count prefix merging's savings
    (cod_fast.bench.train)."""
    from cod_fast.bench import train

    options = {"sections": sections, "reps": reps, "warmup": warmup, "tokens": tokens}
    options |= {"packs": packs, "device": device, "out": out, "jobs": jobs}
    flags = ["--tiny"] * tiny + ["--grad-ckpt"] * grad_ckpt + ["--plain-modules"] * plain_modules
    train.main(_bench_argv(options) + flags)


@bench_app.command("sampler")
def bench_sampler(
    sizes: Annotated[
        str | None, typer.Option(help="Comma-separated model sizes (tiny, small); default both.")
    ] = None,
    contenders: Annotated[
        str | None,
        typer.Option(help="Comma-separated samplers (torch, generate, vllm, vllm-eager)."),
    ] = None,
    reps: Annotated[int | None, typer.Option(help="Timed RL steps of rollouts.")] = None,
    warmup: Annotated[int | None, typer.Option(help="Untimed steps before timing.")] = None,
    model: Annotated[
        str | None, typer.Option(help="A Hugging Face model folder instead of the sizes.")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for sampler.csv/.json.")] = None,
) -> None:
    """Time one RL step's rollouts through the torch sampler, transformers generate and vLLM
    (cod_fast.bench.sampler)."""
    from cod_fast.bench import sampler

    options = dict(sizes=sizes, contenders=contenders, reps=reps, warmup=warmup, model=model)
    options["out"] = out
    sampler.main(_bench_argv(options))


@bench_app.command("launches")
def bench_launches(
    tokens: Annotated[int | None, typer.Option(help="Packed tokens of the step batch.")] = None,
    prompts: Annotated[int | None, typer.Option(help="Prompts in the decode batch.")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda.")] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for launches.csv/.json.")] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Exit 1 when a target is missed (for CI).")
    ] = False,
) -> None:
    """Count dispatched aten ops, host syncs and host-to-device copies per training step (fused
    loss vs logits + eager) and per decode step (cod_fast.bench.launches)."""
    from cod_fast.bench import launches

    options = {"tokens": tokens, "prompts": prompts, "device": device, "out": out}
    launches.main(_bench_argv(options) + ["--check"] * check)


@bench_app.command("plan")
def bench_plan(
    shape: Annotated[
        str | None, typer.Option(help="tiny or 29m (the trainer benchmark's).")
    ] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda.")] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for plan.csv/.json.")] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Exit 1 when a case is off by more than 15%.")
    ] = False,
) -> None:
    """The memory plan (`cod-fast plan`) against the peak of a real training step and rollout
    on this device (cod_fast.bench.plan)."""
    from cod_fast.bench import plan

    options = {"shape": shape, "device": device, "out": out}
    plan.main(_bench_argv(options) + ["--check"] * check)


@bench_app.command("profile")
def bench_profile(
    tokens: Annotated[int | None, typer.Option(help="Packed tokens of the step batch.")] = None,
    steps: Annotated[int | None, typer.Option(help="Profiled steps after a warm-up.")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda.")] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for profile.csv/.json/traces.")] = None,
    tiny: Annotated[bool, typer.Option("--tiny", help="A tiny model (smoke test).")] = False,
) -> None:
    """Profile the trainer benchmark's step, fused loss vs logits + eager: device-busy share,
    kernels, syncs and the top ops by device and host time (cod_fast.bench.profile_step)."""
    from cod_fast.bench import profile_step

    options = {"tokens": tokens, "steps": steps, "device": device, "out": out}
    profile_step.main(_bench_argv(options) + ["--tiny"] * tiny)


@bench_app.command("decode")
def bench_decode(
    batches: Annotated[str | None, typer.Option(help="Comma-separated batch sizes.")] = None,
    new_tokens: Annotated[int | None, typer.Option(help="Tokens per timed call.")] = None,
    prompt: Annotated[int | None, typer.Option(help="Prompt tokens per row.")] = None,
    reps: Annotated[int | None, typer.Option(help="Timed calls per length (median).")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda.")] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for decode.csv/.json.")] = None,
    tiny: Annotated[bool, typer.Option("--tiny", help="A tiny model (smoke test).")] = False,
) -> None:
    """Milliseconds per decode step of the torch sampler at a Qwen3-0.6B shape: compacting vs
    static shapes vs static shapes replayed as CUDA graphs (cod_fast.bench.decode)."""
    from cod_fast.bench import decode

    options = {"batches": batches, "new-tokens": new_tokens, "prompt": prompt, "reps": reps}
    options |= {"device": device, "out": out}
    decode.main(_bench_argv(options) + ["--tiny"] * tiny)


@bench_app.command("e2e")
def bench_e2e(
    sizes: Annotated[
        str | None, typer.Option(help="Comma-separated model sizes (tiny, small); default both.")
    ] = None,
    contenders: Annotated[
        str | None,
        typer.Option(help="Comma-separated contenders (cod-fast, trl, cod-multiturn)."),
    ] = None,
    reps: Annotated[int | None, typer.Option(help="Timed GRPO steps (median, p20, p80).")] = None,
    warmup: Annotated[int | None, typer.Option(help="Untimed steps before timing.")] = None,
    prompts: Annotated[int | None, typer.Option(help="Prompts per step.")] = None,
    group: Annotated[int | None, typer.Option(help="Completions per prompt.")] = None,
    max_completion: Annotated[int | None, typer.Option(help="Tokens per completion.")] = None,
    cod_sampler: Annotated[
        str | None, typer.Option(help="cod-fast's sampler: auto, torch or vllm.")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for e2e.csv/.json.")] = None,
    timeout: Annotated[float | None, typer.Option(help="Seconds per worker process.")] = None,
) -> None:
    """Time one GRPO step end to end (sampling, log-probs, loss, optimizer) through cod-fast
    and TRL's GRPOTrainer on the same model and prompts (cod_fast.bench.e2e)."""
    from cod_fast.bench import e2e

    options = {"sizes": sizes, "contenders": contenders, "reps": reps, "warmup": warmup}
    options |= {"prompts": prompts, "group": group, "max-completion": max_completion}
    options |= {"cod-sampler": cod_sampler, "out": out, "timeout": timeout}
    e2e.main(_bench_argv(options))


@bench_app.command("share")
def bench_share(
    envs: Annotated[str | None, typer.Option(help="Comma-separated environments.")] = None,
    size: Annotated[
        str | None, typer.Option(help="Random model size for the policy's rollouts (tiny, small).")
    ] = None,
    reps: Annotated[int | None, typer.Option(help="Timed steps per layout.")] = None,
    packs: Annotated[int | None, typer.Option(help="Packs of the policy's step.")] = None,
    group: Annotated[int | None, typer.Option(help="Members per pack.")] = None,
    model: Annotated[
        list[str] | None, typer.Option(help="ENV=DIR: a trained policy for that environment.")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for share.csv/.json.")] = None,
) -> None:
    """Trainer tokens and step time with and without shared-prefix packing
    (cod_fast.bench.share)."""
    from cod_fast.bench import share

    options = {"envs": envs, "size": size, "reps": reps, "packs": packs, "group": group}
    share.main(_bench_argv(options | {"out": out}, model=model))


@bench_app.command("rl-effect")
def bench_rl_effect(
    warm_steps: Annotated[int | None, typer.Option(help="Warm-start steps [2000].")] = None,
    rl_steps: Annotated[int | None, typer.Option(help="RL steps per arm [150].")] = None,
    seeds: Annotated[str | None, typer.Option(help="Comma-separated seeds [0,1,2,3,4].")] = None,
    eval_packs: Annotated[
        int | None, typer.Option(help="Held-out packs per evaluation [1024].")
    ] = None,
    overrides: SetOption = None,
    warm_overrides: Annotated[
        list[str] | None,
        typer.Option("--warm-set", help="Override a field of the warm start only (repeatable)."),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for the runs and results.")] = None,
) -> None:
    """CoD RL vs task-by-task RL from one shared warm-start checkpoint, over seeds, both
    evaluated with the CoD protocol on the same packs; the per-seed paired difference
    (cod_fast.bench.rl_effect)."""
    from cod_fast.bench import rl_effect

    options = {"warm-steps": warm_steps, "rl-steps": rl_steps, "seeds": seeds, "out": out}
    options["eval-packs"] = eval_packs
    rl_effect.main(_bench_argv(options, set=overrides, **{"warm-set": warm_overrides}))


@bench_app.command("async")
def bench_async(
    models: Annotated[
        str | None, typer.Option(help="Comma-separated: tiny, small (default both).")
    ] = None,
    staleness: Annotated[
        str | None, typer.Option(help="Comma-separated max_staleness of the async arms [1,2].")
    ] = None,
    warm_steps: Annotated[int | None, typer.Option(help="Warm-start steps [200].")] = None,
    rl_steps: Annotated[int | None, typer.Option(help="RL steps per arm [16].")] = None,
    learn_seeds: Annotated[
        str | None, typer.Option(help="Seeds of the learning arms, K=0 against K>0 [none].")
    ] = None,
    learn_from: Annotated[
        Path | None, typer.Option(help="The warm-started run the learning arms start from.")
    ] = None,
    learn_steps: Annotated[int | None, typer.Option(help="RL steps per learning arm [90].")] = None,
    learn_staleness: Annotated[
        int | None, typer.Option(help="max_staleness of the learning's async arm [2].")
    ] = None,
    eval_packs: Annotated[
        int | None, typer.Option(help="Held-out packs per evaluation of the learning arms [256].")
    ] = None,
    overrides: SetOption = None,
    out: Annotated[Path | None, typer.Option(help="Folder for the runs and results.")] = None,
) -> None:
    """Asynchronous RL on a 2-core CPU: the synchronous loop against a trainer and a rollout
    worker on one core each, with the ideal overlap speedup; with --learn-seeds, the CoD gain
    with and without staleness (cod_fast.bench.async_rl)."""
    from cod_fast.bench import async_rl

    options = {"models": models, "staleness": staleness, "warm-steps": warm_steps}
    options |= {"rl-steps": rl_steps, "learn-seeds": learn_seeds, "learn-from": learn_from}
    options |= {"learn-steps": learn_steps, "learn-staleness": learn_staleness}
    options |= {"eval-packs": eval_packs, "out": out}
    async_rl.main(_bench_argv(options, set=overrides))


@bench_app.command("seeds")
def bench_seeds(
    preset: Annotated[
        list[str] | None,
        typer.Option(help=f"Preset to run (repeatable): {', '.join(PRESETS)} \\[tiny-cpu]."),
    ] = None,
    seeds: Annotated[str | None, typer.Option(help="Comma-separated seeds [0,1,2].")] = None,
    overrides: SetOption = None,
    out: Annotated[Path | None, typer.Option(help="Folder for the runs and results.")] = None,
) -> None:
    """Whole `cod-fast train` runs of presets over seeds: mean and spread of each evaluation,
    what the warm start gives and what RL adds (cod_fast.bench.seeds)."""
    from cod_fast.bench import seeds as seeds_bench

    options = {"seeds": seeds, "out": out}
    seeds_bench.main(_bench_argv(options, preset=preset, set=overrides))


@bench_app.command("distill")
def bench_distill(
    seeds: Annotated[str | None, typer.Option(help="Comma-separated seeds [0,1,2].")] = None,
    jobs: Annotated[int | None, typer.Option(help="Runs at once [2].")] = None,
    overrides: SetOption = None,
    out: Annotated[Path | None, typer.Option(help="Folder for the runs and results.")] = None,
) -> None:
    """Teachers, distilled students (tiny-cpu-opd) and mixed-domain CoD RL from the same warm
    start, over seeds: each environment's gain against its teacher's (cod_fast.bench.distill)."""
    from cod_fast.bench import distill as distill_bench

    options = {"seeds": seeds, "jobs": jobs, "out": out}
    distill_bench.main(_bench_argv(options, set=overrides))


@bench_app.command("concurrent")
def bench_concurrent(
    runs: Annotated[int | None, typer.Option(help="Runs side by side [3].")] = None,
    steps: Annotated[int | None, typer.Option(help="Warm-start steps per run [150].")] = None,
    threads: Annotated[
        int | None, typer.Option(help="runtime.threads of every run \\[torch's default].")
    ] = None,
    compare: Annotated[
        bool,
        typer.Option("--compare", help="Also under PASSIVE, ACTIVE and libgomp's default."),
    ] = False,
    overrides: SetOption = None,
    out: Annotated[Path | None, typer.Option(help="The JSON file.")] = None,
) -> None:
    """tiny-cpu warm starts one after another, then all at once, under cod-fast's OpenMP wait
    policy (and the old ones): wall times and the slowdown of sharing cores
    (cod_fast.bench.concurrent_runs)."""
    from cod_fast.bench import concurrent_runs

    options = {"runs": runs, "steps": steps, "threads": threads, "out": out}
    concurrent_runs.main(_bench_argv(options, set=overrides) + ["--compare"] * compare)
