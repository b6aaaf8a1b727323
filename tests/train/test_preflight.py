"""The checks before any compute (cod_fast/train/preflight.py) and the `train` command's refusals.

Every refusal is driven through the CLI with the Trainer replaced by one that fails the test if
it is built: a value refused only once the Trainer exists was refused after compute began.
"""

from __future__ import annotations

import random
import time
import types

import pytest
import torch
from typer.testing import CliRunner

import cod_fast.train.trainer
from cod_fast.cli.app import app
from cod_fast.config import ConfigError, ModelConfig
from cod_fast.config.io import load_config
from cod_fast.envs import make_env
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.model.loading import ModelFolderError, gib, load_policy
from cod_fast.model.tokenizer import CHATML, char_tokenizer, load_saved_tokenizer
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings
from cod_fast.rollout.scripted import demonstrations
from cod_fast.run.vocab import environment_tokenizer
from cod_fast.train.preflight import preflight
from tests.config.test_config import billion_laughs
from tests.rollout_helpers import save_tiny_qwen3

runner = CliRunner()
CHAR = "model.tokenizer=char"
"""The character tokenizer: exact prompt lengths without training a bpe vocabulary (~1 s)."""


@pytest.fixture(autouse=True)
def one_cpu_process(monkeypatch, tmp_path):
    """One process without CUDA, in a fresh folder (relative paths and the default run_dir land
    there): what is refused does not depend on the machine or its environment."""
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)


def fake_cuda(monkeypatch, memory: int = 80 * 2**30) -> None:
    """A CUDA device of `memory` bytes, for the checks that only read its presence and size."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    properties = types.SimpleNamespace(total_memory=memory)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)


@pytest.fixture
def built(monkeypatch) -> list:
    """The configs the `train` command built a Trainer from (the stand-in then fails the run)."""
    configs: list = []

    def trainer(cfg, *args, **kwargs):
        configs.append(cfg)
        raise AssertionError("the Trainer was built: the refusal came after compute began")

    monkeypatch.setattr(cod_fast.train.trainer, "Trainer", trainer)
    return configs


def _refused(built: list, field: str, *args: str) -> str:
    """Run `train` with `args`; it must exit 2 with one `error:` line naming `field`, and never
    build the Trainer. Returns that line."""
    result = runner.invoke(app, ["train", "--set", CHAR, *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {field}: "), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert not built
    return result.stderr


def _first_prompt_tokens(cfg, split: str = "train", strategy: str = "cod") -> int:
    """The first solve prompt of the run's first pack, as the rollout driver itself builds it
    (a scripted demonstration of that pack), in the character tokenizer."""
    rollout = cfg.rollout
    env = make_env(rollout.env, rollout.env_setting, rollout.env_size)
    packs = make_packs(pack_seeds(split, 1, cfg.train.seed), rollout.tasks_per_pack, strategy)
    chat = ChatFormat(char_tokenizer(CHATML))
    first = demonstrations(env, chat, DriverSettings.from_config(cfg), packs)[0]
    return len(first.episodes[0].turns[0].prompt_ids)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("train.lr=.inf", "train.lr"),
        ("rollout.env_timeout_s=.inf", "rollout.env_timeout_s"),
        ("rollout.env_error_reward=.nan", "rollout.env_error_reward"),
    ],
)
def test_train_refuses_inf_and_nan(built, override, field):
    """An infinite learning rate or timeout, or a NaN error reward, is refused by the config."""
    assert "a finite number" in _refused(built, field, "--set", override)


@pytest.mark.parametrize("run_dir", ["''", "' '"])
def test_train_refuses_an_empty_run_dir(built, run_dir):
    """An empty run_dir would put the run's files into the current folder."""
    _refused(built, "runtime.run_dir", "--set", f"runtime.run_dir={run_dir}")


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_train_refuses_float16_on_the_cpu(built, device):
    """float16 on the CPU, asked for (device=cpu, the config) or landed on (device=auto without
    CUDA, the preflight), is refused naming float32."""
    sets = ["--set", "model.dtype=float16", "--set", f"runtime.device={device}"]
    message = _refused(built, "model.dtype", *sets)
    assert f"runtime.device='{device}'" in message and "'float32'" in message


