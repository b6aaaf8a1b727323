"""The configuration of a cod-fast run: one tree of dataclasses (the named presets built from
it are cod_fast.presets).

Every config class checks its fields against their type hints (``_Config``) and adds its own range
checks; an error names the dotted field, the bad value and what is allowed. The loss fields are the
knobs of docs/concepts.md section 4. How a run's config is resolved from a preset, a YAML file and
``a.b.c=value`` overrides is cod_fast.config_io.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

PolicyLoss = Literal["ppo", "rec_one_side", "rec_one_side_is", "opd"]
KLEstimator = Literal["k1", "k2", "k3"]
RolloutCorrection = Literal["none", "tis", "mis_token", "mis_sequence"]
Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
EnvName = str  # a registered name or a module:Class path, checked by cod_fast.envs.registry

DERIVED = {
    "algo.loss.temperature": "rollout.temperature",
    "algo.loss.max_response_len": "rollout.max_response_tokens",
}
"""Loss fields a run sets from its rollout section (`Config.__post_init__`): one temperature and
one response limit per run, written once. They are not keys of a run's config (YAML, `--set`,
the reference); as keys they are deprecated spellings of the rollout keys (cod_fast.config_io),
accepted for one release with a warning."""

MAX_EVAL_PACKS = 100_000
"""The most packs one evaluation may play (`rollout.eval_packs`, `cod-fast eval --packs`): far
above any real evaluation, and a seed list of that length costs nothing."""

SHOWN_CHARS = 200
"""The most characters of a value (or key) an error message echoes: a message stays one short
line even when the value is a megabyte string or a huge mapping."""


def clipped(text: str) -> str:
    """`text` cut to SHOWN_CHARS, marked where it was cut."""
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} chars)"


def shown(value: Any) -> str:
    """How an error message echoes a value: its repr, clipped."""
    return clipped(repr(value))


class ConfigError(ValueError):
    """A config key, value or file that cannot be used; the message says where and why."""

    def __init__(self, key: str, problem: str):
        self.key = clipped(key)  # keys come from files and --set too, so they can be anything
        self.problem = problem
        super().__init__(f"{self.key}: {problem}")

    def under(self, path: str) -> ConfigError:
        """The same error with ``path`` prepended to its key (``loss.x`` -> ``algo.loss.x``)."""
        return ConfigError(f"{path}.{self.key}", self.problem) if path else self


class _Config:
    """Base of every config dataclass: checks each field against its type hint.

    Literal fields must hold one of their values, ``X | None`` fields may be None, bool is not an
    int, an int is accepted (and stored as float) for a float field, a float field must be finite
    (no field gives inf or nan a meaning: where a limit can be lifted, null does it), and a nested
    config must be an instance of its class. Subclasses extend ``__post_init__`` with their range
    checks.
    """

    def __post_init__(self) -> None:
        hints = type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value, hint = getattr(self, f.name), hints[f.name]
            if not _fits(value, hint):
                raise ConfigError(f.name, f"got {shown(value)}; expected {_describe(hint)}")
            if type(value) in (int, float) and float in (hint, *typing.get_args(hint)):
                if not _finite(value):
                    # inf passes every `x >= low` range check (nan any negated one) and then
                    # fails deep in a run: an inf timeout fails every environment call.
                    null = " or null" if type(None) in typing.get_args(hint) else ""
                    raise ConfigError(f.name, f"got {shown(value)}; expected a finite number{null}")
                setattr(self, f.name, float(value))

    def _require(self, ok: bool, name: str, expected: str) -> None:
        if not ok:
            raise ConfigError(name, f"got {shown(getattr(self, name))}; expected {expected}")

    def _at_least(self, low: float, *names: str) -> None:
        for name in names:
            kind = "an integer" if isinstance(getattr(self, name), int) else "a number"
            self._require(getattr(self, name) >= low, name, f"{kind} >= {low}")

    def _above(self, low: float, *names: str) -> None:
        for name in names:
            self._require(getattr(self, name) > low, name, f"a number > {low}")

    def _at_most(self, high: int, *names: str) -> None:
        """A bound far above any real run: a larger value is a typo (a few zeros too many) that
        would otherwise fill the memory minutes into the run."""
        for name in names:
            self._require(getattr(self, name) <= high, name, f"at most {high} (far above any run)")


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a config class (cached: validation reads them for every
    instance)."""
    return typing.get_type_hints(cls)


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(
            _fits(k, key) and _fits(v, item) for k, v in value.items()
        )
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _finite(number: float) -> bool:
    if isinstance(number, int):  # float() of a huge int overflows instead of giving inf
        return abs(number) <= sys.float_info.max
    return math.isfinite(number)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if origin is dict:
        key, item = typing.get_args(hint)
        return f"a mapping from {_describe(key)} to {_describe(item)}"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    names = {type(None): "null", float: "a number", int: "an integer", bool: "true or false"}
    names[object] = "any value"
    return names.get(hint) or ("a string" if hint is str else f"a mapping of {hint.__name__}")


