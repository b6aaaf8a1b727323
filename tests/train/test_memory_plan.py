"""The memory plan (cod_fast.train.memory_plan) against what runs: parameter counts against a
built model, the activation term against the bytes autograd saves on a real forward, the
training step's and the sampler's peaks against live tensor bytes counted while they run
(bench/live_memory.py), the preflight's refusal on a declared GPU size, and `cod-fast plan` at
Qwen3-1.7B, 8B and 32B shapes on this CPU."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from typer.testing import CliRunner

from bench.plan import SHAPES, TOLERANCE, measured_step, planned_step, sampling_case
from bench.train_workload import StepShape, build_model, step_batch
from cod_fast.cli.app import app
from cod_fast.config import ConfigError, ModelConfig
from cod_fast.config.presets import PRESETS
from cod_fast.model.loading import packed_hidden_states
from cod_fast.model.shapes import KNOWN_CONFIGS, model_shape, shape_of
from cod_fast.train.memory_plan import check_fits, plan_memory, with_setting
from cod_fast.train.memory_terms import (
    activation_terms,
    layer_activation_bytes,
    loss_terms,
)
from cod_fast.train.preflight import check_plan


def _random_config(rng: random.Random, **fixed) -> Qwen3Config:
    kv = rng.choice([1, 2, 3])
    sizes = dict(
        vocab_size=rng.randint(50, 400),
        hidden_size=rng.choice([24, 40, 48]),
        intermediate_size=rng.randint(20, 90),
        num_hidden_layers=rng.randint(1, 3),
        num_attention_heads=kv * rng.choice([1, 2]),
        num_key_value_heads=kv,
        head_dim=rng.choice([8, 16]),
        tie_word_embeddings=rng.random() < 0.5,
        max_position_embeddings=4096,
    )
    return Qwen3Config(**(sizes | fixed))


@pytest.mark.parametrize("seed", range(3))
def test_parameters_counted_on_meta_match_a_built_model(seed):
    config = _random_config(random.Random(seed))
    shape = shape_of(config, "random")
    model = AutoModelForCausalLM.from_config(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert shape.layer_params == layer
    assert shape.root_params == shape.params - shape.layers * layer


def test_known_models_have_their_released_sizes():
    # Qwen3-8B and -32B as their model cards give them: 8.2B and 32.8B parameters.
    assert round(model_shape(ModelConfig(name_or_path="Qwen/Qwen3-8B")).params / 1e9, 1) == 8.2
    assert round(model_shape(ModelConfig(name_or_path="Qwen/Qwen3-32B")).params / 1e9, 1) == 32.8
    with pytest.raises(ValueError, match="download the model"):
        model_shape(ModelConfig(name_or_path="someone/unknown-model"))


def _saved_bytes(model, mb) -> int:
    """Bytes of the tensors autograd saves in a forward, weights left out."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        packed_hidden_states(model, mb)
    return sum(seen.values())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_term_is_what_autograd_saves(seed, checkpointing):
    """The lean path's saved bytes equal the term to the byte count of the micro-batch's token
    ids (the one input the term leaves out); transformers' modules within 5%."""
    rng = random.Random(seed)
    layers, heads, kv = rng.randint(1, 3), rng.choice([2, 4]), rng.choice([1, 2])
    step = StepShape(
        layers=layers, hidden=rng.choice([32, 48]), heads=heads, kv_heads=kv, head_dim=16,
        intermediate=rng.randint(40, 100), vocab=300, tokens=rng.randint(300, 700),
        micro_batches=1,
    )  # fmt: skip
    model = build_model(step, "cpu", torch.float32, grad_ckpt=checkpointing, lean=True)
    mb = step_batch(step)[0][0]
    shape = shape_of(model.config, "step")
    tokens = mb.input_ids.numel()
    (term,) = activation_terms(shape, tokens, 4, lean=True, checkpointing=checkpointing)
    saved = _saved_bytes(model, mb)
    if checkpointing:
        # Only the layer inputs and what follows the last layer are saved in the forward; the
        # recomputed layer exists in the backward (the term counts it on top).
        term_bytes = term.bytes - tokens * layer_activation_bytes(shape, 4, lean=True)
        term_bytes -= tokens * 2 * shape.head_dim * 4  # rotary tables live inside the layers
    else:
        term_bytes = term.bytes
    assert abs(saved - 8 * tokens - term_bytes) <= 4 * 64  # + the int32 sequence starts
    plain = build_model(step, "cpu", torch.float32, lean=False)
    (full,) = activation_terms(shape, tokens, 4, lean=False, checkpointing=False)
    assert abs(_saved_bytes(plain, mb) - full.bytes) <= 0.1 * full.bytes


