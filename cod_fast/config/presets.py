"""The named presets of `cod-fast train --preset NAME` (cod_fast.config.io resolves them).

- `tiny-cpu` (the default): a tiny model that learns the CoD effect on a 2-core CPU;
- `tiny-cpu-tbt`: its task-by-task ablation;
- `tiny-cpu-mixed`: tiny-cpu on two environments at once;
- `tiny-cpu-opd`: the student of an on-policy distillation from tiny-cpu teachers;
- `qwen3-0.6b`, `qwen3-1.7b`, `qwen3-8b`: Qwen3 on a node of GPUs (8 x 80 GB; `cod-fast plan`
  says each fits), the paper-scale runs; a config that names its own model and no preset starts
  from the one of these its parameter count is nearest (cod_fast.model.preset_choice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from cod_fast.config import (
    AlgoConfig,
    Config,
    EnvEntry,
    LossConfig,
    ModelConfig,
    RolloutConfig,
    RuntimeConfig,
    TrainConfig,
)

GPU_PRESETS = {"qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "qwen3-8b": 8e9}
"""The presets for a model of the user's own, each with the parameter count it is sized for."""


def _tiny_cpu() -> Config:
    # Sized for what a tiny model learns on a 2-core CPU (docs/benchmarks.md): tiny FrozenLake,
    # 4-task packs, a ~0.35M-parameter decoder with a BPE vocabulary trained on the environment's
    # text, compact prompts, a warm start on scripted-explorer demonstrations, then CoD RL with
    # one-side REC and RED-weight.
    return Config(
        model=ModelConfig(dtype="float32", tokenizer="bpe", vocab_size=512),
        rollout=RolloutConfig(
            packs_per_step=4,
            group_size=8,
            tasks_per_pack=4,
            max_response_tokens=24,
            max_hint_tokens=16,
            sampler="torch",
            eval_packs=128,
            eval_setting="train",
            prompt_style="compact",
        ),
        algo=AlgoConfig(
            loss=LossConfig(policy="rec_one_side", eps_low=0.2, eps_high=0.28),
        ),
        # RL: lr 3e-4 for 90 steps (bench/results/rl_effect_w2000_lr3e-4_s90: the CoD change
        # +0.05 +- 0.02 over 3 seeds, where lr 1e-4 for 30 steps gave +0.03 +- 0.05).
        train=TrainConfig(
            steps=90,
            lr=3e-4,
            token_budget=8192,
            warm_start_steps=2000,
            warm_start_lr=4e-3,
            warm_start_packs=8,
        ),
        runtime=RuntimeConfig(device="cpu", run_dir="runs/tiny-cpu", checkpoint_every=500),
    )


def _tiny_cpu_tbt() -> Config:
    # The task-by-task ablation of tiny-cpu: GRPO per task, no update episodes, no re-weighting
    # (RED-weight is off for task_by_task unless a config asks for it).
    cod = _tiny_cpu()
    loss = dataclasses.replace(cod.algo.loss, policy="ppo")
    return dataclasses.replace(
        cod,
        algo=dataclasses.replace(cod.algo, algorithm="task_by_task", loss=loss),
        runtime=dataclasses.replace(cod.runtime, run_dir="runs/tiny-cpu-tbt"),
    )


MIXED_ENVS = ("frozenlake", "terminal")
"""The environments of the tiny mixed-domain presets: the two whose scripted explorer gains
most from hints at the tiny size, and whose demonstrations are short."""


def _tiny_cpu_mixed() -> Config:
    # tiny-cpu on two environments at once, each pack from either with equal weight, and twice
    # the warm start, so that each environment gets as many demonstrations as a tiny-cpu run on
    # it alone (with 2000 steps the frozenlake gain after the warm start was +0.01 +- 0.07 over 3
    # seeds, with 4000 +0.35 +- 0.03: bench/results/distill, distill_w4000).
    cod = _tiny_cpu()
    envs = [EnvEntry(name=name) for name in MIXED_ENVS]  # type: ignore[arg-type]
    return dataclasses.replace(
        cod,
        train=dataclasses.replace(cod.train, warm_start_steps=2 * cod.train.warm_start_steps),
        rollout=dataclasses.replace(cod.rollout, env=None, envs=envs),
        runtime=dataclasses.replace(cod.runtime, run_dir="runs/tiny-cpu-mixed"),
    )


def _tiny_cpu_opd() -> Config:
    # The student of a distillation: tiny-cpu-mixed's warm start, then on-policy distillation
    # from one tiny-cpu teacher per environment (`cod-fast distill` trains the teachers it
    # lacks, with this run's tokenizer, under runs/tiny-cpu-opd/teachers/).
    mixed = _tiny_cpu_mixed()
    teachers = {name: f"runs/tiny-cpu-opd/teachers/{name}" for name in MIXED_ENVS}
    loss = dataclasses.replace(mixed.algo.loss, policy="opd", opd_coef=1.0)
    return dataclasses.replace(
        mixed,
        algo=dataclasses.replace(mixed.algo, loss=loss, teachers=teachers),  # type: ignore[arg-type]
        runtime=dataclasses.replace(mixed.runtime, run_dir="runs/tiny-cpu-opd"),
    )


def _qwen3(size: str, token_budget: int) -> Config:
    # Qwen3 on a node of GPUs: full-size FrozenLake, 16 packs x 8 members of 8 tasks, 2048-token
    # responses, bf16 compute with gradient checkpointing, vLLM. The token budget is what
    # `cod-fast plan` fits on 8 x 80 GB beside vLLM's share (docs/gpu.md, "Sizing a run").
    return Config(
        model=ModelConfig(
            name_or_path=f"Qwen/Qwen3-{size.upper()}", dtype="bfloat16", gradient_checkpointing=True
        ),
        rollout=RolloutConfig(
            env_size="full",
            packs_per_step=16,
            group_size=8,
            tasks_per_pack=8,
            max_response_tokens=2048,
            max_hint_tokens=256,
            sampler="vllm",
        ),
        algo=AlgoConfig(
            loss=LossConfig(policy="rec_one_side", eps_low=0.2, eps_high=0.28),
        ),
        train=TrainConfig(steps=200, lr=1e-6, token_budget=token_budget),
        runtime=RuntimeConfig(device="cuda", run_dir=f"runs/qwen3-{size}", checkpoint_every=20),
    )


PRESETS: dict[str, Callable[[], Config]] = {
    "tiny-cpu": _tiny_cpu,
    "tiny-cpu-tbt": _tiny_cpu_tbt,
    "tiny-cpu-mixed": _tiny_cpu_mixed,
    "tiny-cpu-opd": _tiny_cpu_opd,
    "qwen3-0.6b": lambda: _qwen3("0.6b", 32768),
    "qwen3-1.7b": lambda: _qwen3("1.7b", 32768),
    "qwen3-8b": lambda: _qwen3("8b", 12288),
}
DEFAULT_PRESET = "tiny-cpu"
