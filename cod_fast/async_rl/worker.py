"""A rollout worker: the run's driver and sampler in a process of their own (docs/async.md).

It loads the model (in the compute dtype; the weights come from the trainer), waits for the
start message, then for each batch b from there: takes the weight broadcasts until it holds
version V(b) (cod_fast.async_rl.staleness), rolls out its share of batch b's packs and sends
them to trainer 0 with the version and its sampler's state. It samples ahead of the trainer as
far as V allows and no further; it never trains.
"""

from __future__ import annotations

import time
import traceback

import torch

from cod_fast.async_rl.staleness import next_broadcast, weights_version
from cod_fast.config import Config
from cod_fast.distributed.channel import (
    Groups,
    Start,
    WorkerBatch,
    receive_weights,
    send_batch,
    send_start,
)
from cod_fast.distributed.context import DistContext
from cod_fast.distributed.host_memory import keep_freed_memory
from cod_fast.distributed.threads import apply_threads
from cod_fast.envs import make_envs
from cod_fast.eval.evaluate import run_eval_sampling
from cod_fast.model.loading import load_policy, resolve_dtype
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.choice import build_samplers
from cod_fast.rollout.driver import DriverSettings, RolloutDriver
from cod_fast.run.vocab import run_tokenizer
from cod_fast.train.batches import rl_packs


class RolloutWorker:
    """One rollout rank of an asynchronous run."""

    def __init__(self, cfg: Config, ctx: DistContext, groups: Groups):
        self.cfg, self.groups = cfg, groups
        self.index = ctx.rank - groups.trainers
        self.count = groups.world_size - groups.trainers
        # The workers among themselves: worker i samples like rank i of a synchronous run of
        # `count` processes (its sampler seed and its share of every batch's packs).
        self.ctx = DistContext(
            rank=self.index,
            world_size=self.count,
            local_rank=ctx.local_rank,
            device=ctx.device,
            mesh=None,
            group=groups.workers,
            role="rollout",
            rollout_ranks=self.count,
        )
        if cfg.runtime.keep_freed_memory and ctx.device.type == "cpu":
            keep_freed_memory()
        apply_threads(cfg.runtime.threads)  # before its sampler: vLLM's CPU engine fixes them
        envs = make_envs(cfg.rollout.environments)
        settings = DriverSettings.from_config(cfg)
        torch.manual_seed(cfg.train.seed)
        tokenizer = run_tokenizer(cfg, envs, settings, is_main=False)
        dtype = resolve_dtype(cfg.model, ctx.device)
        self.model, tokenizer = load_policy(
            cfg.model, ctx.device, cfg.train.seed, tokenizer, dtype=dtype
        )
        self.model.eval().requires_grad_(False)
        chat = ChatFormat.for_model(tokenizer, cfg.model)
        self.samplers = build_samplers(cfg, self.model, tokenizer, self.ctx, run_eval_sampling(cfg))
        self.sampler = self.samplers.train
        self.driver = RolloutDriver(envs, self.sampler, chat, settings)
        self.version = -1

    def _take_weights(self, version: int) -> None:
        """The broadcast of `version` (every parameter, in place), then into the engine."""
        receive_weights(self.model, self.groups.weights)
        if self.samplers.owns_weights:  # vLLM: its own copy
            self.sampler.push_weights(self.model.named_parameters())
        self.version = version

    def run(self) -> int:
        """Sample every batch from the trainer's start to the run's end; the batches sent."""
        start: Start = send_start(None, self.groups.weights)
        if start.first_batch > start.last_batch:  # the run ended before RL
            return 0
        states = start.sampler_states
        if states is not None and len(states) == self.count:  # else new streams (other R)
            self.sampler.load_state_dict(states[self.index])
        self._take_weights(start.first_batch)
        train, sent = self.cfg.train, 0
        for batch in range(start.first_batch, start.last_batch + 1):
            need = weights_version(
                batch, train.max_staleness, train.sync_interval, start.first_batch
            )
            while self.version < need:
                self._take_weights(next_broadcast(self.version, train.sync_interval))
            send_batch(self._sample(batch), self.groups.batches)
            sent += 1
        return sent

    def _sample(self, batch: int) -> WorkerBatch:
        """This worker's share of `batch`; a failure is sent as its text (the trainer stops
        with it), then raised here."""
        t0 = time.perf_counter()
        mine = rl_packs(self.cfg, batch)[self.index :: self.count]
        try:
            rollouts = self.driver.run(
                mine, self.cfg.rollout.group_size, keyed=self.cfg.rollout.keyed_sampling
            )
        except Exception as exc:
            text = "".join(traceback.format_exception_only(exc)).strip()
            send_batch(
                WorkerBatch(batch, self.version, self.index, [], None, 0.0, error=text),
                self.groups.batches,
            )
            raise
        return WorkerBatch(
            batch,
            self.version,
            self.index,
            rollouts,
            self.sampler.state_dict(),
            time.perf_counter() - t0,
        )

    def close(self) -> None:
        for sampler in (self.samplers.train, self.samplers.eval):
            sampler.close()
