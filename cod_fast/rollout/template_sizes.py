"""How much text an operation of a chat template would make, found before it runs.

cod_fast.rollout.chat_template renders a template, perhaps a stranger's, within bounds of size
and time (its module docstring says which, and what they leave unbounded); these are its
measures. `text_size` is the length of a value as text (a container's repr included), found
without building it and counted no further than a cap. The operations that can make more text
than they are given have their result sized from their arguments before they run:
`percent_size` and `format_size` for `%` and `str.format`, `joined_size` for joins,
METHOD_SIZES for the methods of strings, bytes and integers, FILTER_SIZES for Jinja's filters.
"""

from __future__ import annotations

import inspect
import re
import string
from collections.abc import Callable, Iterable, Mapping, MappingView
from typing import Any

from jinja2.utils import Namespace

MAX_TEXT_CHARS = 2**20
"""The longest text a render may build or output: cod-fast renders sentinel messages of a few
dozen characters, so real renders stay below a few KB."""


def text_size(value: Any, limit: int = MAX_TEXT_CHARS) -> int:
    """The length of `value` as text (`str`, or a container's repr, in which each element costs
    at least its own length), found without building it; counting stops once past `limit`."""
    if isinstance(value, str):
        return len(value)
    size, pending = 0, [value]
    while pending and size <= limit:
        item = pending.pop()
        # The common kinds first, abstract ones (slower to check) last: a render's values
        # are all measured.
        if isinstance(item, str):
            size += len(item) + 2
        elif isinstance(item, int):  # without printing it: Python refuses to past 4300 digits
            size += item.bit_length() // 3 + 2
        elif isinstance(item, (list, tuple, set, frozenset)):
            size += 2 + 2 * len(item)
            pending.extend(item)
        elif isinstance(item, (bytes, bytearray)):  # repr: bytearray(b'\x00...')
            size += 4 * len(item) + 14
        elif isinstance(item, Mapping):
            size += 2 + 4 * len(item)
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, MappingView):
            size += 2 + 2 * len(item)
            pending.extend(item)
        elif isinstance(item, Namespace):  # its repr shows what it holds
            pending.append(getattr(item, "_Namespace__attrs", {}))
            size += 13
        else:  # numbers, None, undefined values and the runtime's objects, whose text is short
            size += len(str(item)) + 1
    return size


def _length(value: Any) -> int:
    """The length of a text or bytes argument as a method reads it (else its text size)."""
    return len(value) if isinstance(value, (str, bytes, bytearray)) else text_size(value)


def total_size(values: Iterable[Any]) -> int:
    """The summed `text_size` of `values`, counted up to just past the cap."""
    total = 0
    for value in values:
        total += text_size(value, MAX_TEXT_CHARS - total)
        if total > MAX_TEXT_CHARS:
            break
    return total


def as_int(value: Any) -> int:
    """A width or count argument as a number (0 for anything else: the call then fails itself)."""
    return value if isinstance(value, int) else 0


def _occurrences(text: Any, old: Any, count: Any) -> int:
    """The most replacements `text.replace(old, new, count)` can make."""
    most = len(text) + 1 if not old else len(text) // max(_length(old), 1)
    return min(most, count) if isinstance(count, int) and count >= 0 else most


_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?.", re.S)


def _widths(digits: Iterable[str], values: list[Any], starred: bool) -> int:
    """The widest field of a format: the widths and precisions written in it, and any integer
    argument where a field takes its width from the arguments (`*`, `{:{}}`)."""
    written = [int(d[:12]) for d in digits if d.isdigit()]
    given = [abs(v) for v in values if isinstance(v, int)] if starred else []
    return max(written + given, default=0)


def _formatted_size(fmt: str, fields: int, widths: int, values: list[Any]) -> int:
    """An upper bound of a format's output: its text, and each field as wide as the widest
    width or the whole of the arguments."""
    return len(fmt) + fields * (widths + total_size(values))


def percent_size(fmt: str, args: Any) -> int:
    """The size of `fmt % args` (the `%` operator and the `format` filter), before it runs."""
    if isinstance(args, Mapping):
        values = list(args.values())
    else:
        values = list(args) if isinstance(args, tuple) else [args]
    specs = _PERCENT_FIELD.findall(fmt)
    digits = [d for spec in specs for d in spec]
    widths = _widths(digits, values, "*" in digits)
    return _formatted_size(fmt, len(specs), widths, values)