def test_float16_training_breaks_on_the_cpu_and_bfloat16_does_not():
    """Why float16 is refused on the CPU: after one AdamW step the tiny model's float16 weights
    hold NaN (AdamW's eps and small squared gradients underflow to 0), while bfloat16's stay
    finite. If torch ever makes float16 train here, this fails and the refusal can go."""
    finite = {}
    for dtype in ("float16", "bfloat16"):
        sizes = {"hidden_size": 32, "num_heads": 2, "num_layers": 1, "intermediate_size": 64}
        model, tokenizer = load_policy(ModelConfig(dtype=dtype, **sizes), "cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, len(tokenizer), (1, 48), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        finite[dtype] = all(bool(p.isfinite().all()) for p in model.parameters())
    assert finite == {"float16": False, "bfloat16": True}


def test_train_refuses_cuda_where_there_is_none(built):
    """runtime.device=cuda on a machine without CUDA is refused before the Trainer."""
    _refused(built, "runtime.device", "--set", "runtime.device=cuda")


@pytest.mark.parametrize("attn_impl", ["flash_attn", "varlen_attn"])
def test_train_refuses_a_cuda_varlen_kernel_with_a_float32_model(built, monkeypatch, attn_impl):
    """flash-attn's and torch's varlen kernels take float16/bfloat16 only: an explicit one with
    model.dtype=float32 on CUDA is refused before the Trainer, naming both ways out; `auto`
    passes (it picks the per-sequence kernel, which takes float32), as does bfloat16."""
    fake_cuda(monkeypatch)
    sets = ["runtime.device=cuda", "model.dtype=float32", f"model.attn_impl={attn_impl}"]
    message = _refused(built, "model.attn_impl", *(x for s in sets for x in ("--set", s)))
    assert "model.dtype=bfloat16" in message and "model.attn_impl=sdpa" in message
    preflight(load_config(overrides=[CHAR, *sets[:2], "model.attn_impl=auto"]))
    varlen = [sets[0], "model.dtype=bfloat16", "model.attn_impl=varlen_attn"]
    preflight(load_config(overrides=[CHAR, *varlen]))


@pytest.mark.parametrize(("world_size", "replicate"), [(None, 2), ("4", 3), ("6", 4)])
def test_train_refuses_hsdp_replicate_that_does_not_divide_the_world_size(
    built, monkeypatch, world_size, replicate
):
    """hsdp_replicate must divide WORLD_SIZE (one process: 1), as the mesh needs; one process
    used to ignore it silently."""
    if world_size is not None:
        monkeypatch.setenv("WORLD_SIZE", world_size)
        monkeypatch.setenv("RANK", "0")
    message = _refused(
        built, "runtime.hsdp_replicate", "--set", f"runtime.hsdp_replicate={replicate}"
    )
    assert f"got {replicate}, which does not divide the world size {world_size or 1}" in message


def test_train_refuses_a_world_size_that_is_not_a_number(built, monkeypatch):
    """A WORLD_SIZE that is not an integer is named, not a ValueError traceback."""
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert "'two'" in _refused(built, "WORLD_SIZE")


def test_train_refuses_a_billion_eval_packs_in_under_a_second(built):
    """rollout.eval_packs=10**9 built a billion-seed list and ran out of memory a minute into
    the run; the config's bound refuses it at once, in one line naming the bound."""
    started = time.perf_counter()
    message = _refused(built, "rollout.eval_packs", "--set", "rollout.eval_packs=1000000000")
    assert time.perf_counter() - started < 1.0
    assert "got 1000000000; expected at most 100000" in message


def test_built_in_model_sizes_beyond_this_machine_are_refused_before_any_weights(built):
    """Built-in model sizes each within its bound whose weights could not fit in all of this
    machine's memory (7.04e13 parameters, 256 TiB in float32: a tied 512-token embedding and 4
    square attention and 3 MLP matrices a layer) are refused by the preflight with the estimate
    and the fields to lower, and by load_policy before it allocates."""
    sizes = {"hidden_size": 2**16, "num_layers": 2**10, "intermediate_size": 2**18}
    sets = [x for name, value in sizes.items() for x in ("--set", f"model.{name}={value}")]
    message = _refused(built, "model", *sets)
    hidden, mlp = sizes["hidden_size"], sizes["intermediate_size"]
    count = 512 * hidden + sizes["num_layers"] * (4 * hidden * hidden + 3 * hidden * mlp)
    assert f"builtin:tiny-qwen3: about {count:.3g} parameters" in message
    assert f"take {gib(4 * count)} in float32" in message
    assert "lower model.hidden_size, model.intermediate_size or model.num_layers" in message
    with pytest.raises(ModelFolderError, match="more than all"):
        load_policy(ModelConfig(**sizes))


BUILTIN_KV_BYTES = 3 * 2 * 4 * 24 * 4
"""Bytes of KV cache per token of the default built-in model in float32: 3 layers x (keys,
values) x 4 KV heads x head size 96 / 4 x 4 bytes, the shape cod_fast.rollout.fast_decode's
`start` allocates per row and token."""


@pytest.mark.parametrize(
    ("sets", "field", "rows", "response"),
    [
        (
            ["rollout.packs_per_step=4096", "rollout.group_size=1024"],
            "rollout.packs_per_step",
            4096 * 1024,
            2048,
        ),
        (
            ["rollout.eval_packs=100000", "train.steps=0", "train.warm_start_steps=0"],
            "rollout.eval_packs",
            100_000,
            2**17,
        ),
    ],
    ids=["rollout", "evaluation"],
)
def test_train_refuses_a_sampler_batch_whose_kv_cache_cannot_fit(
    built, sets, field, rows, response
):
    """Each field within its bound, their product beyond any machine: one rollout batch of
    4096 packs x 1024 members with 2048-token responses, or one evaluation of 100000 packs
    with 2^17-token responses, needs over 18 TiB of KV cache in the torch sampler (every live
    episode decodes in one batch). Refused before the Trainer with the estimate (rows x tokens
    x bytes a token) and the fix."""
    caps = [f"rollout.max_response_tokens={response}"]
    sets = [*sets, *caps]
    tokens = 1 + response
    message = _refused(built, field, *(x for s in sets for x in ("--set", s)))
    assert f"{rows} sequences in one sampler batch, each of at least {tokens} tokens" in message
    assert f"need {gib(rows * tokens * BUILTIN_KV_BYTES)} of KV cache" in message
    assert f"; lower {field}" in message


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("garbage", "unknown kernel implementation 'garbage': expected one of triton, cpp, torch"),
        ("triton", "kernel implementation 'triton' is not usable here: no CUDA device"),
    ],
)
def test_train_refuses_a_kernel_impl_variable_that_cannot_run(built, monkeypatch, value, problem):
    """COD_FAST_IMPL naming no implementation, or Triton without CUDA (and without
    TRITON_INTERPRET=1), is refused before the Trainer with the variable, its value, what is
    allowed and the fix; the run used to meet it at its first training step, after the start
    evaluation (the second as a traceback)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("COD_FAST_IMPL", value)
    message = _refused(built, "COD_FAST_IMPL")
    assert problem in message and "; unset it (the best available" in message


def test_train_refuses_runtime_kernel_impl_triton_without_cuda(built, monkeypatch):
    """runtime.kernel_impl=triton on a machine without CUDA is refused before the Trainer by
    the same rule (cod_fast.ops.dispatch.impl_problem), naming the field and the fix."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    message = _refused(built, "runtime.kernel_impl", "--set", "runtime.kernel_impl=triton")
    assert "'triton' is not usable here: no CUDA device" in message
    assert "; set runtime.kernel_impl to auto or " in message


