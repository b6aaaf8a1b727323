"""The learning rate of every step: the warm start's and RL's, each a function of the step alone.

A resumed run needs no scheduler state: the step it resumes at gives the same learning rate the
uninterrupted run had there. Steps count as the trainer counts them, warm-start and RL steps
together, from 0 (the step about to run); `warm_steps` is train.warm_start_steps.

- The warm start: a linear warmup over train.warm_start_warmup steps, times a constant or a
  cosine from the peak down to 10% of it over the warm start.
- RL: a linear warmup over train.lr_warmup RL steps (RL step j, from 1, uses lr x j / lr_warmup),
  then train.lr_schedule: `constant` lr, or a `cosine` or `linear` decay from lr on the first
  step after the warmup down to train.lr_min_ratio x lr as the last RL step ends.

Both decays reach their floor as the phase ends, one step past its last: the last step still
trains when the floor is 0 (lr_min_ratio's default). That is how TRL's schedules (transformers'
`get_linear_schedule_with_warmup`, `get_cosine_schedule_with_warmup`) and verl's
(verl/utils/torch_functional.py, with `min_lr_ratio`) step after their warmup, so a run moved
from either keeps its learning rates there.
"""

from __future__ import annotations

import math

from cod_fast.config.run import TrainConfig

WARM_START_FLOOR = 0.1
"""The warm start's cosine ends at this share of its peak."""


def warm_start_lr(train: TrainConfig, step: int, warm_steps: int) -> float:
    """The learning rate of warm-start step `step` (0-based)."""
    peak = train.warm_start_lr * min(1.0, (step + 1) / max(train.warm_start_warmup, 1))
    if train.warm_start_schedule == "constant":
        return peak
    progress = min(step, warm_steps) / max(warm_steps, 1)
    return peak * _cosine(progress, WARM_START_FLOOR)


def rl_lr(train: TrainConfig, step: int, warm_steps: int) -> float:
    """The learning rate of step `step` (0-based over the run), an RL step: warmup, then the
    schedule's decay over the train.steps - lr_warmup steps after it."""
    rl_step, warmup = step - warm_steps + 1, train.lr_warmup
    if rl_step <= warmup or train.lr_schedule == "constant":
        return train.lr * min(1.0, rl_step / max(warmup, 1))
    progress = min(1.0, (rl_step - 1 - warmup) / max(train.steps - warmup, 1))
    if train.lr_schedule == "cosine":
        return train.lr * _cosine(progress, train.lr_min_ratio)
    return train.lr * (train.lr_min_ratio + (1 - train.lr_min_ratio) * (1 - progress))


def _cosine(progress: float, floor: float) -> float:
    """Half a cosine from 1 at progress 0 down to `floor` at progress 1."""
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
