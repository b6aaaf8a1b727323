"""The config tree: presets, validation messages, overrides and YAML files (cod_fast/config/)."""

from __future__ import annotations

import dataclasses
import math
import random
import time
import typing

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

import cod_fast.config.io
from cod_fast.config import (
    AlgoConfig,
    Config,
    ConfigError,
    LossConfig,
    ModelConfig,
    RolloutConfig,
    RuntimeConfig,
    TrainConfig,
)
from cod_fast.config.io import apply_overrides, dump_yaml, from_dict, load_config, to_dict
from cod_fast.config.presets import DEFAULT_PRESET, PRESETS
from cod_fast.run.validate import validate
from tests.special_files import DEV_ZERO, lonely_fifo


def _error(overrides: list[str]) -> str:
    """The one line a config's own checks or its check against the world (an environment name
    that names nothing) give, as the CLI shows it."""
    with pytest.raises(ConfigError) as info:
        validate(load_config(overrides=overrides), folders=False)
    return str(info.value)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trips_through_dict_and_yaml(name):
    """Every preset builds, and to_dict -> from_dict and dump_yaml -> safe_load -> from_dict give it back."""
    cfg = PRESETS[name]()
    assert isinstance(cfg, Config)
    assert from_dict(Config, to_dict(cfg)) == cfg
    assert from_dict(Config, yaml.safe_load(dump_yaml(cfg))) == cfg


def test_default_preset_is_tiny_cpu_and_load_config_uses_it():
    """load_config() with no arguments is the DEFAULT_PRESET, the CPU CoD run."""
    assert DEFAULT_PRESET == "tiny-cpu"
    cfg = load_config()
    assert cfg == PRESETS["tiny-cpu"]()
    assert (cfg.runtime.device, cfg.algo.algorithm, cfg.algo.loss.policy) == (
        "cpu",
        "cod",
        "rec_one_side",
    )


def test_task_by_task_preset_differs_from_tiny_cpu_only_in_the_algorithm():
    """tiny-cpu-tbt is tiny-cpu with task_by_task, plain ppo and no re-weighting."""
    cod, tbt = PRESETS["tiny-cpu"](), PRESETS["tiny-cpu-tbt"]()
    assert (tbt.algo.algorithm, tbt.algo.use_red_weight, tbt.algo.loss.policy) == (
        "task_by_task",
        False,
        "ppo",
    )
    assert (tbt.model, tbt.rollout, tbt.train) == (cod.model, cod.rollout, cod.train)


