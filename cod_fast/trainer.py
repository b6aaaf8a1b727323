"""`cod-fast train`: colocated sampling and fused-loss training, one process per device.

Every step, top to bottom:
  rollouts (this rank's packs x group, one batched sampler call per driver step; with rollout
     workers, the batch they sampled ahead: cod_fast.batches, cod_fast.async_rl)
  -> gathered on every rank -> advantages (CoD or task-by-task, RED-weight; cod_fast.algo)
  -> packing into micro-batches balanced over the ranks, the step's global denominator
  -> old / reference log-probs where the config asks for them (bypass by default)
  -> fused loss, grad clip, AdamW (cod_fast.train_step; FSDP2 under torchrun)
  -> the new weights pushed into the sampler (vLLM: one reload, gathered one parameter at a
     time; a torch sampler that shares the training module needs none).
A warm start of supervised steps on scripted demonstrations can come first (cod_fast.warmstart).
Held-out eval packs are rolled out before training, after the warm start, every
`runtime.eval_every` RL steps and at the end, with a sampler of their own fixed seed, so every
evaluation sees the same packs and the same sampling noise.

Steps count warm-start and RL steps together; a checkpoint at step N holds everything N
completed steps produced (model, optimizer, every RNG, the sampler's generator), and pack seeds
derive from the step, so a resumed run repeats the uninterrupted one exactly on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from cod_fast.algo.assign import assign_advantages
from cod_fast.async_rl.channel import RolloutWorkerError
from cod_fast.batches import BatchSource, LocalBatches, mixed_packs
from cod_fast.checkpoint import (
    CheckpointError,
    read_model_state,
    read_optimizer_state,
    read_rank_states,
    read_weights,
    restoring,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from cod_fast.config import Config, LossConfig
from cod_fast.config_io import dump_yaml
from cod_fast.diagnostics import credit_metrics
from cod_fast.distributed import (
    DistContext,
    all_reduce_max,
    broadcast_object,
    full_parameters,
    gather_objects,
    init_distributed,
    load_model_state,
    load_optimizer_state,
    model_state,
    optimizer_state,
    resolve_device,
    shard_policy,
)
from cod_fast.envs import make_envs
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.evaluate import evaluate, run_eval_plans, run_eval_sampling, run_eval_settings
from cod_fast.host_memory import keep_freed_memory
from cod_fast.init_from import initial_weights
from cod_fast.metrics import PositionSummary, summarize_rollouts
from cod_fast.model import load_policy, master_dtype, resolve_dtype
from cod_fast.ops import aggregation_denominator
from cod_fast.ops.loss_terms import SAMPLER_GAP
from cod_fast.packing import (
    MicroBatch,
    build_microbatch,
    plan_microbatches,
    rollout_sequences,
    step_totals,
)
from cod_fast.policy import Policy
from cod_fast.records import Rollout
from cod_fast.replay import ReplayBatches
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.choice import build_samplers
from cod_fast.rollout.driver import DriverSettings, RolloutDriver
from cod_fast.run_dir import (
    RunDirError,
    check_resume,
    flat_config,
    lock_run_dir,
    tokenizer_fingerprint,
    unlock_run_dir,
)
from cod_fast.run_log import RunLog
from cod_fast.safe_write import atomic_file
from cod_fast.teachers import Teachers
from cod_fast.train_step import NonFiniteError, StepResult, runnable, train_step
from cod_fast.warmstart import SFT_LOSS, demonstrations, run_tokenizer

REFERENCE = "reference.safetensors"
"""The KL reference's weights in the run directory."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Signals that finish the step, checkpoint and end the run (a second one ends it at once)."""


@dataclass
class Update:
    """What one rollout batch's optimizer steps produced."""

    steps: list[StepResult] = field(default_factory=list)
    tokens: int = 0
    """Packed tokens (prompts and responses) over every rank."""
    skipped: int = 0
    """Optimizer steps skipped for a NaN/inf loss or gradient (nothing updated)."""
    error: str = ""
    teacher: list[dict[str, float]] = field(default_factory=list)
    """The teachers' metrics of each mini-batch (cod_fast.teachers.Teachers.score)."""


