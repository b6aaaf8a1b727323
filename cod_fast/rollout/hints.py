"""Hint blocks and the context line (docs/concepts.md section 2).

The update-context episode must end its answer with a block between the two marker lines; the
stripped text between them replaces the hints. A missing, empty or too short block gives
`Hints: no hint available.` and the hint reward -hint_penalty; a long one is truncated to the
token cap, not rejected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

HINT_START = "--- Start of updated hints ---"
HINT_END = "--- End of updated hints ---"
NO_HINT = "no hint available."


@dataclass(frozen=True)
class ParsedHints:
    text: str | None
    """The new hints, or None when the block was missing, empty or too short."""
    reward: float
    """The update episode's hint reward h_k: 0, or -hint_penalty for a missing block."""
    truncated: bool = False


def parse_hints(
    answer: str,
    *,
    min_chars: int,
    hint_penalty: float,
    max_tokens: int,
    truncate: Callable[[str, int], tuple[str, bool]],
) -> ParsedHints:
    """The hints an update answer writes. The last complete block counts (models that think
    aloud may quote the markers earlier); `truncate(text, max_tokens)` cuts to the token cap."""
    end = answer.rfind(HINT_END)
    start = answer.rfind(HINT_START, 0, end) if end >= 0 else -1
    if start < 0:
        return ParsedHints(text=None, reward=-hint_penalty)
    text = answer[start + len(HINT_START) : end].strip()
    if not text or len(text) < min_chars:
        return ParsedHints(text=None, reward=-hint_penalty)
    text, cut = truncate(text, max_tokens)
    return ParsedHints(text=text.strip(), reward=0.0, truncated=cut)


def hint_block(hints: str | None) -> str:
    """An update answer that writes `hints` (an empty block for None: counts as missing)."""
    return f"{HINT_START}\n{hints or ''}\n{HINT_END}"


def context_line(hints: str | None, first_task: bool) -> str:
    """`Hints: null` before the first task, `Hints: <text>` after, or the no-hint line."""
    if first_task:
        return "Hints: null"
    return f"Hints: {hints if hints is not None else NO_HINT}"
