"""The text an environment parses out of model output: decimal numbers and `<tag>` blocks,
in time linear in the text (cod_fast.envs.base re-exports both for environments)."""

from __future__ import annotations

import re

NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
r"""A decimal number in model text (`3`, `-0.5`, `.5`, `2.`, `1e-3`). No two of its parts can match
the same digits: `\d*\.?\d+` could, and retried every split of a digit run (16,000 digits took
seconds)."""


class Tag:
    """Finds `<name>...</name>` blocks in model text (case-insensitive; with `spaced`, also
    `< name >` and `</ name >`): the blocks `re.findall(r"<name>(.*?)</name>")` finds, in time
    linear in the text. The lazy `(.*?)` rescans the rest of the text from every opening tag that
    has no closing one, which took 11 s on 128K characters of repeated `<answer>`; here each
    search starts where the previous one stopped."""

    def __init__(self, name: str, spaced: bool = False):
        gap = r"\s*" if spaced else ""
        self.opening = re.compile(rf"<{gap}{name}{gap}>", re.IGNORECASE)
        self.closing = re.compile(rf"<{gap}/{gap}{name}{gap}>", re.IGNORECASE)

    def last_block(self, text: str) -> str | None:
        """The content of the last complete block, None when there is none."""
        block, pos = None, 0
        while (start := self.opening.search(text, pos)) and (
            end := self.closing.search(text, start.end())
        ):
            block, pos = text[start.end() : end.start()], end.end()
        return block
