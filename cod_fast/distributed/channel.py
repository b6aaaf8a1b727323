"""The messages between trainers and rollout workers, over torch.distributed (docs/async.md).

Ranks 0..T-1 train, ranks T..W-1 sample. Three groups besides the trainers' own, made in the
same order on every rank (torch requires every rank to take part in making a group):
- `workers`: the rollout workers (their samplers' barriers);
- `weights`: trainer 0 and the workers, for broadcasts of the policy (NCCL on GPUs, gloo on
  the CPU), one per parameter. Trainer 0 copies each version it will send as it trains it, and
  broadcasts the copy only once every worker waits for it (the worker has sent the batch before
  the first one sampled with that version), then waits for the broadcast: no broadcast stays in
  flight while trainer 0 uses its other groups or synchronises the device (torch requires async
  work to be waited for before another group is used), so its wait there is bounded;
- `batches`: every rank over gloo, used by trainer 0 and the workers for pickled objects: each
  worker's batches to trainer 0, received by a thread into a queue, so that a worker ahead of
  the trainer never waits for it. The other trainers are members only so that making the group
  is balanced on GPUs (`make_groups`).
No other transport: no sockets, no files.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cod_fast.common.errors import CodFastError
from cod_fast.data.records import Rollout


class RolloutWorkerError(RuntimeError, CodFastError):
    """A rollout worker stopped sending batches (it died, hung or failed)."""


@dataclass(frozen=True)
class Groups:
    """The run's groups for asynchronous RL (None where this rank is not a member)."""

    trainers: int
    """How many ranks train (the first ones)."""
    world_size: int
    workers: dist.ProcessGroup | None
    weights: dist.ProcessGroup | None
    batches: dist.ProcessGroup | None

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.trainers, self.world_size))


LONG_WAIT = timedelta(days=7)
"""The weights and batches groups' timeout: a worker waits there through the whole warm start
and every evaluation; the trainer bounds its own waits (runtime.rollout_timeout_s)."""


def make_groups(rollout_ranks: int, timeout_s: float, rollout_timeout_s: float) -> Groups:
    """Every rank calls this once, right after init_distributed, in the same order;
    `timeout_s` bounds the workers' own collectives, `rollout_timeout_s` trainer 0's wait for
    the workers in a weight broadcast (they are known to wait for it when it starts; a worker
    itself waits there through the warm start and every evaluation)."""
    world_size = dist.get_world_size()
    trainers = world_size - rollout_ranks
    workers = list(range(trainers, world_size))
    rank = dist.get_rank()
    weights_wait = timedelta(seconds=rollout_timeout_s) if rank == 0 else LONG_WAIT
    made = {
        "workers": dist.new_group(workers, timeout=timedelta(seconds=timeout_s)),
        "weights": dist.new_group([0, *workers], timeout=weights_wait),
        # Every rank a member. On GPUs the default group is bound to the device, and torch 2.14
        # (distributed_c10d._new_process_group_helper) has every rank that is not a member of a
        # new group split the default NCCL communicator, while the members of a gloo group do
        # not: with trainers 1..T-1 left out, they would block in that split.
        "batches": dist.new_group(list(range(world_size)), timeout=LONG_WAIT, backend="gloo"),
    }
    member = {"workers": rank in workers, "weights": rank == 0 or rank in workers}
    member["batches"] = member["weights"]
    return Groups(
        trainers=trainers,
        world_size=world_size,
        **{name: group if member[name] else None for name, group in made.items()},
    )


@dataclass
class Start:
    """What trainer 0 tells the workers as RL starts (or resumes)."""

    first_batch: int
    """The first batch to sample (the RL step the trainer is at), and the version of the
    weights that follow."""
    last_batch: int
    """The last batch of the run (below first_batch: nothing to sample, the run is over)."""
    sampler_states: list[Any] | None = None
    """Each worker's sampler state from the checkpoint (None: a fresh start)."""


@dataclass
class WorkerBatch:
    """One worker's share of one batch."""

    batch: int
    version: int
    """The weights version it was sampled with."""
    worker: int
    rollouts: list[Rollout]
    sampler_state: Any
    """The worker's sampler state after sampling it (a checkpoint's, to resume the stream)."""
    sample_s: float
    error: str | None = None
    """Set instead of rollouts when the worker failed (the text of its error)."""


def send_start(start: Start | None, group: dist.ProcessGroup) -> Start:
    """Trainer 0 sends `start`; a worker passes None and gets it."""
    box = [start]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def send_batch(part: WorkerBatch, group: dist.ProcessGroup) -> None:
    """A worker's share of a batch, to trainer 0."""
    dist.send_object_list([part], dst=0, group=group)


