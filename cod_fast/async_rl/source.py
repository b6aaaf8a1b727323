"""The trainer's batch source when rollout workers sample (docs/async.md).

A `cod_fast.train.batches.BatchSource`, like `LocalBatches`. The first `next` tells the workers where
RL starts and broadcasts the weights they start from; every batch then comes from the workers'
queue, tagged with the version it was sampled with. After each update `trained` copies the new
weights when the staleness rule (cod_fast.async_rl.staleness) says a batch needs them; trainer 0
broadcasts a copy once the workers wait for it (the batch before its first batch has arrived),
checked after each update and while it waits for a batch.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

import torch

from cod_fast.async_rl.staleness import broadcasts, ready_after, weights_version
from cod_fast.distributed.channel import (
    BatchReceiver,
    Groups,
    RolloutWorkerError,
    Start,
    WeightPublisher,
    send_start,
)
from cod_fast.distributed.context import DistContext, broadcast_object
from cod_fast.distributed.fsdp import full_parameters
from cod_fast.train.batches import Batch, sort_rollouts

if TYPE_CHECKING:
    from collections.abc import Callable

    from cod_fast.config import Config
    from cod_fast.model.policy import Policy


class RemoteBatches:
    """Batches from the rollout workers, at most `train.max_staleness` versions old."""

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        groups: Groups,
        dtype: torch.dtype,
    ):
        self.cfg, self.ctx, self.groups = cfg, ctx, groups
        self.rl_steps = cfg.train.steps
        self.publisher = WeightPublisher(groups.weights, dtype)
        self.receiver: BatchReceiver | None = None
        self.first: int | None = None
        self.failure: RolloutWorkerError | None = None
        """A weight broadcast that failed (main rank), raised by the next `next`."""
        self.sampler_states: list[Any] | None = None

    def _rule(self) -> tuple[int, int, int]:
        train = self.cfg.train
        return train.max_staleness, train.sync_interval, self.first or 0

    def _start(self, rl_step: int, policy: Policy) -> None:
        """Tell the workers where RL starts and send them the weights they start from."""
        self.first = rl_step
        if self.ctx.is_main:
            start = Start(rl_step, self.rl_steps - 1, self.sampler_states)
            send_start(start, self.groups.weights)
            batches = self.rl_steps - rl_step
            self.receiver = BatchReceiver(
                self.groups.batches, self.groups.worker_ranks, rl_step, batches
            )
        self._publish(rl_step, policy)

    def _publish(self, version: int, policy: Policy) -> None:
        """Copy `version` (every trainer gathers), and send what the workers wait for."""
        ready = ready_after(version, *self._rule())
        self.publisher.publish(full_parameters(policy), self.ctx.is_main, ready)
        self._flush()

    def _flush(self) -> None:
        """Send what the workers wait for. A broadcast that fails (a worker that hangs past
        runtime.rollout_timeout_s, or died) is kept, and the next `next` stops every trainer
        with it: after the step that trained the version is logged and checkpointed."""
        if self.receiver is None or self.failure is not None:
            return
        try:
            self.publisher.flush(self.receiver.arrived)
        except RuntimeError as exc:  # gloo's timeout or closed connection
            timeout = self.cfg.runtime.rollout_timeout_s
            last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
            cause = re.sub(r"^\[[^\]]*\]\s*", "", last[0])  # gloo's [source file:line] prefix
            self.failure = RolloutWorkerError(
                f"rollout rank(s) {self.groups.worker_ranks} did not take the weights they wait "
                f"for within {timeout:g} s (runtime.rollout_timeout_s; {cause}): a worker hangs "
                "or died; see its log, or raise runtime.rollout_timeout_s"
            )

    def _flushed(self) -> None:
        """`_flush`, raising a failed broadcast's RolloutWorkerError."""
        self._flush()
        if self.failure is not None:
            raise self.failure

    def next(self, rl_step: int, policy: Policy, stop: Callable[[], bool]) -> Batch:
        """Batch `rl_step`, as the workers sampled it; `stop()` true (a signal) ends the wait
        with RolloutWorkerError."""
        if self.first is None:
            self._start(rl_step, policy)
        waited = time.perf_counter()
        got: Any = None
        if self.ctx.is_main:
            assert self.receiver is not None
            try:
                timeout = self.cfg.runtime.rollout_timeout_s
                parts = self.receiver.get(rl_step, timeout, stop, idle=self._flushed)
            except RolloutWorkerError as exc:
                got = str(exc)
            else:
                got = (
                    [r for part in parts for r in part.rollouts],
                    parts[0].version,
                    [part.sampler_state for part in parts],
                    max(part.sample_s for part in parts),
                )
        got = broadcast_object(got, self.ctx)
        if isinstance(got, str):  # every trainer rank stops alike
            raise RolloutWorkerError(got)
        rollouts, version, states, sample_s = got
        max_staleness, interval, first = self._rule()
        expected = weights_version(rl_step, max_staleness, interval, first)
        if version != expected:
            raise RolloutWorkerError(
                f"batch {rl_step} was sampled with weights version {version}, expected "
                f"{expected} (train.max_staleness={max_staleness}, sync_interval={interval})"
            )
        self.sampler_states = states
        return Batch(
            sort_rollouts(rollouts),
            {
                "staleness": rl_step - version,
                "weights_version": version,
                "rollout_wait_s": time.perf_counter() - waited,
                "worker_sample_s": sample_s,
            },
        )

    def trained(self, version: int, policy: Policy) -> None:
        """Broadcast `version` if some later batch is sampled with it."""
        max_staleness, interval, first = self._rule()
        if broadcasts(version, self.rl_steps - 1, max_staleness, interval, first):
            self._publish(version, policy)

    def state(self) -> Any:
        """The workers' sampler states after the last batch trained on: a resumed run's
        workers continue their streams from there."""
        return self.sampler_states

    def load_state(self, state: Any) -> None:
        self.sampler_states = state

    def close(self) -> None:
        """Drop the copies no worker waits for (after the last batch there are none; a run that
        stopped early leaves them unsent). A run that never reached RL (a warm start alone, a
        resume of a finished run, a stop or failure before) tells the workers there is nothing
        to sample, so they end as it does."""
        self.publisher.pending.clear()
        if self.first is None and self.ctx.is_main:
            send_start(Start(first_batch=0, last_batch=-1), self.groups.weights)