@dataclass(frozen=True)
class EvalProgress:
    """Where an evaluation stands, for a progress display: reported as each of its parts (one
    per environment, and per mode in a task-by-task run) starts, and again with its result."""

    label: str
    """The evaluation's label in eval.jsonl (`start`, `rl step 20`, ...)."""
    step: int
    env: str
    packs: int
    """Eval packs of this part."""
    done: int
    """Parts finished so far, this one included once `summary` is set."""
    parts: int
    summary: PositionSummary | None = None
    """The finished part's result; None as it starts."""


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _episode_metrics(rollouts: list[Rollout], envs: list[str]) -> dict[str, Any]:
    """Per-position reward, CoD gain, success, hint validity, hint quality (cod_fast.diagnostics)
    and response lengths of a batch; in a mixed-domain run also reward by position, CoD gain and
    mean reward per environment (`ENV/reward_by_position`, ...; null for an environment without
    a pack this step)."""
    summary = summarize_rollouts(rollouts)
    episodes = [e for r in rollouts for e in r.episodes]
    updates = [e for e in episodes if e.kind == "update"]
    lengths = [sum(len(t.response_ids) for t in e.turns) for e in episodes]
    out: dict[str, Any] = {
        "reward_by_position": summary.mean_reward,
        "cod_gain": summary.cod_gain,
        "reward_mean": _mean([x for row in [r.task_rewards for r in rollouts] for x in row]),
        "response_tokens_mean": _mean(lengths),
        "cut_frac": _mean([float(bool(e.info.get("cut"))) for e in episodes]),
    }
    if summary.success_rate is not None:
        out["success_rate"] = _mean(summary.success_rate)
    if updates:
        out["hint_valid_frac"] = _mean([float(e.info.get("hints") is not None) for e in updates])
    out.update(summary.hints)
    for env in envs if len(envs) > 1 else []:
        mine = [r for r in rollouts if r.env == env]
        part = summarize_rollouts(mine)
        out[f"{env}/reward_by_position"] = part.mean_reward or None
        out[f"{env}/cod_gain"] = part.cod_gain if mine else None
        out[f"{env}/reward_mean"] = _mean([x for r in mine for x in r.task_rewards])
    return out


def _teacher_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The teachers' metrics of a step: gaps averaged over its mini-batches, seconds summed."""
    out = {k: _mean([p[k] for p in parts if k in p]) for k in {k for p in parts for k in p}}
    if parts:
        out["teacher_s"] = sum(p["teacher_s"] for p in parts)
    return out


