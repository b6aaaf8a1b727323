"""The ground floor of every config class: `ConfigError` (one line naming the dotted key, the
value and the fix) and `_Config`, which checks each field against its type hint.

Imports only `CodFastError` (cod_fast.common.errors), the base of every user error: every
layer may import it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
import typing
from typing import Any, Literal

from cod_fast.common.errors import CodFastError

SHOWN_CHARS = 200
"""The most characters of a value (or key) an error message echoes: a message stays one short
line even when the value is a megabyte string or a huge mapping."""


def clipped(text: str) -> str:
    """`text` cut to SHOWN_CHARS, marked where it was cut."""
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} chars)"


def shown(value: Any) -> str:
    """How an error message echoes a value: its repr, clipped."""
    return clipped(repr(value))


class ConfigError(ValueError, CodFastError):
    """A config key, value or file that cannot be used; the message says where and why."""

    def __init__(self, key: str, problem: str):
        self.key = clipped(key)  # keys come from files and --set too, so they can be anything
        self.problem = problem
        super().__init__(f"{self.key}: {problem}")

    def under(self, path: str) -> ConfigError:
        """The same error with ``path`` prepended to its key (``loss.x`` -> ``algo.loss.x``)."""
        return ConfigError(f"{path}.{self.key}", self.problem) if path else self


class _Config:
    """Base of every config dataclass: checks each field against its type hint.

    Literal fields must hold one of their values, ``X | None`` fields may be None, bool is not an
    int, an int is accepted (and stored as float) for a float field, a float field must be finite
    (no field gives inf or nan a meaning: where a limit can be lifted, null does it), and a nested
    config must be an instance of its class. Subclasses extend ``__post_init__`` with their range
    checks.
    """

    def __post_init__(self) -> None:
        hints = type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value, hint = getattr(self, f.name), hints[f.name]
            if problem := _mapping_problem(f.name, value, hint):
                raise problem
            if not _fits(value, hint):
                raise ConfigError(f.name, f"got {shown(value)}; expected {_describe(hint)}")
            if type(value) in (int, float) and float in (hint, *typing.get_args(hint)):
                if not _finite(value):
                    # inf passes every `x >= low` range check (nan any negated one) and then
                    # fails deep in a run: an inf timeout fails every environment call.
                    null = " or null" if type(None) in typing.get_args(hint) else ""
                    raise ConfigError(f.name, f"got {shown(value)}; expected a finite number{null}")
                setattr(self, f.name, float(value))

    def _require(self, ok: bool, name: str, expected: str) -> None:
        if not ok:
            raise ConfigError(name, f"got {shown(getattr(self, name))}; expected {expected}")

    def _at_least(self, low: float, *names: str) -> None:
        for name in names:
            kind = "an integer" if isinstance(getattr(self, name), int) else "a number"
            self._require(getattr(self, name) >= low, name, f"{kind} >= {low}")

    def _above(self, low: float, *names: str) -> None:
        for name in names:
            self._require(getattr(self, name) > low, name, f"a number > {low}")

    def _at_most(self, high: int, *names: str) -> None:
        """A bound far above any real run: a larger value is a typo (a few zeros too many) that
        would otherwise fill the memory minutes into the run."""
        for name in names:
            self._require(getattr(self, name) <= high, name, f"at most {high} (far above any run)")


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a config class (cached: validation reads them for every
    instance)."""
    return typing.get_type_hints(cls)


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(
            _fits(k, key) and _fits(v, item) for k, v in value.items()
        )
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _mapping_problem(name: str, value: Any, hint: Any) -> ConfigError | None:
    """The first value of a mapping field that does not fit its item type (a nested mapping
    where `rollout.env_options` takes one scalar), or a number in it that is not finite (the
    fields' rule), named by its key; None when there is none."""
    if typing.get_origin(hint) is not dict or not isinstance(value, dict):
        return None
    key_hint, item = typing.get_args(hint)
    numbers = float in (item, *typing.get_args(item))
    for key, one in value.items():
        if not _fits(key, key_hint):
            return None  # the whole mapping's error names the key's type
        if not _fits(one, item):
            return ConfigError(f"{name}.{key}", f"got {shown(one)}; expected {_describe(item)}")
        if numbers and type(one) in (int, float) and not _finite(one):
            return ConfigError(f"{name}.{key}", f"got {shown(one)}; expected a finite number")
    return None


def _finite(number: float) -> bool:
    if isinstance(number, int):  # float() of a huge int overflows instead of giving inf
        return abs(number) <= sys.float_info.max
    return math.isfinite(number)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if origin is dict:
        key, item = typing.get_args(hint)
        return f"a mapping from {_describe(key)} to {_describe(item)}"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    names = {type(None): "null", float: "a number", int: "an integer", bool: "true or false"}
    names[object] = "any value"
    return names.get(hint) or ("a string" if hint is str else f"a mapping of {hint.__name__}")
