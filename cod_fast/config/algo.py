"""Credit assignment and the policy loss: `AlgoConfig` and `LossConfig` (the knobs of
docs/concepts.md sections 3 and 4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cod_fast.config.base import ConfigError, _Config
from cod_fast.config.rollout import EnvName

PolicyLoss = Literal["ppo", "rec_one_side", "rec_one_side_is", "opd"]
KLEstimator = Literal["k1", "k2", "k3"]
RolloutCorrection = Literal["none", "tis", "mis_token", "mis_sequence"]
Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]


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
    """Divide CoD advantages by the group's standard deviation (task_by_task always does, as
    GRPO)."""
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