def format_size(fmt: str, values: list[Any]) -> int:
    """The size of `fmt.format(*values)`, before it runs."""
    fields, digits, nested = 0, [], False
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is not None:
            fields += 1
            digits += re.findall(r"\d+", spec or "")
            nested = nested or "{" in (spec or "")
    return _formatted_size(fmt, fields, _widths(digits, values, nested), values)


def joined_size(separator: Any, items: list[Any]) -> int:
    """The length of `separator.join(items)`: the items as text, a separator between two."""
    return total_size(items) + _length(separator) * max(len(items) - 1, 0)


def _encoded_size(text: str, args: dict[str, Any]) -> int:
    """The most bytes `text.encode(encoding, errors)` makes: a byte a character for ASCII in
    UTF-8, four for other text in strict UTF-8, 92 with namereplace (`\\N{...}` and the longest
    name), 16 otherwise (the most measured is 10: `\\U0010ffff` in unicode_escape); and a BOM."""
    utf8 = str(args["encoding"]).lower().replace("_", "-") in ("utf-8", "utf8")
    if utf8 and text.isascii():
        per = 1
    elif args["errors"] == "namereplace":
        per = 92
    else:
        per = 4 if utf8 and args["errors"] == "strict" else 16
    return per * len(text) + 16


def _translated_size(text: Any, table: Any) -> int:
    """The most `text.translate(table)` can return: each character as long as the longest
    text the table maps one to."""
    longest = max(map(text_size, table.values()), default=1) if isinstance(table, Mapping) else 1
    return len(text) * longest


def _padded_size(text: Any, args: dict[str, Any]) -> int:
    """The length of `text` padded to `width` (center, ljust, rjust, zfill)."""
    return max(len(text), as_int(args["width"]))


METHOD_SIZES: dict[str, Callable[[Any, dict[str, Any]], int]] = {
    **dict.fromkeys(("center", "ljust", "rjust", "zfill"), _padded_size),
    "expandtabs": lambda s, a: (
        len(s) + s.count("\t" if isinstance(s, str) else b"\t") * as_int(a["tabsize"])
    ),
    "replace": lambda s, a: len(s) + _occurrences(s, a["old"], a["count"]) * _length(a["new"]),
    "join": lambda s, a: joined_size(s, *a.values()),  # `iterable`, or `iterable_of_bytes`
    "translate": lambda s, a: _translated_size(s, a["table"]),
    "encode": _encoded_size,
    "decode": lambda b, a: len(b) * (4 if a["errors"] == "backslashreplace" else 1),
    "hex": lambda b, a: 3 * len(b),  # with a separator between two bytes
    "to_bytes": lambda n, a: as_int(a["length"]),
}
"""For the methods of strings, bytes and integers that can return more than they are given: the
size of their result from their arguments (by name, as `inspect.signature` binds them)."""


def call_arguments(
    f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """The arguments of `f(*args, **kwargs)` by name, defaults included: None where they do not
    bind (the call then fails itself), none for a method without a signature (`bytes.hex`)."""
    try:
        signature = inspect.signature(f)
    except ValueError:
        return {}
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


FILTER_SIZES: dict[str, Callable[[dict[str, Any]], int]] = {
    "center": lambda a: max(text_size(a["value"]), as_int(a["width"])),
    "indent": lambda a: (
        text_size(a["s"])
        + (str(a["s"]).count("\n") + 1) * (as_int(a["width"]) or text_size(a["width"]))
    ),
    "wordwrap": lambda a: text_size(a["s"]) * (1 + text_size(a["wrapstring"] or "\n")),
    "format": lambda a: percent_size(str(a["value"]), a["kwargs"] or a["args"]),
    "replace": lambda a: (
        text_size(a["s"]) + _occurrences(str(a["s"]), a["old"], a["count"]) * text_size(a["new"])
    ),
    "batch": lambda a: as_int(a["linecount"]),
    "slice": lambda a: as_int(a["slices"]),
}
"""For the filters that can return more than they are given: the size of their result (items,
for `batch` and `slice`, which pad to their count) from their arguments, by name."""


def signature_after_context(f: Callable[..., Any]) -> inspect.Signature:
    """The parameters of the filter `f` after the context Jinja passes it first, if any (the
    async-ready filters show the signature of their synchronous version, without it)."""
    signature = inspect.signature(f)
    first, *rest = signature.parameters.values()
    if first.name in ("context", "eval_ctx", "environment"):
        return signature.replace(parameters=rest)
    return signature
