"""A run's config from a preset, a YAML file and overrides, and back to YAML.

A run is resolved in three layers, each validated as a whole: a named preset (cod_fast.config),
then a YAML file deep-merged over it, then ``a.b.c=value`` overrides. YAML is read with a safe
loader that refuses anchors and aliases, and every problem is a ConfigError naming where it is.
A config file is a regular file of at most MAX_CONFIG_BYTES and an override at most as long,
refused before parsing (a megabyte of YAML takes seconds to parse).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from cod_fast.common.bounded_read import ReadRefused, read_bounded
from cod_fast.config import DERIVED, Config, ConfigError, clipped, shown
from cod_fast.config.base import type_hints
from cod_fast.config.presets import DEFAULT_PRESET, GPU_PRESETS, PRESETS

MAX_CONFIG_BYTES = 2**20
"""The largest config file read, and the longest override: the largest real configs are a few
KB, and parsing YAML takes seconds per megabyte."""


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as a plain nested dict (what YAML files hold): a run's keys, without the
    loss fields it derives from them (DERIVED)."""
    data = dataclasses.asdict(cfg)  # type: ignore[call-overload]
    if isinstance(cfg, Config):
        for dotted in DERIVED:
            *path, last = dotted.split(".")
            del functools.reduce(operator.getitem, path, data)[last]
    return data


def _deprecated(old: str, where: str = "") -> str:
    """The key that replaces the deprecated `old` (a DERIVED spelling), after a warning."""
    new = DERIVED[old]
    warnings.warn(
        f"{old}{where} is deprecated and will be removed in the next release; it sets {new}, "
        f"write {new} instead",
        FutureWarning,
        stacklevel=3,
    )
    return new


