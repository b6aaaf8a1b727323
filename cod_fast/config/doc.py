"""The reference of every config key, generated from the config dataclasses themselves.

A key's type comes from its annotation, its default from ``Config()``, its meaning from the
string literal under the field in cod_fast/config/ (Python keeps attribute docstrings nowhere
at run time, so they are read from the source with ``ast``). The same entries make
docs/configuration.md (``render_markdown``) and ``cod-fast config show --explain`` (``explain``),
so the reference cannot drift from the code.

Regenerate the document with ``python -m cod_fast.config.doc > docs/configuration.md``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import operator
import re
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from cod_fast.config import DERIVED, Config, LossConfig
from cod_fast.config.base import type_hints
from cod_fast.config.io import to_dict
from cod_fast.config.presets import DEFAULT_PRESET, PRESETS

REGENERATE = "python -m cod_fast.config.doc > docs/configuration.md"
"""The command that writes docs/configuration.md."""

COUNTERPARTS: dict[str, tuple[str, str]] = {
    "model.name_or_path": ("", "actor_rollout_ref.model.path"),
    "model.gradient_checkpointing": (
        "gradient_checkpointing",
        "actor_rollout_ref.model.enable_gradient_checkpointing",
    ),
    "rollout.packs_per_step": ("", "data.train_batch_size"),
    "rollout.group_size": ("num_generations", "actor_rollout_ref.rollout.n"),
    "rollout.max_response_tokens": ("max_completion_length", "data.max_response_length"),
    "rollout.temperature": ("temperature", "actor_rollout_ref.rollout.temperature"),
    "rollout.top_p": ("top_p", "actor_rollout_ref.rollout.top_p"),
    "rollout.vllm_gpu_memory_utilization": (
        "vllm_gpu_memory_utilization",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
    ),
    "rollout.vllm_eager": ("", "actor_rollout_ref.rollout.enforce_eager"),
    "rollout.eval_temperature": ("", "actor_rollout_ref.rollout.val_kwargs.temperature"),
    "algo.std_norm": ("scale_rewards", "algorithm.norm_adv_by_std_in_grpo"),
    "algo.old_logp": ("", "algorithm.rollout_correction.bypass_mode"),
    "algo.loss.ratio_level": ("importance_sampling_level", ""),
    "algo.loss.eps_low": ("epsilon", "actor_rollout_ref.actor.clip_ratio_low"),
    "algo.loss.eps_high": ("epsilon_high", "actor_rollout_ref.actor.clip_ratio_high"),
    "algo.loss.kl": ("", "actor_rollout_ref.actor.kl_loss_type"),
    "algo.loss.beta": ("beta", "actor_rollout_ref.actor.kl_loss_coef"),
    "algo.loss.entropy_coef": ("entropy_coef", "actor_rollout_ref.actor.entropy_coeff"),
    "algo.loss.rollout_correction": ("vllm_importance_sampling_mode", ""),
    "algo.loss.agg": ("loss_type", "actor_rollout_ref.actor.loss_agg_mode"),
    "train.steps": ("max_steps", "trainer.total_training_steps"),
    "train.lr": ("learning_rate", "actor_rollout_ref.actor.optim.lr"),
    "train.lr_warmup": ("warmup_steps", "actor_rollout_ref.actor.optim.lr_warmup_steps"),
    "train.lr_schedule": ("lr_scheduler_type", "actor_rollout_ref.actor.optim.lr_scheduler_type"),
    "train.lr_min_ratio": ("", "actor_rollout_ref.actor.optim.min_lr_ratio"),
    "train.mini_batches": ("steps_per_generation", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    "train.epochs": ("num_iterations", "actor_rollout_ref.actor.ppo_epochs"),
    "train.weight_decay": ("weight_decay", "actor_rollout_ref.actor.optim.weight_decay"),
    "train.grad_clip": ("max_grad_norm", "actor_rollout_ref.actor.grad_clip"),
    "train.token_budget": ("", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    "train.sequence_parallel": ("", "actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    "train.seed": ("seed", ""),
    "runtime.run_dir": ("output_dir", "trainer.default_local_dir"),
    "runtime.checkpoint_every": ("save_steps", "trainer.save_freq"),
    "runtime.keep_checkpoints": ("save_total_limit", "trainer.max_actor_ckpt_to_keep"),
    "runtime.eval_every": ("eval_steps", "trainer.test_freq"),
    "runtime.log_every": ("logging_steps", ""),
}
"""Keys with a close counterpart in TRL's GRPOConfig (1.16) and in verl's ppo_trainer.yaml,
as (TRL field, verl key); "" where the other has none. Close, not equal: the value sets may
differ (`algo.loss.agg` has verl's names, TRL's `loss_type` names whole losses)."""


@dataclass(frozen=True)
class KeyDoc:
    """One key of the config reference."""

    key: str
    """Dotted, as ``--set`` takes it; an item field of a list reads ``rollout.envs[].name``."""
    type: str
    """The annotation, readably: ``int``, ``float | null``, ``one of: auto, torch, vllm``."""
    default: Any
    """The value in ``Config()``, as plain data (what YAML files hold)."""
    doc: str
    """The field's docstring on one line."""

    @property
    def is_item(self) -> bool:
        """A field of the items of a list (no value of its own in a resolved config)."""
        return "[]" in self.key


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass: the string literal right after each field."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = " ".join(str(after.value.value).split())  # type: ignore[attr-defined]
    return docs


