"""What a model writes as it plays a pack, as text (`cod-fast rollout`).

A rollout's episodes in the order they ran: each solve episode's turns (the context the model
read that turn, new since its previous turn, and its response) and reward, each update episode's
prompt, the response and the hint block parsed from it, which the next task then reads. Text is
decoded with the special tokens kept, so a transcript shows exactly what the model saw.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from cod_fast.data.records import Episode, Rollout


def episode_record(episode: Episode, tokenizer: Any) -> dict[str, Any]:
    """An episode as JSON-able text: kind, task, reward, info and its turns."""
    turns, seen = [], []
    for turn in episode.turns:
        # A later turn's prompt extends the previous prompt + response: show only what is new.
        extends = turn.prompt_ids[: len(seen)] == seen
        context = turn.prompt_ids[len(seen) :] if extends else turn.prompt_ids
        turns.append(
            {
                "context": tokenizer.decode(context, skip_special_tokens=False),
                "response": tokenizer.decode(turn.response_ids, skip_special_tokens=False),
                "finish_reason": turn.finish_reason,
            }
        )
        seen = turn.prompt_ids + turn.response_ids
    return {
        "kind": episode.kind,
        "task": episode.task_index,
        "reward": episode.reward,
        "info": episode.info,
        "turns": turns,
    }


def rollout_record(rollout: Rollout, tokenizer: Any) -> dict[str, Any]:
    """A whole rollout (one member's run through one pack) as JSON-able text."""
    return {
        "pack_id": rollout.pack_id,
        "member": rollout.member,
        "env": rollout.env,
        "task_rewards": rollout.task_rewards,
        "episodes": [episode_record(e, tokenizer) for e in rollout.episodes],
    }


def print_rollout(record: dict[str, Any], console: Console) -> None:
    """A rollout record for a person: one panel per episode, the hints it wrote highlighted."""
    rewards = ", ".join(f"{r:.2f}" for r in record["task_rewards"])
    console.rule(f"pack {record['pack_id']} ({record['env']}): task rewards {rewards}")
    for episode in record["episodes"]:
        body = Text()
        for turn in episode["turns"]:
            body.append(turn["context"], style="cyan")
            body.append(turn["response"], style="bold")
            if turn["finish_reason"] != "stop":
                body.append(f"  [{turn['finish_reason']}]", style="red")
            body.append("\n")
        if episode["kind"] == "update":
            hints = episode["info"].get("hints")
            body.append("hints carried forward: ", style="magenta")
            body.append("(none: no valid hint block)" if hints is None else hints, style="magenta")
        elif "error" in episode["info"]:
            body.append(f"environment error: {episode['info']['error']}", style="red")
        title = f"{episode['kind']} task {episode['task']}: reward {episode['reward']:.3f}"
        console.print(Panel(body, title=title, title_align="left"))