@pytest.mark.parametrize(
    ("overrides", "must_mention"),
    [
        # Literal membership, with the allowed values listed.
        (["algo.loss.policy=grpo"], ["algo.loss.policy", "'grpo'", "'rec_one_side'", "'opd'"]),
        (["algo.loss.kl=k4"], ["algo.loss.kl", "'k4'", "'k3'", "null"]),
        (["rollout.env=chess"], ["rollout.env", "'frozenlake'", "'grid_nav'"]),
        # Ranges.
        (["algo.loss.eps_low=1.0"], ["algo.loss.eps_low", "1.0", "[0, 1)"]),
        (["algo.loss.eps_high=-0.1"], ["algo.loss.eps_high", ">= 0"]),
        (["rollout.temperature=0"], ["rollout.temperature", "> 0"]),
        (["algo.loss.mis_high=0.4"], ["algo.loss.mis_high", "> 0.5"]),
        (["rollout.max_response_tokens=0"], ["rollout.max_response_tokens", ">= 1"]),
        (["rollout.group_size=1"], ["rollout.group_size", ">= 2"]),
        (["rollout.top_p=0"], ["rollout.top_p", "(0, 1]"]),
        (["rollout.vllm_gpu_memory_utilization=1"], ["vllm_gpu_memory_utilization", "(0, 1)"]),
        (["model.num_heads=5"], ["model.hidden_size", "num_heads=5"]),
        (["train.lr=0"], ["train.lr", "> 0"]),
        # Finite numbers only: inf and nan fail deep in a run.
        (["train.lr=.inf"], ["train.lr", "inf", "a finite number"]),
        (["rollout.env_timeout_s=.inf"], ["rollout.env_timeout_s", "inf", "finite", "or null"]),
        (["rollout.env_error_reward=.nan"], ["rollout.env_error_reward", "nan", "finite"]),
        (["train.lr=1" + "0" * 400], ["train.lr", "a finite number", "(401 chars)"]),
        # Types: bool is not an int or a float; a string is not a number.
        (["train.steps=true"], ["train.steps", "True", "an integer"]),
        (["train.lr=false"], ["train.lr", "False", "a number"]),
        (["train.seed=abc"], ["train.seed", "'abc'", "an integer"]),
        (["algo.std_norm=1"], ["algo.std_norm", "true or false"]),
        (["algo=3"], ["algo", "AlgoConfig"]),
        # window / gamma are required by their return style, and only by it.
        (["algo.return_style=window"], ["algo.window", ">= 1"]),
        (["algo.window=3"], ["algo.window", "return_style='window'"]),
        (["algo.return_style=discounted"], ["algo.gamma", "(0, 1]"]),
        (["algo.return_style=discounted", "algo.gamma=1.5"], ["algo.gamma", "1.5", "(0, 1]"]),
        (["algo.gamma=0.9"], ["algo.gamma", "return_style='discounted'"]),
        # beta > 0 needs a KL estimator.
        (["algo.loss.beta=0.1"], ["algo.loss.kl", "beta=0.1", "set `kl`", "k3"]),
        # Cross-field: Ralph strategies need update episodes.
        (
            ["algo.algorithm=task_by_task", "rollout.strategy=ralph_sample"],
            ["rollout.strategy", "'ralph_sample'", "'cod'", "task_by_task"],
        ),
    ],
)
def test_bad_value_names_field_value_and_what_is_allowed(overrides, must_mention):
    """A rejected value raises ConfigError naming the dotted field, the value and what is allowed."""
    message = _error(overrides)
    missing = [m for m in must_mention if m not in message]
    assert not missing, f"{missing} not in {message!r}"
    assert "\n" not in message


def test_config_error_is_a_value_error_and_direct_construction_validates():
    """Building a config class directly runs the same checks (without a dotted prefix)."""
    with pytest.raises(ValueError, match=r"^eps_low: got -0\.1"):
        LossConfig(eps_low=-0.1)
    with pytest.raises(ConfigError, match=r"^loss: .*LossConfig"):
        AlgoConfig(loss={"eps_low": 0.1})  # type: ignore[arg-type]


def test_int_is_accepted_and_stored_as_float_for_float_fields():
    """An int for a float field becomes a float; an int field keeps its int."""
    loss = LossConfig(eps_high=1, beta=0)
    assert loss.eps_high == 1.0 and type(loss.eps_high) is float and type(loss.beta) is float
    assert type(LossConfig(max_response_len=7).max_response_len) is int


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_eps_low_accepted_exactly_in_its_range(eps_low):
    """LossConfig accepts eps_low exactly when 0 <= eps_low < 1 (NaN and inf included)."""
    try:
        LossConfig(eps_low=eps_low)
        accepted = True
    except ConfigError:
        accepted = False
    assert accepted == (0 <= eps_low < 1)


def test_window_and_discounted_styles_accept_their_parameter():
    """return_style window / discounted are valid once window / gamma is set (gamma = 1 allowed)."""
    assert load_config(overrides=["algo.return_style=window", "algo.window=2"]).algo.window == 2
    cfg = load_config(overrides=["algo.return_style=discounted", "algo.gamma=1"])
    assert cfg.algo.gamma == 1.0


def test_from_dict_unknown_key_names_dotted_key_and_lists_allowed_keys():
    """from_dict rejects an unknown key with its dotted path and the keys allowed at that level."""
    with pytest.raises(ConfigError) as info:
        from_dict(Config, {"algo": {"loss": {"epsilon": 0.1}}})
    message = str(info.value)
    assert message.startswith("algo.loss.epsilon: unknown key")
    assert "eps_low" in message and "opd_coef" in message


