"""The memory plan (cod_fast.train.memory_plan) against what runs: parameter counts against a
built model, the activation term against the bytes autograd saves on a real forward, the
training step's and the sampler's peaks against live tensor bytes counted while they run
(bench/live_memory.py), the preflight's refusal on a declared GPU size, and `cod-fast plan` at
Qwen3-1.7B, 8B and 32B shapes on this CPU; with sequence parallelism, its terms against the model's
shape and what the sequence-parallel forward and loss keep."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen3Config
from typer.testing import CliRunner

from bench.live_memory import LiveBytes
from bench.plan import SHAPES, TOLERANCE, measured_step, planned_step, sampling_case
from bench.train_workload import StepShape, build_model, step_batch
from cod_fast.cli.app import app
from cod_fast.config import ConfigError, LossConfig, ModelConfig
from cod_fast.config.presets import PRESETS
from cod_fast.data.sequence_split import with_sequence_shard
from cod_fast.model.loading import packed_hidden_states
from cod_fast.model.shapes import KNOWN_CONFIGS, model_shape, shape_of
from cod_fast.ops.loss_terms import LossInputs
from cod_fast.ops.policy_loss import policy_loss_from_logp
from cod_fast.ops.sequence_parallel import SequenceGroup
from cod_fast.train.memory_plan import check_fits, plan_memory, with_setting
from cod_fast.train.memory_terms import (
    activation_terms,
    layer_activation_bytes,
    loss_terms,
    sequence_parallel_terms,
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


def _saved_bytes(model, mb, sequence_group=None) -> int:
    """Bytes of the tensors autograd saves in a forward, weights left out."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        packed_hidden_states(model, mb, sequence_group)
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


def _node_of_80(sp: int, budget: int, model: str = "Qwen/Qwen3-32B", gpus: int = 8, **train):
    """The plan of the qwen3-8b preset at `model`, 16-bit masters, on `gpus` GPUs of 80 GiB."""
    cfg = with_setting(PRESETS["qwen3-8b"](), "model", name_or_path=model)
    cfg = with_setting(
        cfg, "train", master_dtype="model", sequence_parallel=sp, token_budget=budget, **train
    )
    shape = model_shape(cfg.model)
    return plan_memory(cfg, shape, gpus=gpus, memory=80 * 2**30, sampler="vllm"), shape


def _step_terms(plan) -> dict[str, int]:
    return {t.name: t.bytes for t in plan.phase("training step").terms}


SP_TERMS = {"attention layouts", "all-to-all buffers", "loss vectors"}


def test_sequence_parallel_one_plans_as_before():
    """train.sequence_parallel=1 adds no term and no note; the longest sequence is the budget."""
    plan, _ = _node_of_80(1, 26624)
    assert not SP_TERMS & {t.name for p in plan.phases for t in p.terms}
    assert not any("train.sequence_parallel" in n for n in plan.notes)
    assert (plan.sequence_parallel, plan.longest_sequence) == (1, 26624)


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_sequence_parallel_at_qwen3_32b_on_a_node_of_80_gib(sp):
    """Qwen3-32B (64 query, 8 key/value heads of 128, 64 layers) on 8 GPUs: at the same
    token_budget a GPU every term of the SP=1 step keeps its bytes (activations, loss chunks:
    the rank's own tokens); the SP terms, from the shape: the attention output's second layout
    (one recomputed layer under checkpointing), one layer's q, k, v and one buffer, and the
    whole micro-batch's per-token vectors on every rank (N-fold); sequences N x as long."""
    budget = 6656
    one, shape = _node_of_80(1, budget)
    plan, _ = _node_of_80(sp, budget)
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (64, 8, 128)
    steps, base = _step_terms(plan), _step_terms(one)
    assert {name: steps[name] for name in base} == base
    assert set(steps) - set(base) == SP_TERMS
    assert steps["attention layouts"] == budget * 1 * 64 * 128 * 2
    assert steps["all-to-all buffers"] == budget * (2 * 64 + 2 * 8) * 128 * 2
    whole = sp * budget
    assert steps["loss vectors"] == whole * 16 + whole * (3 * 8 + 4 * 4 + 2 * 4 + 20 * 4)
    assert plan.longest_sequence == sp * budget
    assert f"micro-batches of up to {sp * budget:,} tokens over {sp} GPUs" in plan.notes[0]
    assert plan.phase("sampling").bytes == one.phase("sampling").bytes