@dataclass(kw_only=True)
class LossConfig(_Config):
    """The policy loss over packed, segmented tokens (docs/concepts.md section 4)."""

    policy: PolicyLoss = "ppo"
    """GRPO-clipped `ppo`, one-side REC (`rec_one_side`, CoD runs; `_is` weights by the ratio), or
    on-policy distillation `opd`."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Ratio per token, or one geometric-mean ratio per segment (`sequence`, GSPO)."""
    eps_low: float = 0.2
    """Lower clip range: ratios below 1 - eps_low are clipped (ppo) or dropped (rec) for A < 0."""
    eps_high: float = 0.2
    """Upper clip range: ratios above 1 + eps_high are clipped (ppo) or dropped (rec) for A >= 0."""
    kl: KLEstimator | None = None
    """KL estimator to the reference policy; null skips the reference forward."""
    beta: float = 0.0
    """Weight of the KL term; > 0 needs `kl`."""
    entropy_coef: float = 0.0
    """Weight alpha of the entropy bonus -alpha H_t."""
    update_entropy_coef: float | None = None
    """Weight of the entropy bonus on update-episode tokens; null: entropy_coef (the same weight
    on every token)."""
    rollout_correction: RolloutCorrection = "none"
    """Correction for sampler/trainer mismatch: truncated IS (`tis`) or masking (`mis_*`)."""
    tis_cap: float = 2.0
    """Cap C of the truncated importance weight min(exp(old - roll), C)."""
    mis_low: float = 0.5
    """Masked IS keeps tokens (or segments) whose ratio is at least this."""
    mis_high: float = 2.0
    """Masked IS keeps tokens (or segments) whose ratio is at most this."""
    agg: Aggregation = "token-mean"
    """How per-token losses are reduced; the denominator is fixed for the whole optimizer step."""
    max_response_len: int = 512
    """The fixed response length in the denominator of `seq-mean-token-sum-norm`. In a run it is
    rollout.max_response_tokens (see DERIVED)."""
    temperature: float = 1.0
    """Divides the logits in the loss. In a run it is rollout.temperature, the sampler's (see
    DERIVED)."""
    opd_coef: float = 1.0
    """Coefficient of the distillation advantage coef * (teach - logp) for `opd`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(0 <= self.eps_low < 1, "eps_low", "a number in [0, 1)")
        self._at_least(0, "eps_high", "beta", "entropy_coef")
        if self.update_entropy_coef is not None:
            self._at_least(0, "update_entropy_coef")
        self._above(0, "tis_cap", "mis_low", "temperature", "opd_coef")
        self._above(self.mis_low, "mis_high")
        self._at_least(1, "max_response_len")
        self._at_most(2**17, "max_response_len")  # rollout.max_response_tokens's bound
        if self.beta > 0 and self.kl is None:
            raise ConfigError("kl", f"got None with beta={self.beta}; set `kl` to k1, k2 or k3")


@dataclass(kw_only=True)
class ModelConfig(_Config):
    """The policy model and how it runs."""

    name_or_path: str = "builtin:tiny-qwen3"
    """A Hugging Face folder or hub id, or `builtin:tiny-qwen3`, built locally from the fields
    below."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype; `auto` is bfloat16 on a GPU and float32 on the CPU."""
    attn_impl: Literal["auto", "flash_attn", "varlen_attn", "sdpa"] = "auto"
    """Attention over packed sequences; `auto` picks the best one installed."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    lean_activations: bool = True
    """SwiGLU MLPs and RMSNorms (Qwen3, Qwen2, Llama, Mistral) that keep only what their backward
    needs: about a third less activation memory, the same forward values (cod_fast.lean)."""
    hidden_size: int = 96
    """Builtin models only: width of the residual stream."""
    num_layers: int = 3
    """Builtin models only: number of decoder layers."""
    num_heads: int = 4
    """Builtin models only: attention heads; must divide hidden_size."""
    intermediate_size: int = 256
    """Builtin models only: width of the MLP."""
    tokenizer: Literal["char", "bpe"] = "char"
    """Builtin models only: one token per character, or a byte-pair vocabulary trained locally on
    the scripted explorer's transcripts of the run's environment."""
    vocab_size: int = 512
    """Builtin models with the `bpe` tokenizer: the most tokens the vocabulary may have."""
    tokenizer_path: str | None = None
    """Builtin models: this saved tokenizer folder (a run's `tokenizer/`) instead of one built for
    the run, so that runs on different environments share a vocabulary (a distillation's
    teachers and student)."""
    chat_template: str | None = None
    """A Jinja chat template used instead of the tokenizer's: the template itself, or the path of
    a file holding one (a value that names an existing file is read; a relative path is from
    the working directory). A template without a system role gets the system text at the head
    of the first user turn. Null: the tokenizer's own."""
    chat_template_kwargs: dict[str, object] | None = None
    """Extra variables for every render of the chat template, e.g. `{enable_thinking: false}`
    for Qwen3 (not the arguments cod-fast sets itself, such as `tokenize`). Null: none."""

    def __post_init__(self) -> None:
        super().__post_init__()
        named = bool(self.name_or_path.strip())
        self._require(named, "name_or_path", "a model folder, a hub id or 'builtin:tiny-qwen3'")
        if self.tokenizer_path is not None:
            self._require(bool(self.tokenizer_path.strip()), "tokenizer_path", "a folder or null")
        if self.chat_template is not None:
            blank = not self.chat_template.strip()
            self._require(not blank, "chat_template", "a Jinja template, a file or null")
        # What cod-fast sets itself: the arguments of transformers' `apply_chat_template`
        # (PreTrainedTokenizerBase, 5.19; tests/test_chat_templates.py reads its signature)
        # and the conversation a template receives as `messages`.
        ours = (
            "conversation",
            "messages",
            "tools",
            "documents",
            "chat_template",
            "add_generation_prompt",
            "continue_final_message",
            "tokenize",
            "padding",
            "truncation",
            "max_length",
            "return_tensors",
            "return_dict",
            "return_assistant_tokens_mask",
            "tokenizer_kwargs",
        )
        for key, value in (self.chat_template_kwargs or {}).items():
            if key in ours:
                raise ConfigError(
                    "chat_template_kwargs",
                    f"{shown(key)} is set by cod-fast, not a template variable; remove it "
                    f"(cod-fast sets {', '.join(ours)})",
                )
            if not (isinstance(key, str) and key.isidentifier()) or key in JINJA_NAMES:
                raise ConfigError(
                    "chat_template_kwargs",
                    f"{shown(key)} is not a name a template can read; write a variable name "
                    "such as enable_thinking",
                )
            if not _plain(value):
                raise ConfigError(
                    f"chat_template_kwargs.{key}",
                    f"got {shown(value)}; expected text, a number, true/false, null, or a list "
                    "or mapping of them (quote a date: '2024-07-26')",
                )
        self._at_least(1, "hidden_size", "num_layers", "num_heads", "intermediate_size")
        self._at_least(128, "vocab_size")
        # Built-in model sizes at about 4x the largest open models (width 16k, MLP 53k, 126
        # layers, vocabularies of 262k); what fits this machine is the preflight's estimate.
        self._at_most(2**16, "hidden_size")
        self._at_most(2**18, "intermediate_size")
        self._at_most(2**10, "num_layers")
        self._at_most(2**20, "vocab_size")
        divisible = self.hidden_size % self.num_heads == 0
        self._require(divisible, "hidden_size", f"a multiple of num_heads={self.num_heads}")


JINJA_NAMES = ("self", "loop", "super", "caller", "varargs", "kwargs")
"""Names Jinja gives a meaning of its own inside a template."""


def _plain(value: object, depth: int = 0) -> bool:
    """Whether `value` is plain data the run's config can record (JSON's kinds): YAML also
    reads dates, binary and sets, which no checkpoint's record of the config could hold."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if depth < 32 and isinstance(value, list):
        return all(_plain(v, depth + 1) for v in value)
    if depth < 32 and isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


@dataclass(kw_only=True)
class EnvEntry(_Config):
    """One environment of a mixed-domain run (an item of `rollout.envs`)."""

    name: EnvName | None = None
    """The environment (required): a built-in's name, a registered plugin's, or a path
    `package.module:Class` / `file.py:Class` (docs/environments.md)."""
    weight: float = 1.0
    """Each pack comes from this environment with probability weight / (sum of the weights)."""
    size: Literal["tiny", "full"] | None = None
    """null: rollout.env_size."""
    setting: Literal["train", "eval"] | None = None
    """null: rollout.env_setting."""
    options: dict[str, str] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (learn2ask: `cases`, a JSONL file of
    your own cases)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(self.name is not None, "name", "an environment name")
        from cod_fast.envs.registry import environment_problem  # it imports this module

        if problem := environment_problem(self.name):  # type: ignore[arg-type]
            raise ConfigError("name", problem)
        self._above(0, "weight")


@dataclass(kw_only=True)
class RolloutConfig(_Config):
    """Which environments are rolled out, and how packs are sampled."""

    env: EnvName | None = "frozenlake"
    """The environment of a single-environment run: a built-in's name, a registered plugin's,
    or a path `package.module:Class` / `file.py:Class` (docs/environments.md); null when `envs`
    lists several."""
    envs: list[EnvEntry] = field(default_factory=list)
    """Several environments in one run (name, weight, size, setting, options): each step's packs are
    drawn across them by weight, every pack from one environment; metrics, evaluations and plots
    report each. Empty: the one `env`."""
    env_options: dict[str, str] = field(default_factory=dict)
    """Keyword arguments of the one `env`'s constructor (learn2ask: `cases`, a JSONL file of
    your own cases); an environment refuses an option it does not take, in one line."""
    env_setting: Literal["train", "eval"] = "train"
    """Which split of the environment's hidden rules the packs are drawn from."""
    env_size: Literal["tiny", "full"] = "tiny"
    """`tiny` shrinks the environment so a CPU-sized model can learn it."""
    strategy: Literal["cod", "ralph_sample", "ralph_full"] = "cod"
    """How the context is carried between the tasks of a pack."""
    packs_per_step: int = 8
    """Distinct packs per optimizer step; each is rolled out group_size times."""
    group_size: int = 8
    """G: independent rollouts of the same pack, the baseline group."""
    tasks_per_pack: int = 4
    """K: tasks per pack (K solve episodes, K - 1 update episodes)."""
    max_response_tokens: int = 512
    """Cap on the tokens of one model response; also the fixed length in the denominator of the
    `seq-mean-token-sum-norm` aggregation."""
    temperature: float = 1.0
    """Sampling temperature of the training rollouts; the loss divides the logits by the same
    number, so the trainer's log-probs are the sampler's."""
    max_hint_tokens: int = 256
    """Hints longer than this are truncated, not rejected."""
    min_hint_chars: int = 1
    """Hints shorter than this count as missing."""
    hint_penalty: float = 0.1
    """Missing hints give the update episode the reward -hint_penalty."""
    top_p: float = 1.0
    """Nucleus sampling threshold; below 1 only in a run without RL steps (train.steps=0),
    whose evaluations it then shapes: the trainer's log-probs are over the full softmax."""
    eval_temperature: float | None = None
    """Sampling temperature of evaluations; null: `temperature` (training's)."""
    keyed_sampling: bool = True
    """Each training response's sampling noise comes from what it answers (the run's seed, its
    pack, member, position and turn), as in evaluations, so a run's rollouts do not depend on
    how many processes sample them or which packs share a sampler call: the same run on 1, 2
    or 8 ranks, with or without rollout workers, samples the same tokens from the same weights.
    false: one random stream per rank, seeded by the rank."""
    sampler: Literal["auto", "torch", "vllm"] = "auto"
    """Generation backend; `auto` takes the one measured faster on the device
    (cod_fast.rollout.choice; `cod-fast info` says which and why)."""
    vllm_gpu_memory_utilization: float = 0.5
    """Share of GPU memory vLLM may take; the trainer needs the rest. (On the CPU the adapter
    sizes vLLM's KV cache itself.)"""
    torch_fast_decode: bool = True
    """The torch sampler decodes from the model's parameters without transformers' module
    stack where the architecture allows (cod_fast.rollout.fast_decode; same samples); false
    decodes through the model's forward."""
    torch_static_shapes: bool | None = None
    """Fast decode over one (batch bucket, cache width bucket) shape per call, finished rows
    masked instead of dropped, one read of the device per step (same samples); null: on for
    CUDA, off on the CPU, where dropping finished rows is faster."""
    torch_cuda_graphs: bool | None = None
    """Replay each decode step as a CUDA graph (needs static shapes on CUDA); null: on whenever
    static shapes run on CUDA."""
    vllm_eager: bool = False
    """Run vLLM without torch.compile / CUDA graphs: on the CPU it starts in 3-5 s instead of
    30-40 s and samples somewhat slower (0.85-0.96x in `cod-fast bench sampler`)."""
    eval_packs: int = 64
    """Packs rolled out per evaluation; 0 turns evaluation off."""
    eval_setting: Literal["train", "eval"] = "eval"
    """Rules of the held-out eval packs: the training distribution, or the harder eval setting."""
    length_penalty: float = 0.0
    """Subtracted from the reward of an episode with a response cut at max_response_tokens."""
    env_error_reward: float = 0.0
    """Reward of a solve episode whose environment raised or timed out."""
    env_timeout_s: float | None = 30.0
    """Give up on one environment call after this many seconds; null waits forever."""
    prompt_style: Literal["full", "compact"] = "full"
    """Wording of the solve and update prompts: `full` for LLMs, `compact` (same structure, fewest
    words) for tiny models."""
    judge: str = "rule"
    """Who scores the environments whose outcome a judge reads (learn2ask; docs/environments.md):
    `rule`, the environment's own rule; a Hugging Face model folder, run through the torch
    sampler; or an OpenAI-compatible endpoint's base URL (`http://HOST:PORT/v1`; the key from
    COD_FAST_JUDGE_API_KEY or OPENAI_API_KEY). A judge that fails scores the episode like an
    environment error; a trajectory it flags as malformed is left out of its advantage group."""
    judge_model: str | None = None
    """The model name an endpoint judge is asked for; null: `default`."""
    judge_timeout_s: float = 30.0
    """How long one endpoint judge request may take."""
    judge_max_tokens: int = 64
    """The longest verdict a model or endpoint judge may write."""

    @property
    def environments(self) -> tuple[EnvEntry, ...]:
        """The run's environments with their size and setting resolved: `envs`, or `env`."""
        entries = self.envs or [EnvEntry(name=self.env, options=self.env_options)]
        return tuple(
            dataclasses.replace(
                e, size=e.size or self.env_size, setting=e.setting or self.env_setting
            )
            for e in entries
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.envs:
            names = [e.name for e in self.envs]
            self._require(self.env is None, "env", "null when rollout.envs lists the environments")
            repeated = sorted({n for n in names if names.count(n) > 1})
            self._require(not repeated, "envs", f"each environment once (repeated: {repeated})")
        else:
            self._require(self.env is not None, "env", "an environment name (or rollout.envs)")
            from cod_fast.envs.registry import environment_problem  # it imports this module

            if problem := environment_problem(self.env):  # type: ignore[arg-type]
                raise ConfigError("env", problem)
        self._at_least(1, "packs_per_step", "tasks_per_pack", "max_response_tokens")
        self._at_least(1, "max_hint_tokens")
        self._at_least(2, "group_size")  # the baseline is a group mean
        self._at_least(0, "min_hint_chars", "hint_penalty", "eval_packs", "length_penalty")
        # Bounds 64x the largest preset or more (qwen3-1.7b: 16 packs x 8 members x 8 tasks,
        # 2048-token responses; tiny-cpu: 128 eval packs); 2^17 tokens is the longest context
        # window of today's open models. Their products (one sampler batch) are the preflight's.
        self._at_most(4096, "packs_per_step")
        self._at_most(1024, "group_size", "tasks_per_pack")
        self._at_most(2**17, "max_response_tokens", "max_hint_tokens")
        self._at_most(MAX_EVAL_PACKS, "eval_packs")
        if self.env_timeout_s is not None:
            self._above(0, "env_timeout_s")
        self._above(0, "temperature")
        self._require(0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        self._require(
            not (self.envs and self.env_options),
            "env_options",
            "empty when rollout.envs lists the environments (give each its own options)",
        )
        from cod_fast.judges import judge_problem  # loads nothing: a cheap check of the spec

        if problem := judge_problem(self.judge):
            raise ConfigError("judge", problem)
        self._above(0, "judge_timeout_s")
        self._at_least(1, "judge_max_tokens")
        if self.eval_temperature is not None:
            self._above(0, "eval_temperature")
        memory_ok = 0 < self.vllm_gpu_memory_utilization < 1
        self._require(memory_ok, "vllm_gpu_memory_utilization", "a number in (0, 1)")


@dataclass(kw_only=True)
class AlgoConfig(_Config):
    """Credit assignment (docs/concepts.md section 3) and the policy loss."""

    algorithm: Literal["cod", "task_by_task"] = "cod"
    """CoD returns over the pack, or the task-by-task GRPO baseline without update episodes."""
    return_style: Literal["mean", "window", "discounted"] = "mean"
    """How the returns of later tasks are combined."""
    window: int | None = None
    """Entries averaged by return_style `window`; set exactly when that style is used."""
    gamma: float | None = None
    """Discount in (0, 1] for return_style `discounted`; set exactly when that style is used."""
    std_norm: bool = False
    """Divide advantages by the group's standard deviation."""
    red_weight: bool | None = None
    """Adaptive re-weighting that keeps the token-weighted mean advantage >= 0; null: on for
    `cod`, off for `task_by_task` (plain GRPO, docs/concepts.md section 3). `use_red_weight` is the
    effective value, and `config show` prints it beside the key."""
    old_logp: Literal["bypass", "recompute"] = "bypass"
    """Take the ratio against the sampler's log-probs, or recompute them with the trainer."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss."""
    teachers: dict[EnvName, str] = field(default_factory=dict)
    """On-policy distillation (`loss.policy=opd`): environment -> teacher model folder (a
    `cod-fast export` or any Hugging Face folder with the run's tokenizer). The teacher of each
    pack's environment scores the student's sequences at the trainable positions."""

    @property
    def use_red_weight(self) -> bool:
        """Whether RED-weight runs: as set, else on for CoD and off for task-by-task."""
        return self.red_weight if self.red_weight is not None else self.algorithm == "cod"

    def __post_init__(self) -> None:
        super().__post_init__()
        from cod_fast.envs.registry import environment_problem  # it imports this module

        for name in self.teachers:
            if problem := environment_problem(name):
                raise ConfigError(f"teachers.{name}", problem)
        if self.return_style == "window":
            ok = self.window is not None and self.window >= 1
            self._require(ok, "window", "an integer >= 1 with return_style='window'")
        else:
            self._require(self.window is None, "window", "null unless return_style='window'")
        if self.return_style == "discounted":
            ok = self.gamma is not None and 0 < self.gamma <= 1
            self._require(ok, "gamma", "a number in (0, 1] with return_style='discounted'")
        else:
            self._require(self.gamma is None, "gamma", "null unless return_style='discounted'")


@dataclass(kw_only=True)
class TrainConfig(_Config):
    """The optimizer and the length of the run."""

    steps: int = 30
    """Optimizer steps of RL."""
    lr: float = 1e-5
    """AdamW learning rate of RL."""
    lr_warmup: int = 0
    """RL steps of linear learning-rate warmup (step j of RL uses lr x j / lr_warmup); 0: the
    full lr from the first RL step."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Maximum global gradient norm."""
    token_budget: int = 16384
    """Tokens per packed micro-batch; a longer sequence is an error."""
    share_prefix: bool = True
    """Pack each micro-batch as its sequences' prefix tree: a prefix that several sequences share
    (the system text, a group's first prompt, equal responses) is run through the model once
    and every continuation attends to it (cod_fast.prefix_tree); the loss and gradients are
    the flat layout's. The token budget then bounds the tree's tokens."""
    mini_batches: int = 1
    """Optimizer steps per rollout batch: the batch is split into this many mini-batches of
    whole episodes, each with its own step (the ratio to the sampler grows after the first)."""
    warm_start_steps: int = 0
    """Supervised steps on scripted demonstrations before RL; 0 skips the warm start."""
    warm_start_lr: float = 1e-3
    """Peak AdamW learning rate of the warm start."""
    warm_start_schedule: Literal["constant", "cosine"] = "cosine"
    """Warm-start learning rate after the warmup: constant, or a cosine down to 10% of the peak
    at the last warm-start step."""
    warm_start_warmup: int = 100
    """Warm-start steps of linear learning-rate warmup."""
    warm_start_packs: int = 16
    """Demonstration packs per warm-start step (fresh ones every step)."""
    warm_start_hint_noise: float = 0.0
    """Fraction of the demonstrations' update episodes that write another pack's hints instead
    of their own (cod_fast.warmstart.ScriptedDriver): the warm-started model then writes right
    hints only part of the time, and RL has hint quality to raise."""
    warm_start_hint_dropout: float = 0.0
    """Probability that each known entry of a demonstration's hints is written as unknown
    (never wrong; the explorer relearns it on the next task), so that the warm-started model
    writes incomplete hints and RL has entries to add. Needs an environment that declares its
    hint format (docs/environments.md; FrozenLake and Terminal do). Measured on tiny FrozenLake, RL then
    adds more but the warm start keeps far less, so the end is worse (docs/benchmarks.md)."""
    max_staleness: int = 0
    """Asynchronous RL: rollout batch b is sampled with the weights of RL step b - K (K this
    value; rounded up to a multiple of sync_interval), so rollout workers sample up to K
    batches ahead while the trainer trains. 0: every batch is sampled with the current weights
    (the synchronous loop). K > 0 needs rollout workers (runtime.rollout_ranks under torchrun;
    docs/async.md)."""
    sync_interval: int = 1
    """RL steps between weight broadcasts to the rollout workers (at most max_staleness + 1)."""
    replay_batches: int = 0
    """Priority replay (Trinity-RFT's decay-limit randomisation; docs/async.md): each RL step
    also trains on this many earlier batches from a pool, the highest priority first; 0: off."""
    replay_use_limit: int = 2
    """A batch leaves the replay pool once trained this many times (its fresh use included)."""
    replay_decay: float = 1.0
    """Replay priority = weights version - replay_decay x uses + noise: fresher and less used
    batches first."""
    replay_sigma: float = 0.0
    """Standard deviation of the Gaussian noise on the replay priority (drawn from train.seed
    and the step, so runs stay reproducible)."""
    replay_max_age: int = 4
    """A batch leaves the replay pool once its weights version is more than this many RL steps
    behind the step's."""
    carry_optimizer: bool = False
    """RL continues the warm start's AdamW moments (at RL's learning rate) instead of starting a
    fresh optimizer."""
    master_dtype: Literal["float32", "model"] = "float32"
    """The dtype of the weights the optimizer updates, of their gradients and of its state.
    `float32` with a 16-bit model.dtype is mixed precision: float32 master weights, compute in
    model.dtype, gradients reduced and accumulated in float32 (FSDP2's MixedPrecisionPolicy,
    one process included), so updates smaller than half a bf16 ulp are kept. `model`: the
    parameters, gradients and optimizer state in model.dtype (half the memory; small updates
    vanish in bf16)."""
    max_skipped_steps: int = 3
    """Consecutive steps with a NaN/inf loss or gradient (skipped, parameters unchanged) after
    which the run stops."""
    seed: int = 0
    """Seed of the model init, the samplers and the pack seeds."""
    init_from: str | None = None
    """Start from these weights instead of the model's own init: a run directory (its latest
    checkpoint and tokenizer) or a model folder in safetensors. The optimizer, seeds and packs
    are this run's own (cod_fast.init_from)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.init_from is not None:
            self._require(bool(self.init_from.strip()), "init_from", "a folder path or null")
        self._at_least(0, "steps", "weight_decay", "warm_start_steps", "warm_start_warmup", "seed")
        self._at_least(0, "lr_warmup")
        self._above(0, "lr", "grad_clip", "warm_start_lr")
        self._at_least(1, "token_budget", "mini_batches", "warm_start_packs", "max_skipped_steps")
        # Over 100x the qwen3-1.7b preset's 32768 tokens and 16 packs per step.
        self._at_most(2**22, "token_budget")
        self._at_most(4096, "warm_start_packs")
        self._require(
            0 <= self.warm_start_hint_noise <= 1, "warm_start_hint_noise", "a fraction in [0, 1]"
        )
        dropout_ok = 0 <= self.warm_start_hint_dropout <= 1
        self._require(dropout_ok, "warm_start_hint_dropout", "a probability in [0, 1]")
        self._at_least(0, "max_staleness", "replay_batches", "replay_max_age")
        self._at_least(0, "replay_decay", "replay_sigma")
        if self.replay_batches:
            self._require(
                self.replay_use_limit >= 2,
                "replay_use_limit",
                "an integer >= 2 with train.replay_batches > 0 (1 would never replay)",
            )
        self._at_least(1, "sync_interval")
        self._require(
            self.sync_interval <= self.max_staleness + 1,
            "sync_interval",
            f"at most train.max_staleness + 1 = {self.max_staleness + 1} (a worker must not "
            "need weights that are not broadcast yet); raise train.max_staleness or lower it",
        )


@dataclass(kw_only=True)
class RuntimeConfig(_Config):
    """Where the run executes and what it writes."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` is cuda when available."""
    kernel_impl: Literal["auto", "torch", "cpp", "triton"] = "auto"
    """Kernel implementation; `auto` lets cod_fast.ops.dispatch pick per device."""
    run_dir: str = "runs/latest"
    """Folder for the resolved config, logs and checkpoints."""
    checkpoint_every: int = 10
    """Steps between checkpoints (warm start and RL steps alike); 0 saves only at the end."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept; 0 keeps all."""
    eval_every: int = 0
    """RL steps between evaluations on held-out packs (besides before training, after the warm
    start and at the end); 0: only those."""
    log_every: int = 1
    """Steps between log lines."""
    tensorboard: bool = False
    """Also write TensorBoard event files."""
    keep_freed_memory: bool = True
    """On the CPU, keep freed host memory in the process instead of returning it to the OS
    after every step (glibc malloc settings, cod_fast.host_memory): repeated allocations stop
    taking page faults. Linux with glibc only."""
    hsdp_replicate: int = 1
    """Replica groups of hybrid-sharded data parallelism (1 = plain FSDP)."""
    dist_timeout_s: float = 1800.0
    """Seconds a collective may wait for the other ranks before the run fails (the process
    group's timeout). Evaluation is split over the ranks, so no rank waits while another
    evaluates; the longest wait is the main rank writing a checkpoint."""
    rollout_ranks: int = 0
    """Under torchrun, the last this-many ranks are rollout workers that only sample (the
    driver and sampler) and send their batches to the trainer ranks (docs/async.md); 0: every
    rank samples and trains in turn."""
    rollout_timeout_s: float = 1800.0
    """Seconds the trainer waits for a rollout worker's next batch before it checkpoints and
    stops with an error naming the worker."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # An empty run_dir is the current folder: checkpoints and logs would land among the
        # user's files, and a later run there would find them as "a previous run".
        self._require(bool(self.run_dir.strip()), "run_dir", "a folder path, e.g. runs/my-run")
        self._at_least(0, "checkpoint_every", "keep_checkpoints", "eval_every")
        self._at_least(1, "log_every", "hsdp_replicate")
        self._at_least(0, "rollout_ranks")
        self._above(0, "dist_timeout_s", "rollout_timeout_s")


@dataclass(kw_only=True)
class Config(_Config):
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_teachers()
        # The loss's copies of the sampling settings (DERIVED) follow the rollout's, always; a
        # new AlgoConfig, so that one passed in by the caller is left as it was.
        loss = dataclasses.replace(
            self.algo.loss,
            temperature=self.rollout.temperature,
            max_response_len=self.rollout.max_response_tokens,
        )
        self.algo = dataclasses.replace(self.algo, loss=loss)
        if self.rollout.top_p < 1 and self.train.steps > 0:
            # Measured on the CPU engine (tests/test_vllm_engine.py): at top_p=0.8 the sampled
            # tokens' log-probs were 0.05-0.22 nats above the full softmax's.
            raise ConfigError(
                "rollout.top_p",
                f"got {self.rollout.top_p} with train.steps={self.train.steps}; expected 1 for "
                "RL: the sampler's log-probs are renormalised over the nucleus and the "
                "trainer's are over the full softmax, so every ratio starts below 1; set "
                "rollout.top_p=1 (for a nucleus in evaluation: cod-fast eval --top-p)",
            )
        if self.runtime.device == "cpu":
            refuse_cpu_dtype(self.model.dtype, "runtime.device='cpu'")
        if self.algo.algorithm == "task_by_task" and self.rollout.strategy != "cod":
            raise ConfigError(
                "rollout.strategy",
                f"got {self.rollout.strategy!r} with algo.algorithm='task_by_task'; expected "
                "'cod' (Ralph strategies need update episodes, which task_by_task has not)",
            )

        if self.train.max_staleness and not self.runtime.rollout_ranks:
            raise ConfigError(
                "train.max_staleness",
                f"got {self.train.max_staleness} with runtime.rollout_ranks=0; expected rollout "
                "workers to sample ahead: set runtime.rollout_ranks=R and launch under torchrun "
                "with more than R processes, or train.max_staleness=0",
            )

    def _check_teachers(self) -> None:
        """`opd` needs a teacher for every environment of the run; teachers need `opd`."""
        teachers, opd = self.algo.teachers, self.algo.loss.policy == "opd"
        names = [e.name for e in self.rollout.environments]
        if opd and not teachers:
            raise ConfigError(
                "algo.teachers",
                "got none with algo.loss.policy='opd'; expected a teacher model folder per "
                f"environment, e.g. algo.teachers={{{names[0]}: path/to/teacher}}",
            )
        if teachers and not opd:
            raise ConfigError(
                "algo.teachers",
                f"got teachers with algo.loss.policy={self.algo.loss.policy!r}; expected "
                "algo.loss.policy='opd' (only on-policy distillation reads teachers)",
            )
        missing = [n for n in names if opd and n not in teachers]
        if missing:
            raise ConfigError(
                "algo.teachers", f"no teacher for {', '.join(missing)}; every environment needs one"
            )
        unused = sorted(set(teachers) - set(names))
        if unused:
            raise ConfigError(
                "algo.teachers",
                f"teachers for {', '.join(unused)}, which the run does not roll out (its "
                f"environments: {', '.join(names)})",
            )
        empty = [n for n, path in teachers.items() if not path.strip()]
        if empty:
            raise ConfigError("algo.teachers", f"an empty path for {empty[0]}; expected a folder")


def refuse_cpu_dtype(dtype: str, device: str) -> None:
    """Refuse a model dtype that cannot train on the CPU; `device` says how the run got there.

    Measured on the tiny model: float16 weights are NaN after the first AdamW step (its eps and
    the small squared gradients underflow to 0 in float16, so updates divide 0 by 0); bfloat16
    has float32's exponent range and trains (slowly). Nothing in that arithmetic is particular
    to the CPU, but only the CPU was measured. The preflight (cod_fast.preflight) calls this
    again for `runtime.device=auto`, once it knows where that lands.
    """
    if dtype == "float16":
        raise ConfigError(
            "model.dtype",
            f"got 'float16' with {device}; expected 'float32' (or 'auto', which is float32 "
            "there) on the CPU: float16 weights turn NaN at the first AdamW step there",
        )
