"""Rollout records -> per-episode advantages, written onto the episodes (docs/concepts.md sec. 3).

CoD: per pack, the G members' task rewards [G, K] and hint rewards [G, K-1] give returns
(`cod_returns`), the group baseline gives advantages (`group_advantages`), and RED-weight, when
on, re-weights the whole batch by response length. Task-by-task: each solve episode gets the
GRPO advantage of its own reward.

A rollout a judge flagged as malformed (`Rollout.malformed`) is left out of its pack's group, as
Trinity-RFT drops the trajectories its judge flags: the baseline comes from the other members,
and its episodes keep `advantage` None (`Rollout.graded` is false), so they are not trained. A
pack left with fewer than two members has no baseline and is not trained at all.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from cod_fast.algo.advantages import (
    cod_returns,
    group_advantages,
    red_weight,
    task_by_task_advantages,
)
from cod_fast.config import AlgoConfig
from cod_fast.data.records import Episode, Rollout


def _by_pack(rollouts: list[Rollout]) -> dict[int, list[Rollout]]:
    packs: dict[int, list[Rollout]] = defaultdict(list)
    for rollout in rollouts:
        packs[rollout.pack_id].append(rollout)
    for pack_id, group in packs.items():
        group.sort(key=lambda r: r.member)
        shapes = {(len(r.task_rewards), len(r.hint_rewards)) for r in group}
        if len(shapes) != 1 or len(group) < 2:
            raise ValueError(
                f"pack {pack_id}: the group needs >= 2 members with the same number "
                f"of solve and update episodes, got {len(group)} with {shapes}"
            )
    return packs


def _episodes(rollout: Rollout, kind: str) -> list[Episode]:
    return sorted((e for e in rollout.episodes if e.kind == kind), key=lambda e: e.task_index)


def assign_advantages(rollouts: list[Rollout], algo: AlgoConfig) -> float | None:
    """Set `advantage` on every episode of the batch; returns RED-weight's tau (None if unused)."""
    for members in _by_pack(rollouts).values():
        group = [r for r in members if not r.malformed]
        if len(group) < 2:
            continue
        rewards = torch.tensor([r.task_rewards for r in group], dtype=torch.float64)
        if algo.algorithm == "task_by_task":
            targets = [(task_by_task_advantages(rewards), "solve")]
        else:
            hints = torch.tensor([r.hint_rewards for r in group], dtype=torch.float64)
            hints = hints.reshape(len(group), rewards.shape[1] - 1)
            solve, update = cod_returns(rewards, hints, algo.return_style, algo.window, algo.gamma)
            targets = [
                (group_advantages(solve, algo.std_norm), "solve"),
                (group_advantages(update, algo.std_norm), "update"),
            ]
        for advantages, kind in targets:
            for g, rollout in enumerate(group):
                for episode in _episodes(rollout, kind):
                    episode.advantage = float(advantages[g, episode.task_index])
    if not algo.use_red_weight:
        return None
    episodes = [e for r in rollouts for e in r.episodes if e.advantage is not None]
    adv = torch.tensor([e.advantage for e in episodes], dtype=torch.float64)
    lengths = torch.tensor([sum(len(t.response_ids) for t in e.turns) for e in episodes])
    weighted, tau = red_weight(adv, lengths)
    for episode, value in zip(episodes, weighted.tolist(), strict=True):
        episode.advantage = value
    return tau
