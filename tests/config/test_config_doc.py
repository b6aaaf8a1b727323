"""The generated configuration reference (cod_fast/config/doc.py, docs/configuration.md), and
`cod-fast config show --explain` and `cod-fast --version`, which share its entries."""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cod_fast
from cod_fast.cli.app import app
from cod_fast.config import DERIVED, Config
from cod_fast.config.doc import (
    COUNTERPARTS,
    REGENERATE,
    config_keys,
    preset_differences,
    render_markdown,
    type_name,
)
from cod_fast.config.presets import PRESETS

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
runner = CliRunner()


def leaf_fields(cls: type = Config, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every field of the config tree that holds a value, by dotted key, except the loss fields
    a run derives from rollout keys (DERIVED); the fields of the items of a list of configs as
    `list[].field`. Counted here, apart from config_doc."""
    hints = typing.get_type_hints(cls)
    leaves = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        hint, key = hints[f.name], prefix + f.name
        if key in DERIVED:
            continue
        if dataclasses.is_dataclass(hint):
            leaves |= leaf_fields(hint, key + ".")  # type: ignore[arg-type]
            continue
        leaves[key] = f
        (item, *_) = typing.get_args(hint) or (None,)
        if typing.get_origin(hint) is list and dataclasses.is_dataclass(item):
            leaves |= leaf_fields(item, key + "[].")  # type: ignore[arg-type]
    return leaves


def value_at(cfg: Config, key: str) -> object:
    return functools.reduce(getattr, key.split("."), cfg)


def test_committed_reference_is_the_generated_one():
    """docs/configuration.md is exactly what render_markdown() writes today."""
    committed = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    assert committed == render_markdown(), f"{DOC} is stale; regenerate it: {REGENERATE}"


def test_every_leaf_field_has_one_row_with_a_doc():
    """Each value-holding field of the config tree, counted from the dataclasses, is one key
    of the reference, in a table row of its own, with a docstring on one line."""
    leaves = leaf_fields()
    keys = {k.key: k for k in config_keys()}
    assert len(keys) == len(config_keys()) == len(leaves) > 80
    assert set(keys) == set(leaves)
    sections = render_markdown().split("## Presets")[0]  # the presets' table repeats keys
    rows = [line for line in sections.splitlines() if line.startswith("| `")]
    for key in leaves:
        assert sum(row.startswith(f"| `{key}` |") for row in rows) == 1, key
        doc = keys[key].doc
        assert doc and "\n" not in doc and "  " not in doc, (key, doc)


def test_docs_come_from_the_source_under_each_field():
    """A field's doc is the string literal right after it, not its neighbour's."""
    keys = {k.key: k for k in config_keys()}
    assert keys["algo.loss.eps_low"].doc.startswith("Lower clip range")
    assert keys["algo.loss.eps_high"].doc.startswith("Upper clip range")
    assert keys["rollout.temperature"].doc.startswith("Sampling temperature of the training")
    assert not DERIVED.keys() & keys.keys()
    assert keys["rollout.envs[].weight"].doc.startswith("Each pack comes from this environment")


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("train.steps", "int"),
        ("rollout.eval_temperature", "float | null"),
        ("model.gradient_checkpointing", "bool"),
        ("rollout.torch_static_shapes", "bool | null"),
        ("rollout.sampler", "one of: auto, torch, vllm"),
        ("algo.loss.kl", "one of: k1, k2, k3, null"),
        ("rollout.envs", "list of {name, weight, size, setting, options}"),
        ("model.tokenizer_path", "str | null"),
    ],
)
def test_types_are_written_readably(key, expected):
    """Annotations render in YAML's words, a Literal as its values."""
    assert {k.key: k.type for k in config_keys()}[key] == expected


def test_type_name_of_a_mapping():
    """A dict annotation names its key and value types; `object` is any value."""
    assert type_name(dict[typing.Literal["a", "b"], str]) == "mapping (one of: a, b) -> str"
    assert type_name(dict[str, object] | None) == "mapping (str) -> any | null"


def test_defaults_are_those_of_a_default_config():
    """Every key's default is its value in Config() (the fields of list items: the field's
    own default)."""
    default, leaves = Config(), leaf_fields()
    for k in config_keys():
        if "[]" in k.key:
            f = leaves[k.key]
            made = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            assert k.default == (f.default if made is None else made), k.key
        elif k.key != "rollout.envs":
            assert k.default == value_at(default, k.key), k.key
    assert {k.key: k.default for k in config_keys()}["rollout.envs"] == []


def test_preset_differences_are_exactly_the_changed_keys():
    """Each preset lists the keys whose value differs from Config()'s, and only those."""
    default, diffs = Config(), preset_differences()
    assert list(diffs) == list(PRESETS)
    keys = [k.key for k in config_keys() if "[]" not in k.key and k.key != "rollout.envs"]
    for name, make in PRESETS.items():
        cfg = make()
        changed = {k for k in keys if value_at(cfg, k) != value_at(default, k)}
        assert changed == set(diffs[name]) - {"rollout.envs"}, name
        assert all(diffs[name][k] == value_at(cfg, k) for k in changed), name
    assert diffs["tiny-cpu-tbt"]["algo.algorithm"] == "task_by_task"
    assert "rollout.envs" in diffs["tiny-cpu-mixed"] and "rollout.envs" not in diffs["tiny-cpu"]


def test_markdown_tables_have_one_cell_per_column():
    """A `|` inside a cell (`float | null`) is escaped, so no row has more cells than its
    header."""
    header_cells = None
    for line in render_markdown().splitlines():
        if not line.startswith("|"):
            header_cells = None
            continue
        cells = len(re.findall(r"(?<!\\)\|", line))
        header_cells = header_cells or cells
        assert cells == header_cells, line


@pytest.mark.slow  # importing trl takes about a second
def test_every_trl_name_is_a_grpo_config_field():
    """The TRL column names only fields that TRL's GRPOConfig has."""
    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    names = [trl_name for trl_name, _ in COUNTERPARTS.values() if trl_name]
    assert names and not [n for n in names if n not in fields]
    assert set(COUNTERPARTS) <= {k.key for k in config_keys()}


def test_explain_shows_every_key_marking_the_changed_ones():
    """`config show --explain` lists every key of the resolved config once with its value,
    type and default; `*` marks exactly the values that differ from the default."""
    args = ["config", "show", "--explain", "--preset", "tiny-cpu-tbt"]
    result = runner.invoke(app, [*args, "--set", "algo.loss.eps_high=0.3"])
    assert result.exit_code == 0, result.output
    heads = [line for line in result.stdout.splitlines() if re.match(r"[* ] [\w.]+ = ", line)]
    keys = [k.key for k in config_keys() if "[]" not in k.key]
    assert [line[2:].split(" = ")[0] for line in heads] == keys
    marked = {line[2:].split(" = ")[0] for line in heads if line.startswith("*")}
    assert marked == {*preset_differences()["tiny-cpu-tbt"], "algo.loss.eps_high"}
    line = next(h for h in heads if "algo.loss.eps_high" in h)
    assert re.match(r"\* algo\.loss\.eps_high = 0\.3 +\(float; default 0\.2\)$", line), line
    assert "algo.red_weight = null (effective: false)" in result.stdout


def test_explain_key_keeps_one_section_and_refuses_an_unknown_one():
    """`--key rollout` shows only rollout's keys; an unknown key or `--key` without
    `--explain` is one error line and exit code 2."""
    result = runner.invoke(app, ["config", "show", "--explain", "--key", "algo.loss"])
    assert result.exit_code == 0, result.output
    heads = [line for line in result.stdout.splitlines() if re.match(r"[* ] [\w.]+ = ", line)]
    assert heads and all(line[2:].startswith("algo.loss.") for line in heads)
    for args in (["--explain", "--key", "algo.los"], ["--key", "algo"]):
        result = runner.invoke(app, ["config", "show", *args])
        assert result.exit_code == 2 and result.stdout == ""
        assert result.stderr.startswith("error: --key") and result.stderr.count("\n") == 1


def test_version_prints_the_package_version():
    """`cod-fast --version` prints `cod-fast <version>` and exits 0 without a command."""
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"cod-fast {cod_fast.__version__}\n" == "cod-fast 0.1.0\n"
