"""Which environments are rolled out, and how packs are sampled: `RolloutConfig` and
`EnvEntry`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from cod_fast.config.base import _Config

EnvName = str
"""A registered environment name or a `module:Class` / `file.py:Class` path; its form and
whether it names one are checked against the world by cod_fast.run.validate."""

MAX_EVAL_PACKS = 100_000
"""The most packs one evaluation may play (`rollout.eval_packs`, `cod-fast eval --packs`): far
above any real evaluation, and a seed list of that length costs nothing."""


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
    options: dict[str, str | int | float | bool | None] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor, each one scalar (learn2ask: `cases`,
    a JSONL file of your own cases); converted to the types its parameters are annotated with
    (`tries: '3'` gives an `int` parameter 3)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(self.name is not None, "name", "an environment name")
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
    env_options: dict[str, str | int | float | bool | None] = field(default_factory=dict)
    """Keyword arguments of the one `env`'s constructor, each one scalar (learn2ask: `cases`, a
    JSONL file of your own cases); converted to the types its parameters are annotated with
    (`tries: '3'` gives an `int` parameter 3). An environment refuses an option it does not
    take, or a value that does not convert, in one line."""
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
        self._above(0, "judge_timeout_s")
        self._at_least(1, "judge_max_tokens")
        if self.eval_temperature is not None:
            self._above(0, "eval_temperature")
        memory_ok = 0 < self.vllm_gpu_memory_utilization < 1
        self._require(memory_ok, "vllm_gpu_memory_utilization", "a number in (0, 1)")
