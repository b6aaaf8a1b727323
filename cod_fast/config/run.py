"""A whole run: `Config` (model, rollout, algo, train, runtime), `TrainConfig` and
`RuntimeConfig`, and the checks that span sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from cod_fast.config.algo import AlgoConfig
from cod_fast.config.base import ConfigError, _Config
from cod_fast.config.model import ModelConfig, refuse_cpu_dtype
from cod_fast.config.rollout import RolloutConfig

DERIVED = {
    "algo.loss.temperature": "rollout.temperature",
    "algo.loss.max_response_len": "rollout.max_response_tokens",
}
"""Loss fields a run sets from its rollout section (`Config.__post_init__`): one temperature and
one response limit per run, written once. They are not keys of a run's config (YAML, `--set`,
the reference); as keys they are deprecated spellings of the rollout keys (cod_fast.config.io),
accepted for one release with a warning."""


@dataclass(kw_only=True)
class TrainConfig(_Config):
    """The optimizer and the length of the run."""

    steps: int = 30
    """Optimizer steps of RL."""
    lr: float = 1e-6
    """AdamW learning rate of RL (TRL's and verl's default; every preset sets its own)."""
    lr_warmup: int = 0
    """RL steps of linear learning-rate warmup (step j of RL uses lr x j / lr_warmup); 0: the
    full lr from the first RL step."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """RL's learning rate after the warmup: lr, or a cosine or linear decay from lr down to
    lr_min_ratio x lr as the last RL step ends (cod_fast.train.schedule; a function of the step,
    so a resumed run continues it)."""
    lr_min_ratio: float = 0.0
    """Where RL's cosine or linear decay ends, as a share of lr (verl's `min_lr_ratio`); 0 with
    lr_schedule `constant`."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Maximum global gradient norm."""
    token_budget: int = 16384
    """Tokens per packed micro-batch on each GPU; a longer sequence is an error. With
    sequence_parallel N a micro-batch holds up to N x token_budget tokens, token_budget on
    each of its N ranks."""
    sequence_parallel: int = 1
    """Ulysses sequence parallelism: each packed micro-batch is split over N consecutive
    trainer ranks, each holding 1/N of its tokens, and attention trades sequence for heads
    with an all-to-all (docs/gpu.md, "Sequence parallelism"). N divides the trainer ranks
    (and, with HSDP, each replica's) and the model's attention heads; 1: off."""
    share_prefix: bool = True
    """Pack each micro-batch as its sequences' prefix tree: a prefix that several sequences share
    (the system text, a group's first prompt, equal responses) is run through the model once
    and every continuation attends to it (cod_fast.data.prefix_tree); the loss and gradients are
    the flat layout's. The token budget then bounds the tree's tokens."""
    mini_batches: int = 1
    """Optimizer steps per rollout batch: the batch is split into this many mini-batches of
    whole episodes, each with its own step (the ratio to the sampler grows after the first)."""
    epochs: int = 1
    """Passes over each RL batch (TRL's `num_iterations`, verl's `ppo_epochs`): its mini-batches
    are trained this many times in the same order, epochs x mini_batches optimizer steps. Every
    pass takes the ratio against the policy that sampled: the sampler's log-probs
    (algo.old_logp=bypass) or the trainer's, computed once before the first pass (`recompute`).
    The step's record averages the loss and sums the tokens over every pass. The warm start
    trains each batch once."""
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
    of their own (cod_fast.rollout.scripted.ScriptedDriver): the warm-started model then writes right
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
    are this run's own (cod_fast.run.init_from)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.init_from is not None:
            self._require(bool(self.init_from.strip()), "init_from", "a folder path or null")
        self._at_least(0, "steps", "weight_decay", "warm_start_steps", "warm_start_warmup", "seed")
        self._at_least(0, "lr_warmup")
        self._require(0 <= self.lr_min_ratio <= 1, "lr_min_ratio", "a share of train.lr in [0, 1]")
        if self.lr_schedule == "constant":
            no_floor = "0 with train.lr_schedule='constant' (set lr_schedule=cosine or linear)"
            self._require(self.lr_min_ratio == 0, "lr_min_ratio", no_floor)
        self._at_least(1, "epochs")
        self._at_most(64, "epochs")
        self._above(0, "lr", "grad_clip", "warm_start_lr")
        self._at_least(1, "token_budget", "mini_batches", "warm_start_packs", "max_skipped_steps")
        self._at_least(1, "sequence_parallel")
        self._at_most(64, "sequence_parallel")
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
    checkpoint_format: Literal["auto", "whole"] = "auto"
    """`auto`: under torchrun with FSDP2 every rank writes and reads its own shard (the run
    directory must be one folder every node sees), else one file set; `whole`: gathered on the
    main rank and written by it alone (~12 bytes a parameter through its host memory), for a
    run directory on the first node's own disk."""
    eval_every: int = 0
    """RL steps between evaluations on held-out packs (besides before training, after the warm
    start and at the end); 0: only those."""
    log_every: int = 1
    """Steps between log lines."""
    tensorboard: bool = False
    """The older spelling of listing `tensorboard` in report_to (either turns it on)."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = field(
        default_factory=list
    )
    """Experiment trackers that get every step's numbers and each evaluation's CoD gain
    besides metrics.jsonl (TRL's `report_to`, verl's `trainer.logger`), from the main rank only,
    each under the run directory's name (cod_fast.run.trackers): `tensorboard` writes event
    files to RUN_DIR/tb; `wandb` a Weights & Biases run (its local files in RUN_DIR/wandb unless
    WANDB_DIR says otherwise); `mlflow` an MLflow run in the store MLFLOW_TRACKING_URI names;
    `trackio` a trackio run in project `cod-fast` (stored in TRACKIO_DIR). Each needs its extra:
    pip install 'cod-fast[wandb]' (or tensorboard, mlflow, trackio). Where and how they log in
    (keys, servers, offline modes: WANDB_API_KEY, WANDB_MODE=offline, MLFLOW_TRACKING_URI, HF_TOKEN)
    comes from each library's own environment variables; cod-fast never reads or stores a
    credential. A resumed run continues the same tracker runs (their ids in
    RUN_DIR/trackers.json)."""
    keep_freed_memory: bool = True
    """On the CPU, keep freed host memory in the process instead of returning it to the OS
    after every step (glibc malloc settings, cod_fast.distributed.host_memory): repeated allocations stop
    taking page faults. Linux with glibc only."""
    threads: int | None = None
    """Torch's CPU threads in each process of the run (trainers and rollout workers); null:
    torch's default, one per core the process may use (under torchrun with several processes a
    node: one, as torchrun sets OMP_NUM_THREADS=1 when it is unset). Idle threads sleep rather
    than spin (cod-fast sets OMP_WAIT_POLICY=PASSIVE unless you set it), so runs that share
    cores do not starve each other (cod_fast.distributed.threads)."""
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

    @property
    def trackers(self) -> list[str]:
        """The trackers the run reports to: report_to, and `tensorboard` where the older
        `tensorboard: true` asks for it."""
        older = ["tensorboard"] if self.tensorboard and "tensorboard" not in self.report_to else []
        return [*older, *self.report_to]

    def __post_init__(self) -> None:
        super().__post_init__()
        # An empty run_dir is the current folder: checkpoints and logs would land among the
        # user's files, and a later run there would find them as "a previous run".
        self._require(bool(self.run_dir.strip()), "run_dir", "a folder path, e.g. runs/my-run")
        self._at_least(0, "checkpoint_every", "keep_checkpoints", "eval_every")
        self._at_least(1, "log_every", "hsdp_replicate")
        self._at_least(0, "rollout_ranks")
        self._above(0, "dist_timeout_s", "rollout_timeout_s")
        self._require(
            len(set(self.report_to)) == len(self.report_to),
            "report_to",
            "each tracker at most once",
        )
        self._require(
            self.threads is None or self.threads >= 1,
            "threads",
            "an integer >= 1, or null for torch's default",
        )


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
            # Measured on the CPU engine (tests/rollout/test_vllm_engine.py): at top_p=0.8 the sampled
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
        if teachers and self.train.sequence_parallel > 1:
            raise ConfigError(
                "train.sequence_parallel",
                f"got {self.train.sequence_parallel} with algo.teachers; on-policy distillation "
                "scores each rank's sequences with whole teacher models, without sequence "
                "parallelism: set train.sequence_parallel=1",
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