def test_kernel_impls_that_can_run_pass_the_preflight(monkeypatch):
    """What the dispatcher runs passes: COD_FAST_IMPL=torch, an empty COD_FAST_IMPL (unset, as
    the dispatcher reads it), and Triton under TRITON_INTERPRET=1 (its CPU interpreter)."""
    cfg = load_config(overrides=[CHAR, "train.steps=0", "train.warm_start_steps=0"])
    for value in ("torch", ""):
        monkeypatch.setenv("COD_FAST_IMPL", value)
        preflight(cfg)
    monkeypatch.setenv("COD_FAST_IMPL", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    preflight(cfg)
    preflight(load_config(overrides=[CHAR, "train.steps=0", "runtime.kernel_impl=triton"]))


def test_train_refuses_a_local_rank_that_is_not_a_number(built, monkeypatch):
    """Under torchrun (WORLD_SIZE > 1) LOCAL_RANK picks each rank's device: one that is not an
    integer is named, not a ValueError traceback from the process group's setup."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "first")
    assert "'first'" in _refused(built, "LOCAL_RANK")


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("/nonexistent-cod-fast/model", "no such folder"),
        ("./missing-model", "no such folder"),
        ("models/qwen/v1", "no such folder"),
        ("weights.bin", "a file"),
        ("empty-folder", "a folder without config.json"),
        ("~/models/qwen", "does not expand ~"),
        ("builtin:tiny-llama", "the built-in model is 'builtin:tiny-qwen3'"),
    ],
)
def test_train_refuses_a_model_path_that_is_not_a_model_folder(built, tmp_path, name, problem):
    """A name meant as a local path (absolute, ./, more parts than owner/name, or existing here)
    must be a folder with a config.json; the line names the path."""
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    (tmp_path / "empty-folder").mkdir()
    message = _refused(built, "model.name_or_path", "--set", f"model.name_or_path={name}")
    assert name in message and problem in message


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (random.Random(1).randbytes(400) + b"\x00" * 4, "not a UTF-8 text file"),
        (b"train:\n  steps: 3\x00\n", "not YAML text"),
    ],
)
def test_train_refuses_a_binary_config_file(built, tmp_path, data, problem):
    """A binary file (undecodable bytes, NUL) is one line naming the file, no traceback."""
    path = tmp_path / "run.yaml"
    path.write_bytes(data)
    assert problem in _refused(built, str(path), "--config", str(path))


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("train: [1, 2\n", "line 2"),
        ("train:\n\tsteps: 1\n", "line 2"),
        ("a: b: c\n", "line 1"),
        ("train: " + "[" * 1000, "nested too deeply"),  # was a RecursionError traceback
    ],
)
def test_train_refuses_malformed_yaml(built, tmp_path, text, problem):
    """Malformed YAML is one line naming the file, the problem and where."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    message = _refused(built, str(path), "--config", str(path))
    assert "malformed YAML" in message and problem in message


def test_train_refuses_a_yaml_alias_bomb_in_a_short_message(built, tmp_path):
    """Nested aliases are refused at the first anchor: a short line, nothing expanded."""
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs(6))  # 9 levels: gigabytes, were aliases expanded
    message = _refused(built, str(path), "--config", str(path))
    assert len(message) < 500 and "anchors and aliases" in message