def type_name(hint: Any) -> str:
    """A type hint as the reference writes it, in YAML's words (null, true/false)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        choices = [_choices(a) for a in args]
        if Literal in map(typing.get_origin, args) and None not in choices:
            # `one of: k1, k2, null` reads better than `one of: k1, k2 | null`
            return "one of: " + ", ".join(v for c in choices for v in c)  # type: ignore[union-attr]
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return "one of: " + ", ".join(_choices(hint))  # type: ignore[arg-type]
    if hint is type(None):
        return "null"
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping ({type_name(args[0])}) -> {type_name(args[1])}"
    if dataclasses.is_dataclass(hint):
        return "{" + ", ".join(f.name for f in dataclasses.fields(hint)) + "}"
    return "any" if hint is object else hint.__name__


def _choices(hint: Any) -> list[str] | None:
    """The values a Literal or None allows, as written in YAML; None for any other type."""
    if typing.get_origin(hint) is Literal:
        return [str(a) for a in typing.get_args(hint)]
    return ["null"] if hint is type(None) else None


@functools.cache
def config_keys() -> tuple[KeyDoc, ...]:
    """Every key of the config in declaration order, each list of configs followed by the
    fields of its items."""
    return tuple(_keys(Config, to_dict(Config()), ""))


def _keys(cls: type, defaults: dict[str, Any], prefix: str) -> Iterator[KeyDoc]:
    hints, docs = type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        hint, key = hints[f.name], prefix + f.name
        if key in DERIVED:  # set from the rollout key, not a key of its own
            continue
        if dataclasses.is_dataclass(hint):
            yield from _keys(hint, defaults[f.name], key + ".")  # type: ignore[arg-type]
            continue
        yield KeyDoc(key, type_name(hint), defaults[f.name], docs.get(f.name, ""))
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        if dataclasses.is_dataclass(item):
            # The fields of rollout.envs's items: Config() has no item, so their defaults are
            # the fields' own.
            item_defaults = {g.name: _field_default(g) for g in dataclasses.fields(item)}  # type: ignore[arg-type]
            yield from _keys(item, item_defaults, key + "[].")  # type: ignore[arg-type]


def _field_default(f: dataclasses.Field) -> Any:
    """A field's default value (made by its factory where it has one)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def flat_values(cfg: Config) -> dict[str, Any]:
    """The config's keys (dotted) and their values as plain data."""
    data = to_dict(cfg)
    return {
        k.key: functools.reduce(operator.getitem, k.key.split("."), data)
        for k in config_keys()
        if not k.is_item
    }


def preset_differences() -> dict[str, dict[str, Any]]:
    """Per preset, the keys whose value differs from ``Config()``'s, and that value."""
    default = flat_values(Config())
    diffs = {}
    for name, make in PRESETS.items():
        values = flat_values(make())
        diffs[name] = {k: v for k, v in values.items() if v != default[k]}
    return diffs


