"""Which environment a name means: a built-in, a class registered with `@register`, a path to a
class (`module:Class`, `path/to/file.py:Class`) or an entry point of another package.

A name resolves in that order. The built-ins load lazily, so importing cod_fast.envs stays cheap
and one broken environment cannot break the others; any name with a colon is a path and loads
by importing its module (a file path is relative to the working directory, so an environment in
a lone file outside any package works); entry points of the group `cod_fast.environments` are
read only for a name that is none of the others, afresh each time (a package installed since
counts). Every failure is an `EnvironmentLookupError` of one line: the name, what was tried and
the known names, or the path and the error its import raised.

Nothing is imported to check a name (`environment_problem`, which every config runs): a path or
an entry point is imported only when its environment is made. A config read from a folder
someone else wrote (a run directory, an exported model) therefore runs no code by being read,
and the commands that would make its environment refuse a path it names unless the user names
that path too (cod_fast.eval.matrix `load_player`).

`make_env` passes a config's environment options (one scalar each) to the constructor as its
parameters are annotated (`option_values`): `tries: '3'` and `--option tries=3` give an `int`
parameter 3.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Literal, TypeVar

from cod_fast.common.errors import CodFastError
from cod_fast.config import clipped, shown
from cod_fast.envs.base import Environment, Setting, Size, derive_seed

if TYPE_CHECKING:
    from cod_fast.config import EnvEntry

ENTRY_POINT_GROUP = "cod_fast.environments"

OptionValue = str | int | float | bool | None
"""What a config gives an environment option (`rollout.env_options`): one scalar."""

ENVIRONMENTS = {
    "frozenlake": "cod_fast.envs.frozenlake:FrozenLakeEnv",
    "alchemy": "cod_fast.envs.alchemy:AlchemyEnv",
    "terminal": "cod_fast.envs.terminal:TerminalEnv",
    "optimal_control": "cod_fast.envs.optimal_control:OptimalControlEnv",
    "pde": "cod_fast.envs.pde:PdeEnv",
    "grid_nav": "cod_fast.envs.gridnav:GridNavEnv",
    "learn2ask": "cod_fast.envs.learn2ask:Learn2AskEnv",
}
"""The built-in environments, name -> "module:class"."""

HOW_TO_REGISTER = (
    "register one with @cod_fast.envs.register, an entry point in group "
    f"{ENTRY_POINT_GROUP}, or a path module:Class or file.py:Class"
)

_registered: dict[str, type[Environment]] = {}
"""The environments `register` added, by name."""

E = TypeVar("E", bound=type[Environment])


class EnvironmentLookupError(ValueError, CodFastError):
    """A name that means no environment, or a path or entry point that does not load one."""


def register(name: str) -> Callable[[E], E]:
    """Class decorator: `@register("my_env")` on an Environment subclass makes `my_env` an
    environment name (`rollout.env`, `cod-fast eval --env`, ...) once the module is imported.
    Registering a name again is allowed only for the same class (the same file and qualified
    name: a module imported twice, once by a path and once as a module)."""
    if not name or name != name.strip() or ":" in name:
        raise ValueError(
            f"an environment name is a word without ':' (a path has one); got {name!r}"
        )
    if name in ENVIRONMENTS:
        raise ValueError(f"{name!r} is a built-in environment; register under another name")

    def decorate(cls: E) -> E:
        cls = _checked(cls, f"@register({name!r})")
        known = _registered.get(name)
        if known is not None and _origin(known) != _origin(cls):
            raise ValueError(
                f"environment {name!r} is already registered to {_origin(known)}; "
                f"not registering {_origin(cls)} under the same name"
            )
        _registered[name] = cls
        return cls

    return decorate


def env_class(name: str) -> type[Environment]:
    """The environment class `name` means (the module docstring says in which order)."""
    if name in ENVIRONMENTS:
        module, cls = ENVIRONMENTS[name].split(":")
        return getattr(importlib.import_module(module), cls)
    if name in _registered:
        return _registered[name]
    if ":" in name:
        return _checked(_load_path(name), f"environment {shown(name)}")
    entry = _entry_points().get(name)
    if entry is None:
        raise EnvironmentLookupError(_unknown(name))
    what = f"environment {shown(name)} (entry point {entry.value} in group {ENTRY_POINT_GROUP})"
    try:
        loaded = entry.load()
    except Exception as e:  # a plugin's import may raise anything: one line, the cause chained
        raise EnvironmentLookupError(f"{what}: it does not load: {error_line(e)}") from e
    return _checked(loaded, what)


def make_env(
    name: str,
    setting: Setting = "train",
    size: Size = "full",
    options: Mapping[str, OptionValue] | None = None,
) -> Environment:
    """The environment `name` in a train or eval setting, at full or tiny size, with `options`
    as keyword arguments of its constructor, each converted to its parameter's annotation
    (`option_values`; an option it does not take, or a value that does not convert, is a
    one-line ValueError). It answers to `name` (its `name` attribute): a run names a pack's
    environment, its metrics and its records by the name in its config, and a path or a
    registered name may differ from the class's own."""
    cls = env_class(name)
    env = cls(setting=setting, size=size, **option_values(name, cls, options or {}))
    if getattr(env, "name", None) != name:
        env.name = name  # type: ignore[misc]  # this instance's, the class keeps its own
    return env


