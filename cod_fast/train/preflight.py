"""Checks of a run's config against the machine it starts on, before any compute.

`cod_fast.config` judges what a config says on its own. Some values can only be judged where the
run starts: `runtime.hsdp_replicate` and `train.sequence_parallel` against the world size
torchrun gives (the latter against the model's attention heads too), a model path against the
files there (a model folder's config.json against its tokenizer and, with the built-in model's
sizes, against this machine's memory), the device `runtime.device=auto` lands on against the
model dtype, the kernel implementation (`COD_FAST_IMPL`, `runtime.kernel_impl`) against what
runs here, the torch sampler's KV cache for the run's largest batch against the device's memory,
and `train.token_budget` (times `train.sequence_parallel`) against a prompt's length in the
run's tokenizer. The `train` command calls `preflight` before it builds the Trainer, so such a
value is one line naming the field (or variable), the value and the fix, not a traceback (or a
stopped run) after minutes of compute.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from cod_fast.config import Config, ConfigError, clipped, refuse_cpu_dtype, shown
from cod_fast.distributed.context import check_sequence_parallel, mesh_layout, resolve_device
from cod_fast.envs import Environment, env_class, make_envs
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.model.attention import resolve_attn_impl
from cod_fast.model.loading import (
    BUILTIN_SIZES_FIX,
    BUILTIN_TINY,
    ModelFolderError,
    check_parameter_memory,
    device_memory,
    gib,
    load_model_files,
    master_dtype,
    resolve_dtype,
    tiny_qwen3_config,
)
from cod_fast.model.shapes import model_shape, shape_of, transformers_config
from cod_fast.ops import dispatch
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.choice import choose_sampler
from cod_fast.rollout.driver import DriverSettings
from cod_fast.rollout.hints import context_line
from cod_fast.rollout.prompts import PROMPT_STYLES
from cod_fast.rollout.vllm_sampler import head_dim, kv_bytes_per_token, kv_heads
from cod_fast.run.trackers import check_trackers
from cod_fast.run.validate import environment_keys, validate
from cod_fast.run.vocab import run_tokenizer
from cod_fast.train.memory_plan import check_fits, check_sequence_degree, plan_memory


def preflight(cfg: Config) -> None:
    """Raise ConfigError (one line) for a config that would fail on this machine once compute
    started. The token-budget check needs the run's tokenizer: a `bpe` one is trained and saved
    in runtime.run_dir, as the run would, and the run then finds it there."""
    validate(cfg)
    world_size = _environment_int("WORLD_SIZE", 1)
    if world_size > 1:
        _environment_int("LOCAL_RANK", 0)  # the device of each rank (cod_fast.distributed.context)
    _check_mesh(cfg.runtime.hsdp_replicate, world_size)
    envs = _made_environments(cfg)  # imports a path environment: the first code of its own
    _check_explorers(cfg)
    check_trackers(cfg.runtime.trackers)  # their packages are there, before anything is written
    for name, path in cfg.algo.teachers.items():
        # Teachers wait in host memory, in the compute dtype (cod_fast.train.teachers).
        compute = resolve_dtype(cfg.model, resolve_device(cfg.runtime.device))
        _check_model_files(path, f"algo.teachers.{name}", torch.device("cpu"), compute)
    _check_device_dtype(cfg)
    _check_attention(cfg)
    _check_kernel_impls(cfg.runtime.kernel_impl)
    model = _check_model(cfg)
    _check_sequence_parallel(cfg, model, world_size)
    if model is not None:
        _check_sampler_memory(cfg, model, world_size)
    device = resolve_device(cfg.runtime.device)
    if device.type == "cuda":
        check_plan(cfg, model, world_size, device_memory(device))
    # Only the main process writes the tokenizer (run_tokenizer); the others would train their
    # own copy here for nothing, and the main process's refusal ends the run for all of them.
    if world_size == 1 or _environment_int("RANK", 0) == 0:
        _check_token_budget(cfg, envs)


def _made_environments(cfg: Config) -> list[Environment]:
    """The run's environments, made with their options (a path is imported here, the first
    time anything runs it; a learn2ask cases file is read and checked here, before anything is
    written); a ConfigError naming the key of the one that fails."""
    envs = []
    for key, options_key, entry in environment_keys(cfg):
        try:
            env_class(entry.name)  # type: ignore[arg-type]
        except ValueError as e:
            raise ConfigError(key, str(e)) from None
        try:
            envs += make_envs([entry])
        except ValueError as e:
            raise ConfigError(options_key, f"environment {entry.name}: {e}") from None
    return envs


def _environment_int(name: str, default: int) -> int:
    """An integer that torchrun sets, read as cod_fast.distributed.context reads it."""
    text = os.environ.get(name, str(default))
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            name, f"got {shown(text)}; expected an integer (torchrun sets it)"
        ) from None


def _check_mesh(replicate: int, world_size: int) -> None:
    try:
        mesh_layout(world_size, replicate)  # the layouts init_distributed can build
    except ValueError:
        started = "WORLD_SIZE" if "WORLD_SIZE" in os.environ else "one process, no torchrun"
        raise ConfigError(
            "runtime.hsdp_replicate",
            f"got {replicate}, which does not divide the world size {world_size} ({started}); "
            f"set it to a divisor of {world_size} (1: plain FSDP), or start a multiple of "
            f"{replicate} processes with torchrun",
        ) from None


def _check_sequence_parallel(cfg: Config, model, world_size: int) -> None:
    """train.sequence_parallel against the trainer ranks torchrun starts (the world less
    runtime.rollout_ranks, within each HSDP replica) and the model's attention heads, which the
    run would meet only as it builds its groups or, for the heads, at its first forward.
    `model`: the model's transformers config (None: a hub id, whose heads are known here only
    for the models of cod_fast.model.shapes.KNOWN_CONFIGS)."""
    size = cfg.train.sequence_parallel
    trainers = world_size - cfg.runtime.rollout_ranks
    if size == 1 or trainers < 1:  # no rank left to train: refused as the processes start
        return
    replicate = cfg.runtime.hsdp_replicate  # one that does not divide: refused by _check_mesh
    shard_ranks = trainers // replicate if trainers % replicate == 0 else trainers
    if model is None:
        try:
            model = transformers_config(cfg.model)
        except ModelFolderError:  # a hub id cod-fast does not know: its heads are unknown
            check_sequence_parallel(size, shard_ranks, trainers)
            return
    name = cfg.model.name_or_path
    check_sequence_degree(size, model.num_attention_heads, name, trainers, shard_ranks)


def _check_explorers(cfg: Config) -> None:
    """Refuse a run that needs the scripted explorer of an environment that has none (an
    explorer is optional, cod_fast.envs.base): the warm start imitates its demonstrations, and
    the built-in model's `bpe` vocabulary is trained on its transcripts unless the run finds a
    saved one (as `warmstart.run_tokenizer` does)."""
    train, model = cfg.train, cfg.model
    if train.warm_start_steps > 0:
        use = f"train.warm_start_steps={train.warm_start_steps} needs (demonstrations)"
        fix = "set train.warm_start_steps=0"
    elif (
        model.name_or_path == BUILTIN_TINY
        and model.tokenizer == "bpe"
        and model.tokenizer_path is None
        and train.init_from is None
        and not (Path(cfg.runtime.run_dir) / "tokenizer").exists()
    ):
        use = "model.tokenizer='bpe' needs (its vocabulary is trained on the transcripts)"
        fix = "set model.tokenizer=char, give model.tokenizer_path a saved tokenizer"
    else:
        return
    for key, _, entry in environment_keys(cfg):
        if not env_class(entry.name).has_explorer():  # type: ignore[arg-type]
            raise ConfigError(
                key,
                f"{clipped(entry.name)} has no scripted explorer, which {use}; {fix} or give the "
                "environment an explorer()",
            )


def _check_model(cfg: Config):
    """The run's model config (a transformers config), checked against its tokenizer and this
    machine's memory before any weights exist (cod_fast.model.loading); None for a hub id, which only a
    download tells."""
    model, device = cfg.model, resolve_device(cfg.runtime.device)
    if model.name_or_path != BUILTIN_TINY:
        dtype = master_dtype(model, cfg.train.master_dtype, device)  # as the Trainer loads it
        return _check_model_files(model.name_or_path, "model.name_or_path", device, dtype)
    # model.vocab_size bounds a bpe vocabulary; the character one is below its floor (128).
    config = tiny_qwen3_config(model, model.vocab_size)
    try:  # as build_tiny_qwen3 builds it: in float32, in host memory
        check_parameter_memory(
            config, torch.device("cpu"), torch.float32, model.name_or_path, BUILTIN_SIZES_FIX
        )
    except ModelFolderError as e:
        raise ConfigError("model", str(e)) from None
    return config


def _check_model_files(name: str, key: str, place: torch.device, dtype: torch.dtype):
    """The config of the model folder `name` (config field `key`), checked as load_policy
    checks it for weights in `dtype` on `place`; None for a hub id."""
    if not (Path(name) / "config.json").is_file():
        return None
    try:
        return load_model_files(name, place, dtype)[0].get_text_config()
    except ModelFolderError as e:
        raise ConfigError(key, str(e)) from None


def _check_sampler_memory(cfg: Config, model, world_size: int) -> None:
    """The torch sampler's KV cache for the run's largest batch against the device's memory.

    Every live episode of a rollout (rollout.packs_per_step x rollout.group_size) or of an
    evaluation (rollout.eval_packs) decodes in one batch, each row with room for its prompt and
    rollout.max_response_tokens, split over the ranks. Each field has its bound in the config;
    their product has none that suits every model and machine, hence this estimate. A lower
    bound (a prompt counts as one token), so a refusal is certain. vLLM pages its cache within
    rollout.vllm_gpu_memory_utilization instead: not checked.
    """
    device = resolve_device(cfg.runtime.device)
    try:
        kind, _ = choose_sampler(cfg.rollout.sampler, device.type, head_dim(model))
    except ValueError:
        return  # a sampler that cannot run here: the Trainer refuses it in one line
    if kind != "torch":
        return
    rollout = cfg.rollout
    batches = [("rollout.eval_packs", rollout.eval_packs, f"{rollout.eval_packs} eval packs")]
    if cfg.train.steps > 0:
        rows = rollout.packs_per_step * rollout.group_size
        what = f"{rollout.packs_per_step} packs x rollout.group_size={rollout.group_size}"
        batches.append(("rollout.packs_per_step", rows, what))
    key, rows, what = max(batches, key=lambda batch: batch[1])
    rows = -(-rows // world_size)
    ranks = f" on each of {world_size} ranks" if world_size > 1 else ""
    tokens = 1 + rollout.max_response_tokens
    dtype = resolve_dtype(cfg.model, device)
    need, memory = rows * tokens * kv_bytes_per_token(model, dtype), device_memory(device)
    if need > memory:
        fewer = key if key == "rollout.eval_packs" else f"{key} or rollout.group_size"
        raise ConfigError(
            key,
            f"{what}: {rows} sequences in one sampler batch{ranks}, each of at least {tokens} "
            f"tokens (a prompt and rollout.max_response_tokens), need {gib(need)} of KV cache "
            f"in the torch sampler ({model.num_hidden_layers} layers x 2 x {kv_heads(model)} kv "
            f"heads x {head_dim(model)} x {dtype.itemsize} bytes a token), more than all "
            f"{gib(memory)} "
            f"of the {device.type} here; lower {fewer} or rollout.max_response_tokens",
        )


def check_plan(cfg: Config, model, world_size: int, memory: int) -> None:
    """The run's memory plan (cod_fast.train.memory_plan) on GPUs of `memory` bytes: a
    ConfigError naming the phase, its largest part and the setting that shrinks it when the
    peak does not fit. `model`: the model's transformers config (None: a hub id, whose sizes
    the plan knows only for the models of cod_fast.model.shapes.KNOWN_CONFIGS)."""
    try:
        shape = shape_of(model, cfg.model.name_or_path) if model else model_shape(cfg.model)
        sampler, _ = choose_sampler(cfg.rollout.sampler, "cuda", shape.head_dim)
    except (ModelFolderError, ValueError):
        return  # an unknown hub id, a sampler that cannot run: refused elsewhere, or no plan
    check_fits(plan_memory(cfg, shape, gpus=world_size, memory=memory, sampler=sampler))


def _check_device_dtype(cfg: Config) -> None:
    device = cfg.runtime.device
    resolved = resolve_device(device)  # a ConfigError when cuda is asked for and there is none
    if resolved.type == "cpu" and device == "auto":  # device=cpu is refused by the config itself
        refuse_cpu_dtype(cfg.model.dtype, "runtime.device='auto', the CPU here (no CUDA device)")


def _check_attention(cfg: Config) -> None:
    """model.attn_impl against the device and compute dtype the run lands on (a CUDA varlen
    kernel with a float32 model or on the CPU, flash-attn where it is not installed), which the
    Trainer would otherwise meet only when it loads the model."""
    device = resolve_device(cfg.runtime.device)
    resolve_attn_impl(cfg.model.attn_impl, device, resolve_dtype(cfg.model, device))


def _check_kernel_impls(kernel_impl: str) -> None:
    """COD_FAST_IMPL and runtime.kernel_impl against cod_fast.ops.dispatch's own rule, which the
    run would apply only at its first training step (after the start evaluation). The variable
    is checked even where the field names an implementation: the layer kernels read it too."""
    usable = " or ".join(name for name in dispatch.IMPLS if dispatch.is_available(name))
    env_fix = f"unset it (the best available implementation is then picked) or set it to {usable}"
    field_fix = f"set runtime.kernel_impl to auto or {usable}"
    for key, impl, fix in (
        (dispatch.ENV_VAR, os.environ.get(dispatch.ENV_VAR), env_fix),
        ("runtime.kernel_impl", None if kernel_impl == "auto" else kernel_impl, field_fix),
    ):
        if impl and (problem := dispatch.impl_problem(impl)):
            raise ConfigError(key, f"{problem}; {fix}")


def _check_token_budget(cfg: Config, envs: list[Environment]) -> None:
    floor = _sequence_floor(cfg, envs)
    if floor is None:
        return
    tokens, parts = floor
    budget, size = cfg.train.token_budget, cfg.train.sequence_parallel
    if budget * size >= tokens:  # a micro-batch holds token_budget tokens on each of its GPUs
        return
    lower = ", or lower rollout.max_response_tokens" if cfg.train.steps > 0 else ""
    if size == 1:
        raise ConfigError(
            "train.token_budget",
            f"got {budget}, less than one sequence of this run ({parts} = {tokens} tokens); "
            f"set train.token_budget >= {tokens}{lower}",
        )
    raise ConfigError(
        "train.token_budget",
        f"got {budget} with train.sequence_parallel={size}: micro-batches of {budget * size} "
        f"tokens, less than one sequence of this run ({parts} = {tokens} tokens); raise "
        f"train.token_budget to >= {-(-tokens // size)} or train.sequence_parallel to >= "
        f"{-(-tokens // budget)}{lower}",
    )


def _sequence_floor(cfg: Config, envs: list[Environment]) -> tuple[int, str] | None:
    """A lower bound on the longest sequence the run packs, and what it adds up; None when the
    run trains on nothing.

    The sequence is the first solve episode of the first pack the run trains on: its prompt,
    built as the rollout driver builds it, then a response. RL may sample a response as long as
    rollout.max_response_tokens, and a budget that fits it only while the model stops early is
    luck; warm-start demonstrations are scripted and may be shorter, so alone they count one
    token. A Hugging Face model's prompt counts one token: its tokenizer is not loaded here
    (the bound then only catches a budget below the response cap).
    """
    train, rollout = cfg.train, cfg.rollout
    if train.steps > 0:
        split, strategy, phase = "train", rollout.strategy, "RL"
        response = rollout.max_response_tokens
        response_parts = f"rollout.max_response_tokens={response}"
    elif train.warm_start_steps > 0:
        split, strategy, phase = "warm", "cod", "warm-start"  # as Trainer._demonstrations
        response, response_parts = 1, "one response token"
    else:
        return None
    if cfg.model.name_or_path != BUILTIN_TINY:
        return 1 + response, f"a prompt of at least 1 token + {response_parts}"
    try:
        tokenizer = run_tokenizer(cfg, envs, DriverSettings.from_config(cfg), is_main=True)
    except ConfigError:  # a folder the config names (train.init_from): its own key
        raise
    except (OSError, ValueError) as e:  # an unwritable run folder, a damaged saved tokenizer
        folder = Path(cfg.runtime.run_dir) / "tokenizer"
        raise ConfigError(
            "runtime.run_dir",
            f"cannot load or save the run's tokenizer {folder} ({clipped(' '.join(str(e).split()))}"
            "); repair or remove that folder, or set runtime.run_dir to a new one",
        ) from None
    pack = make_packs(pack_seeds(split, 1, train.seed), rollout.tasks_per_pack, strategy)[0]
    chat = ChatFormat.for_model(tokenizer, cfg.model)
    prompts = {}  # the longest first prompt over the run's environments
    for env in envs:
        task = env.task(pack.pack_seed, pack.task_indices[0])
        system = PROMPT_STYLES[rollout.prompt_style].solve_system(
            task.prompt(), context_line(None, first_task=True)
        )
        prompts[env.name] = len(chat.first_prompt(system, task.reset()))
    name = max(prompts, key=prompts.__getitem__)
    where = f" ({name})" if len(envs) > 1 else ""
    prompt = prompts[name]
    return (
        prompt + response,
        f"the first {phase} prompt's{where} {prompt} tokens + {response_parts}",
    )
