"""Keyed sampling (cod_fast.rollout.sampler): a response's draws come from its key alone, so
an evaluation split over ranks plays each pack exactly as one rank would. The torch sampler's
keyed draws and a split rollout are tested in test_torch_sampler.py, on its tiny model."""

from __future__ import annotations

import numpy as np

from cod_fast.rollout.sampler import key_streams, keyed_uniforms, request_seed
from cod_fast.rollout.vllm_sampler import VLLMSampler
from tests.rollout.test_vllm_sampler import StandInEngine


def test_keyed_uniforms_are_uniform_and_distinct_per_key_and_step():
    """The counter-based uniforms lie in [0, 1), have the mean and variance of U[0, 1) over many
    keys, differ between keys, steps and seeds, and repeat for the same (seed, key, step)."""
    streams = key_streams(3, list(range(20_000)))
    u0, u1 = keyed_uniforms(streams, 0), keyed_uniforms(streams, 1)
    assert u0.min() >= 0 and u0.max() < 1
    assert abs(u0.mean() - 0.5) < 0.01 and abs(u0.var() - 1 / 12) < 0.005
    assert abs(np.corrcoef(u0, u1)[0, 1]) < 0.03  # consecutive steps of a key: independent
    assert len(np.unique(u0)) == len(u0)
    np.testing.assert_array_equal(keyed_uniforms(key_streams(3, [5, 7]), 0), u0[[5, 7]])
    assert not np.array_equal(keyed_uniforms(key_streams(4, [5]), 0), u0[[5]])
    assert 0 <= request_seed(3, 2**64 - 1) < 2**63


def test_vllm_sampler_seeds_keyed_requests_from_their_key():
    """The vLLM adapter gives a keyed request the seed request_seed(seed, key), whatever its
    position in the call and however many calls came before; unkeyed requests keep the
    stream's seeds."""
    engine = StandInEngine()
    seen = []
    s = VLLMSampler(engine, temperature=1.0, seed=9, sampling_params=lambda **kw: seen.append(kw))
    s.engine.generate = lambda prompts, params, use_tqdm: [_output() for _ in prompts]
    s.generate([[1], [2]], [3, 3], keys=[7, 8])
    s.generate([[2]], [3], keys=[8])
    assert [p["seed"] for p in seen] == [request_seed(9, 7), request_seed(9, 8), request_seed(9, 8)]
    s.generate([[1], [2]], [3, 3])
    assert [p["seed"] for p in seen[3:]] == [9 + 1_000_003 * 3, 9 + 1_000_003 * 3 + 1]


def _output():
    from types import SimpleNamespace

    done = SimpleNamespace(token_ids=[], logprobs=[], finish_reason="stop")
    return SimpleNamespace(outputs=[done])