class Trainer:
    """One process's share of a run (all of it without torchrun)."""

    def __init__(
        self, cfg: Config, ctx: DistContext | None = None, batches: BatchSource | None = None
    ):
        """`batches`: where RL steps get their rollouts; default this process's own driver
        (LocalBatches), cod_fast.async_rl.RemoteBatches for rollout workers."""
        self.cfg = cfg
        device = resolve_device(cfg.runtime.device)
        self.compute_dtype = resolve_dtype(cfg.model, device)
        self.master_dtype = master_dtype(cfg.model, cfg.train.master_dtype, device)
        self.ctx = ctx or init_distributed(
            cfg.runtime.device,
            cfg.runtime.hsdp_replicate,
            timeout_s=cfg.runtime.dist_timeout_s,
            # Mixed precision shards even one process: FSDP2 keeps the float32 masters.
            one_rank_mesh=self.master_dtype != self.compute_dtype,
        )
        self.device = self.ctx.device
        if cfg.runtime.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()
        self.run_dir = Path(cfg.runtime.run_dir)
        if self.ctx.is_main:  # the one writer of the run directory, from before its first write
            lock_run_dir(self.run_dir)
        self.log = RunLog(
            self.run_dir, enabled=self.ctx.is_main, tensorboard=cfg.runtime.tensorboard
        )
        self.mix = cfg.rollout.environments
        self.envs = make_envs(self.mix)
        self.settings = DriverSettings.from_config(cfg)
        self.warm_steps = cfg.train.warm_start_steps
        self.total_steps = self.warm_steps + cfg.train.steps
        torch.manual_seed(cfg.train.seed)
        self.tokenizer = run_tokenizer(cfg, self.envs, self.settings, self.ctx.is_main)
        model, self.tokenizer = self._load_model(self.master_dtype)
        self.chat = ChatFormat.for_model(self.tokenizer, cfg.model)
        self.impl = None if cfg.runtime.kernel_impl == "auto" else cfg.runtime.kernel_impl
        self.samplers = build_samplers(cfg, model, self.tokenizer, self.ctx, run_eval_sampling(cfg))
        self.sampler = self.samplers.train
        self.policy = shard_policy(
            Policy(model, self.impl), self.ctx, compute_dtype=self.compute_dtype
        )
        self.driver = RolloutDriver(self.envs, self.sampler, self.chat, self.settings)
        self.batches = batches or LocalBatches(cfg, self.driver, self.ctx)
        # With rollout workers this process's samplers only evaluate: they get the weights
        # before an evaluation and sleep after it, instead of after every step. (vLLM's
        # external launcher makes its groups over every rank of the job, so a trainer still
        # starts an engine when the workers do.)
        self.local_sampling = self.ctx.rollout_ranks == 0
        self.sampler_step: int | None = None
        """The step whose weights the sampler holds (None: not pushed yet)."""
        if cfg.train.replay_batches:
            vocab_size = model.get_input_embeddings().num_embeddings
            self.batches = ReplayBatches(self.batches, cfg.train, vocab_size)
        self.teachers = (
            Teachers(cfg.algo.teachers, cfg.model, self.device, self.tokenizer, self.impl)
            if cfg.algo.teachers
            else None
        )
        self.optimizer = self._optimizer(warm=self.warm_steps > 0)
        self.reference: Policy | None = None
        self.step = 0
        self.stop_requested = False
        self.stop_signal: int | None = None
        self.on_eval: Callable[[EvalProgress], None] | None = None

    # --- setup ---------------------------------------------------------------------------------

    def _load_model(self, dtype: torch.dtype):
        return load_policy(
            self.cfg.model, self.device, self.cfg.train.seed, self.tokenizer, dtype=dtype
        )

    def _optimizer(self, warm: bool) -> torch.optim.Optimizer:
        train = self.cfg.train
        # Unsharded: torch's fused AdamW (one kernel per parameter; on the CPU a third of the
        # per-parameter loop's time for the tiny model). Under FSDP2 the default, which takes
        # DTensor parameters everywhere.
        fused = not self.ctx.sharded and self.device.type in ("cpu", "cuda")
        return torch.optim.AdamW(
            self.policy.parameters(),
            lr=train.warm_start_lr if warm else train.lr,
            weight_decay=train.weight_decay,
            fused=fused or None,
        )

    def _warm_start_lr(self) -> float:
        """The warm-start learning rate of this step, a function of the step alone (so a
        resumed run needs no scheduler state): linear warmup, then constant or cosine to 10%."""
        train, step = self.cfg.train, self.step
        peak = train.warm_start_lr * min(1.0, (step + 1) / max(train.warm_start_warmup, 1))
        if train.warm_start_schedule == "constant":
            return peak
        progress = min(step, self.warm_steps) / max(self.warm_steps, 1)
        return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    def _rl_lr(self) -> float:
        """RL's learning rate at this step, a function of the step alone: a linear warmup over
        train.lr_warmup RL steps, then train.lr."""
        train, rl_step = self.cfg.train, self.step - self.warm_steps + 1
        return train.lr * min(1.0, rl_step / max(train.lr_warmup, 1))

    def _sync_sampler(self) -> None:
        """Push the policy's weights into a sampler that holds its own copy, unless it holds
        this step's already."""
        if self.samplers.owns_weights and self.sampler_step != self.step:
            self.sampler.push_weights(full_parameters(self.policy))
            self.sampler_step = self.step

    def _sleep_sampler(self) -> None:
        if hasattr(self.sampler, "sleep"):  # vLLM frees its memory for training
            self.sampler.sleep()

    # --- the run -------------------------------------------------------------------------------

    def run(
        self,
        resume: bool = False,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        on_eval: Callable[[EvalProgress], None] | None = None,
    ) -> dict[str, Any]:
        """Train to the end, or until SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption),
        either of which finishes the step and checkpoints first; returns a summary with every
        evaluation of the run, the signal that stopped it, if one did, and the run directory.
        `on_step` gets each step's metrics record, `on_eval` each evaluation's progress."""
        started = time.perf_counter()
        self.on_eval = on_eval
        self._restore_or_start(resume)
        if self.local_sampling:
            self._sync_sampler()
        if self.step == 0:
            self._evaluate("start")
        previous = {sig: signal.signal(sig, self._request_stop) for sig in STOP_SIGNALS}
        try:
            self._loop(on_step)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.step == self.total_steps:
            self._evaluate("end" if self.cfg.train.steps else "after warm start")
        self.log.close()
        return {
            "steps": self.step,
            "warm_steps": self.warm_steps,
            "stopped": self.step < self.total_steps,
            "signal": self.stop_signal,
            "seconds": time.perf_counter() - started,
            "evals": self.log.evaluations() if self.ctx.is_main else [],
            "run_dir": str(self.run_dir),
        }

    def _loop(self, on_step: Callable[[dict[str, Any]], None] | None) -> None:
        cfg, skipped = self.cfg, 0
        while self.step < self.total_steps:
            if all_reduce_max(int(self.stop_requested), self.ctx):
                self._checkpoint()
                return
            if self.step == self.warm_steps:
                self._begin_rl()
            try:
                record = self._one_step()
            except RolloutWorkerError:
                self._checkpoint()  # every step trained so far is kept
                if self.stop_requested:  # a signal ended the wait: a stop, not a failure
                    return
                raise
            skipped = skipped + 1 if record["skipped"] else 0
            if skipped >= cfg.train.max_skipped_steps:
                raise NonFiniteError(
                    f"{skipped} steps in a row had a NaN/inf loss or gradient and were skipped "
                    f"(nothing was updated by them; the last checkpoint is intact); last: "
                    f"{record['error']}"
                )
            self.log.step(record)
            if on_step is not None:
                on_step(record)
            every = cfg.runtime.checkpoint_every
            if self.step == self.total_steps or (every and self.step % every == 0):
                self._checkpoint()
            rl_steps = self.step - self.warm_steps
            due = cfg.runtime.eval_every and rl_steps > 0 and rl_steps % cfg.runtime.eval_every == 0
            if due and self.step < self.total_steps:
                self._evaluate(f"rl step {rl_steps}")

    def _request_stop(self, signum, frame) -> None:
        if self.stop_requested:  # a second signal: stop at once
            raise KeyboardInterrupt
        self.stop_requested, self.stop_signal = True, signum

    def _one_step(self) -> dict[str, Any]:
        warm = self.step < self.warm_steps
        t0 = time.perf_counter()
        extra: dict[str, Any] = {}
        for group in self.optimizer.param_groups:
            group["lr"] = self._warm_start_lr() if warm else self._rl_lr()
        if warm:
            rollouts = self._demonstrations()
            t_sampled = t0
            update = self._update(rollouts, SFT_LOSS, mini_batches=1)
        else:
            batch = self.batches.next(
                self.step - self.warm_steps, self.policy, lambda: self.stop_requested
            )
            t_sampled = time.perf_counter()
            rollouts = batch.rollouts
            trained = rollouts + batch.replayed
            extra.update(batch.metrics)
            extra["red_tau"] = assign_advantages(trained, self.cfg.algo)
            extra.update(credit_metrics(rollouts))
            graded = [r for r in trained if r.graded]  # judge-flagged rollouts left out
            extra["malformed_frac"] = _mean([float(r.malformed) for r in rollouts])
            extra["ungraded_rollouts"] = len(trained) - len(graded)
            if self.local_sampling:
                self._sleep_sampler()
            update = (
                self._update(graded, self.cfg.algo.loss, self.cfg.train.mini_batches)
                if graded
                else Update()
            )
        t_trained = time.perf_counter()
        self.step += 1
        if self.local_sampling and self.step >= self.warm_steps:  # the next step samples
            self._sync_sampler()
        if not warm:
            self.batches.trained(self.step - self.warm_steps, self.policy)
        t_end = time.perf_counter()
        last = update.steps[-1] if update.steps else None
        metrics = dict(last.metrics) if last else {}
        # The sampler/trainer gap comes from the batch's first optimizer step, before any update:
        # there trainer and sampler hold the same weights. Warm-start demonstrations have no
        # sampler (their "gap" would be a log-likelihood), so warm steps report none.
        for name in [k for k in metrics if k.startswith(SAMPLER_GAP)]:
            if warm:
                del metrics[name]
            else:
                metrics[name] = update.steps[0].metrics[name]
                if "staleness" in extra:  # the gap by how old the sampler's weights were
                    metrics[f"staleness{extra['staleness']}/{name}"] = metrics[name]
        record: dict[str, Any] = {
            "step": self.step,
            "phase": "warm_start" if warm else "rl",
            "phase_step": self.step if warm else self.step - self.warm_steps,
            **_episode_metrics(rollouts, [e.name for e in self.mix]),
            **extra,
            "loss": _mean([s.loss for s in update.steps]),
            "grad_norm": last.grad_norm if last else float("nan"),
            **metrics,
            **_teacher_metrics(update.teacher),
            "lr": self.optimizer.param_groups[0]["lr"],
            "tokens": update.tokens,
            "trainable_tokens": sum(s.trainable_tokens for s in update.steps),
            "sample_s": t_sampled - t0,
            "train_s": t_trained - t_sampled,
            "push_s": t_end - t_trained,
            "step_s": t_end - t0,
            "tokens_per_s_per_device": update.tokens / (t_end - t0) / self.ctx.world_size,
            "skipped": update.skipped > 0,
        }
        if update.skipped:
            record["error"] = update.error
        # JSON has no NaN: a metric that does not exist this step is null.
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in record.items()}

    # --- data ----------------------------------------------------------------------------------

    def _demonstrations(self) -> list[Rollout]:
        """The explorer through this warm-start step's packs; every rank makes them all (it is
        deterministic and cheap), and packing then splits them like rollouts."""
        train = self.cfg.train
        count = train.warm_start_packs
        seeds = pack_seeds("warm", count, train.seed, start=self.step * count)
        packs = mixed_packs(
            self.cfg, make_packs(seeds, self.cfg.rollout.tasks_per_pack), "warm", self.step * count
        )
        return demonstrations(
            self.envs,
            self.chat,
            self.settings,
            packs,
            hint_noise=train.warm_start_hint_noise,
            hint_dropout=train.warm_start_hint_dropout,
        )

    def _update(self, rollouts: list[Rollout], loss: LossConfig, mini_batches: int) -> Update:
        """Optimizer steps over the batch, split into `mini_batches` of whole rollouts."""
        budget, world = self.cfg.train.token_budget, self.ctx.world_size
        share = self.cfg.train.share_prefix
        size = math.ceil(len(rollouts) / mini_batches)
        plans, update = [], Update()
        for start in range(0, len(rollouts), size):
            episodes = [e for r in rollouts[start : start + size] for e in r.episodes]
            sequences = rollout_sequences(episodes)
            layout = plan_microbatches(sequences, budget, world, share)
            if self.teachers is not None and loss is not SFT_LOSS:  # this rank's sequences
                mine = [sequences[i] for mb in layout[self.ctx.rank] for i in mb]
                update.teacher.append(self.teachers.score(mine, loss, budget, share))
            batches = [
                [build_microbatch([sequences[i] for i in mb], share) for mb in rank]
                for rank in layout
            ]
            packed = sum(mb.num_tokens for rank in batches for mb in rank)
            plans.append((batches[self.ctx.rank], step_totals(batches), packed))
        if loss is not SFT_LOSS:
            for mbs, _, _ in plans:  # all before the first update: the policy that sampled
                self._fill_logprobs(mbs, loss)
        for mbs, (tokens, segments), packed in plans:
            update.tokens += packed
            try:
                result = train_step(
                    self.policy,
                    self.optimizer,
                    mbs,
                    denominator=aggregation_denominator(loss, tokens, segments),
                    config=loss,
                    grad_clip=self.cfg.train.grad_clip,
                    group=self.ctx.group,
                )
            except NonFiniteError as e:  # nothing was updated; the run decides whether to go on
                update.skipped += 1
                update.error = str(e)
                continue
            update.steps.append(result)
        return update

    @torch.no_grad()
    def _fill_logprobs(self, microbatches: list[MicroBatch], loss: LossConfig) -> None:
        """Old-policy log-probs (`algo.old_logp=recompute`) and reference log-probs (KL)."""
        recompute = self.cfg.algo.old_logp == "recompute"
        if not recompute and self.reference is None:
            return
        self.policy.eval()
        # Host copies (a wait for the device per micro-batch): the micro-batches stay on the host
        # until their optimizer step, so a batch's log-probs never hold device memory.
        for mb in microbatches:
            batch = runnable(mb).to(self.device)
            if recompute:
                mb.old_logp = self.policy(batch, config=loss, mode="logprobs").cpu()
            if self.reference is not None:
                mb.ref_logp = self.reference(batch, config=loss, mode="logprobs").cpu()

    # --- phases, evaluation, checkpoints -------------------------------------------------------

    def _begin_rl(self) -> None:
        """After the warm start: evaluate it, freeze the reference, start a fresh optimizer
        (unless train.carry_optimizer keeps the warm start's)."""
        if self.warm_steps:
            self._evaluate("after warm start")
            if not self.cfg.train.carry_optimizer:
                self.optimizer = self._optimizer(warm=False)
        self._freeze_reference(model_state(self.policy, self.ctx), save=True)

    def _freeze_reference(self, state: dict[str, torch.Tensor], save: bool) -> None:
        """The KL term's reference: the policy as RL began (kept in the run directory, so a
        resumed run gets it back); nothing at all without a KL term."""
        loss = self.cfg.algo.loss
        if loss.kl is None or loss.beta == 0:
            return
        if save and self.ctx.is_main:  # renamed into place: a link there is replaced, not followed
            with atomic_file(self.run_dir / REFERENCE) as tmp:
                save_file(state, tmp)
        model, _ = self._load_model(self.compute_dtype)  # frozen: no master weights
        reference = Policy(model, self.impl)
        self.reference = shard_policy(reference, self.ctx) if self.ctx.distributed else reference
        load_model_state(self.reference, state, self.ctx)
        self.reference.eval().requires_grad_(False)

    def _evaluate(self, label: str) -> None:
        """Held-out eval packs of each environment, split over the ranks (no rank idles in a
        collective while another evaluates), each response's sampling noise keyed by what it
        answers, so every evaluation sees the same noise and a mixed run's evaluation of an
        environment is what a run on that environment alone with the same seed would see: the
        CoD protocol, and for a task-by-task run also its own mode (null hints at every task),
        logged as `LABEL (own mode)`."""
        cfg = self.cfg
        if cfg.rollout.eval_packs == 0:
            return
        modes = {label: run_eval_settings(cfg)}
        if self.settings.mode != "cod":
            modes[f"{label} (own mode)"] = self.settings
        parts = [
            (name, settings, plan)
            for name, settings in modes.items()
            for plan in run_eval_plans(cfg)
        ]
        self._sync_sampler()
        for done, (name, settings, plan) in enumerate(parts):
            (env,) = plan.envs
            progress = EvalProgress(name, self.step, env, plan.packs, done, len(parts))
            self._report_eval(progress)
            report = evaluate(self.samplers.eval, self.chat, plan, settings, ctx=self.ctx)
            summary = report["summaries"][env]["cod"]
            self.log.evaluation(name, self.step, summary, env=env)
            self._report_eval(dataclasses.replace(progress, done=done + 1, summary=summary))
        if not self.local_sampling:
            self._sleep_sampler()

    def _report_eval(self, progress: EvalProgress) -> None:
        if self.on_eval is not None:
            self.on_eval(progress)

    def _checkpoint(self) -> None:
        rank_state = {
            "rng": rng_state(),
            "sampler": self.sampler.state_dict(),
            "batch_source": self.batches.state(),  # the rollout workers' sampler states
        }
        ranks = gather_objects(rank_state, self.ctx)
        weights = model_state(self.policy, self.ctx)
        optim = optimizer_state(self.policy, self.optimizer, self.ctx)
        failure = None
        if self.ctx.is_main:
            try:
                save_checkpoint(
                    self.run_dir,
                    self.step,
                    weights,
                    optim,
                    rank_states=ranks,
                    extra={
                        "warm_start_steps": self.warm_steps,
                        "world_size": self.ctx.world_size,
                        "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                        "master_dtype": str(self.master_dtype).removeprefix("torch."),
                        "config": flat_config(self.cfg),
                        "tokenizer": tokenizer_fingerprint(self.tokenizer),
                    },
                    keep=self.cfg.runtime.keep_checkpoints,
                )
            except CheckpointError as exc:
                failure = exc
        # Every rank learns whether the save failed (this also waits for it), so all stop alike.
        if all_reduce_max(int(failure is not None), self.ctx):
            raise failure or CheckpointError("the main process could not write the checkpoint")

    def _restore_or_start(self, resume: bool) -> None:
        ckpt = check_resume(self.cfg, resume)
        if ckpt is None:
            if self.cfg.train.init_from is not None:
                weights = self._read_on_main(lambda: initial_weights(self.cfg.train.init_from))
                load_model_state(self.policy, weights, self.ctx)
            self.log.truncate(-1)
        else:
            self._restore(ckpt)
        self.log.write_config(dump_yaml(self.cfg), self.chat.own_template)

    def _restore(self, ckpt) -> None:
        recorded = ckpt.extra.get("tokenizer")
        if recorded is not None and recorded != tokenizer_fingerprint(self.tokenizer):
            raise RunDirError(
                f"the checkpoint of step {ckpt.step} in {self.run_dir} was trained with another "
                "tokenizer than this run loads (its token ids would mean other text): restore "
                f"the run's tokenizer ({self.run_dir / 'tokenizer'} for a built-in model, else "
                "the model folder's), or start a new run_dir"
            )
        self.step = ckpt.step
        # A state that does not fit what takes it back (a damaged or edited file) is a
        # ValueError there, and one line naming the file here (`restoring`).
        state = self._read_on_main(lambda: read_model_state(ckpt))
        with restoring(ckpt, "model.safetensors"):
            load_model_state(self.policy, state, self.ctx)
        # The optimizer that wrote the checkpoint: the warm start's up to its last step (RL then
        # starts a fresh one), RL's after.
        if self.step > self.warm_steps and self.warm_steps:
            self.optimizer = self._optimizer(warm=False)
        state = self._read_on_main(lambda: read_optimizer_state(ckpt))
        with restoring(ckpt, "optimizer.pt"):
            load_optimizer_state(self.policy, self.optimizer, state, self.ctx)
        if self.step > self.warm_steps:
            reference = self.run_dir / REFERENCE
            fix = "it is the KL reference (the policy as RL began): restore it from a backup"
            state = self._read_on_main(
                lambda: read_weights(reference, fix) if reference.exists() else {}
            )
            self._freeze_reference(state, save=False)
        ranks = read_rank_states(ckpt)
        with restoring(ckpt, "ranks.pt"):
            self.batches.load_state(ranks[0].get("batch_source"))
            if len(ranks) == self.ctx.world_size:  # else new streams: resumed, not bit-for-bit
                mine = ranks[self.ctx.rank]
                set_rng_state(mine.get("rng"))
                self.sampler.load_state_dict(mine.get("sampler"))
        self.log.truncate(self.step)

    def _read_on_main(self, read: Callable[[], Any]) -> Any:
        """`read()` on the main rank ({} on the others, which get the state by broadcast); a
        damaged file there raises its CheckpointError on every rank, so none waits for it."""
        value, problem = {}, None
        if self.ctx.is_main:
            try:
                value = read()
            except CheckpointError as exc:
                problem = str(exc)
        if (problem := broadcast_object(problem, self.ctx)) is not None:
            raise CheckpointError(problem)
        return value

    def close(self) -> None:
        """Free the samplers' engine (vLLM: its memory and its groups), so that another run can
        start in this process, and give back the run directory's lock; the process group stays.
        A torch sampler has nothing to free."""
        self.batches.close()
        for sampler in (self.samplers.train, self.samplers.eval):
            if hasattr(sampler, "close"):
                sampler.close()
        if self.ctx.is_main:
            unlock_run_dir(self.run_dir)
