"""User cases of the learn2ask environment: a JSONL file read and checked line by line.

One JSON object per line, `{"facts": {"fever": "yes", "cough": "no"}, "answer": "flu",
"distractors": ["cold", "allergy"], "group": "respiratory"}` (`group` optional). Names are
matched in lower case with runs of whitespace made one space (`normalise`). Anything else is a
`CasesError` of one line naming the file, the line, the field and the fix; cod_fast.train.preflight
reads the file before a run writes anything. The file is bounded (MAX_CASES_BYTES, MAX_CASES,
MAX_LINE_CHARS) and must be a regular file: `/dev/zero` or a named pipe is refused unread.
"""

from __future__ import annotations

import json
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path

from cod_fast.common.bounded_read import ReadRefused, read_bounded
from cod_fast.common.errors import CodFastError

MAX_NAME_CHARS = 40
"""The longest condition or finding name read (a longer `ask` is a malformed action)."""
MAX_CASES_BYTES = 64 * 2**20
"""The largest cases file read: about a million cases of a few findings each."""
MAX_CASES = 1_000_000
"""The most cases a file may hold (each costs about a kilobyte of memory)."""
MAX_LINE_CHARS = 65_536
"""The longest line, one case: a thousand findings of the longest names fit in it."""
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9 '-]*")


def normalise(name: str) -> str:
    """Names are matched in lower case with runs of whitespace made one space."""
    return " ".join(name.split()).lower()


@dataclass(frozen=True)
class Case:
    """One consultation: the patient's findings, the right condition and the wrong candidates."""

    facts: dict[str, str]
    """Normalised finding -> `yes` or `no`; the patient is `not sure` about any other."""
    answer: str
    distractors: tuple[str, ...]
    group: str = ""
    """Cases of one group form the packs of that group."""


class CasesError(ValueError, CodFastError):
    """A cases file that cannot be used; one line naming the file, the line, the field, the fix."""


def _name(where: str, field: str, value: object) -> str:
    name = normalise(value) if isinstance(value, str) else ""
    if not (_NAME_RE.fullmatch(name) and len(name) <= MAX_NAME_CHARS):
        raise CasesError(
            f"{where}: field '{field}' has {reprlib.repr(value)}; write a name of letters, "
            f"digits, spaces, ' and - (at most {MAX_NAME_CHARS} characters)"
        )
    return name


def _case(where: str, text: str) -> Case:
    try:
        row = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        raise CasesError(f"{where}: not JSON ({why}); write one JSON object per line") from e
    if not isinstance(row, dict):
        raise CasesError(f'{where}: not a JSON object; write {{"facts": ..., "answer": ...}}')
    for field in ("facts", "answer", "distractors"):
        if field not in row:
            raise CasesError(f"{where}: missing field '{field}'; add it")
    facts = row["facts"]
    if not (isinstance(facts, dict) and facts) or any(
        not isinstance(v, str) or v.lower() not in ("yes", "no") for v in facts.values()
    ):
        raise CasesError(
            f"{where}: field 'facts' is not a map of findings to yes or no; write e.g. "
            '{"fever": "yes", "cough": "no"}'
        )
    answer, distractors = _name(where, "answer", row["answer"]), row["distractors"]
    if not (isinstance(distractors, list) and distractors):
        raise CasesError(f"{where}: field 'distractors' lists no condition; list at least 1")
    names = [_name(where, "distractors", d) for d in distractors]
    if answer in names or len(set(names)) < len(names):
        raise CasesError(
            f"{where}: field 'distractors' repeats the answer or a condition; list each once"
        )
    group = row.get("group", "")
    if not isinstance(group, str):
        raise CasesError(
            f"{where}: field 'group' is {reprlib.repr(group)}; write a name or leave it out"
        )
    facts = {_name(where, "facts", k): v.lower() for k, v in facts.items()}
    return Case(facts, answer, tuple(names), group)


def load_cases(path: str | Path) -> list[Case]:
    """The cases of a JSONL file, one JSON object per line (blank lines skipped), e.g.
    `{"facts": {"fever": "yes"}, "answer": "flu", "distractors": ["cold"], "group": "g"}` with
    `group` optional. CasesError, in one line, for anything else."""
    try:
        lines = read_bounded(path, MAX_CASES_BYTES).decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CasesError(f"{path}: cannot read it ({type(e).__name__}); pass a JSONL file") from e
    except ReadRefused as e:
        raise CasesError(
            f"{path}: cannot read it ({e}); pass a JSONL file of at most {MAX_CASES_BYTES} bytes"
        ) from None
    cases = []
    for n, line in enumerate(lines, 1):
        if len(line) > MAX_LINE_CHARS:
            raise CasesError(
                f"{path}:{n}: the line is {len(line)} characters long, more than "
                f"{MAX_LINE_CHARS} characters; write one case per line, in fewer characters"
            )
        if line.strip():
            if len(cases) == MAX_CASES:
                raise CasesError(
                    f"{path}: more than {MAX_CASES} cases; keep at most that many in one file"
                )
            cases.append(_case(f"{path}:{n}", line))
    if not cases:
        raise CasesError(f"{path}: no cases; write one JSON object per line")
    return cases