def test_sequence_parallel_splits_a_long_packs_activations():
    """A 26,624-token pack over 4 GPUs: each holds a quarter of its activations, so the step's
    peak drops by three quarters of them less the SP terms."""
    whole, _ = _node_of_80(1, 26624)
    split, _ = _node_of_80(4, 26624 // 4)
    act_whole, act_split = _step_terms(whole)["activations"], _step_terms(split)["activations"]
    assert act_whole == 4 * act_split
    assert split.longest_sequence == whole.longest_sequence == 26624
    extra = sum(_step_terms(split)[n] for n in SP_TERMS)
    shrink = _step_terms(whole)["loss gradients"] - _step_terms(split)["loss gradients"]
    shrink += _step_terms(whole)["loss inputs"] - _step_terms(split)["loss inputs"]
    drop = whole.phase("training step").bytes - split.phase("training step").bytes
    assert drop == act_whole - act_split + shrink - extra


def test_sequence_parallel_repeats_kv_heads_it_does_not_split():
    """16 ranks over Qwen3-32B's 8 key/value heads: each is repeated to the query heads before
    the all-to-all, and the kernel keeps them so (2 x 56 heads more a token)."""
    plan, _ = _node_of_80(16, 4096, gpus=16, warm_start_steps=0)
    steps = _step_terms(plan)
    assert steps["attention layouts"] == 4096 * (64 + 2 * (64 - 8)) * 128 * 2
    assert steps["all-to-all buffers"] == 4096 * (2 * 64 + 2 * 64) * 128 * 2


@pytest.mark.parametrize(
    ("sp", "gpus", "model", "replicate", "said"),
    [
        (2, 3, "Qwen/Qwen3-32B", 1, "does not divide the 3 trainer rank(s)"),
        (16, 16, "Qwen/Qwen3-32B", 2, "in replicas of 8 (runtime.hsdp_replicate)"),
        (16, 16, "Qwen/Qwen3-14B", 1, "40 attention heads of Qwen/Qwen3-14B"),
    ],
)
def test_plan_refuses_a_sequence_parallel_degree_that_does_not_divide(
    sp, gpus, model, replicate, said
):
    """The degree must divide the trainer GPUs (each HSDP replica's) and the attention heads;
    the refusal is a ConfigError (a ValueError) on train.sequence_parallel with the fix."""
    cfg = with_setting(PRESETS["qwen3-8b"](), "model", name_or_path=model)
    cfg = with_setting(cfg, "train", sequence_parallel=sp)
    cfg = with_setting(cfg, "runtime", hsdp_replicate=replicate)
    with pytest.raises(ValueError) as refused:
        plan_memory(cfg, model_shape(cfg.model), gpus=gpus)
    assert isinstance(refused.value, ConfigError)
    assert refused.value.key == "train.sequence_parallel" and said in str(refused.value)
    assert "set it to" in str(refused.value) and "\n" not in str(refused.value)
    if "heads" in said:  # gcd(40, 16) = 8
        assert "set it to 2, 4, 8 (divisors of the heads and of the 16 trainer ranks)" in str(
            refused.value
        )


@pytest.mark.parametrize(
    "loss",
    [
        {},
        {"kl": "k3", "beta": 0.1, "entropy_coef": 0.01, "rollout_correction": "tis"},
        {
            "policy": "rec_one_side",
            "ratio_level": "sequence",
            "agg": "seq-mean-token-mean",
            "rollout_correction": "mis_sequence",
            "kl": "k2",
            "beta": 0.1,
            "entropy_coef": 0.01,
        },
    ],
    ids=["ppo", "kl-entropy-tis", "gspo-mis"],
)
def test_sequence_parallel_loss_stays_within_its_20_vectors(loss):
    """Under sequence parallelism every rank computes the whole micro-batch's loss from the
    gathered log-probs and entropies (cod_fast.ops.policy_loss): the live bytes of its forward
    and backward, those two vectors included, stay within the 20 float32 vectors a token the
    plan's `loss vectors` counts, and above 15 (the count is no loose bound)."""
    n, g = 20_000, torch.Generator().manual_seed(0)
    advantages = torch.randn(n, generator=g)
    old, roll, ref, gathered_logp = (-torch.rand(n, generator=g) for _ in range(4))
    gathered_entropy = torch.rand(n, generator=g)
    # The micro-batch's own vectors, made before the count: the term counts them apart.
    inputs = LossInputs(
        advantages, torch.arange(n) // 400, old_logp=old, rollout_logp=roll, ref_logp=ref,
        denominator=float(n), num_segments=n // 400,
    )  # fmt: skip
    with LiveBytes() as live:
        logp = gathered_logp.clone().requires_grad_()
        entropy = gathered_entropy.clone().requires_grad_()
        value, _ = policy_loss_from_logp(
            logp, inputs, loss_config=LossConfig(**loss), entropy=entropy
        )
        value.backward()
    assert 15 * 4 * n <= live.peak <= 20 * 4 * n, live.peak / n


@pytest.fixture
def one_rank_group():
    """A sequence-parallel group of one gloo rank in this process (the default group)."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield SequenceGroup(None, 0, 1)
    finally:
        if made:
            dist.destroy_process_group()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_attention_layouts_term_is_what_the_sequence_parallel_path_saves_more(
    one_rank_group, checkpointing
):
    """The sequence-parallel forward (all-to-alls around attention, here over one rank) saves
    one attention output more a layer than the plain one, Hq x D a token: the output
    projection's input in sequence layout beside the kernel's in head layout. Under
    checkpointing the forward saves the same; the term is the recomputed layer's."""
    step = StepShape(
        layers=2, hidden=32, heads=4, kv_heads=2, head_dim=16, intermediate=50, vocab=300,
        tokens=400, micro_batches=1,
    )  # fmt: skip
    model = build_model(step, "cpu", torch.float32, grad_ckpt=checkpointing, lean=True)
    mb = step_batch(step)[0][0]
    tokens = mb.num_tokens
    plain = _saved_bytes(model, mb)
    sharded = _saved_bytes(model, with_sequence_shard(mb, 0, 1), one_rank_group)
    shape = shape_of(model.config, "step")
    term = sequence_parallel_terms(shape, tokens, 1, tokens, 4, checkpointing)[0]
    assert term.name == "attention layouts"
    expected = 0 if checkpointing else tokens * step.layers * step.heads * step.head_dim * 4
    assert sharded - plain == expected
    assert term.bytes == tokens * (1 if checkpointing else step.layers) * 4 * 16 * 4
