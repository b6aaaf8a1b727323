"""`cod-fast train`: colocated sampling and fused-loss training, one process per device.

Every step, top to bottom:
  rollouts (this rank's packs x group, one batched sampler call per driver step; with rollout
     workers, the batch they sampled ahead: cod_fast.train.batches, cod_fast.async_rl)
  -> gathered on every rank -> advantages (CoD or task-by-task, RED-weight; cod_fast.algo)
  -> packing into micro-batches balanced over the ranks, the step's global denominator
  -> old / reference log-probs where the config asks for them (bypass by default)
  -> fused loss, grad clip, AdamW (cod_fast.train.step; FSDP2 under torchrun)
  -> the new weights pushed into the sampler (vLLM: one reload, gathered one parameter at a
     time; a torch sampler that shares the training module needs none)
  -> the step's record (cod_fast.train.record), a checkpoint when due (cod_fast.train.checkpointer).
Every sampler sleeps before any training step, the warm start's too (vLLM frees its weights and
KV cache), and the push of the weights it samples next wakes it, before rollouts and evaluations.
A warm start of supervised steps on scripted demonstrations can come first (cod_fast.train.warm_start).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cod_fast.algo.assign import assign_advantages
from cod_fast.config import Config, LossConfig
from cod_fast.config.io import dump_yaml
from cod_fast.data.diagnostics import credit_metrics
from cod_fast.data.metrics import PositionSummary
from cod_fast.data.packing import (
    MicroBatch,
    build_microbatch,
    plan_microbatches,
    rollout_sequences,
    step_totals,
)
from cod_fast.data.records import Rollout
from cod_fast.distributed.channel import RolloutWorkerError
from cod_fast.distributed.context import (
    DistContext,
    all_reduce_max,
    init_distributed,
    resolve_device,
)
from cod_fast.distributed.fsdp import full_parameters, shard_policy
from cod_fast.distributed.host_memory import keep_freed_memory
from cod_fast.distributed.threads import apply_threads
from cod_fast.envs import make_envs
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.eval.evaluate import evaluate, run_eval_plans, run_eval_sampling, run_eval_settings
from cod_fast.model.loading import load_policy, master_dtype, resolve_dtype
from cod_fast.model.policy import Policy
from cod_fast.ops import aggregation_denominator
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.choice import plan_samplers, start_samplers
from cod_fast.rollout.driver import DriverSettings, RolloutDriver
from cod_fast.rollout.sampler import Sampler
from cod_fast.rollout.scripted import demonstrations
from cod_fast.run.directory import lock_run_dir, unlock_run_dir
from cod_fast.run.log import RunLog
from cod_fast.run.vocab import run_tokenizer
from cod_fast.train.batches import BatchSource, LocalBatches, mixed_packs
from cod_fast.train.checkpointer import Checkpointer
from cod_fast.train.record import BatchSteps, mean, step_record
from cod_fast.train.replay import ReplayBatches
from cod_fast.train.schedule import rl_lr, warm_start_lr
from cod_fast.train.step import NonFiniteError, on_device, runnable, train_step
from cod_fast.train.teachers import Teachers
from cod_fast.train.warm_start import SFT_LOSS

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Signals that finish the step, checkpoint and end the run (a second one ends it at once)."""


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
            sequence_parallel=cfg.train.sequence_parallel,
        )
        self.device = self.ctx.device
        if cfg.runtime.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()
        apply_threads(cfg.runtime.threads)
        self.run_dir = Path(cfg.runtime.run_dir)
        if self.ctx.is_main:  # the one writer of the run directory, from before its first write
            lock_run_dir(self.run_dir)
        self.log = RunLog(
            self.run_dir, enabled=self.ctx.is_main, trackers=cfg.runtime.trackers, config=cfg
        )
        self.mix = cfg.rollout.environments
        self.envs = make_envs(self.mix)
        self.settings = DriverSettings.from_config(cfg)
        self.warm_steps = cfg.train.warm_start_steps
        self.total_steps = self.warm_steps + cfg.train.steps
        torch.manual_seed(cfg.train.seed)
        self.tokenizer = run_tokenizer(cfg, self.envs, self.settings, self.ctx.is_main)
        # Under FSDP2 in host memory: fully_shard moves one unit at a time to the device.
        master, host = self.master_dtype, ("cpu" if self.ctx.sharded else None)
        model, self.tokenizer = load_policy(
            cfg.model, self.device, cfg.train.seed, self.tokenizer, dtype=master, place=host
        )
        self.chat = ChatFormat.for_model(self.tokenizer, cfg.model)
        self.impl = None if cfg.runtime.kernel_impl == "auto" else cfg.runtime.kernel_impl
        plan = plan_samplers(cfg, model, self.tokenizer, self.ctx)
        self.policy = shard_policy(
            Policy(model, self.impl, self.ctx.sequence_group),
            self.ctx,
            compute_dtype=self.compute_dtype,
        )
        # vLLM starts after sharding, when its share of the GPU is free.
        self.samplers = start_samplers(cfg, plan, self.tokenizer, self.ctx, run_eval_sampling(cfg))
        self.sampler: Sampler = self.samplers.train
        self.driver = RolloutDriver(self.envs, self.sampler, self.chat, self.settings)
        self.batches = batches or LocalBatches(cfg, self.driver, self.ctx)
        # With rollout workers this process's samplers only evaluate (vLLM's external launcher
        # makes its groups over every rank, so a trainer still starts an engine then too).
        self.local_sampling = self.ctx.rollout_ranks == 0
        self.sampler_step: int | None = None
        """The step whose weights the samplers hold, awake (None: asleep, or not pushed yet)."""
        if cfg.train.replay_batches:
            vocab_size = model.get_input_embeddings().num_embeddings
            self.batches = ReplayBatches(self.batches, cfg.train, vocab_size)
        self.teachers = (
            Teachers(cfg.algo.teachers, cfg.model, self.device, self.tokenizer, self.impl)
            if cfg.algo.teachers
            else None
        )
        self.optimizer = self._optimizer(warm=self.warm_steps > 0)
        self.checkpointer = Checkpointer(
            cfg,
            self.ctx,
            policy=self.policy,
            sampler=self.sampler,
            batches=self.batches,
            log=self.log,
            tokenizer=self.tokenizer,
            dtypes=(self.compute_dtype, self.master_dtype),
            new_optimizer=self._optimizer,
        )
        self.reference: Policy | None = None
        self.step = 0
        self.stop_requested = False
        self.stop_signal: int | None = None
        self.on_eval: Callable[[EvalProgress], None] | None = None
        self.signals = 0
        self.on_signal: Callable[[int], None] | None = None

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
                self.checkpointer.save(self.step, self.optimizer)
                return
            if self.step == self.warm_steps:
                self._begin_rl()
            try:
                record = self._warm_step() if self.step < self.warm_steps else self._rl_step()
            except RolloutWorkerError:
                self.checkpointer.save(self.step, self.optimizer)  # every step trained so far
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
                self.checkpointer.save(self.step, self.optimizer)
            rl_steps = self.step - self.warm_steps
            due = cfg.runtime.eval_every and rl_steps > 0 and rl_steps % cfg.runtime.eval_every == 0
            if due and self.step < self.total_steps:
                self._evaluate(f"rl step {rl_steps}")

    def _warm_step(self) -> dict[str, Any]:
        """A supervised step on the explorer's demonstrations; returns its record."""
        t0 = time.perf_counter()
        self._set_lr(warm_start_lr(self.cfg.train, self.step, self.warm_steps))
        rollouts = self._demonstrations()
        steps = self._update(rollouts, SFT_LOSS, mini_batches=1)
        t_trained = time.perf_counter()
        self.step += 1
        times = (t0, t0, t_trained, time.perf_counter())  # demonstrations sample nothing
        return self._record(rollouts, {}, steps, times)

    def _rl_step(self) -> dict[str, Any]:
        """An RL step on the batch source's next batch; returns its record."""
        t0 = time.perf_counter()
        self._set_lr(rl_lr(self.cfg.train, self.step, self.warm_steps))
        if self.local_sampling:  # pushed as the previous RL step ended, unless this is the first
            self._sync_sampler()
        batch = self.batches.next(
            self.step - self.warm_steps, self.policy, lambda: self.stop_requested
        )
        t_sampled = time.perf_counter()
        rollouts = batch.rollouts
        trained = rollouts + batch.replayed
        extra = dict(batch.metrics)
        extra["red_tau"] = assign_advantages(trained, self.cfg.algo)
        extra.update(credit_metrics(rollouts))
        graded = [r for r in trained if r.graded]  # judge-flagged rollouts left out
        extra["malformed_frac"] = mean([float(r.malformed) for r in rollouts])
        extra["ungraded_rollouts"] = len(trained) - len(graded)
        steps = (
            self._update(graded, self.cfg.algo.loss, self.cfg.train.mini_batches)
            if graded
            else BatchSteps()
        )
        t_trained = time.perf_counter()
        self.step += 1
        if self.local_sampling:  # the next step samples: its push is timed as this step's
            self._sync_sampler()
        self.batches.trained(self.step - self.warm_steps, self.policy)
        return self._record(rollouts, extra, steps, (t0, t_sampled, t_trained, time.perf_counter()))

    def _record(self, rollouts: list[Rollout], extra: dict, trained: BatchSteps, times) -> dict:
        """The step's record (cod_fast.train.record); `times` as step_record takes them."""
        lr, envs = self.optimizer.param_groups[0]["lr"], [e.name for e in self.mix]
        world = self.ctx.world_size
        return step_record(
            self.step, self.warm_steps, rollouts, envs, extra, trained, lr, times, world
        )

    def _request_stop(self, signum, frame) -> None:
        """A stop signal: the first and second finish the step and checkpoint it, a third
        stops at once (KeyboardInterrupt); `on_signal` hears each (the CLI says what follows)."""
        self.signals += 1
        if self.signals >= 3:
            raise KeyboardInterrupt
        self.stop_requested, self.stop_signal = True, self.stop_signal or signum
        if self.on_signal is not None:
            self.on_signal(self.signals)

    def _restore_or_start(self, resume: bool) -> None:
        """The run's state from its latest checkpoint (`resume`) or a fresh start, then its
        config written to the run directory."""
        start = self.checkpointer.restore_or_start(resume, self.optimizer)
        self.step, self.optimizer, self.reference = start.step, start.optimizer, start.reference
        self.log.write_config(dump_yaml(self.cfg), self.chat.own_template)

    def _begin_rl(self) -> None:
        """After the warm start: evaluate it, start a fresh optimizer (unless
        train.carry_optimizer keeps the warm start's), freeze the KL reference."""
        if self.warm_steps:
            self._evaluate("after warm start")
            if not self.cfg.train.carry_optimizer:
                self.optimizer = self._optimizer(warm=False)
        self.reference = self.checkpointer.freeze_reference()

    # --- optimizer -----------------------------------------------------------------------------

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

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

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

    def _update(self, rollouts: list[Rollout], loss: LossConfig, mini_batches: int) -> BatchSteps:
        """Optimizer steps over the batch, split into `mini_batches` of whole rollouts, each
        trained train.epochs times over in RL (once in the warm start)."""
        self._sleep_samplers()  # no step trains beside a sampler's memory
        ctx = self.ctx  # a sequence-parallel group: one data rank's micro-batches, N x budget
        budget, world = self.cfg.train.token_budget * ctx.sequence_parallel, ctx.data_world
        share = self.cfg.train.share_prefix
        size = math.ceil(len(rollouts) / mini_batches)
        plans, out = [], BatchSteps()
        for start in range(0, len(rollouts), size):
            episodes = [e for r in rollouts[start : start + size] for e in r.episodes]
            sequences = rollout_sequences(episodes)
            layout = plan_microbatches(sequences, budget, world, share)
            if self.teachers is not None and loss is not SFT_LOSS:  # this rank's sequences
                mine = [sequences[i] for mb in layout[ctx.data_rank] for i in mb]
                out.teacher.append(self.teachers.score(mine, loss, budget, share))
            batches = [
                [build_microbatch([sequences[i] for i in mb], share) for mb in rank]
                for rank in layout
            ]
            packed = sum(mb.num_tokens for rank in batches for mb in rank)
            plans.append((batches[ctx.data_rank], step_totals(batches), packed))
        if loss is not SFT_LOSS:
            for mbs, _, _ in plans:  # all before the first update: the policy that sampled
                self._fill_logprobs(mbs, loss)
        epochs = 1 if loss is SFT_LOSS else self.cfg.train.epochs
        for mbs, (tokens, segments), packed in plans * epochs:  # old log-probs fixed above
            out.tokens += packed
            try:
                result = train_step(
                    self.policy,
                    self.optimizer,
                    mbs,
                    denominator=aggregation_denominator(loss, tokens, segments),
                    loss_config=loss,
                    grad_clip=self.cfg.train.grad_clip,
                    group=self.ctx.group,
                )
            except NonFiniteError as e:  # nothing was updated; the run decides whether to go on
                out.skipped += 1
                out.error = str(e)
                continue
            out.steps.append(result)
        return out

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
            batch = on_device(runnable(mb), self.policy, self.device)
            if recompute:
                mb.old_logp = self.policy(batch, loss_config=loss, mode="logprobs").cpu()
            if self.reference is not None:
                mb.ref_logp = self.reference(batch, loss_config=loss, mode="logprobs").cpu()

    # --- sampler and evaluation ----------------------------------------------------------------

    def _sync_sampler(self) -> None:
        """Ready the samplers to sample with this step's weights: push the policy's into a
        sampler that holds its own copy (train and eval share it), unless it holds this step's
        already. The push wakes a sleeping vLLM engine; nothing else does."""
        if self.sampler_step == self.step:
            return
        if self.samplers.owns_weights:
            self.sampler.push_weights(full_parameters(self.policy))
        self.sampler_step = self.step

    def _sleep_samplers(self) -> None:
        """Every sampler frees what it holds on the device (vLLM: weights and KV cache; torch:
        its decode cache; a no-op for one asleep already); `_sync_sampler` brings them back."""
        for sampler in (self.samplers.train, self.samplers.eval):
            sampler.sleep()
        self.sampler_step = None

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
        if not self.local_sampling:  # the rollout workers sample the next batches
            self._sleep_samplers()

    def _report_eval(self, progress: EvalProgress) -> None:
        if self.on_eval is not None:
            self.on_eval(progress)

    def close(self) -> None:
        """Free the samplers' engine (vLLM: its memory and its groups), so that another run can
        start in this process, and give back the run directory's lock; the process group stays.
        A torch sampler has nothing to free."""
        self.batches.close()
        for sampler in (self.samplers.train, self.samplers.eval):
            sampler.close()
        if self.ctx.is_main:
            unlock_run_dir(self.run_dir)
