"""The text of solve-task and update-context prompts (docs/concepts.md sections 1-2), in two styles.

Solve: the task's own statement with the current hints under a heading. Update: the previous
hints, then the task's trajectory (its statement without hints, then `Step i: Observation ... /
Action ...` pairs, the reward to 3 decimals where the environment reveals it, and the feedback),
and the instruction to end with the hint block. `full` words this for an instruction-following
LLM; `compact` keeps the same structure with the fewest words, for the tiny models a CPU can
train (every prompt token costs a tiny model as much as a response token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cod_fast.rollout.hints import HINT_END, HINT_START


@dataclass
class Trajectory:
    """What the update episode is shown of one solve episode."""

    task_prompt: str
    steps: list[tuple[str, str]] = field(default_factory=list)
    """(observation, action) pairs in order."""
    reward: float | None = None
    """None when the environment hides the reward from the update episode."""
    feedback: str = ""


def render_trajectory(traj: Trajectory) -> str:
    lines = [traj.task_prompt, ""]
    for i, (observation, action) in enumerate(traj.steps, start=1):
        lines += [f"Step {i}: Observation: {observation}", f"Action: {action}"]
    if traj.reward is not None:
        lines.append(f"Reward: {traj.reward:.3f}")
    if traj.feedback:
        lines.append(f"Feedback: {traj.feedback}")
    return "\n".join(lines)


@dataclass(frozen=True)
class PromptStyle:
    hints_heading: str
    """The heading the solve prompt puts the hints under."""
    update_system: str
    """The update episode's system prompt."""
    update_instruction: str
    """Closes the update episode's user prompt ('' for none)."""

    def solve_system(self, task_prompt: str, context: str) -> str:
        return f"{task_prompt}\n\n{self.hints_heading}\n{context}"

    def update_user(self, context: str, traj: Trajectory) -> str:
        text = f"Previous hints:\n{context}\n\nLast task:\n{render_trajectory(traj)}"
        return f"{text}\n\n{self.update_instruction}" if self.update_instruction else text


PROMPT_STYLES = {
    "full": PromptStyle(
        hints_heading="## Hints that might help",
        update_system=(
            "You are improving the hints an agent carries from task to task in an environment "
            "whose rules are hidden. Read the previous hints and what happened in the last task, "
            "work out what the environment's rules are, and write new hints that replace the old "
            f"ones. End your answer with the hints between the lines\n{HINT_START}\n...\n{HINT_END}"
        ),
        update_instruction=f"Write the updated hints now, ending with\n{HINT_START}\n...\n{HINT_END}",
    ),
    "compact": PromptStyle(
        hints_heading="## Hints",
        update_system="Rewrite the hints.",
        update_instruction="",
    ),
}
