"""The colocated vLLM sampler: every vLLM call of cod-fast, written against vLLM 0.34.0.

One engine per rank lives in the training process (`distributed_executor_backend=
"external_launcher"`), takes token-id prompts and returns the sampled ids with their processed
log-probs (`logprobs=0`: the sampled token's log-prob after temperature and top-p, what the loss
recomputes). Between phases the engine sleeps (level 2: weights and KV cache released, since
fresh weights always come from the trainer); before the next rollout it wakes the weights,
receives the trainer's weights in buckets of about 1 GB (the caller's iterator gathers FSDP2
shards one parameter at a time, so at most one bucket is gathered at once), then wakes the KV
cache and drops the prefix cache. The engine starts from dummy weights, so nothing is ever read
from disk by accident.

vLLM cannot be installed on the project's CI; the adapter's contract is tested with a stand-in
engine (tests/test_vllm_sampler.py) and has not been run against real vLLM yet.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from cod_fast.rollout.sampler import Sample

VLLM_VERSION = "0.34.0"
BUCKET_BYTES = 1 << 30


def _model_weight_loader(llm: Any) -> Callable[[list[tuple[str, torch.Tensor]]], Any]:
    """The in-process model's `load_weights`. With external_launcher and V1 multiprocessing off
    the engine core, its executor and the worker all live in this process. Not yet checked
    against a running vLLM 0.34 (no GPU so far): the first GPU session must confirm this path."""
    engine = llm.llm_engine
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    executor = core.model_executor if core is not None else engine.model_executor
    return executor.driver_worker.worker.model_runner.model.load_weights


def weight_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive lists of (name, tensor) of about `bucket_bytes` each, in the given order; a
    tensor larger than a bucket travels alone."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class VLLMSampler:
    """`Sampler` over a vLLM `LLM` (or a stand-in with the same methods)."""

    def __init__(
        self,
        engine: Any,
        *,
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
        sampling_params: Callable[..., Any] | None = None,
        load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
    ):
        self.engine = engine
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        if sampling_params is None:
            from vllm import SamplingParams

            sampling_params = SamplingParams
        self._params = sampling_params
        self._load = load_weights or _model_weight_loader(engine)
        self.calls = 0

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
    ) -> VLLMSampler:
        """A colocated engine for this rank (call under torchrun; one GPU per process)."""
        # The engine core must run in this process for the weight push to reach the model.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        llm = LLM(
            model=model,
            dtype=dtype,
            seed=seed,
            load_format="dummy",
            distributed_executor_backend="external_launcher",
            tensor_parallel_size=1,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=True,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            max_model_len=max_model_len,
        )
        return cls(llm, temperature=temperature, top_p=top_p, seed=seed)

    def with_seed(self, seed: int, temperature: float | None = None) -> VLLMSampler:
        """Another sampling stream over the same engine (the trainer's eval sampler)."""
        return VLLMSampler(
            self.engine,
            temperature=self.temperature if temperature is None else temperature,
            top_p=self.top_p,
            seed=seed,
            sampling_params=self._params,
            load_weights=self._load,
        )

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands: request seeds derive from (seed, calls)."""
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = int(state["calls"])

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        self.calls += 1
        params = [
            self._params(
                temperature=self.temperature,
                top_p=self.top_p,
                max_tokens=cap,
                logprobs=0,
                seed=self.seed + 1_000_003 * self.calls + i,
            )
            for i, cap in enumerate(max_new_tokens)
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
        """Release weights and KV cache for the training phase."""
        self.engine.sleep(level=2)

    def push_weights(
        self, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = BUCKET_BYTES
    ) -> int:
        """Wake the weights, load the trainer's in buckets, wake the KV cache; returns buckets."""
        self.engine.wake_up(tags=["weights"])
        count = 0
        for bucket in weight_buckets(named, bucket_bytes):
            self._load(bucket)
            count += 1
        self.engine.wake_up(tags=["kv_cache"])
        self.engine.reset_prefix_cache()  # cached prefixes were computed with the old weights
        return count
