"""The trainer's phases and its samplers' memory: no step trains beside an awake sampler, a
sampler samples only after the push that wakes it, and the vLLM engine starts only once the
policy is sharded.

The runs use the vLLM adapter (cod_fast.rollout.vllm_sampler.VLLMSampler) over a stand-in engine
with CUDA's sleep mode (weights and KV cache dropped at level 2, generate refused until both are
woken), so the CPU checks the order of calls the CUDA engine needs; the tokens it answers with
are junk the trainer trains on all the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch.distributed.tensor import DTensor

import cod_fast.train.trainer as trainer_module
from cod_fast.config.io import load_config
from cod_fast.rollout import choice, vllm_sampler
from cod_fast.rollout.torch_sampler import TorchSampler
from cod_fast.rollout.vllm_sampler import VLLMSampler
from cod_fast.run.log import RunLog
from cod_fast.train.trainer import Trainer
from tests.rollout.test_vllm_sampler import StandInEngine

# One layer, one head of 32 (a head size vLLM's CPU backend takes, so rollout.sampler=vllm is
# accepted), one pack of two members per step, one eval pack, short responses.
SMALL = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=1",
    "model.intermediate_size=64",
    "rollout.packs_per_step=1",
    "rollout.group_size=2",
    "rollout.tasks_per_pack=2",
    "rollout.eval_packs=1",
    "rollout.max_response_tokens=4",
    "train.warm_start_packs=1",
    "runtime.checkpoint_every=0",
]
ASLEEP = {"weights", "kv_cache"}


@dataclass
class SleepyEngine(StandInEngine):
    """vLLM 0.34's sleep mode as the adapter meets it: sleep(level=2) drops weights and KV
    cache, wake_up(tags) brings those tags back, and generate needs both (a level-2 engine has
    no weights to sample from). Every call, and each training step, goes to `calls`."""

    sleeping: set = field(default_factory=set)

    def sleep(self, level):
        super().sleep(level)
        self.sleeping = set(ASLEEP)

    def wake_up(self, tags):
        super().wake_up(tags)
        self.sleeping -= set(tags)

    def generate(self, prompts, params, use_tqdm):
        assert not self.sleeping, f"generate on an engine whose {sorted(self.sleeping)} sleep"
        return super().generate(prompts, params, use_tqdm)


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    """The run directory's plots take most of a tiny run's time and matter nothing here."""
    monkeypatch.setattr(RunLog, "plot", lambda self: None)


@pytest.fixture
def engines(monkeypatch):
    """Every engine the trainer starts is a SleepyEngine behind the real adapter; each training
    step is logged in its engine's calls with what of it was asleep."""
    started: list[SleepyEngine] = []

    def create(cls, model, **options):
        engine = SleepyEngine()
        started.append(engine)
        return cls(
            engine,
            temperature=options["temperature"],
            top_p=options["top_p"],
            seed=options["seed"],
            sleep_mode=True,
            max_model_len=options["max_model_len"],
            sampling_params=lambda **kw: kw,
        )

    def train_step(*args, **kwargs):
        engine = started[-1]
        engine.calls.append(("train", tuple(sorted(engine.sleeping))))
        return real_train_step(*args, **kwargs)

    real_train_step = trainer_module.train_step
    monkeypatch.setattr(choice, "vllm_installed", lambda: True)
    monkeypatch.setattr(VLLMSampler, "create", classmethod(create))
    monkeypatch.setattr(vllm_sampler, "_shut_down", lambda engine: None)
    monkeypatch.setattr(trainer_module, "train_step", train_step)
    return started


def vllm_config(run_dir, *extra):
    return load_config(
        "tiny-cpu",
        overrides=[*SMALL, "rollout.sampler=vllm", f"runtime.run_dir={run_dir}", *extra],
    )


def run(cfg, engines, resume=False, stop_after=None) -> list:
    """One run's engine calls, with ("eval", label) as each evaluation starts and ("step", n)
    after each step."""
    trainer = Trainer(cfg)
    calls = engines[-1].calls

    def on_step(record):
        calls.append(("step", record["step"]))
        if record["step"] == stop_after:
            trainer.stop_requested = True

    def on_eval(progress):
        if progress.summary is None:
            calls.append(("eval", progress.label))

    try:
        trainer.run(resume=resume, on_step=on_step, on_eval=on_eval)
    finally:
        trainer.close()
    return calls


def assert_trains_only_asleep(calls: list) -> None:
    """Every training step ran with the engine's weights and KV cache asleep, and there was
    at least one."""
    trained = [c for c in calls if c[0] == "train"]
    assert trained, calls
    bad = [i for i, c in enumerate(calls) if c[0] == "train" and set(c[1]) != ASLEEP]
    assert not bad, f"training steps beside an awake engine at calls {bad}: {calls}"


def before(calls: list, event: tuple, since: int = 0) -> list:
    """The calls from `since` up to the first `event` after it."""
    return calls[since : calls.index(event, since)]


RELOAD = [("reload_weights",), ("rpc", "_repack_tied")]
PUSH = [*RELOAD, ("reset_prefix_cache",)]
"""A push into an engine that is awake."""
WAKING_PUSH = [("wake_up", ("weights",)), *RELOAD, ("wake_up", ("kv_cache",)), PUSH[-1]]
"""A push into a sleeping engine: it wakes the weights, reloads, then wakes the KV cache."""