class WeightPublisher:
    """Trainer 0's side of the weight broadcasts. `publish` copies a trained version (in the
    workers' dtype) with the batch after which the workers wait for it; `flush` broadcasts, in
    order, every copied version whose batch has arrived, and waits for each broadcast before it
    returns. A run that stops drops the copies no worker waits for."""

    def __init__(self, group: dist.ProcessGroup | None, dtype: torch.dtype):
        self.group, self.dtype = group, dtype
        self.pending: deque[tuple[int, list[torch.Tensor]]] = deque()
        """(ready after batch, the copies of the parameters) of each version not sent yet."""

    def publish(
        self, parameters: Iterable[tuple[str, torch.Tensor]], is_main: bool, ready_after: int
    ) -> None:
        """Every trainer rank calls this with `full_parameters(policy)` (its gathers are
        collectives of the trainers); only the main rank keeps the copies."""
        copies = [
            tensor.detach().to(dtype=self.dtype, copy=True).contiguous()
            for _, tensor in parameters
            if is_main
        ]
        if is_main:
            self.pending.append((ready_after, copies))

    def flush(self, arrived: int) -> None:
        """Send every version whose workers wait for it: its batch `ready_after` <= `arrived`,
        the last batch every worker has sent."""
        while self.pending and self.pending[0][0] <= arrived:
            _, copies = self.pending.popleft()
            works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in copies]
            wait_all(works)


def wait_all(works: list[dist.Work]) -> None:
    """Wait for every work, then raise the first failure: a broadcast that fails (a worker
    died or timed out) must not leave the ones after it pending while the trainer goes on to
    use another group (on NCCL that stalls the trainer). A failure closes the connection, so
    the ones after it fail at once (gloo's pair closure; NCCL's watchdog aborts the
    communicator)."""
    failure: RuntimeError | None = None
    for work in works:
        try:
            work.wait()
        except RuntimeError as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def receive_weights(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """A worker's side of one publish: every parameter, in place, in named_parameters order (the
    trainer's full_parameters order: the same model class)."""
    with torch.no_grad():
        for _, param in model.named_parameters():
            dist.broadcast(param.data, src=0, group=group)


class BatchReceiver:
    """Trainer 0's side of the batches: a thread receives every worker's parts in batch order
    into a queue; `get` waits for one whole batch."""

    def __init__(self, group: dist.ProcessGroup, worker_ranks: list[int], first: int, batches: int):
        self.group, self.ranks = group, worker_ranks
        self.arrived = first - 1
        """The last batch every worker's part of has arrived (set by the thread)."""
        self.queue: queue.Queue[WorkerBatch | BaseException] = queue.Queue()
        self.thread = threading.Thread(target=self._receive, args=(batches,), daemon=True)
        self.thread.start()

    def _receive(self, batches: int) -> None:
        try:
            for _ in range(batches):
                for rank in self.ranks:
                    box: list[Any] = [None]
                    dist.recv_object_list(box, src=rank, group=self.group)
                    self.queue.put(box[0])
                self.arrived = box[0].batch
        except BaseException as exc:  # the main thread reports it, with the step it was at
            self.queue.put(exc)

    def get(
        self,
        batch: int,
        timeout_s: float,
        stop: Callable[[], bool],
        idle: Callable[[], None] = lambda: None,
    ) -> list[WorkerBatch]:
        """Every worker's part of `batch` (they arrive in batch order); raises
        RolloutWorkerError when a worker failed, the connection broke, or nothing came for
        `timeout_s` seconds. `stop()` true (a signal) ends the wait the same way; `idle()` runs
        before every wait (the weight broadcasts that batches just arrived make due)."""
        parts: list[WorkerBatch] = []
        deadline = time.monotonic() + timeout_s
        while len(parts) < len(self.ranks):
            idle()
            try:
                item = self.queue.get(timeout=0.2)
            except queue.Empty:
                if stop():
                    raise RolloutWorkerError(f"stopped while waiting for batch {batch}") from None
                if time.monotonic() > deadline:
                    waiting = self.ranks[len(parts) :]
                    raise RolloutWorkerError(
                        f"no batch {batch} from rollout rank(s) {waiting} within {timeout_s:g} s "
                        "(runtime.rollout_timeout_s): a worker hangs or is far slower than "
                        "expected; see its log, or raise runtime.rollout_timeout_s"
                    ) from None
                continue
            if isinstance(item, BaseException):
                raise RolloutWorkerError(
                    f"lost the rollout workers while waiting for batch {batch} "
                    f"({type(item).__name__}: {str(item).splitlines()[0] if str(item) else ''}); "
                    "a worker process ended: see its log"
                ) from item
            if item.error is not None:
                raise RolloutWorkerError(
                    f"rollout worker {item.worker} failed on batch {item.batch}: {item.error}"
                )
            if item.batch != batch:
                raise RolloutWorkerError(
                    f"rollout worker {item.worker} sent batch {item.batch} where batch {batch} "
                    "was due (the workers and the trainer disagree on the run's steps)"
                )
            parts.append(item)
        return parts