def shown_value(value: Any) -> str:
    """A value as YAML writes it in flow style: null, true, [a, b], {k: v}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(shown_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shown_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else ""


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows), ""]


def _section_of(key: str) -> str:
    return key.split("[]")[0].rpartition(".")[0]


def sections() -> list[str]:
    """The config's sections (``model``, ``algo.loss``, ...), in declaration order."""
    return list(dict.fromkeys(_section_of(k.key) for k in config_keys()))


INTRO = f"""\
# Configuration reference

_Generated from the config dataclasses (cod_fast/config/) by `{REGENERATE}`;
do not edit by hand._

A run's configuration is one tree of sections (`model`, `rollout`, `algo` with `algo.loss`,
`train`, `runtime`), resolved in three layers, each validated as a whole:

1. a named preset, `--preset NAME` (default: a config file's top-level `preset:` key; else
   `{DEFAULT_PRESET}` for a config that keeps the built-in model, and for one that names its
   own model (`model.name_or_path`) the GPU preset sized nearest to it, said in a `note:` line;
   docs/models.md); the presets are listed in "Presets";
2. a YAML file, `--config FILE`, deep-merged over the preset: it names only the keys it changes,
   e.g. `train: {{steps: 10}}`;
3. overrides, `--set a.b.c=VALUE` (repeatable, applied in order); values are YAML (`null`, `3`,
   `0.5`, `true`, `k3`), and a mapping merges into the section it names.

`cod-fast config show` (with the same options) prints the resolved config as YAML, a file that
`--config` reads back; `cod-fast config show --explain` prints every key with its value, type,
default and meaning, and `--key rollout` keeps the keys of one section.

The default column holds the fields' own defaults; a run starts from a preset (above), and
the keys a preset changes are in the "Presets" table. Types are
written in YAML's words: `null` is YAML's null, `bool` is `true` or `false`. The last
column names the closest setting of TRL's `GRPOConfig` (1.16) and of verl's `ppo_trainer.yaml`
where there is one; their values may be spelled differently. The last section, "Coming from TRL /
verl", sets their defaults beside cod-fast's.
"""