def test_train_refuses_a_token_budget_below_one_sequence(built):
    """A budget below the first prompt plus the response cap fails at the first packing; it is
    refused before compute, naming the bound and the two fixes."""
    cfg = load_config(overrides=[CHAR])
    floor = _first_prompt_tokens(cfg) + cfg.rollout.max_response_tokens
    message = _refused(built, "train.token_budget", "--set", "train.token_budget=30")
    assert f"set train.token_budget >= {floor}, or lower rollout.max_response_tokens" in message


@pytest.mark.parametrize(
    ("overrides", "split", "response"),
    [
        ([], "train", 24),  # RL: a response may run to the cap
        (["rollout.strategy=ralph_full"], "train", 24),
        (["train.steps=0"], "warm", 1),  # demonstrations only: scripted, maybe short
    ],
)
def test_token_budget_floor_is_the_drivers_first_prompt_plus_a_response(
    tmp_path, overrides, split, response
):
    """The preflight's bound is exact at the edge: the first prompt of the first pack the run
    trains on, as the driver builds it, plus the cap (RL) or one token (warm start only)."""
    cfg = load_config(overrides=[CHAR, *overrides])
    strategy = cfg.rollout.strategy if split == "train" else "cod"
    floor = _first_prompt_tokens(cfg, split, strategy) + response
    preflight(load_config(overrides=[CHAR, *overrides, f"train.token_budget={floor}"]))
    with pytest.raises(ConfigError, match=rf"^train\.token_budget: got {floor - 1}, "):
        preflight(load_config(overrides=[CHAR, *overrides, f"train.token_budget={floor - 1}"]))