def _renamed(data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` (a config file's mapping) with each deprecated key moved to the key that replaces
    it; both given with different values is an error naming both."""
    for old in DERIVED:
        *path, last = old.split(".")
        section: Any = data
        for key in path:
            section = section.get(key) if isinstance(section, dict) else None
        if not isinstance(section, dict) or last not in section:
            continue
        value, new = section.pop(last), _deprecated(old, f" (in {where})")
        parent, new_last = _parent_section_or_make(data, new.split("."))
        if new_last in parent and parent[new_last] != value:
            raise ConfigError(
                old,
                f"got {shown(value)} and {new}={shown(parent[new_last])} (in {where}); "
                f"expected only {new}",
            )
        parent[new_last] = value
    return data


def _parent_section_or_make(data: dict[str, Any], keys: list[str]) -> tuple[dict, str]:
    """The dict that holds the last of `keys` (sections made where missing), and that key."""
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    return node, keys[-1]


def from_dict(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """Build and validate ``cls`` from a (partial) nested mapping; missing keys keep defaults.

    ``path`` is the dotted position of ``data`` in the whole config, used in error messages.
    """
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = [k for k in data if k not in names]
    if unknown:
        key = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise ConfigError(key, f"unknown key; allowed keys: {', '.join(names)}")
    hints = type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        hint, where = hints[name], f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            value = from_dict(hint, value, where)
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        if dataclasses.is_dataclass(item) and isinstance(value, list):  # e.g. rollout.envs
            value = [
                from_dict(item, v, f"{where}[{i}]") if isinstance(v, Mapping) else v  # type: ignore[arg-type]
                for i, v in enumerate(value)
            ]
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.under(path) from None


class _RefusedYaml(yaml.MarkedYAMLError):
    """Well-formed YAML that config files may not use."""


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` as a float (YAML 1.1 insists on ``1.0e-5``) and
    refuses anchors and aliases: a config never needs them, and nested aliases (the "billion
    laughs") expand a few hundred bytes into millions of nodes, which validation would then
    echo. The refusal comes at the first anchor, before anything is expanded."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            name = clipped(event.anchor)
            raise _RefusedYaml(
                problem=f"anchors and aliases (&{name}, *{name}) are not allowed in configs; "
                "write the values out",
                problem_mark=event.start_mark,
            )
        return super().compose_node(parent, index)


class _YamlDumper(yaml.SafeDumper):
    """SafeDumper that quotes strings such as ``'1e5'``, which `_YamlLoader` would read as floats."""


_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)[eE][-+]?\d+$")
_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+.0123456789"))
_YamlDumper.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+.0123456789"))


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.reader.ReaderError as e:  # NUL and other control characters: binary, not text
        what = f"unprintable character #x{e.character:04x} at offset {e.position}"
        raise ConfigError(where, f"not YAML text: {what}") from None
    except RecursionError:  # the composer recurses once per level of nesting
        raise ConfigError(where, "malformed YAML: nested too deeply") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = clipped(getattr(e, "problem", None) or " ".join(str(e).split()))
        kind = "" if isinstance(e, _RefusedYaml) else "malformed YAML: "
        raise ConfigError(where, f"{kind}{problem}{at}") from None


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(merged.get(key), dict) and isinstance(value, Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _parent_section(data: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """The dict that holds the last of ``keys``, checking that every key on the way exists; the
    last may be a new key of a mapping field (`rollout.env_options.tries`)."""
    node: Any = data
    hint: Any = Config
    for depth, key in enumerate(keys):
        here = ".".join(keys[: depth + 1])
        if not isinstance(node, dict):
            raise ConfigError(here, f"{'.'.join(keys[:depth])} holds a value, not a section")
        free = typing.get_origin(hint) is dict  # a mapping of the user's: any key
        if key not in node and not (free and depth == len(keys) - 1):
            # `node` may be a mapping of the user's: list its keys clipped
            raise ConfigError(here, f"unknown key; allowed keys: {clipped(', '.join(node))}")
        parent, node = node, node.get(key)
        hint = type_hints(hint).get(key) if dataclasses.is_dataclass(hint) else None
    return parent


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """Return a new, validated config with each ``a.b.c=value`` applied in order.

    Values are YAML (``null``, ``3``, ``0.5``, ``true``, ``k3``, ``{eps_low: 0.1}``); a mapping
    merges into the section it names.
    """
    data = to_dict(cfg)
    for override in overrides:
        dotted, sep, text = override.partition("=")
        if len(override) > MAX_CONFIG_BYTES:
            raise ConfigError(
                dotted,
                f"the override is {len(override)} characters, more than the {MAX_CONFIG_BYTES} "
                "a config may hold; give a long value (a chat template) as a file",
            )
        if not sep:
            raise ConfigError(
                override, "missing '='; expected the form a.b.c=value, e.g. algo.loss.kl=k3"
            )
        dotted = dotted.strip()
        if dotted in DERIVED:
            dotted = _deprecated(dotted)
        keys = dotted.split(".")
        parent = _parent_section(data, keys)
        value = _parse_yaml(text, dotted)
        if isinstance(parent.get(keys[-1]), dict) and isinstance(value, Mapping):
            value = _deep_merge(parent[keys[-1]], value)
        parent[keys[-1]] = value
    return from_dict(Config, data)


def _read_yaml_file(path: str) -> dict[str, Any]:
    try:
        text = read_bounded(path, MAX_CONFIG_BYTES).decode("utf-8")
    except OSError as e:
        raise ConfigError(path, f"cannot read config file: {e.strerror}") from None
    except ReadRefused as e:
        raise ConfigError(
            path,
            f"cannot read config file ({e}); give a regular file of at most {MAX_CONFIG_BYTES} "
            "bytes",
        ) from None
    except UnicodeDecodeError as e:
        byte = f"byte 0x{e.object[e.start]:02x} at offset {e.start}"
        raise ConfigError(path, f"not a UTF-8 text file: {byte} does not decode") from None
    data = _parse_yaml(text, path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping at the top level, got {type(data).__name__}")
    return data


def load_config(
    preset: str | None = None,
    path: str | None = None,
    overrides: Sequence[str] = (),
    choose_preset: Callable[[str], str] | None = None,
) -> Config:
    """Resolve a run's config: a preset, then a YAML file merged over it, then overrides.

    The file may name its preset with a top-level ``preset:`` key; the ``preset`` argument wins.
    With neither, a config that keeps the built-in model, or a file that sets every key (a
    resolved config written out), starts from DEFAULT_PRESET (the tiny CPU run); one that names
    a model of its own starts from ``choose_preset(model)`` (a preset sized for it), or is
    refused in one line naming the preset choice when there is no chooser.
    """
    file_data = _renamed(_read_yaml_file(path), path) if path is not None else {}
    file_preset = file_data.pop("preset", None)
    name = preset if preset is not None else file_preset
    if name is not None:
        return _resolved(name, file_data, path, overrides)
    cfg = _resolved(DEFAULT_PRESET, file_data, path, overrides)
    model = cfg.model.name_or_path
    if model.startswith("builtin:") or _complete(file_data, to_dict(cfg)):
        return cfg
    if choose_preset is None:
        raise ConfigError(
            "preset",
            f"the config names its own model {shown(model)} but no preset, and the default "
            f"({DEFAULT_PRESET}) is a tiny model's CPU run; name the one to start from with "
            f"--preset or a `preset:` key: {', '.join(GPU_PRESETS)} (sized for GPUs), or "
            f"{DEFAULT_PRESET}",
        )
    return _resolved(choose_preset(model), file_data, path, overrides)


def _complete(data: Mapping[str, Any], full: Mapping[str, Any]) -> bool:
    """Whether a config file's mapping sets every key of the config (`full`): a resolved
    config written out (`dump_yaml`, `config show`), which no preset underlies."""
    return all(
        key in data
        and (not isinstance(value, dict) or isinstance(data[key], Mapping))
        and (not isinstance(value, dict) or _complete(data[key], value))
        for key, value in full.items()
    )


def load_run_config(
    run_config: str | Path, path: str | None = None, overrides: Sequence[str] = ()
) -> Config:
    """A run directory's own config.yaml (every key written by `dump_yaml`; a key added to
    cod-fast after the run was written takes DEFAULT_PRESET's value, as when it was written),
    then a YAML file merged over it (its `preset:` key ignored: the run's file holds every key),
    then overrides: the config a resumed run continues with."""
    where = str(run_config)
    data = _renamed(_read_yaml_file(where), where)
    data.pop("preset", None)
    if path is not None:
        mine = _renamed(_read_yaml_file(path), path)
        mine.pop("preset", None)
        data, where = _deep_merge(data, mine), f"{where} with {path}"
    return _resolved(DEFAULT_PRESET, data, where, overrides)


def named_keys(path: str | None, overrides: Sequence[str]) -> set[str]:
    """Every dotted key a config file and overrides set, with the sections above them
    (`rollout.env` gives `rollout` and `rollout.env`): what the user named."""
    keys: set[str] = set()

    def walk(prefix: str, node: Mapping[str, Any]) -> None:
        for key, value in node.items():
            keys.add(prefix + str(key))
            if isinstance(value, Mapping):
                walk(f"{prefix}{key}.", value)

    if path is not None:
        walk("", _read_yaml_file(path))
    for override in overrides:
        parts = override.partition("=")[0].strip().split(".")
        keys.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return keys


def _resolved(name: Any, file_data: dict[str, Any], path: str | None, overrides) -> Config:
    """Preset `name`, the file's mapping merged over it, then the overrides."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(
            "preset", f"unknown preset {shown(name)}; choose one of {', '.join(PRESETS)}"
        )
    cfg = PRESETS[name]()
    if file_data:
        try:
            cfg = from_dict(Config, _deep_merge(to_dict(cfg), file_data))
        except ConfigError as e:
            raise ConfigError(e.key, f"{e.problem} (in {path})") from None
    return apply_overrides(cfg, overrides)


def dump_yaml(cfg: Config) -> str:
    """The config as YAML that ``load_config(path=...)`` reads back to an equal config; a key
    left null to mean "the default for this run" carries its effective value as a comment."""
    text = yaml.dump(to_dict(cfg), Dumper=_YamlDumper, sort_keys=False)
    if cfg.algo.red_weight is None:
        effective = str(cfg.algo.use_red_weight).lower()
        text = text.replace(
            "  red_weight: null\n", f"  red_weight: null  # effective: {effective}\n"
        )
    return text