def make_envs(entries: Sequence[EnvEntry]) -> list[Environment]:
    """The environments of a run (`rollout.environments`: sizes and settings resolved)."""
    return [make_env(e.name, e.setting, e.size, e.options) for e in entries]  # type: ignore[arg-type]


def option_values(
    name: str, cls: type[Environment], options: Mapping[str, OptionValue]
) -> dict[str, object]:
    """`options` as the constructor of `cls` (environment `name`) takes them: each value
    converted to its parameter's annotation, since a config's value may be text where the
    parameter wants a number (`--option tries=3`, a quoted YAML value): an `int` parameter
    given '3' gets 3, a `bool` one 'true' or 'false' (any case) True or False, a `float` one a
    finite number, a `str` one text (a number as its text), `X | None` None or 'null', a
    Literal one of its values, a `Path` one text; an unannotated parameter, or one annotated
    with a type this does not convert to, gets the value as given. An option the constructor
    does not take, or a value that does not convert, is one line naming both."""
    parameters = inspect.signature(cls).parameters
    free = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    taken = [
        p.name
        for p in parameters.values()
        if p.name not in ("setting", "size") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if not free and (unknown := sorted(set(options) - set(taken))):
        raise ValueError(
            f"environment {clipped(name)} takes no option {clipped(', '.join(map(repr, unknown)))};"
            f" it takes {', '.join(map(repr, taken)) or 'none'}"
        )
    types_of = _parameter_types(cls)
    values = {}
    for option, value in options.items():
        hint = types_of.get(option, object)
        values[option] = _converted(value, hint)
        if values[option] is _NO_VALUE:
            raise ValueError(
                f"environment {clipped(name)}: option {clipped(option)!r} takes "
                f"{inspect.formatannotation(hint)}; got {shown(value)} "
                f"({type(value).__name__}); give a value of that type"
            )
    return values


def _parameter_types(cls: type[Environment]) -> dict[str, object]:
    """The resolved annotations of the parameters of `cls.__init__` (text under `from
    __future__ import annotations`). Where one does not resolve (a name imported only for type
    checkers) the others still do, and that parameter counts as unannotated."""
    init = cls.__init__
    try:
        return typing.get_type_hints(init)
    except Exception:  # a plugin's annotation may name anything: resolve the others one by one
        namespace = getattr(init, "__globals__", {})
        resolved = {}
        for parameter, annotation in getattr(init, "__annotations__", {}).items():
            holder = types.SimpleNamespace(__annotations__={parameter: annotation})
            try:
                resolved.update(typing.get_type_hints(holder, globalns=namespace))
            except Exception:  # this one stays unannotated
                continue
        return resolved


_NO_VALUE = object()
"""What `_converted` gives for a value that does not convert."""
_BOOLS = {"true": True, "false": False}


def _converted(value: object, hint: object) -> object:
    """`value` as a parameter annotated `hint` takes it, or _NO_VALUE (the rules are
    `option_values`'s); a union tries first the members `value` already is, then the others."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(hint)
        exact = [m for m in members if isinstance(m, type) and type(value) is m]
        for member in (*exact, *members):
            if (converted := _converted(value, member)) is not _NO_VALUE:
                return converted
        return _NO_VALUE
    if origin is Literal:
        for choice in typing.get_args(hint):
            converted = _converted(value, type(choice))
            if type(converted) is type(choice) and converted == choice:
                return choice
        return _NO_VALUE
    if hint is type(None) or hint is None:
        null = value is None or (isinstance(value, str) and value.strip().lower() == "null")
        return None if null else _NO_VALUE
    if hint in (int, float, bool, str):
        return _scalar(value, hint)  # type: ignore[arg-type]
    if origin is None and isinstance(hint, type) and hint is not object:
        if isinstance(value, hint):
            return value
        if isinstance(value, str) and issubclass(hint, PurePath):
            return hint(value)
        return _NO_VALUE
    return value  # object, Any, a generic this does not read: as given


def _scalar(value: object, hint: type) -> object:
    """`value` as an int, float, bool or str parameter takes it, or _NO_VALUE."""
    if value is None or (isinstance(value, bool) and hint is not bool):
        return _NO_VALUE
    if hint is str:
        return value if isinstance(value, str) else str(value)
    if hint is bool:
        return (
            value if isinstance(value, bool) else _BOOLS.get(str(value).strip().lower(), _NO_VALUE)
        )
    try:  # int('9' * 5000) is past Python's digit limit, float(10**400) past a float's range
        number = hint(value.strip()) if isinstance(value, str) else value
        if hint is float and isinstance(number, (int, float)):
            number = float(number)
    except (ValueError, OverflowError):
        return _NO_VALUE
    if type(number) is not hint:
        return _NO_VALUE
    return number if hint is int or math.isfinite(number) else _NO_VALUE  # no inf or nan


def known_environments() -> list[str]:
    """Every name that means an environment without a path: the built-ins, the registered ones
    (in the order of registration) and the entry points."""
    names = [*ENVIRONMENTS, *_registered]
    return names + [name for name in _entry_points() if name not in names]


def is_path(name: str) -> bool:
    """Whether `name` is a path to a class (`module:Class`, `file.py:Class`): code that only
    importing tells anything about, which cod-fast imports only when the user names it."""
    return ":" in name  # a registered name has none (`register` refuses one)


def environment_problem(name: str) -> str | None:
    """Why `name` means no environment, None when it may: the config's check of an environment
    name. It imports nothing: a built-in or registered name is known, an entry point's name is
    read from the installed packages' metadata, and a path is checked for its form (a file path
    must name a file) and imported only when the environment is made (`env_class`), so that
    building a config (from a run directory, say) never runs the code it names."""
    if name in ENVIRONMENTS or name in _registered:
        return None
    if ":" in name:
        return _path_problem(name)
    return None if name in _entry_points() else _unknown(name)


_MODULE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def _path_problem(path: str) -> str | None:
    """Why `path` is no `module:attr` or `file.py:attr` (one line), or None; nothing imported."""
    where, _, attr = path.rpartition(":")
    what = f"environment {shown(path)}"
    if not attr.isidentifier():
        return f"{what}: {clipped(attr)!r} is not a class name; write module:Class or file.py:Class"
    if _is_file(where):
        if not Path(where).is_file():
            return _no_file(what, where)
        return None
    if not _MODULE.fullmatch(where):
        return (
            f"{what}: {clipped(where)!r} is neither a module (package.module) nor a file "
            "(path/to/file.py); write module:Class or file.py:Class"
        )
    return None


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _no_file(what: str, where: str) -> str:
    return (
        f"{what}: no file {clipped(where)} (a path is relative to the working directory, "
        f"{Path.cwd()})"
    )


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    import importlib.metadata  # 20 ms: only when a name is none of the built-in or registered

    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _unknown(name: str) -> str:
    known = known_environments()
    close = difflib.get_close_matches(name, known, n=1)
    if name.endswith(".py"):
        hint = f" (a path names its class too: {clipped(name)}:CLASS)"
    else:
        hint = f" (did you mean {close[0]}?)" if close else ""
    listed = ", ".join(map(repr, known))
    return f"unknown environment {shown(name)}{hint}; known: {listed}; {HOW_TO_REGISTER}"


def _load_path(path: str) -> object:
    """The object `path` (`module:attr` or `file.py:attr`) names, imported."""
    where, _, attr = path.rpartition(":")  # rpartition: a Windows path has a colon of its own
    what = f"environment {shown(path)}"
    is_file = _is_file(where)
    if is_file and not Path(where).is_file():
        raise EnvironmentLookupError(_no_file(what, where))
    try:
        module = _import_file(Path(where)) if is_file else importlib.import_module(where)
    except Exception as e:  # a plugin's import may raise anything: one line, the cause chained
        hint = ""
        if isinstance(e, ModuleNotFoundError) and not is_file:
            hint = " (is its package installed? a lone file is named as path/to/file.py:Class)"
        raise EnvironmentLookupError(
            f"{what}: importing {clipped(where)} failed: {error_line(e)}{hint}"
        ) from e
    if not hasattr(module, attr):
        raise EnvironmentLookupError(f"{what}: {clipped(where)} defines no {clipped(attr)!r}")
    return getattr(module, attr)


def _import_file(path: Path) -> object:
    """The module of a Python file, imported once per process under a name of its own (its stem
    and a hash of its absolute path: two files with one stem stay apart). It is registered in
    sys.modules, where dataclasses and pickle look up a class's module."""
    path = path.resolve()
    name = f"{path.stem}_{derive_seed(str(path)):016x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a fixed file is imported afresh next time
        raise
    return module


def _checked(obj: object, what: str) -> type[Environment]:
    """`obj`, which must be an Environment subclass that can be instantiated."""
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise EnvironmentLookupError(
            f"{what}: got {shown(obj)}, not a subclass of cod_fast.envs.Environment"
        )
    if inspect.isabstract(obj):
        missing = ", ".join(f"{m}()" for m in sorted(obj.__abstractmethods__))
        raise EnvironmentLookupError(f"{what}: {obj.__qualname__} does not define {missing}")
    return obj


def _origin(cls: type) -> str:
    """Where a class is defined: its file (or module) and qualified name."""
    module = sys.modules.get(cls.__module__)
    return f"{getattr(module, '__file__', None) or cls.__module__}:{cls.__qualname__}"


def error_line(error: BaseException) -> str:
    """An exception as one clipped line: its type and its message."""
    return clipped(f"{type(error).__name__}: {' '.join(str(error).split())}")