def test_preflight_passes_configs_that_work(tmp_path, monkeypatch):
    """What the checks must not refuse: the default run, a run that trains nothing with a
    budget of 1, a hub id (not checkable offline), a model folder, float16 where CUDA is, and
    HSDP that divides the world size (on a rank other than the main one)."""
    folder = save_tiny_qwen3(tmp_path / "my-model", char_tokenizer(CHATML))
    for overrides in (
        [],
        ["train.steps=0", "train.warm_start_steps=0", "train.token_budget=1"],
        ["model.name_or_path=Qwen/Qwen3-1.7B"],
        [f"model.name_or_path={folder}"],
        ["model.name_or_path=./my-model"],
    ):
        preflight(load_config("tiny-cpu", overrides=[CHAR, *overrides]))
    fake_cuda(monkeypatch)
    preflight(load_config(overrides=[CHAR, "runtime.device=auto", "model.dtype=float16"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    preflight(load_config(overrides=[CHAR, "runtime.hsdp_replicate=2"]))


@pytest.mark.slow
def test_bpe_tokenizer_of_the_preflight_is_kept_where_the_run_finds_it(tmp_path):
    """With the default bpe tokenizer the preflight trains the run's vocabulary once and saves it
    in the run folder (what the run itself would do first), so the run loads it from there."""
    cfg = load_config(overrides=[f"runtime.run_dir={tmp_path / 'run'}"])
    preflight(cfg)
    saved = tmp_path / "run" / "tokenizer"
    assert saved.is_dir()
    env = make_env(cfg.rollout.env, cfg.rollout.env_setting, cfg.rollout.env_size)
    fresh = environment_tokenizer(
        env, DriverSettings.from_config(cfg), cfg.model.vocab_size, cfg.train.seed
    )
    assert load_saved_tokenizer(saved).get_vocab() == fresh.get_vocab()


def torchrun(monkeypatch, world_size: int) -> None:
    """The main rank of `world_size` processes under torchrun (its variables, no process)."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")


@pytest.mark.parametrize(
    ("world_size", "sets", "said"),
    [
        (3, ["train.sequence_parallel=2"], "got 2, which does not divide the 3 trainer rank(s)"),
        (
            4,
            ["train.sequence_parallel=2", "runtime.rollout_ranks=1"],
            "got 2, which does not divide the 3 trainer rank(s)",
        ),
        (
            4,
            ["train.sequence_parallel=4", "runtime.hsdp_replicate=2"],
            "4 trainer rank(s) in replicas of 2 (runtime.hsdp_replicate)",
        ),
        (
            8,
            ["train.sequence_parallel=8"],
            "got 8, which does not divide the 4 attention heads of builtin:tiny-qwen3",
        ),
        (
            16,
            # the tiny-cpu preset: a config naming its model alone starts from a GPU preset
            ["train.sequence_parallel=16", "model.name_or_path=Qwen/Qwen3-14B", "tiny-cpu"],
            "does not divide the 40 attention heads of Qwen/Qwen3-14B",
        ),
    ],
    ids=["world", "rollout-ranks", "hsdp", "heads", "hub-id-heads"],
)
def test_train_refuses_a_sequence_parallel_degree_that_does_not_divide(
    built, monkeypatch, world_size, sets, said
):
    """train.sequence_parallel must divide the trainer ranks (the world less the rollout
    workers, within each HSDP replica) and the model's attention heads (the built-in model's 4,
    a known hub id's 40), which the run met only as it made its groups or at its first forward;
    refused before the Trainer, naming what it must divide and the degrees that work."""
    torchrun(monkeypatch, world_size)
    args = [x for s in sets for x in (("--set", s) if "=" in s else ("--preset", s))]
    message = _refused(built, "train.sequence_parallel", *args)
    assert said in message
    if "heads" in said:
        works = "2, 4" if world_size == 8 else "2, 4, 8"  # divisors of gcd(heads, ranks)
        assert f"set it to {works} (divisors of the heads and of the {world_size}" in message


def test_sequence_parallel_degrees_that_divide_pass_the_preflight(monkeypatch):
    """2 and 4 over the built-in model's 4 heads on 4 ranks, and 2 per HSDP replica of 2."""
    torchrun(monkeypatch, 4)
    monkeypatch.setenv("RANK", "1")  # the token-budget check (main rank only) is tested below
    for sets in (["train.sequence_parallel=2"], ["train.sequence_parallel=4"]):
        preflight(load_config(overrides=[CHAR, *sets]))
    preflight(
        load_config(overrides=[CHAR, "train.sequence_parallel=2", "runtime.hsdp_replicate=2"])
    )


def test_token_budget_bound_is_one_sequence_over_the_sequence_parallel_group(built, monkeypatch):
    """With train.sequence_parallel=2 a micro-batch holds twice train.token_budget: a sequence
    longer than the budget but within twice it passes; one longer than twice it is refused,
    naming both keys and the value each needs."""
    cfg = load_config(overrides=[CHAR])
    floor = _first_prompt_tokens(cfg) + cfg.rollout.max_response_tokens
    half = -(-floor // 2)
    assert half < floor
    torchrun(monkeypatch, 2)
    preflight(
        load_config(overrides=[CHAR, "train.sequence_parallel=2", f"train.token_budget={half}"])
    )
    message = _refused(
        built,
        "train.token_budget",
        *("--set", "train.sequence_parallel=2", "--set", f"train.token_budget={half - 1}"),
    )
    assert (
        f"got {half - 1} with train.sequence_parallel=2: micro-batches of {2 * half - 2}" in message
    )
    assert f"= {floor} tokens); raise train.token_budget to >= {half} or " in message
    assert f"train.sequence_parallel to >= {-(-floor // (half - 1))}" in message
