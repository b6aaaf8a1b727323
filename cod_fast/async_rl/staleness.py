"""Which weights an asynchronous batch is sampled with (docs/async.md).

Versions count RL updates: version v is the policy after v RL optimizer steps (version 0 is
the policy RL starts from). With `train.max_staleness` K and `train.sync_interval` N, the
trainer broadcasts version v when v is a multiple of N, and batch b is sampled with version

    V(b) = max(first, N * ceil((b - K) / N))     (b - K below 0 counts as 0)

where `first` is the version the workers started from (0, or the step a run resumed at). So
b - V(b) <= K always (N <= K + 1), and V(b) <= b: a batch never waits for weights the trainer
cannot have made yet. The rule takes no account of timing, so a run is the same however fast
its processes are; K = 0 is the synchronous loop.

A worker takes a version just before the first batch sampled with it, V(b) = v first for
b = v + K - N + 1, so it waits for v once it has sent batch v + K - N (`ready_after`): the
trainer broadcasts v only then, and waits for the broadcast before it uses another group.
"""

from __future__ import annotations

import math


def weights_version(batch: int, max_staleness: int, sync_interval: int, first: int = 0) -> int:
    """V(batch): the version batch `batch` is sampled with."""
    needed = max(0, batch - max_staleness)
    return max(first, sync_interval * math.ceil(needed / sync_interval))


def next_broadcast(version: int, sync_interval: int) -> int:
    """The first version after `version` that the trainer broadcasts."""
    return (version // sync_interval + 1) * sync_interval


def broadcasts(
    version: int, last_batch: int, max_staleness: int, sync_interval: int, first: int = 0
) -> bool:
    """Whether the trainer broadcasts `version` after training it: a multiple of the interval
    past `first` that some batch up to `last_batch` is sampled with (none after the last one,
    which no worker would receive)."""
    if version <= first or version % sync_interval:
        return False
    return version <= weights_version(last_batch, max_staleness, sync_interval, first)


def ready_after(version: int, max_staleness: int, sync_interval: int, first: int = 0) -> int:
    """The batch after which every worker waits for broadcast `version` (a version the trainer
    broadcasts: `first`, or a multiple of the interval past it): the one before the first batch
    sampled with it."""
    if version <= first:
        return first - 1
    return version + max_staleness - sync_interval