COMING_FROM = """\
## Coming from TRL / verl

The defaults of the settings most often set, beside TRL's `GRPOConfig` and verl's PPO trainer,
and why cod-fast's differ. Read from TRL 1.16.0 (the PyPI release): `trl/trainer/grpo_config.py`, \
`trl/trainer/base_config.py`, and transformers 5.19.0's `TrainingArguments` for the fields \
GRPOConfig inherits (seed, schedule, warmup, weight decay, clipping); and verl v0.9.0 \
(verl-project/verl, commit 483b8a0): `verl/trainer/config/ppo_trainer.yaml` (its `algorithm` \
section) with `actor/actor.yaml`, `optim/fsdp.yaml`, `engine/fsdp.yaml`, `rollout/rollout.yaml`, \
`model/hf_model.yaml`, `data/legacy_data.yaml` and `algorithm/rollout_correction.yaml` \
(flattened in `_generated_ppo_trainer.yaml`); verl's `actor.`, `rollout.` and `model.` keys are \
under `actor_rollout_ref.`. The cod-fast column is the field's default, then the default \
preset's and the `qwen3-*` presets' values where they differ.

| setting | cod-fast default | TRL (GRPOConfig) | verl | why cod-fast differs |
|---|---|---|---|---|
| learning rate, `train.lr` | {train.lr} | `learning_rate` 1e-6 | `actor.optim.lr` 1e-6 | A run \
starts from a preset: the `qwen3-*` ones train at 1e-6 (so did the CoD paper's Qwen3 runs), \
`tiny-cpu` a 0.35M-parameter model at the best of the rates measured (docs/benchmarks.md). |
| warmup, `train.lr_warmup` | {train.lr_warmup} | `warmup_steps` 0 | \
`actor.optim.lr_warmup_steps` -1 (ratio 0.0): none | The same. In a warmup, RL step j trains at \
lr x j / lr_warmup; transformers' schedules start at 0. |
| schedule, `train.lr_schedule`, floor `train.lr_min_ratio` | {train.lr_schedule}, \
{train.lr_min_ratio} | `lr_scheduler_type` `linear`, to 0 as the run ends | \
`actor.optim.lr_scheduler_type` `constant`, `min_lr_ratio` 0.0 | As verl; the runs of \
docs/benchmarks.md trained at a constant rate. TRL's is `train.lr_schedule=linear`. |
| KL coefficient, `algo.loss.beta` | {algo.loss.beta} | `beta` 0.0 | `actor.use_kl_loss` false \
(`kl_loss_coef` 0.001 once on) | The same: no reference model is built or run. |
| KL estimator, `algo.loss.kl` | {algo.loss.kl} | k3, fixed | `actor.kl_loss_type` `low_var_kl` \
(k3 clipped to [-10, 10]) | cod-fast has k1, k2 and k3; a KL term (beta > 0) must name one. |
| clip low, `algo.loss.eps_low` | {algo.loss.eps_low} | `epsilon` 0.2 | `actor.clip_ratio_low` 0.2 \
| The same. |
| clip high, `algo.loss.eps_high` | {algo.loss.eps_high} | `epsilon_high` null (= `epsilon`) | \
`actor.clip_ratio_high` 0.2 | The same; the presets' 0.28 is DAPO's clip-higher, which TRL's \
documentation recommends. |
| policy loss, `algo.loss.policy` | {algo.loss.policy} | PPO-clip | \
`actor.policy_loss.loss_mode` `vanilla` (PPO-clip) | The same; the presets run one-side REC, \
the CoD paper's loss (docs/concepts.md section 4). |
| advantage std normalisation, `algo.std_norm` | {algo.std_norm} | `scale_rewards` `group` \
(divided by the group's std) | `algorithm.norm_adv_by_std_in_grpo` true | CoD advantages are \
centred, not divided, as in the CoD paper's runs (Trinity-RFT `examples/research_cod`: \
`std_cal_level: none`); TRL's documentation cites Dr. GRPO for the same choice (the division \
biases by question difficulty). The task-by-task baseline always divides, as GRPO does \
(docs/concepts.md section 3). |
| loss aggregation, `algo.loss.agg` | {algo.loss.agg} | `loss_type` `dapo` (the global batch's \
token mean) | `actor.loss_agg_mode` `token-mean` | The same; each value's counterparts are in \
the next table. |
| old log-probs, `algo.old_logp`; `algo.loss.rollout_correction` | {algo.old_logp}; \
{algo.loss.rollout_correction} | recomputed when vLLM samples (its importance correction is on \
by default: `sequence_mask`, at most 3) or generation and updates are out of step | \
`algorithm.rollout_correction.bypass_mode` false: recomputed; `rollout_is` null | The ratio is \
taken against the sampler's log-probs: no extra forward, and the ratio measures the whole \
distance to the policy that sampled, staleness included (docs/async.md); a correction then \
changes nothing (docs/concepts.md section 4). |
| epochs per batch, `train.epochs` | {train.epochs} | `num_iterations` 1 | `actor.ppo_epochs` 1 | \
The same. |
| optimizer steps per batch, `train.mini_batches` | {train.mini_batches} | \
`steps_per_generation` null (= `gradient_accumulation_steps`, 1) | `data.train_batch_size` 1024 / \
`actor.ppo_mini_batch_size` 256: 4 | As TRL; on `tiny-cpu` two did no better \
(docs/benchmarks.md). |
| group size, `rollout.group_size` | {rollout.group_size} | `num_generations` 8 | `rollout.n` 1 \
(GRPO runs set it) | As TRL and the CoD paper's runs; the baseline is a group mean. |
| batch, `rollout.packs_per_step` | {rollout.packs_per_step} | `per_device_train_batch_size` 8 \
completions | `data.train_batch_size` 1024 prompts | A pack is K tasks played as one rollout \
(2K - 1 episodes); a step trains packs x group_size of them. |
| temperature, `rollout.temperature` | {rollout.temperature} | `temperature` 1.0 | \
`rollout.temperature` 1.0 | The same; the loss divides the logits by it too. |
| top_p, `rollout.top_p` | {rollout.top_p} | `top_p` 1.0 | `rollout.top_p` 1 | The same; below 1 \
is refused with RL steps (the sampler's log-probs would be over the nucleus). |
| response length, `rollout.max_response_tokens` | {rollout.max_response_tokens} | \
`max_completion_length` 512 | `data.max_response_length` 512 | The same. |
| prompt length | no cap; hints at most `rollout.max_hint_tokens` {rollout.max_hint_tokens} | none \
| `data.max_prompt_length` 512 | A CoD prompt grows along the pack (the hints, and in an update \
episode the last task's trajectory); a sequence over `train.token_budget` is refused. |
| vLLM memory share, `rollout.vllm_gpu_memory_utilization` | \
{rollout.vllm_gpu_memory_utilization} | `vllm_gpu_memory_utilization` 0.3 | \
`rollout.gpu_memory_utilization` 0.5 | As verl: the engine sleeps (weights and KV cache freed) \
through every training step; TRL's keeps its share unless `vllm_enable_sleep_mode` (default \
false). `cod-fast plan` counts it (docs/gpu.md). |
| vLLM tensor parallelism | none: an engine a GPU | `vllm_tensor_parallel_size` 1 | \
`rollout.tensor_model_parallel_size` 2 | Not implemented; docs/gpu.md ("Sizing a run") names \
the largest model one GPU serves. |
| gradient checkpointing, `model.gradient_checkpointing` | {model.gradient_checkpointing} | \
`gradient_checkpointing` true | `model.enable_gradient_checkpointing` true | Off for the tiny CPU \
model, whose activations are small; the `qwen3-*` presets turn it on (`cod-fast plan` prints \
the activations with and without). |
| seed, `train.seed` | {train.seed} | `seed` 42 | `actor.fsdp_config.seed`, `rollout.seed` 42 | \
Seeds the model's init, the samplers and the packs; docs/benchmarks.md's results are for seeds \
0, 1 and 2. |
| gradient clipping, `train.grad_clip` | {train.grad_clip} | `max_grad_norm` 1.0 | \
`actor.grad_clip` 1.0 | The same. |
| weight decay, `train.weight_decay` | {train.weight_decay} | `weight_decay` 0.0 | \
`actor.optim.weight_decay` 0.01 | As TRL. |
| entropy bonus, `algo.loss.entropy_coef` | {algo.loss.entropy_coef} | `entropy_coef` 0.0 | \
`actor.entropy_coeff` 0 | The same. |
| precision, `model.dtype`, `train.master_dtype` | {model.dtype}, {train.master_dtype} | `bf16` \
true (unless `fp16`) | `actor.fsdp_config.model_dtype` fp32, `dtype` bfloat16 | The same on a \
GPU: bf16 compute, float32 master weights and gradient reduction; float32 on the CPU. |
"""
"""The comparison, as markdown; `{key}` is replaced by that key's default (`_default_cell`)."""