@pytest.mark.slow  # 1-2 s: left to the full suite
def test_warm_start_and_rl_steps_train_with_the_engine_asleep(tmp_path, engines):
    """Through a warm start, its evaluations and RL steps: the engine is asleep at every
    training step (the warm start's too), the first warm step comes after the start
    evaluation's sampling and a sleep, and the first RL rollout comes after a push that woke
    the weights, reloaded them and woke the KV cache."""
    cfg = vllm_config(tmp_path / "run", "train.warm_start_steps=2", "train.steps=2")
    calls = run(cfg, engines)
    assert_trains_only_asleep(calls)
    assert len(engines) == 1
    start = before(calls, ("train", tuple(sorted(ASLEEP))))
    assert start[: len(PUSH) + 1] == [*PUSH, ("eval", "start")]  # a new engine is awake
    assert ("generate", 1) in start
    assert start[-1] == ("sleep", 2)
    warm_end = calls.index(("step", 2))
    rollout = calls.index(("generate", 2), warm_end)  # the first RL batch: 2 members
    pushes = [i for i in range(warm_end, rollout) if calls[i] == ("reload_weights",)]
    assert pushes, calls[warm_end:rollout]
    assert calls[pushes[-1] - 1 : pushes[-1] + 4] == WAKING_PUSH
    assert ("sleep", 2) not in calls[pushes[-1] : rollout]


@pytest.mark.slow  # 1-2 s: left to the full suite
def test_each_evaluation_is_followed_by_sleep_before_training(tmp_path, engines):
    """With an evaluation before the warm step, after it and after every RL step, every
    evaluation's sampling is followed by a sleep before the next training step."""
    cfg = vllm_config(
        tmp_path / "run", "train.warm_start_steps=1", "train.steps=2", "runtime.eval_every=1"
    )
    calls = run(cfg, engines)
    assert_trains_only_asleep(calls)
    evals = [i for i, c in enumerate(calls) if c[0] == "eval"]
    assert [calls[i][1] for i in evals] == ["start", "after warm start", "rl step 1", "end"]
    for i in evals[:-1]:
        upto = before(calls, ("train", tuple(sorted(ASLEEP))), i)
        assert ("sleep", 2) in upto[upto.index(("generate", 1)) :], upto


@pytest.mark.slow  # 1-2 s: left to the full suite
def test_a_run_resumed_into_the_warm_start_sleeps_before_it_trains(tmp_path, engines):
    """A run stopped after its first warm step and resumed: the new engine starts awake, and
    the resumed warm step trains only after it sleeps; no weights are pushed into an engine
    that is put to sleep before it samples."""
    cfg = vllm_config(tmp_path / "run", "train.warm_start_steps=2", "train.steps=1")
    run(cfg, engines, stop_after=1)
    calls = run(cfg, engines, resume=True)
    assert len(engines) == 2
    assert_trains_only_asleep(calls)
    first = before(calls, ("train", tuple(sorted(ASLEEP))))
    assert first == [("sleep", 2)]


def test_torch_samplers_sleep_before_training(tmp_path, monkeypatch):
    """The torch samplers (train and eval, over the training module itself) are put to sleep
    before every training step that follows their sampling, warm start and RL alike."""
    log = []
    real_sleep, real_step = TorchSampler.sleep, trainer_module.train_step

    def sleep(self):
        log.append(("sleep", self.seed))
        real_sleep(self)

    def train_step(*args, **kwargs):
        log.append(("train",))
        return real_step(*args, **kwargs)

    monkeypatch.setattr(TorchSampler, "sleep", sleep)
    monkeypatch.setattr(trainer_module, "train_step", train_step)
    steps = ["train.warm_start_steps=1", "train.steps=1"]
    cfg = load_config("tiny-cpu", overrides=[*SMALL, f"runtime.run_dir={tmp_path}", *steps])
    trainer = Trainer(cfg)
    seeds = {trainer.samplers.train.seed, trainer.samplers.eval.seed}
    assert len(seeds) == 2
    trainer.run()
    trainer.close()
    trains = [i for i, c in enumerate(log) if c == ("train",)]
    assert len(trains) == 2  # the warm step, the RL step
    for i in trains:
        assert {s for _, s in log[i - 2 : i]} == seeds, log


@pytest.mark.slow  # 1-2 s: left to the full suite
def test_the_engine_starts_after_the_policy_is_sharded(tmp_path, engines, monkeypatch):
    """In mixed precision one process shards its policy over a one-rank mesh: when the vLLM
    engine starts, every parameter of the policy is a sharded DTensor, and the folder the
    engine starts from holds the whole model, written before sharding. The policy is loaded
    into host memory (place="cpu"), from where fully_shard moves one unit at a time to the
    device: on a GPU no device holds the whole model."""
    models, seen, places = [], [], []
    real_load, real_create = trainer_module.load_policy, VLLMSampler.create.__func__

    def load_policy(*args, **kwargs):
        places.append(kwargs.get("place"))
        models.append(real_load(*args, **kwargs))
        return models[-1]

    def create(cls, folder, **options):
        model = models[-1][0]
        seen.append(all(isinstance(p, DTensor) for p in model.parameters()))
        seen.append((tmp_path / "run" / "sampler-model" / "model.safetensors").exists())
        return real_create(cls, folder, **options)

    monkeypatch.setattr(trainer_module, "load_policy", load_policy)
    monkeypatch.setattr(VLLMSampler, "create", classmethod(create))
    trainer = Trainer(vllm_config(tmp_path / "run", "model.dtype=bfloat16"))
    try:
        assert trainer.ctx.sharded and seen == [True, True] and places == ["cpu"]
        assert isinstance(trainer.sampler, VLLMSampler)
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()