@pytest.mark.parametrize(
    "step",
    [
        StepShape(**SHAPES["tiny"]),
        pytest.param(StepShape(**SHAPES["29m"]), marks=pytest.mark.slow),
    ],
    ids=["tiny", "29M"],
)
def test_training_step_plan_within_15_percent_of_live_peak(step):
    measured, tokens, share, model = measured_step(step)
    planned = planned_step(model, tokens, share)
    assert abs(planned - measured) <= TOLERANCE * measured, (planned, measured)


@pytest.mark.slow  # 0.5-1 s: left to the full suite
@pytest.mark.parametrize("static", [False, True])
def test_sampling_plan_within_15_percent_of_live_peak(static):
    """A generate() of 6 groups of 4 members with every response at its cap: the model's
    weights and the sampler's terms against the live bytes of the call."""
    planned, measured, _ = sampling_case(static)
    assert abs(planned - measured) <= TOLERANCE * measured, (planned, measured)


def test_loss_term_follows_the_chunk_rule():
    shape = shape_of(_random_config(random.Random(1), vocab_size=50_000), "v")
    _, chunks, grads = loss_terms(shape, 20_000, torch.device("cuda"), 2)
    # CUDA: a 2 GiB budget of float32 logits, at least 4096 rows, rows split evenly.
    assert chunks.bytes == 5000 * 50_000 * 4
    assert grads.bytes == (50_000 + 20_000) * shape.hidden * 4


def test_preflight_refuses_what_cannot_fit_on_a_declared_gpu():
    cfg = PRESETS["qwen3-1.7b"]()
    cfg = with_setting(cfg, "rollout", sampler="torch")
    config = Qwen3Config(**KNOWN_CONFIGS["Qwen/Qwen3-1.7B"])
    with pytest.raises(ConfigError) as refused:
        check_plan(cfg, config, world_size=1, memory=24 * 2**30)
    line = str(refused.value)
    assert "\n" not in line
    assert "sampling phase needs" in line and "KV cache" in line
    assert refused.value.key == "rollout.packs_per_step"  # the KV cache's first knob
    check_plan(cfg, config, world_size=8, memory=141 * 2**30)  # an H200 node: fits


def test_check_fits_names_the_knob_of_the_largest_part():
    cfg = with_setting(PRESETS["qwen3-1.7b"](), "rollout", sampler="torch")
    shape = model_shape(ModelConfig(name_or_path="Qwen/Qwen3-8B"))
    plan = plan_memory(cfg, shape, gpus=8, memory=40 * 2**30, sampler="torch")
    assert plan.fits() is False
    with pytest.raises(ConfigError, match="lower"):
        check_fits(plan)