AGG_COUNTERPARTS: dict[str, tuple[str, str]] = {
    "token-mean": ("`dapo`; `bnpo` is the mean per micro-batch", "`token-mean`"),
    "seq-mean-token-mean": ("`grpo` (per micro-batch)", "`seq-mean-token-mean`"),
    "seq-mean-token-sum": ("none; `luspo` with sequence-level ratios", "`seq-mean-token-sum`"),
    "seq-mean-token-sum-norm": ("`dr_grpo`", "`seq-mean-token-sum-norm`"),
}
"""Each `algo.loss.agg` value's TRL `loss_type` and verl `loss_agg_mode`."""

GPU_PRESET_PREFIX = "qwen3-"
"""The presets a GPU run starts from, shown beside the defaults in the comparison."""


def render_markdown() -> str:
    """The text of docs/configuration.md."""
    keys = config_keys()
    lines = [INTRO]
    for section in sections():
        lines += [f"## `{section}`", ""]
        rows = []
        for k in keys:
            if _section_of(k.key) == section:
                trl, verl = COUNTERPARTS.get(k.key, ("", ""))
                both = " / ".join(
                    filter(None, (trl and f"TRL {_code(trl)}", verl and f"verl {_code(verl)}"))
                )
                rows.append(
                    [_code(k.key), _code(k.type), _code(shown_value(k.default)), _cell(k.doc), both]
                )
        lines += _table(["key", "type", "default", "meaning", "TRL / verl"], rows)
    diffs = preset_differences()
    changed = [k.key for k in keys if any(k.key in d for d in diffs.values())]
    default = flat_values(Config())
    lines += [
        "## Presets",
        "",
        "The keys each preset sets to something other than the default (blank: the default).",
        "",
    ]
    rows = [
        [_code(key), _code(shown_value(default[key]))]
        + [_code(shown_value(d[key])) if key in d else "" for d in diffs.values()]
        for key in changed
    ]
    lines += _table(["key", "default", *(f"`{name}`" for name in diffs)], rows)
    lines += [
        "## Deprecated keys",
        "",
        "Accepted for one more release with a warning; each sets the key that replaced it.",
        "",
    ]
    lines += _table(["key", "use instead"], [[_code(o), _code(n)] for o, n in DERIVED.items()])
    lines += coming_from()
    return "\n".join(lines)


