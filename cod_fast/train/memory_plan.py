"""Will it fit? A run's peak memory per device and per phase, before it starts.

`plan_memory(cfg, shape, gpus=N)` adds up, for one GPU of a run on N GPUs, the buffers each
phase holds at its peak (cod_fast.train.memory_terms): the warm start's supervised step, a
rollout's sampling, the RL training step, an evaluation, the teachers' scoring. It reads only
the config and the model's shape (counted on the meta device: no weights), so a plan for
Qwen3-32B on 8 GPUs answers in a second on a laptop; `cod-fast plan` prints it, and the
preflight refuses a run on a GPU whose plan does not fit (`check_fits`).

Under sequence parallelism (train.sequence_parallel N) a rank's activations and loss chunks are
those of its own train.token_budget tokens, while a micro-batch holds N times as many: every rank
of the group keeps the whole micro-batch's per-token loss vectors, and attention's all-to-alls
add their buffers (`sequence_parallel_terms`).

Where the plan is an estimate it says so: the prompt length of a rollout (`prompt_tokens`,
default the hint cap plus one response), the CUDA allocator's rounding and fragmentation
(`HEADROOM` of the device is kept free), and the CUDA context (outside torch's count).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from cod_fast.config import Config, ConfigError
from cod_fast.distributed.context import check_sequence_parallel
from cod_fast.model.loading import master_dtype, resolve_dtype
from cod_fast.model.shapes import ModelShape
from cod_fast.train.memory_terms import (
    Layout,
    Term,
    activation_terms,
    checkpoint_host_terms,
    loss_terms,
    master_terms,
    prefill_terms,
    sequence_parallel_terms,
    teacher_host_terms,
    torch_sampler_terms,
    training_weight_terms,
)

GPUS_PER_NODE = 8
"""GPUs of one node, for the host memory a node's ranks hold together."""
HEADROOM = 0.05
"""Share of a GPU's memory the plan keeps free: the allocator's rounding and fragmentation."""
GIB = 2**30


@dataclass(frozen=True)
class Phase:
    """One phase of a run at its peak on one device."""

    name: str
    terms: list[Term]

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)


@dataclass
class MemoryPlan:
    """A run's phases on one device, and the device's memory (None: not given)."""

    model: str
    gpus: int
    device: str
    phases: list[Phase]
    memory: int | None = None
    notes: list[str] = field(default_factory=list)
    host: list[Term] = field(default_factory=list)
    """Host memory of one node, per moment (a checkpoint's save or load, teachers waiting)."""
    engine: tuple[int, int] | None = None
    """vLLM's (need, share) with a device size given: its whole 16-bit weights (the colocated
    engine runs without tensor parallelism) and one sequence's KV cache, against
    rollout.vllm_gpu_memory_utilization of the device; vLLM refuses to start below it."""
    sequence_parallel: int = 1
    """GPUs that share each micro-batch (train.sequence_parallel)."""
    longest_sequence: int = 0
    """The most tokens one sequence may have: train.token_budget x train.sequence_parallel."""

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.bytes)

    @property
    def usable(self) -> int | None:
        return None if self.memory is None else int(self.memory * (1 - HEADROOM))

    def fits(self) -> bool | None:
        if self.memory is None:
            return None
        engine_fits = self.engine is None or self.engine[0] <= self.engine[1]
        return self.peak.bytes <= self.usable and engine_fits

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)


