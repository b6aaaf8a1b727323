"""The vLLM adapter's contract, against a stand-in engine (vLLM cannot be installed here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from cod_fast.rollout.vllm_sampler import VLLMSampler, weight_buckets


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

    def load_weights(self, bucket):
        self.calls.append(("load", len(bucket)))
        self.loaded.extend(bucket)


def sampler(engine):
    return VLLMSampler(
        engine, temperature=0.7, sampling_params=lambda **kw: kw, load_weights=engine.load_weights
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


def test_weight_push_delivers_every_parameter_in_order_once():
    """Sleep, then wake weights -> buckets -> wake KV cache -> reset prefix cache; every
    parameter arrives once, in order, in buckets no larger than asked (a big one alone)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.Linear(64, 8), torch.nn.Embedding(300, 64)
    )
    engine = StandInEngine()
    s = sampler(engine)
    s.sleep()
    named = list(model.named_parameters())
    buckets = s.push_weights(iter(named), bucket_bytes=20_000)
    assert [n for n, _ in engine.loaded] == [n for n, _ in named]
    assert all(a is b for (_, a), (_, b) in zip(engine.loaded, named, strict=True))
    kinds = [c[0] for c in engine.calls]
    assert kinds[:2] == ["sleep", "wake_up"] and engine.calls[1] == ("wake_up", ("weights",))
    assert kinds[-2:] == ["wake_up", "reset_prefix_cache"]
    assert engine.calls[-2] == ("wake_up", ("kv_cache",))
    assert kinds.count("load") == buckets > 1


def test_buckets_respect_the_size_and_isolate_big_tensors():
    """Buckets stay under the limit unless one tensor alone exceeds it."""
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 100, 5, 5, 5])]
    sizes = [[t.numel() for _, t in b] for b in weight_buckets(tensors, bucket_bytes=4 * 25)]
    assert sizes == [[10, 10], [100], [5, 5, 5]]
