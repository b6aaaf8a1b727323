"""The text of solve-task and update-context prompts (SPEC.md sections 1-2).

Solve: the task's own statement with the current hints under `## Hints that might help`.
Update: the previous hints, then the task's trajectory (its statement without hints, then
`Step i: Observation ... / Action ...` pairs, the reward to 3 decimals where the environment
reveals it, and the feedback), and the instruction to end with the hint block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cod_fast.rollout.hints import HINT_END, HINT_START

UPDATE_SYSTEM = (
    "You are improving the hints an agent carries from task to task in an environment whose "
    "rules are hidden. Read the previous hints and what happened in the last task, work out what "
    "the environment's rules are, and write new hints that replace the old ones. End your answer "
    f"with the hints between the lines\n{HINT_START}\n...\n{HINT_END}"
)


@dataclass
class Trajectory:
    """What the update episode is shown of one solve episode."""

    task_prompt: str
    steps: list[tuple[str, str]] = field(default_factory=list)
    """(observation, action) pairs in order."""
    reward: float | None = None
    """None when the environment hides the reward from the update episode."""
    feedback: str = ""


def solve_system_prompt(task_prompt: str, context: str) -> str:
    return f"{task_prompt}\n\n## Hints that might help\n{context}"


def render_trajectory(traj: Trajectory) -> str:
    lines = [traj.task_prompt, ""]
    for i, (observation, action) in enumerate(traj.steps, start=1):
        lines += [f"Step {i}: Observation: {observation}", f"Action: {action}"]
    if traj.reward is not None:
        lines.append(f"Reward: {traj.reward:.3f}")
    if traj.feedback:
        lines.append(f"Feedback: {traj.feedback}")
    return "\n".join(lines)


def update_user_prompt(context: str, traj: Trajectory) -> str:
    return (
        f"Previous hints:\n{context}\n\nLast task:\n{render_trajectory(traj)}\n\n"
        f"Write the updated hints now, ending with\n{HINT_START}\n...\n{HINT_END}"
    )
