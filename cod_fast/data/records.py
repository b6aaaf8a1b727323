"""Rollout records: what the sampler and the environments hand to advantages and packing.

Plain dataclasses, no torch. A `Rollout` is one group member's run through one pack
(docs/concepts.md section 1): solve episodes 0..K-1 interleaved with update episodes 0..K-2 (none in
task-by-task mode). Each `Episode` holds its turns; each `Turn` holds token ids and per-token
log-probs, which packing (section 5) turns into sequences and trainable segments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "error"]
EpisodeKind = Literal["solve", "update"]

FINISH_REASONS = ("stop", "length", "error")
EPISODE_KINDS = ("solve", "update")


@dataclass(kw_only=True)
class Turn:
    """One model response and the context it was sampled from."""

    prompt_ids: list[int]
    """The full context the model read for this turn (system prompt, earlier turns, observation)."""
    response_ids: list[int]
    """The sampled response tokens; these are the trainable tokens."""
    response_logprobs: list[float]
    """The sampler's log-prob of each response token."""
    finish_reason: FinishReason = "stop"
    """Why sampling stopped: a stop token, the length cap, or an error."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("Turn.prompt_ids must be non-empty")
        if not self.response_ids:
            raise ValueError("Turn.response_ids must be non-empty")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Turn.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )
        n = len(self.response_ids)
        if len(self.response_logprobs) != n:
            raise ValueError(
                f"Turn.response_logprobs has {len(self.response_logprobs)} entries but "
                f"response_ids has {n}; there must be one log-prob per response token"
            )


@dataclass(kw_only=True)
class Episode:
    """A solve-task or update-context episode of one group member in one pack."""

    pack_id: int
    """Which pack (same pack_seed and task list for every group member)."""
    member: int
    """The group member g in 0..G-1."""
    kind: EpisodeKind
    """`solve` (task k) or `update` (writes the hints used by task k+1)."""
    task_index: int
    """Position k in the pack."""
    turns: list[Turn]
    """The model responses, in order."""
    reward: float
    """r_k for a solve episode, the hint reward h_k for an update episode."""
    advantage: float | None = None
    """Filled in by the advantage code; every token of every turn gets it."""
    env: str = ""
    """Task family; picks the OPD teacher."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form diagnostics (feedback text, parsed hints, ...)."""

    def __post_init__(self) -> None:
        if self.kind not in EPISODE_KINDS:
            raise ValueError(f"Episode.kind must be one of {EPISODE_KINDS}, got {self.kind!r}")
        if self.task_index < 0:
            raise ValueError(f"Episode.task_index must be >= 0, got {self.task_index}")
        if self.member < 0:
            raise ValueError(f"Episode.member must be >= 0, got {self.member}")
        if not self.turns:
            raise ValueError(f"Episode {self.key} has no turns; it needs at least one")
        if not math.isfinite(self.reward):
            raise ValueError(f"Episode {self.key} has a non-finite reward {self.reward!r}")
        if self.advantage is not None and not math.isfinite(self.advantage):
            raise ValueError(f"Episode {self.key} has a non-finite advantage {self.advantage!r}")

    @property
    def key(self) -> tuple:
        """(pack_id, member, kind, task_index): unique within a training batch."""
        return (self.pack_id, self.member, self.kind, self.task_index)


@dataclass(kw_only=True)
class Rollout:
    """One group member's run through one pack, episodes in the order they ran."""

    pack_id: int
    """Which pack."""
    member: int
    """The group member g."""
    env: str = ""
    """Task family of the pack."""
    episodes: list[Episode]
    """solve 0, update 0, solve 1, ..., solve K-1 (no update episodes in task-by-task mode)."""

    def __post_init__(self) -> None:
        for episode in self.episodes:
            if (episode.pack_id, episode.member) != (self.pack_id, self.member):
                raise ValueError(
                    f"episode {episode.key} does not belong to rollout "
                    f"(pack_id={self.pack_id}, member={self.member})"
                )
        solve = sorted(e.task_index for e in self.episodes if e.kind == "solve")
        update = sorted(e.task_index for e in self.episodes if e.kind == "update")
        num_tasks = len(solve)
        if num_tasks == 0 or solve != list(range(num_tasks)):
            raise ValueError(
                f"rollout (pack_id={self.pack_id}, member={self.member}) must have solve "
                f"episodes with task indices 0..K-1 exactly once, got {solve}"
            )
        if update and update != list(range(num_tasks - 1)):
            raise ValueError(
                f"rollout (pack_id={self.pack_id}, member={self.member}) has K={num_tasks} tasks, "
                f"so its update episodes must have task indices 0..{num_tasks - 2} exactly once, "
                f"got {update}"
            )

    @property
    def num_tasks(self) -> int:
        """K, the number of tasks in the pack."""
        return sum(e.kind == "solve" for e in self.episodes)

    @property
    def task_rewards(self) -> list[float]:
        """Solve rewards r_0..r_{K-1}, by task index."""
        return [e.reward for e in sorted(self._of_kind("solve"), key=lambda e: e.task_index)]

    @property
    def hint_rewards(self) -> list[float]:
        """Update rewards h_0..h_{K-2}, by task index (empty in task-by-task mode)."""
        return [e.reward for e in sorted(self._of_kind("update"), key=lambda e: e.task_index)]

    @property
    def malformed(self) -> bool:
        """Whether a judge flagged one of its episodes as ungradable (`info["malformed"]`,
        cod_fast.envs.judge): such a rollout is left out of its pack's advantage group."""
        return any(e.info.get("malformed") for e in self.episodes)

    @property
    def graded(self) -> bool:
        """Whether every episode has its advantage (false for a rollout left out of its group)."""
        return all(e.advantage is not None for e in self.episodes)

    def _of_kind(self, kind: EpisodeKind) -> list[Episode]:
        return [e for e in self.episodes if e.kind == kind]