@pytest.mark.parametrize(
    "args",
    [
        ["--preset", "qwen3-1.7b", "--gpus", "8"],
        ["--preset", "qwen3-1.7b", "--set", "model.name_or_path=Qwen/Qwen3-8B", "--gpus", "8"],
        ["--preset", "qwen3-1.7b", "--set", "model.name_or_path=Qwen/Qwen3-32B", "--gpus", "8"],
    ],
)
def test_plan_command_answers_at_real_sizes(args):
    result = CliRunner().invoke(app, ["plan", *args, "--gpu-memory", "80", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    shape = model_shape(ModelConfig(name_or_path=out["model"]))
    weights = out["phases"]["training step"]["terms"][0]
    assert weights["name"] == "weights"
    assert weights["bytes"] == -(-shape.params // 8) * 4  # float32 masters, 1/8 each
    assert out["fits"] == (max(p["bytes"] for p in out["phases"].values()) <= 0.95 * 80 * 2**30)
    if out["fits"]:
        assert out["largest_fitting"]["train.token_budget"] >= 32768


@pytest.mark.parametrize("gpus", [1, 8, 16])
def test_host_memory_of_a_checkpoint_per_node(gpus):
    """One process: the whole float32 state (weights + 2 AdamW moments) in its host; under
    torchrun each rank its shard, so a node of 8 holds 8/S of it."""
    cfg = PRESETS["qwen3-1.7b"]()
    shape = model_shape(ModelConfig(name_or_path="Qwen/Qwen3-8B"))
    _, term = plan_memory(cfg, shape, gpus=gpus).host
    whole = 3 * shape.params * 4
    expected = whole if gpus == 1 else min(gpus, 8) * 3 * -(-shape.params // gpus) * 4
    assert term.bytes == expected


def test_the_model_load_holds_one_whole_unit_at_a_time_under_fsdp2():
    """Under FSDP2 the model waits in host memory (each rank loads it whole there) and
    fully_shard moves one unit at a time to the GPU: its shard plus the largest unit, whole.
    One unsharded process loads the whole model onto its GPU."""
    cfg = PRESETS["qwen3-1.7b"]()
    shape = model_shape(ModelConfig(name_or_path="Qwen/Qwen3-32B"))
    plan = plan_memory(cfg, shape, gpus=8, sampler="vllm")
    shards, unit = plan.phase("model load").terms
    assert shards.bytes == -(-shape.params // 8) * 4
    assert unit.bytes == max(shape.root_params, shape.layer_params) * 4
    assert plan.host[0].name == "model load" and plan.host[0].bytes == 8 * shape.params * 4
    one = with_setting(cfg, "train", master_dtype="model")  # bf16 weights: nothing to shard
    (whole,) = plan_memory(one, shape, gpus=1, sampler="vllm").phase("model load").terms
    assert whole.bytes == shape.params * 2


def test_the_plan_shows_activations_with_and_without_checkpointing():
    cfg = PRESETS["qwen3-1.7b"]()
    shape = model_shape(ModelConfig(name_or_path="Qwen/Qwen3-1.7B"))
    plan = plan_memory(cfg, shape, gpus=8, sampler="vllm")
    (note,) = [n for n in plan.notes if n.startswith("activations")]
    tokens = cfg.train.token_budget
    with_ckpt, without = (
        activation_terms(shape, tokens, 2, lean=True, checkpointing=c)[0].bytes
        for c in (True, False)
    )
    assert (
        f"{with_ckpt / 2**30:.2f} GiB with" in note and f"{without / 2**30:.2f} GiB without" in note
    )
    assert without > 5 * with_ckpt  # 28 layers' activations against their inputs and one layer


def test_a_vllm_share_that_cannot_hold_the_model_does_not_fit():
    """The colocated engine holds the whole 16-bit model on each GPU: Qwen3-32B's 61 GiB does
    not fit vLLM's 40 GiB share of an 80 GiB GPU even where the training step fits (16-bit
    masters), and the refusal names the share; Qwen3-14B's 27.5 GiB and its sequence do."""
    cfg = with_setting(PRESETS["qwen3-8b"](), "train", master_dtype="model")

    def node_of_80(model: str, sampler: str = "vllm"):
        shape = model_shape(ModelConfig(name_or_path=model))
        return plan_memory(cfg, shape, gpus=8, memory=80 * 2**30, sampler=sampler)

    big = node_of_80("Qwen/Qwen3-32B")
    assert big.peak.bytes <= big.usable and big.fits() is False
    need, share = big.engine
    assert share == 40 * 2**30 and need > 61 * 2**30
    with pytest.raises(ConfigError) as refused:
        check_fits(big)
    assert refused.value.key == "rollout.vllm_gpu_memory_utilization"
    assert "tensor parallelism" in str(refused.value) and "\n" not in str(refused.value)
    fits = node_of_80("Qwen/Qwen3-14B")
    assert fits.fits() and fits.engine[0] < fits.engine[1]
    assert node_of_80("Qwen/Qwen3-32B", sampler="torch").engine is None