def test_from_dict_partial_mapping_keeps_defaults():
    """A partial nested mapping fills only what it names; everything else keeps its default."""
    cfg = from_dict(Config, {"algo": {"loss": {"eps_high": 0.3}}, "train": {"steps": 3}})
    assert cfg.algo.loss.eps_high == 0.3 and cfg.train.steps == 3
    assert dataclasses.replace(cfg.algo.loss, eps_high=0.2) == LossConfig()


def test_overrides_parse_yaml_scalars_and_nested_sections():
    """Override values are YAML: null, ints, floats (also 1e-5), bools, strings and mappings."""
    base = load_config()
    cfg = apply_overrides(
        base,
        [
            "algo.loss.kl=k3",
            "algo.loss.beta=0.05",
            "train.steps=7",
            "train.lr=1e-5",
            "algo.std_norm=true",
            "algo.loss={eps_low: 0.1, agg: seq-mean-token-sum-norm}",
            "runtime.run_dir='123'",
        ],
    )
    assert (cfg.algo.loss.kl, cfg.algo.loss.beta) == ("k3", 0.05)
    assert cfg.train.steps == 7 and type(cfg.train.steps) is int
    assert cfg.train.lr == 1e-5 and type(cfg.train.lr) is float
    assert cfg.algo.std_norm is True
    assert (cfg.algo.loss.eps_low, cfg.algo.loss.agg) == (0.1, "seq-mean-token-sum-norm")
    assert cfg.algo.loss.eps_high == base.algo.loss.eps_high  # a mapping merges, not replaces
    assert cfg.runtime.run_dir == "123"
    assert apply_overrides(cfg, ["algo.loss.beta=0", "algo.loss.kl=null"]).algo.loss.kl is None
    assert base == load_config(), "apply_overrides must not mutate its input"


@pytest.mark.parametrize(
    ("override", "must_mention"),
    [
        ("algo.loss.epsilon=0.1", ["algo.loss.epsilon", "unknown key", "eps_low", "opd_coef"]),
        ("trian.steps=1", ["trian", "unknown key", "train", "runtime"]),
        ("train.lr.x=1", ["train.lr.x", "train.lr", "not a section"]),
        ("algo.loss.kl", ["algo.loss.kl", "missing '='", "a.b.c=value"]),
        ("algo.loss.kl=[k3", ["algo.loss.kl", "malformed YAML"]),
    ],
)
def test_bad_override_names_the_path_and_the_expected_form(override, must_mention):
    """An unknown path, a missing '=' or an unparsable value is a ConfigError saying which and why."""
    message = _error([override])
    missing = [m for m in must_mention if m not in message]
    assert not missing, f"{missing} not in {message!r}"


def test_yaml_file_is_deep_merged_over_the_preset_and_overrides_win(tmp_path):
    """A YAML file changes only the fields it names; --set overrides are applied after it."""
    path = tmp_path / "run.yaml"
    path.write_text("algo:\n  loss:\n    eps_high: 0.3\ntrain:\n  steps: 5\n  lr: 1e-4\n")
    cfg = load_config(path=str(path), overrides=["train.steps=6"])
    expected = PRESETS[DEFAULT_PRESET]()
    expected.algo.loss.eps_high, expected.train.steps, expected.train.lr = 0.3, 6, 1e-4
    assert cfg == expected


def test_yaml_file_preset_key_is_used_unless_the_argument_names_one(tmp_path):
    """A top-level `preset:` in the file picks the preset; an explicit preset argument wins."""
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny-cpu-tbt\ntrain:\n  steps: 4\n")
    from_file = load_config(path=str(path))
    assert from_file.algo.algorithm == "task_by_task" and from_file.train.steps == 4
    from_argument = load_config(preset="qwen3-1.7b", path=str(path))
    assert from_argument.model.name_or_path == "Qwen/Qwen3-1.7B"
    assert from_argument.train.steps == 4