def layout_for(cfg: Config, gpus: int, device: torch.device) -> Layout:
    """How the trainer places the model on each of `gpus` trainer ranks (Trainer.__init__)."""
    compute = resolve_dtype(cfg.model, device)
    master = master_dtype(cfg.model, cfg.train.master_dtype, device)
    trainers = gpus - cfg.runtime.rollout_ranks
    shards = max(1, trainers // cfg.runtime.hsdp_replicate)
    sharded = trainers > 1 or master != compute
    return Layout(shards=shards, sharded=sharded, compute=compute, master=master, device=device)


def check_sequence_degree(
    size: int, heads: int, model: str, trainers: int, shard_ranks: int
) -> None:
    """A ConfigError on train.sequence_parallel unless `size` ranks per group tile the
    `trainers` (inside each FSDP shard group of `shard_ranks`: HSDP's replicas hold whole groups)
    and split the model's `heads` attention heads (cod_fast.ops.sequence_parallel.split_heads
    would refuse it only at the first forward)."""
    check_sequence_parallel(size, shard_ranks, trainers)
    if heads % size:
        both = math.gcd(heads, shard_ranks)
        works = ", ".join(str(n) for n in range(2, both + 1) if both % n == 0)
        fix = (
            f"set it to {works} (divisors of the heads and of the {shard_ranks} trainer ranks) "
            "or 1 (off)"
            if works
            else f"set it to 1 (off): no degree above 1 divides both the heads and the "
            f"{shard_ranks} trainer ranks"
        )
        raise ConfigError(
            "train.sequence_parallel",
            f"got {size}, which does not divide the {heads} attention heads of {model} (each "
            f"rank of a group attends with 1/N of them); {fix}",
        )


def default_prompt_tokens(cfg: Config) -> int:
    """A rollout's longest prompt when the caller does not know it: the hint cap plus one
    response (an update episode reads the hint and the last attempt), within the token budget."""
    rollout = cfg.rollout
    return min(cfg.train.token_budget, rollout.max_hint_tokens + rollout.max_response_tokens)


def plan_memory(
    cfg: Config,
    shape: ModelShape,
    *,
    gpus: int = 1,
    memory: int | None = None,
    device: str = "cuda",
    sampler: str = "torch",
    prompt_tokens: int | None = None,
    teachers: list[ModelShape] | None = None,
    trainable_share: float = 1.0,
) -> MemoryPlan:
    """The plan of `cfg` for `shape` on one of `gpus` devices of `memory` bytes each.
    `sampler`: the run's sampler kind (cod_fast.rollout.choice.choose_sampler); `teachers`:
    the shapes of algo.teachers' models; `trainable_share`: the share of a micro-batch's tokens
    the loss trains on (responses; 1.0, every token, is the bound a refusal uses). A
    train.sequence_parallel that does not divide the trainer GPUs or the model's attention heads
    is a ConfigError (a ValueError) naming it and the degrees that work."""
    if gpus < 1 or gpus <= cfg.runtime.rollout_ranks:
        raise ValueError(
            f"gpus={gpus}: a plan needs at least one trainer GPU beside runtime.rollout_ranks="
            f"{cfg.runtime.rollout_ranks}"
        )
    dev = torch.device(device)
    layout = layout_for(cfg, gpus, dev)
    trainers = gpus - cfg.runtime.rollout_ranks
    sp = cfg.train.sequence_parallel
    check_sequence_degree(sp, shape.heads, shape.name, trainers, layout.shards)
    prompt = default_prompt_tokens(cfg) if prompt_tokens is None else prompt_tokens
    model, cb = cfg.model, layout.compute.itemsize
    tokens = cfg.train.token_budget  # a GPU's: its share of a sequence-parallel micro-batch
    rows = max(1, math.ceil(trainable_share * tokens))
    stepped = master_terms(shape, layout, optimizer=True)
    ckpt = model.gradient_checkpointing
    train = (
        stepped
        + training_weight_terms(shape, layout)
        + activation_terms(shape, tokens, cb, model.lean_activations, ckpt)
        + loss_terms(shape, rows, dev, cb)
    )
    if sp > 1:
        whole_rows = max(1, math.ceil(trainable_share * tokens * sp))
        train += sequence_parallel_terms(shape, tokens, sp, whole_rows, cb, ckpt)
    own_copy = layout.sharded and sampler == "torch"
    copy = [Term("sampler weights", shape.params * cb, "the torch sampler's whole copy")]
    asleep = copy if own_copy else []
    kl = cfg.algo.loss.kl is not None and cfg.algo.loss.beta > 0
    reference = _reference_terms(shape, layout) if kl else []
    rollout = cfg.rollout
    members = math.ceil(rollout.packs_per_step / trainers) * rollout.group_size
    phases = [Phase("model load", _load_terms(shape, layout, layout.master.itemsize) + asleep)]
    if cfg.train.warm_start_steps:
        phases.append(Phase("warm start", train + asleep))
    if cfg.train.steps:
        sampling = _sampling_terms(cfg, shape, layout, sampler, members, prompt, gpus, memory)
        phases.append(Phase("sampling", stepped + reference + sampling))
        phases.append(Phase("training step", train + reference + asleep))
        if kl:  # loaded as RL starts, beside the policy's state
            loading = _load_terms(shape, dataclasses.replace(layout, sharded=trainers > 1), cb)
            phases.append(Phase("KL reference load", stepped + asleep + loading))
    if rollout.eval_packs:
        eval_rows = math.ceil(rollout.eval_packs / gpus)
        sampling = _sampling_terms(cfg, shape, layout, sampler, eval_rows, prompt, gpus, memory)
        phases.append(Phase("evaluation", stepped + reference + sampling))
    if teachers:
        largest = max(teachers, key=lambda t: t.params)
        scoring = [Term("teacher weights", largest.params * cb, f"{largest.name}, whole")]
        # A no-grad forward keeps nothing: a layer's input and output, and the loss's chunk.
        scoring.append(
            Term("teacher forward", tokens * 2 * largest.hidden * cb, "a layer's input and output")
        )
        scoring += loss_terms(largest, rows, dev, cb)[1:2]
        phases.append(Phase("teachers", stepped + reference + asleep + scoring))
    lean = model.lean_activations
    ways = {
        ckpt: activation_terms(shape, tokens, cb, lean, ckpt)[0].bytes for ckpt in (True, False)
    }
    notes = [
        f"activations at {tokens:,} tokens: {gib(ways[True])} with "
        f"model.gradient_checkpointing, {gib(ways[False])} without",
        f"rollout prompts counted as {prompt} tokens (--prompt-tokens)",
        f"{HEADROOM:.0%} of each GPU kept free for the allocator; the CUDA context is not counted",
    ]
    if sp > 1:
        notes.insert(
            0,
            f"micro-batches of up to {tokens * sp:,} tokens over {sp} GPUs "
            "(train.sequence_parallel)",
        )
    per_node = min(gpus, GPUS_PER_NODE)
    sharded_format = trainers > 1 and cfg.runtime.checkpoint_format == "auto"
    size = layout.master.itemsize
    how = f"{per_node} ranks x {shape.params:,} parameters x {size} B (each loads it whole)"
    host = [Term("model load", per_node * shape.params * size, how)]
    host += checkpoint_host_terms(shape, layout, per_node, sharded_format)
    if teachers:
        host += teacher_host_terms(teachers, per_node, cb)
    engine = None
    if sampler == "vllm" and memory is not None and cfg.train.steps + rollout.eval_packs:
        sequence = (prompt + rollout.max_response_tokens) * shape.kv_bytes_per_token(cb)
        engine = (shape.params * cb + sequence, int(rollout.vllm_gpu_memory_utilization * memory))
    return MemoryPlan(
        shape.name, gpus, device, phases, memory, notes, host, engine, sp, tokens * sp
    )


def _load_terms(shape: ModelShape, layout: Layout, itemsize: int) -> list[Term]:
    """A model's load onto one GPU, in `itemsize` bytes a parameter: whole in one unsharded
    process; under FSDP2 it waits in host memory and fully_shard moves one unit at a time to
    the device and shards it (torch/distributed/fsdp/_fully_shard/_fsdp_init.py,
    _move_states_to_device), so the GPU holds the shards so far and one whole unit."""
    if not layout.sharded:
        how = f"{shape.params:,} parameters x {itemsize} B"
        return [Term("whole model (loading)", shape.params * itemsize, how)]
    share = math.ceil(shape.params / layout.shards)
    unit = max(shape.root_params, shape.layer_params)
    return [
        Term("shards (loading)", share * itemsize, f"{share:,} parameters x {itemsize} B"),
        Term("unit being sharded", unit * itemsize, f"{unit:,} parameters x {itemsize} B"),
    ]


def _reference_terms(shape: ModelShape, layout: Layout) -> list[Term]:
    share = math.ceil(shape.params / layout.shards)
    cb = layout.compute.itemsize
    return [Term("KL reference", share * cb, f"{share:,} parameters x {cb} B, frozen")]


def _sampling_terms(cfg, shape, layout, sampler, rows, prompt, gpus, memory) -> list[Term]:
    """What sampling adds on a trainer GPU: vLLM's share, or the torch sampler's weights copy
    (under FSDP2) and decode state."""
    rollout, cb = cfg.rollout, layout.compute.itemsize
    if sampler == "vllm":
        if memory is None:
            share = shape.params * cb + rows * (prompt + rollout.max_response_tokens) * (
                shape.kv_bytes_per_token(cb)
            )
            how = "weights + KV cache (no device size given for the utilization share)"
        else:
            share = int(rollout.vllm_gpu_memory_utilization * memory)
            how = f"rollout.vllm_gpu_memory_utilization={rollout.vllm_gpu_memory_utilization}"
        return [Term("vLLM", share, how)]
    device_is_cuda = layout.device.type == "cuda"
    static = rollout.torch_static_shapes
    static = device_is_cuda if static is None else static
    graphs = rollout.torch_cuda_graphs
    graphs = (device_is_cuda and static) if graphs is None else graphs
    terms = []
    if layout.sharded:
        terms.append(Term("sampler weights", shape.params * cb, "the torch sampler's whole copy"))
    columns = prompt + rollout.max_response_tokens
    terms += torch_sampler_terms(shape, rows, columns, cb, static, graphs)
    prompts = max(1, rows // rollout.group_size)
    terms += prefill_terms(shape, prompts, prompt, cb)
    return terms


KNOBS = {
    "activations": "train.token_budget (or model.gradient_checkpointing=true)",
    "loss inputs": "train.token_budget",
    "loss chunks": "the COD_FAST_CHUNK_MIB variable or train.token_budget",
    "loss gradients": "train.token_budget",
    "attention layouts": "train.token_budget (or model.gradient_checkpointing=true)",
    "all-to-all buffers": "train.token_budget",
    "loss vectors": "train.token_budget",
    "weights": "train.master_dtype=model (16-bit masters), or use more GPUs",
    "AdamW state": "train.master_dtype=model (16-bit AdamW state), or use more GPUs",
    "gradients": "train.master_dtype=model (16-bit gradients), or use more GPUs",
    "gathered weights": "more GPUs (or a smaller model)",
    "whole gradients": "more GPUs (or a smaller model)",
    "sampler weights": "rollout.sampler=vllm",
    "KV cache": "rollout.packs_per_step, rollout.group_size or rollout.max_response_tokens",
    "prefill cache": "rollout.packs_per_step or rollout.max_hint_tokens",
    "decode step": "rollout.packs_per_step or rollout.group_size",
    "CUDA graph pool": "rollout.torch_cuda_graphs=false",
    "vLLM": "rollout.vllm_gpu_memory_utilization",
    "KL reference": "algo.loss.beta=0 (no KL term) or more GPUs",
    "whole model (loading)": "train.master_dtype=model (load in 16 bits), or a smaller model",
    "shards (loading)": "more GPUs (or a smaller model)",
    "unit being sharded": "a smaller model",
    "teacher weights": "fewer or smaller algo.teachers",
    "teacher forward": "train.token_budget",
}
"""The setting that shrinks each term, for a refusal's fix."""


def check_fits(plan: MemoryPlan) -> None:
    """A ConfigError of one line when the plan's peak phase exceeds the device: the phase, the
    bytes, its largest term and the setting that shrinks it."""
    if plan.fits() is not False:
        return
    if plan.engine is not None and plan.engine[0] > plan.engine[1]:
        need, share = plan.engine
        raise ConfigError(
            "rollout.vllm_gpu_memory_utilization",
            f"vLLM's share of each GPU ({gib(share)}) cannot hold {plan.model}'s 16-bit weights "
            f"and one sequence's KV cache ({gib(need)}; the colocated engine runs without tensor "
            f"parallelism): raise it to at least {math.ceil(100 * need / plan.memory) / 100:g} "
            "if the training step still fits (`cod-fast plan`), or use rollout.sampler=torch "
            "or a smaller model",
        )
    peak = plan.peak
    term = peak.largest()
    knob = KNOBS.get(term.name, "a smaller config")
    first = knob.split(" ", 1)[0].rstrip(",")
    key = first if first.startswith(("train.", "rollout.", "algo.", "model.")) else "model"
    raise ConfigError(
        key,
        f"the {peak.name} phase needs {gib(peak.bytes)} on each GPU, more than "
        f"{gib(plan.usable)} usable of {gib(plan.memory)} ({1 - HEADROOM:.0%}); its largest part "
        f"is {term.name} ({gib(term.bytes)}: {term.what}); lower {knob}, or see `cod-fast plan`",
    )


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def largest_fitting(plan_for, low: int, high: int) -> int | None:
    """The largest value in [low, high] whose plan fits (`plan_for(value)` -> MemoryPlan),
    assuming more never fits better; None when even `low` does not."""
    if not plan_for(low).fits():
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if plan_for(mid).fits():
            low = mid
        else:
            high = mid - 1
    return low


def with_setting(cfg: Config, section: str, **values) -> Config:
    """`cfg` with fields of one section replaced (the fit searches' what-if configs)."""
    part = dataclasses.replace(getattr(cfg, section), **values)
    return dataclasses.replace(cfg, **{section: part})
