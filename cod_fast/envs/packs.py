"""Packs of tasks (docs/concepts.md section 6, pack strategies) and stable pack seeds.

- `cod`: K different tasks sharing the pack's hidden rule (task indices 0..K-1);
- `ralph_sample`: the first task of the pack repeated K times (the Ralph loop on one task);
- `ralph_full`: every task of the pack expanded into a pack of K copies of itself.
Pack seeds come from a split name and an index, so the same eval packs come back for every
checkpoint and never overlap the training packs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from cod_fast.envs.base import derive_seed

Strategy = Literal["cod", "ralph_sample", "ralph_full"]
STRATEGIES = ("cod", "ralph_sample", "ralph_full")


@dataclass(frozen=True)
class PackSpec:
    """One pack as the driver runs it: which pack seed, and which task index at each position."""

    pack_id: int
    pack_seed: int
    task_indices: tuple[int, ...]
    env: str | None = None
    """The pack's environment in a mixed-domain run (None: the driver's only one)."""


def pack_seeds(split: str, count: int, base_seed: int = 0, start: int = 0) -> list[int]:
    """Seeds of packs start..start+count-1 of a split ('train', 'eval', ...)."""
    return [derive_seed("pack", split, base_seed, i) for i in range(start, start + count)]


def draw_env(names: list[str], weights: list[float], split: str, base_seed: int, index: int) -> str:
    """The environment of pack `index` of a split in a mixed-domain run: drawn with
    probability weight / sum(weights), from (split, base seed, index) alone."""
    if len(names) == 1:
        return names[0]
    rng = random.Random(f"env-mix/{split}/{base_seed}/{index}")
    return rng.choices(names, weights)[0]


def make_packs(seeds: list[int], num_tasks: int, strategy: Strategy = "cod") -> list[PackSpec]:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown pack strategy {strategy!r}; choose one of {STRATEGIES}")
    if num_tasks < 1:
        raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
    if strategy == "cod":
        layouts = [(seed, tuple(range(num_tasks))) for seed in seeds]
    elif strategy == "ralph_sample":
        layouts = [(seed, (0,) * num_tasks) for seed in seeds]
    else:
        layouts = [(seed, (k,) * num_tasks) for seed in seeds for k in range(num_tasks)]
    return [
        PackSpec(pack_id=i, pack_seed=seed, task_indices=tasks)
        for i, (seed, tasks) in enumerate(layouts)
    ]