def test_dumped_yaml_loads_back_as_a_config_file(tmp_path):
    """dump_yaml writes a file that load_config reads back to the same config, odd strings included."""
    cfg = load_config(preset="qwen3-1.7b", overrides=["runtime.run_dir='1e5'", "train.lr=3e-7"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(path=str(path)) == cfg


@pytest.mark.parametrize(
    ("text", "must_mention"),
    [
        ("algo: [1, 2\n", ["malformed YAML", "line"]),
        ("- 1\n- 2\n", ["mapping", "list"]),
        ("algo:\n  lossy: {}\n", ["algo.lossy", "unknown key", "loss"]),
        ("algo:\n  loss:\n    eps_low: 2\n", ["algo.loss.eps_low", "[0, 1)"]),
    ],
)
def test_bad_yaml_file_error_names_the_file_and_the_problem(tmp_path, text, must_mention):
    """Malformed YAML, a non-mapping or a bad field in a file is a ConfigError naming the file."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path=str(path))
    message = str(info.value)
    missing = [m for m in [str(path), *must_mention] if m not in message]
    assert not missing, f"{missing} not in {message!r}"


def test_missing_file_and_unknown_preset_are_config_errors(tmp_path):
    """A missing file names the file; an unknown preset lists the presets there are."""
    with pytest.raises(ConfigError, match=r"nope\.yaml"):
        load_config(path=str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError) as info:
        load_config(preset="huge-gpu")
    assert all(name in str(info.value) for name in ["'huge-gpu'", *PRESETS])


def test_red_weight_defaults_by_algorithm_and_shows_its_effective_value():
    """RED-weight left null is on for CoD and off for task-by-task (plain GRPO, docs/concepts.md 3),
    an explicit value wins, and the YAML shows the effective value and reads back equal."""
    cod = load_config("tiny-cpu")
    tbt = load_config("tiny-cpu", overrides=["algo.algorithm=task_by_task"])
    forced = load_config(
        "tiny-cpu", overrides=["algo.algorithm=task_by_task", "algo.red_weight=true"]
    )
    assert (cod.algo.use_red_weight, tbt.algo.use_red_weight, forced.algo.use_red_weight) == (
        True,
        False,
        True,
    )
    assert "red_weight: null  # effective: false" in dump_yaml(tbt)
    assert "red_weight: null  # effective: true" in dump_yaml(cod)
    assert "red_weight: true\n" in dump_yaml(forced)
    for cfg in (cod, tbt, forced):
        assert from_dict(Config, yaml.safe_load(dump_yaml(cfg))) == cfg


def test_opd_and_teachers_come_together():
    """`opd` without teachers, teachers without `opd`, an environment without a teacher, a
    teacher for an environment the run does not roll out, and an empty path are each refused
    naming algo.teachers; a teacher per environment passes and round-trips through YAML."""
    assert "got none with algo.loss.policy='opd'" in _error(["algo.loss.policy=opd"])
    assert "expected algo.loss.policy='opd'" in _error(["algo.teachers={frozenlake: t}"])
    mixed = ["rollout.env=null", "rollout.envs=[{name: frozenlake}, {name: terminal}]"]
    opd = [*mixed, "algo.loss.policy=opd"]
    assert "no teacher for terminal" in _error([*opd, "algo.teachers={frozenlake: a}"])
    unused = _error(["algo.loss.policy=opd", "algo.teachers={frozenlake: a, alchemy: b}"])
    assert "teachers for alchemy, which the run does not roll out" in unused
    assert "empty path for terminal" in _error(
        [*opd, "algo.teachers={frozenlake: a, terminal: ' '}"]
    )
    cfg = load_config(overrides=[*opd, "algo.teachers={frozenlake: a, terminal: b}"])
    assert cfg.algo.teachers == {"frozenlake": "a", "terminal": "b"}
    assert from_dict(Config, yaml.safe_load(dump_yaml(cfg))) == cfg
    assert LossConfig(policy="opd").policy == "opd"  # the loss alone (library use) builds


def test_mixed_environments_resolve_and_validate():
    """`rollout.envs` lists several environments (size and setting default to the rollout's),
    a single `env` is a one-item list, and each mistake names its field: `env` and `envs` both
    set, neither, an entry without a name, a repeated name, a weight <= 0, an unknown key."""
    single = load_config()
    assert [(e.name, e.weight, e.size, e.setting) for e in single.rollout.environments] == [
        ("frozenlake", 1.0, "tiny", "train")
    ]
    cfg = load_config(
        overrides=[
            "rollout.env=null",
            "rollout.envs=[{name: terminal, weight: 3}, {name: alchemy, size: full}]",
        ]
    )
    assert [(e.name, e.weight, e.size) for e in cfg.rollout.environments] == [
        ("terminal", 3.0, "tiny"),
        ("alchemy", 1.0, "full"),
    ]
    assert from_dict(Config, yaml.safe_load(dump_yaml(cfg))) == cfg
    assert "rollout.env: got 'frozenlake'; expected null" in _error(
        ["rollout.envs=[{name: terminal}]"]
    )
    assert "rollout.env: got None" in _error(["rollout.env=null"])
    off = ["rollout.env=null"]
    assert "rollout.envs[1].name: got None" in _error(
        [*off, "rollout.envs=[{name: terminal}, {weight: 2}]"]
    )
    assert "repeated: ['pde']" in _error([*off, "rollout.envs=[{name: pde}, {name: pde}]"])
    assert "rollout.envs[0].weight: got 0" in _error(
        [*off, "rollout.envs=[{name: pde, weight: 0}]"]
    )
    assert "rollout.envs[0].colour: unknown key" in _error(
        [*off, "rollout.envs=[{name: pde, colour: 1}]"]
    )
    assert "expected a list of" in _error([*off, "rollout.envs=pde"])


def test_the_loss_takes_its_temperature_and_response_limit_from_the_rollout():
    """One temperature and one response limit per run: the loss's copies follow the rollout
    keys in every preset and after overrides, and are no keys of the run's YAML."""
    cfg = load_config(overrides=["rollout.max_response_tokens=64", "rollout.temperature=0.7"])
    assert (cfg.algo.loss.max_response_len, cfg.algo.loss.temperature) == (64, 0.7)
    for name in PRESETS:
        c = load_config(name)
        assert c.algo.loss.max_response_len == c.rollout.max_response_tokens, name
        assert c.algo.loss.temperature == c.rollout.temperature, name
    loss_yaml = dump_yaml(cfg).split("\n  loss:\n")[1].split("\ntrain:")[0]
    assert "temperature" not in loss_yaml and "max_response_len" not in loss_yaml
    assert from_dict(Config, yaml.safe_load(dump_yaml(cfg))) == cfg


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [
        ("algo.loss.temperature", "rollout.temperature", 0.6),
        ("algo.loss.max_response_len", "rollout.max_response_tokens", 40),
    ],
)
def test_deprecated_loss_keys_set_the_rollout_keys_with_a_warning(old, new, value, tmp_path):
    """The loss keys the rollout keys replaced still work for one release, as `--set` and in a
    file, each with a FutureWarning naming the new key; a file giving both, differently, is
    refused naming both."""
    with pytest.warns(FutureWarning, match=f"{old} is deprecated.*write {new}"):
        cfg = load_config(overrides=[f"{old}={value}"])
    assert _value(cfg, new) == value
    section, key = old.split(".")[1:]
    path = tmp_path / "old.yaml"
    path.write_text(f"algo:\n  {section}:\n    {key}: {value}\n")
    with pytest.warns(FutureWarning, match=f"{old} \\(in {path}\\) is deprecated"):
        assert _value(load_config(path=str(path)), new) == value
    rollout_key = new.split(".")[1]
    path.write_text(f"algo:\n  {section}:\n    {key}: {value}\nrollout:\n  {rollout_key}: 3\n")
    with (
        pytest.warns(FutureWarning),
        pytest.raises(ConfigError, match=f"{old}: got {value} and {new}=3"),
    ):
        load_config(path=str(path))


def test_top_p_below_one_is_refused_for_rl_naming_the_cause_and_the_fix():
    """rollout.top_p < 1 with RL steps is refused: the sampler's log-probs are over the nucleus,
    the trainer's over the full softmax (tests/rollout/test_vllm_engine.py measures the gap), so the
    message names the field, that cause and the fix (top_p=1, `cod-fast eval --top-p`). A
    warm-start-only run (train.steps=0) keeps its top_p, and every preset passes."""
    message = _error(["rollout.top_p=0.9", "train.steps=5"])
    for words in ("rollout.top_p", "0.9", "train.steps=5", "nucleus", "full softmax"):
        assert words in message, f"{words!r} not in {message!r}"
    assert "rollout.top_p=1" in message and "cod-fast eval --top-p" in message
    warm = load_config(overrides=["rollout.top_p=0.9", "train.steps=0"])
    assert warm.rollout.top_p == 0.9
    assert all(load_config(name).rollout.top_p == 1 for name in PRESETS)


BOUNDS = {
    "rollout.eval_packs": 100_000,
    "rollout.packs_per_step": 4096,
    "rollout.group_size": 1024,
    "rollout.tasks_per_pack": 1024,
    "rollout.max_response_tokens": 2**17,
    "rollout.max_hint_tokens": 2**17,
    "train.token_budget": 2**22,
    "train.warm_start_packs": 4096,
    "model.hidden_size": 2**16,
    "model.intermediate_size": 2**18,
    "model.num_layers": 2**10,
    "model.vocab_size": 2**20,
}
"""Every bounded size and its bound (cod_fast/config/: 64x the largest preset's or more)."""


@pytest.mark.parametrize(("field", "bound"), BOUNDS.items(), ids=BOUNDS.keys())
def test_sizes_are_bounded_far_above_any_run(field, bound):
    """A size is accepted at its bound and refused one above it with a ConfigError naming the
    field and the bound: rollout.eval_packs=10**9 used to build a billion-seed list and run out
    of memory a minute into the run."""
    assert _value(load_config(overrides=[f"{field}={bound}"]), field) == bound
    message = _error([f"{field}={bound + 1}"])
    assert message == f"{field}: got {bound + 1}; expected at most {bound} (far above any run)"


def test_the_presets_sit_far_below_every_bound():
    """The bounds leave room: every preset (the paper-scale qwen3-1.7b included) stays at a
    64th of each bound or below, so no real run meets one."""
    for name in PRESETS:
        cfg = load_config(name)
        for field, bound in BOUNDS.items():
            assert _value(cfg, field) * 64 <= bound, (name, field, _value(cfg, field))


def _value(cfg: Config, field: str):
    """The value of the dotted `field` of `cfg`."""
    node = to_dict(cfg)
    for part in field.split("."):
        node = node[part]
    return node


def _float_fields() -> list[tuple[type, str]]:
    sections = (LossConfig, ModelConfig, RolloutConfig, AlgoConfig, TrainConfig, RuntimeConfig)
    return [
        (cls, f.name)
        for cls in sections
        for f in dataclasses.fields(cls)
        if float in (hint := typing.get_type_hints(cls)[f.name], *typing.get_args(hint))
    ]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize(("cls", "name"), _float_fields())
def test_every_float_field_must_be_finite(cls, name, value):
    """No float field gives inf or nan a meaning (null lifts a limit where one can be lifted), so
    each refuses them by the base check, naming the field and the value, before its own range
    checks could let inf through or call nan out of range."""
    with pytest.raises(ConfigError) as info:
        cls(**{name: value})
    assert str(info.value).startswith(f"{name}: got {value!r}; expected a finite number")


@pytest.mark.parametrize("run_dir", ["''", "'   '"])
def test_run_dir_must_name_a_folder(run_dir):
    """An empty (or blank) runtime.run_dir would write the run into the current folder."""
    message = _error([f"runtime.run_dir={run_dir}"])
    assert message.startswith("runtime.run_dir: got") and "a folder path" in message


def test_model_name_or_path_must_not_be_empty():
    """An empty model name is neither a folder, a hub id nor the built-in model."""
    assert _error(["model.name_or_path=''"]).startswith("model.name_or_path: got ''")


def test_float16_on_the_cpu_is_refused_naming_the_fix():
    """float16 weights turn NaN at the first AdamW step on the CPU (tests/train/test_preflight.py
    measures it), so runtime.device=cpu refuses float16 and names float32; bfloat16 and float32
    pass, and so does float16 where the device is not the CPU (auto: see the preflight)."""
    message = _error(["model.dtype=float16"])  # the default preset runs on the CPU
    assert message.startswith("model.dtype: got 'float16' with runtime.device='cpu'")
    assert "'float32'" in message and "\n" not in message
    for dtype in ("bfloat16", "float32", "auto"):
        assert load_config(overrides=[f"model.dtype={dtype}"]).model.dtype == dtype
    for device in ("cuda", "auto"):
        cfg = load_config(overrides=["model.dtype=float16", f"runtime.device={device}"])
        assert cfg.model.dtype == "float16"


def billion_laughs(levels: int) -> str:
    """The classic alias bomb as the value of train.lr: 9**levels strings from a few hundred
    bytes (9 levels: 387M strings; validation once echoed the expanded value)."""
    lists = ["    - &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lists += [f"    - &l{k} [{', '.join([f'*l{k - 1}'] * 9)}]" for k in range(1, levels)]
    return "train:\n  lr:\n" + "\n".join(lists) + "\n"


def test_yaml_anchors_and_aliases_are_refused_before_they_expand(tmp_path):
    """A config file with anchors and aliases is refused at its first anchor, in one short line
    naming the file and the place: nothing is expanded, and nothing huge is echoed (6 levels is
    a 4 MB message when the value is expanded and echoed). Overrides are parsed the same way."""
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs(6))
    with pytest.raises(ConfigError) as info:
        load_config(path=str(path))
    message = str(info.value)
    assert len(message) < 500 and "\n" not in message
    assert message.startswith(f"{path}: anchors and aliases") and "line 3, column 7" in message
    assert "aliases" in _error(["train.lr=&rate 0.1"])


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (random.Random(0).randbytes(256) + b"\x00", "not a UTF-8 text file: byte 0x"),
        (b"train:\n  steps: 3\x00\x01\n", "not YAML text: unprintable character #x0000"),
    ],
)
def test_binary_config_file_is_one_line_naming_the_file(tmp_path, data, problem):
    """Random bytes (undecodable, with a NUL) or text with a NUL in it are not a config file:
    one line naming the file and what is wrong, never a UnicodeDecodeError traceback."""
    path = tmp_path / "binary.yaml"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as info:
        load_config(path=str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: {problem}") and "\n" not in message


def test_deeply_nested_yaml_is_a_config_error(tmp_path):
    """Nesting deeper than the parser's recursion is a malformed file, not a RecursionError."""
    path = tmp_path / "deep.yaml"
    path.write_text("train: " + "[" * 1000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(path=str(path))


def test_echoed_values_and_keys_are_clipped():
    """A huge value or key is echoed in at most SHOWN_CHARS characters, so the message stays one
    short line whatever the input."""
    huge = "x" * 100_000
    for overrides in ([f"algo.loss.policy={huge}"], [f"{huge}=1"], [f"algo.loss.{huge}=1"]):
        message = _error(overrides)
        assert len(message) < 500 and " chars)" in message, message[:600]
    with pytest.raises(ConfigError) as info:
        load_config(preset=huge)
    assert len(str(info.value)) < 500


def _file_error(path) -> str:
    """The one-line error of loading the config file at `path`."""
    with pytest.raises(ConfigError) as info:
        load_config(path=str(path))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_config_file_over_the_cap_is_refused_before_it_is_parsed(tmp_path):
    """A 2 MiB config file (valid YAML, which takes seconds to parse) is refused at once, in one
    short line naming the file, the cap and the fix, without being parsed or echoed."""
    path = tmp_path / "big.yaml"
    lines = [f"  k{i}: value{i}" for i in range(180_000)]
    path.write_text("rollout:\n  env_options:\n" + "\n".join(lines) + "\n")
    assert path.stat().st_size > 2 * 2**20
    started = time.monotonic()
    message = _file_error(path)
    assert time.monotonic() - started < 1.0
    assert len(message) < 300, message[:400]
    assert message.startswith(f"{path}: ") and str(cod_fast.config.io.MAX_CONFIG_BYTES) in message


def test_a_config_file_at_the_cap_is_read(tmp_path, monkeypatch):
    """The cap is the most a file may hold: a file of exactly that many bytes loads, one byte
    more is refused."""
    path = tmp_path / "exact.yaml"
    path.write_text("train:\n  steps: 3\n# " + "x" * 100 + "\n")
    monkeypatch.setattr(cod_fast.config.io, "MAX_CONFIG_BYTES", path.stat().st_size)
    assert load_config(path=str(path)).train.steps == 3
    monkeypatch.setattr(cod_fast.config.io, "MAX_CONFIG_BYTES", path.stat().st_size - 1)
    assert "more than" in _file_error(path)


def test_a_config_path_to_no_regular_file_is_refused_without_reading(tmp_path):
    """/dev/zero (endless) and a named pipe no one writes (opening it would block) are refused
    at once as what they are, in one line naming the path; so is a folder."""
    with lonely_fifo(tmp_path) as fifo:
        for path, kind in (
            (DEV_ZERO, "character device"),
            (fifo, "named pipe"),
            (tmp_path, "folder"),
        ):
            message = _file_error(path)
            assert message.startswith(f"{path}: ") and kind in message, message


def test_an_override_over_the_cap_is_refused_in_one_line(monkeypatch):
    """A `--set` longer than a config file may be is refused before it is parsed, in one short
    line."""
    monkeypatch.setattr(cod_fast.config.io, "MAX_CONFIG_BYTES", 1000)
    message = _error([f"model.chat_template='{'{{ x }}' * 200}'"])
    assert message.startswith("model.chat_template: ") and "1000" in message and len(message) < 300
    assert load_config(overrides=[f"model.chat_template='{'{{ x }}' * 100}'"])


@pytest.mark.slow  # 1-2 s: left to the full suite
def test_huge_values_in_a_config_are_refused_in_a_short_line(tmp_path):
    """A config file with a 5 MB string where a number goes, or with a mapping of 100,000
    unknown keys under `rollout`, is one short line (the size cap refuses both files unread);
    the same values given as a mapping are echoed clipped, and a `--set` into a mapping of
    100,000 keys lists them clipped."""
    text = tmp_path / "text.yaml"
    text.write_text("train:\n  steps: " + "x" * 5_000_000 + "\n")
    keys = tmp_path / "keys.yaml"
    keys.write_text("rollout:\n" + "".join(f"  key{i}: 1\n" for i in range(100_000)))
    for path in (text, keys):
        assert len(_file_error(path)) < 300
    many = {f"k{i}": "v" for i in range(100_000)}
    for data in ({"train": {"steps": "x" * 5_000_000}}, {"rollout": many}):
        with pytest.raises(ConfigError) as info:
            from_dict(Config, data)
        assert len(str(info.value)) < 600
    cfg = from_dict(Config, {"rollout": {"env_options": many}})
    with pytest.raises(ConfigError) as info:
        apply_overrides(cfg, ["rollout.env_options.nope.deeper=1"])
    assert len(str(info.value)) < 600 and " chars)" in str(info.value)


def test_an_override_adds_a_key_to_a_mapping_field_and_nothing_deeper():
    """`--set rollout.env_options.tries=3` adds an option (a YAML number stays a number, a
    quoted one a string: the environment's constructor converts it by its annotation); a key
    below that, or an unknown key of a section, is refused naming it."""
    cfg = load_config(
        "tiny-cpu", overrides=["rollout.env_options.tries=3", "rollout.env_options.a='3'"]
    )
    assert cfg.rollout.env_options == {"tries": 3, "a": "3"}
    for bad, key in (
        ("rollout.env_options.nope.deeper=1", "rollout.env_options.nope"),
        ("rollout.nope=1", "rollout.nope"),
    ):
        with pytest.raises(ConfigError) as refused:
            load_config("tiny-cpu", overrides=[bad])
        assert refused.value.key == key and "unknown key" in str(refused.value)