def coming_from() -> list[str]:
    """The section "Coming from TRL / verl": COMING_FROM with its keys' defaults filled in,
    then each aggregation's counterparts (a KeyError for an `algo.loss.agg` value without)."""
    text = re.sub(r"\{([a-z_.]+)\}", lambda m: _default_cell(m.group(1)), COMING_FROM)
    rows = [
        [_code(agg), *AGG_COUNTERPARTS[agg]]
        for agg in typing.get_args(type_hints(LossConfig)["agg"])
    ]
    lines = [*text.splitlines(), ""]
    lines += _table(["`algo.loss.agg`", "TRL `loss_type`", "verl `loss_agg_mode`"], rows)
    note = "cod-fast's means are over responses and the whole optimizer step (docs/concepts.md "
    note += "section 4); TRL's `cispo`, `sapo` and `vespo` name losses, not aggregations."
    return [*lines, note, ""]


def _default_cell(key: str) -> str:
    """`key`'s default, then the default preset's and the GPU presets' values where they
    differ from it."""
    default = shown_value(flat_values(Config())[key])
    gpu = [n for n in PRESETS if n.startswith(GPU_PRESET_PREFIX)]
    shown = []
    for label, names in {DEFAULT_PRESET: [DEFAULT_PRESET], f"{GPU_PRESET_PREFIX}*": gpu}.items():
        values = list(dict.fromkeys(shown_value(flat_values(PRESETS[n]())[key]) for n in names))
        if values != [default]:
            shown.append(f"`{label}`: " + " / ".join(_code(v) for v in values))
    return _code(default) + (f" ({'; '.join(shown)})" if shown else "")


EXPLAIN_WIDTH = 48
"""The widest `key = value` that `explain_config` aligns the types and defaults after."""


def explain_config(cfg: Config, prefix: str = "") -> str:
    """Every key of ``cfg`` (under ``prefix``, a section or a key) with its value, type,
    default and meaning, as plain aligned text; ``*`` marks a value other than the default.
    Empty when no key is under ``prefix``."""
    values = flat_values(cfg)
    keys = [k for k in config_keys() if not k.is_item and _under(k.key, prefix)]
    if not keys:
        return ""
    shown = {k.key: _explained_value(cfg, k.key, values[k.key]) for k in keys}
    # aligned, but a long value (a list of environments) does not push every line right
    width = min(max(len(f"{k.key} = {shown[k.key]}") for k in keys), EXPLAIN_WIDTH)
    lines = []
    for k in keys:
        mark = "*" if values[k.key] != k.default else " "
        head = f"{k.key} = {shown[k.key]}".ljust(width)
        lines += [f"{mark} {head}  ({k.type}; default {shown_value(k.default)})", f"    {k.doc}"]
    return "\n".join([*lines, "", "* differs from the default"]) + "\n"


def _under(key: str, prefix: str) -> bool:
    return not prefix or key == prefix or key.startswith(prefix + ".")


def _explained_value(cfg: Config, key: str, value: Any) -> str:
    """The value as shown; a key left null for "the run's default" also shows what it is."""
    text = shown_value(value)
    if key == "algo.red_weight" and value is None:
        text += f" (effective: {shown_value(cfg.algo.use_red_weight)})"
    return text


if __name__ == "__main__":
    print(render_markdown(), end="")
