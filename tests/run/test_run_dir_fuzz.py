"""Run directories from someone else or a damaged disk: every reader of a run directory
(`--resume`, `cod-fast export`, the logs' readers) gives a loaded run or a one-line refusal
naming the file (CheckpointError, RunDirError, RunLogError, or a ConfigError naming its field),
never a traceback.

One small real run (a warm-start step, two RL steps with priority replay, a checkpoint after
each) is copied and mutated with a seeded generator: truncations and bit flips of any file;
type swaps, huge values (a 10**400 integer, a megabyte string, a 10,000-item list), deleted
and extra keys in meta.json, config.yaml and the JSON-lines logs; and in ranks.pt and
optimizer.pt, loaded with `torch.load(weights_only=True)`, changed as plain data and saved back
with `torch.save` as a hostile sender would: tensors of another dtype, shape or size (one that
claims a billion elements), generator states that are not one, a replay pool of wrong types,
negative numbers and NaN. A failure prints its seed and mutations, so it reproduces.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.config import ConfigError
from cod_fast.config.io import load_config
from cod_fast.run.checkpoint import CheckpointError
from cod_fast.run.directory import RunDirError, check_resume
from cod_fast.run.export import export_model
from cod_fast.run.log import RunLog, RunLogError
from cod_fast.train.preflight import preflight
from cod_fast.train.trainer import Trainer
from tests.train.test_trainer import FAST

pytestmark = pytest.mark.slow  # a real run, copied and mutated: seconds
runner = CliRunner()

KNOWN = (CheckpointError, RunDirError, RunLogError, ConfigError)
"""What a refused run directory raises: each message one line naming the file (a ConfigError
names the field, as every refusal of the config does)."""
STEPS = ["train.warm_start_steps=1", "train.steps=2"]
"""The source run's length: its latest checkpoint is step 3, so a resume loads and stops."""
STEP = "checkpoints/step-0000003"
FILES = {
    "config.yaml": "yaml",
    "metrics.jsonl": "jsonl",
    "eval.jsonl": "jsonl",
    "checkpoints/latest": "latest",
    f"{STEP}/meta.json": "json",
    f"{STEP}/ranks.pt": "pt",
    f"{STEP}/optimizer.pt": "pt",
    f"{STEP}/model.safetensors": "safetensors",
}
"""Every file a resume, an export or a log reader reads, and its kind."""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A run with every reader's file: config, logs, three checkpoints (ranks.pt with the RNG
    states, the sampler's generator and a replay pool of two batches), tokenizer."""
    run = tmp_path_factory.mktemp("fuzz") / "run"
    overrides = [*FAST, *STEPS, "train.replay_batches=1", "rollout.eval_packs=1"]
    trainer = Trainer(load_config("tiny-cpu", overrides=[*overrides, f"runtime.run_dir={run}"]))
    trainer.run()
    trainer.close()
    return run


# --- the readers, as the product runs them -----------------------------------------------------


def resume(run: Path) -> None:
    """What `cod-fast train --resume --config RUN/config.yaml` does before its first step: the
    run's config read, --resume's rules, the preflight, the trainer built and restored from the
    latest checkpoint (model, optimizer, every rank state), the logs cut back to it."""
    cfg = load_config(path=str(run / "config.yaml"), overrides=[f"runtime.run_dir={run}"])
    check_resume(cfg, resume=True)
    preflight(cfg)
    trainer = Trainer(cfg)
    try:
        trainer._restore_or_start(resume=True)
    finally:
        trainer.close()


def export(run: Path) -> None:
    export_model(run, run.parent / "hf")


def logs(run: Path) -> None:
    log = RunLog(run)
    log.metrics()
    log.evaluations()


class Refused(Exception):
    """A command's refusal: exit code 2 and its one line (checked)."""


def cli_resume(run: Path) -> None:
    """`cod-fast train --resume --config RUN/config.yaml` in this process, to the end of the
    run's steps: it loads, evaluates, plots (reading both logs) and stops."""
    own = ["--config", str(run / "config.yaml"), "--set", f"runtime.run_dir={run}"]
    for key in STEPS:  # never trains on: a mutated train.steps is not what is tested here
        own += ["--set", key]
    _command(run, ["train", "--resume", *own])


def cli_export(run: Path) -> None:
    _command(run, ["export", str(run), "--out", str(run.parent / "hf")])


def _command(run: Path, args: list[str]) -> None:
    """Run `cod-fast ARGS`: exit code 0, or Refused for exit code 2 with one line naming a file
    of the run (or, for the config, its field); anything else raises."""
    result = runner.invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    if result.exit_code not in (0, 2):
        raise AssertionError(f"exit code {result.exit_code}: {result.output[-300:]}")
    if result.exit_code == 2:
        message = result.stderr.strip().removeprefix("error: ")
        _check_message(message, run, config=CONFIG_REFUSAL.match(message) is not None)
        raise Refused(message)


CONFIG_REFUSAL = re.compile(r"[\w.\[\]]+: ")
"""How a refusal of the config begins: with the field (`train.init_from: ...`)."""


def _check_message(message: str, run: Path, config: bool) -> None:
    """One line, naming a file of the run (a refusal of the config: its field)."""
    if "\n" in message.strip() or "Traceback" in message:
        raise AssertionError(f"a message of several lines: {message[:500]!r}")
    if str(run) not in message and not config:
        raise AssertionError(f"a message naming no file of the run: {message[:300]!r}")


def outcome(read: Callable[[Path], None], run: Path) -> tuple[str, str | None]:
    """("loaded", None) or ("refused", None) when `read(run)` does what the product should;
    else ("failed", what it did instead: the exception and where it was raised)."""
    try:
        read(run)
    except Refused:
        return "refused", None
    except KNOWN as exc:
        try:
            _check_message(str(exc), run, config=isinstance(exc, ConfigError))
        except AssertionError as bad:
            return "failed", f"{type(exc).__name__}: {bad}"
        return "refused", None
    except Exception as exc:  # a traceback for the user: what this test is after
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{Path(frame.filename).name}:{frame.lineno}"
        return "failed", f"{type(exc).__name__}: {str(exc)[:200]!r} at {where}"
    return "loaded", None


# --- mutations ---------------------------------------------------------------------------------

GONE = object()
"""An edit's result that removes the entry."""


def _plain_values() -> list[Any]:
    return [
        7,
        -3,
        2.5,
        math.nan,
        math.inf,
        "x",
        "",
        [],
        [1, "a"],
        {},
        {"a": 1},
        None,
        True,
        10**18,
        10**400,
        "y" * 10**6,
        [0] * 10**4,
    ]


def _tensor_values() -> list[Any]:
    """What a hostile ranks.pt or optimizer.pt can hold besides plain data."""
    return [
        torch.zeros(3),
        torch.zeros(1, dtype=torch.uint8).expand(10**9),  # a billion elements over one byte
        torch.zeros(5056, dtype=torch.uint8),  # a CPU generator's size, not a state
        torch.full((624,), -5, dtype=torch.int64),
        torch.tensor(math.nan),
        10**5000,  # past the digits repr() writes
    ]


def _walk(node: Any, rng: random.Random) -> list[Any]:
    """A random path into a nested structure, stopping at any depth."""
    path = []
    while isinstance(node, dict | list | tuple) and node and rng.random() < 0.8:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
    return path


def _edited(node: Any, path: list[Any], edit: Callable[[Any], Any]) -> Any:
    """`node` with the value at `path` replaced by `edit(value)` (removed for GONE); the
    containers along the path are copies (tuples stay tuples)."""
    if not path:
        return edit(node)
    key, value = path[0], _edited(node[path[0]], path[1:], edit)
    if isinstance(node, dict):
        copy = dict(node)
        copy.pop(key) if value is GONE else copy.__setitem__(key, value)
        return copy
    items = list(node)
    items.pop(key) if value is GONE else items.__setitem__(key, value)
    return tuple(items) if isinstance(node, tuple) else items


def _tensor_edit(tensor: torch.Tensor, rng: random.Random) -> tuple[torch.Tensor, str]:
    op = rng.choice(["dtype", "shape", "half", "billion", "nan"])
    if op == "dtype":
        dtype = rng.choice([torch.float32, torch.int64, torch.uint8, torch.bool, torch.float16])
        return tensor.to(dtype), f"dtype {dtype}"
    if op == "shape":
        return tensor.reshape(1, -1, 1), "shape (1, n, 1)"
    if op == "half":
        return tensor.reshape(-1)[: tensor.numel() // 2].clone(), "half its elements"
    if op == "billion":
        return torch.zeros(1, dtype=tensor.dtype).expand(10**9), "a billion elements"
    if tensor.is_floating_point():
        return torch.full_like(tensor, math.nan), "NaN"
    return -tensor - 1, "negated"


def _structure_edit(data: Any, rng: random.Random, values: list[Any]) -> tuple[Any, str]:
    """One edit at a random place of plain data: a type swap or huge value, a deleted or
    extra key or item, or (in a .pt file) a tensor of another dtype, shape or size."""
    path = _walk(data, rng)
    node = data
    for key in path:
        node = node[key]
    op = rng.choice(["swap", "swap", "swap", "delete", "extra"])
    if isinstance(node, torch.Tensor) and rng.random() < 0.7:
        new, what = _tensor_edit(node, rng)
        return _edited(data, path, lambda _: new), f"{path}: tensor {what}"
    if op == "delete" and path:
        return _edited(data, path, lambda _: GONE), f"{path}: deleted"
    value = rng.choice(values)
    if op == "extra" and isinstance(node, dict):
        return _edited(data, path, lambda d: {**d, "extra": value}), f"{path}: extra key"
    if op == "extra" and isinstance(node, list):
        return _edited(data, path, lambda items: [*items, value]), f"{path}: extra item"
    return _edited(data, path, lambda _: value), f"{path}: -> {_shown(value)}"


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {value.dtype} {tuple(value.shape)}"
    if isinstance(value, int) and abs(value) > 10**20:
        return f"int of {value.bit_length()} bits"
    return repr(value)[:30] + ("..." if len(repr(value)) > 30 else "")


def _bytes_edit(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    op = rng.choice(["truncate", "flip", "flip", "junk", "deep"])
    if op == "truncate" or not data:
        cut = rng.randrange(len(data) + 1)
        path.write_bytes(bytes(data[:cut]))
        return f"truncated at {cut} of {len(data)} bytes"
    if op == "flip":
        flips = rng.randint(1, 8)
        for _ in range(flips):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return f"{flips} bits flipped"
    if op == "junk":
        path.write_bytes(rng.randbytes(rng.choice([1, 16, 4096])))
        return "random bytes"
    path.write_text("[" * 2000 + "]" * 2000)  # nested past the parsers' recursion limit
    return "nested 2000 deep"


def _json_edit(path: Path, rng: random.Random) -> str:
    data, what = _structure_edit(json.loads(path.read_text()), rng, _plain_values())
    path.write_text(json.dumps(data))
    return what


def _yaml_edit(path: Path, rng: random.Random) -> str:
    data, what = _structure_edit(yaml.safe_load(path.read_text()), rng, _plain_values())
    path.write_text(yaml.safe_dump(data))
    return what


def _jsonl_edit(path: Path, rng: random.Random) -> str:
    lines = path.read_text().splitlines()
    op = rng.random()
    n = rng.randrange(len(lines))
    if op < 0.15:
        junk = rng.choice(["junk", "[]", "{}", "null", '{"step": "x"}', "1" * 5000])
        lines.insert(n, junk)
        what = f"line {n + 1} inserted: {junk[:20]}"
    elif op < 0.25:
        del lines[n]
        what = f"line {n + 1} deleted"
    elif op < 0.3:
        lines.insert(n, lines[n])
        what = f"line {n + 1} doubled"
    else:
        record, what = _structure_edit(json.loads(lines[n]), rng, _plain_values())
        lines[n] = json.dumps(record)
        what = f"line {n + 1}: {what}"
    path.write_text("".join(line + "\n" for line in lines))
    return what


def _latest_edit(path: Path, rng: random.Random) -> str:
    name = rng.choice(
        ["step-0000099", "step-0000001", "../step-0000003", "", "step-0000003/..", "s" * 10**6]
    )
    path.write_text(name)
    return f"names {name[:20]!r}"


def _pt_edit(path: Path, rng: random.Random) -> str:
    data = torch.load(path, map_location="cpu", weights_only=True)
    data, what = _structure_edit(data, rng, _plain_values() + _tensor_values())
    torch.save(data, path)
    _record_size(path)
    return what


def _record_size(path: Path) -> None:
    """Write a checkpoint file's new size into its meta.json, as a sender who changed the file
    on purpose would (the size check alone would refuse a shorter file), where meta.json still
    holds sizes."""
    meta_path = path.parent / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        meta["sizes"][path.name] = path.stat().st_size
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # mutated itself
        return
    meta_path.write_text(json.dumps(meta))


def _safetensors_edit(path: Path, rng: random.Random) -> str:
    weights = load_file(path)
    name = rng.choice(sorted(weights))
    op = rng.choice(["drop", "extra", "dtype", "half"])
    if op == "drop":
        del weights[name]
    elif op == "extra":
        weights["extra.weight"] = torch.zeros(3)
    elif op == "dtype":
        weights[name] = weights[name].to(torch.int64)
    else:
        weights[name] = weights[name].reshape(-1)[: weights[name].numel() // 2].clone()
    save_file(weights, path)
    _record_size(path)
    return f"{op} {name}"


STRUCTURE_EDITS = {
    "json": _json_edit,
    "yaml": _yaml_edit,
    "jsonl": _jsonl_edit,
    "latest": _latest_edit,
    "pt": _pt_edit,
    "safetensors": _safetensors_edit,
}


def mutated(source: Path, where: Path, seed: int) -> tuple[Path, list[tuple[str, str]]]:
    """A copy of `source` with one to three files mutated by the generator of `seed`, and what
    was done to which."""
    shutil.rmtree(where, ignore_errors=True)
    run = where / "run"
    shutil.copytree(source, run, ignore=shutil.ignore_patterns("*.png", ".lock"))
    rng = random.Random(seed)
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        name = rng.choice(list(FILES))
        path = run / name
        edit = STRUCTURE_EDITS[FILES[name]] if rng.random() < 0.7 else _bytes_edit
        try:
            done.append((name, edit(path, rng)))
        except Exception:  # an earlier edit left the file without a structure: its bytes then
            done.append((name, _bytes_edit(path, rng)))
    return run, done


Readers = dict[str, tuple[Callable[[Path], None], set[str]]]
"""Readers by name, each with the files it reads."""
LOGS = {"metrics.jsonl", "eval.jsonl"}
CHEAP: Readers = {
    "resume": (resume, set(FILES)),
    "export": (export, set(FILES) - LOGS),
    "logs": (logs, LOGS),
}
CLI: Readers = {
    "cli resume": (cli_resume, set(FILES)),
    "cli export": (cli_export, set(FILES) - LOGS),
}


def sweep(source: Path, where: Path, seeds: range, readers: Readers) -> list[str]:
    """A mutated copy per seed, read by each reader that reads a mutated file; the failures,
    each with its seed, its mutations and what the reader did. Each reader must also have
    loaded some copies and refused others: a fuzzer whose every copy fails the first check
    would test nothing past it."""
    failures, seen = [], Counter()
    for seed in seeds:
        run, done = mutated(source, where, seed)
        for name, (read, reads) in readers.items():
            if reads & {file for file, _ in done}:
                verdict, problem = outcome(read, run)
                seen[name, verdict] += 1
                if problem is not None:
                    failures.append(f"seed {seed} {done}: {name}: {problem}")
    for name in readers:
        total = seen[name, "loaded"] + seen[name, "refused"] + seen[name, "failed"]
        if min(seen[name, "loaded"], seen[name, "refused"]) < total // 10:
            failures.append(f"{name}: {dict(seen)}: too few copies loaded or refused")
    return failures


# --- tests -------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*dropped its last line:RuntimeWarning")
def test_mutated_run_directories_load_or_are_refused_in_one_line(source, tmp_path):
    """Mutated copies of a real run through the resume's readers (config, --resume's rules,
    preflight, the trainer's restore of model, optimizer and every rank state, the logs cut
    back), the export's and the logs': each loads or is refused with one line naming the file;
    none raises anything else. A quick sample of 40 here; 500 more in the next test."""
    failures = sweep(source, tmp_path, range(40), CHEAP)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])


@pytest.mark.filterwarnings("ignore:.*dropped its last line:RuntimeWarning")
def test_500_mutated_run_directories(source, tmp_path):
    """The same on 500 more seeds."""
    failures = sweep(source, tmp_path, range(40, 540), CHEAP)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])


@pytest.mark.filterwarnings("ignore:.*dropped its last line:RuntimeWarning")
def test_mutated_run_directories_through_the_cli(source, tmp_path):
    """30 mutated copies through `cod-fast train --resume` to the end of the run (the restore,
    the end evaluation, the plots that read both logs) and `cod-fast export`: exit code 0, or 2
    with one line; never a traceback."""
    failures = sweep(source, tmp_path, range(1000, 1030), CLI)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])


# --- the two damages that gave tracebacks: a replay pool, a sampler generator -------------------


def _with_ranks(source: Path, where: Path, edit: Callable[[list[dict]], None]) -> Path:
    """A copy of the run whose latest ranks.pt is loaded, changed by `edit` and saved back
    (with its size in meta.json)."""
    run = where / "run"
    shutil.copytree(source, run, ignore=shutil.ignore_patterns("*.png", ".lock"))
    path = run / STEP / "ranks.pt"
    ranks = torch.load(path, weights_only=True)
    edit(ranks)
    torch.save(ranks, path)
    _record_size(path)
    return run


def _turn(ranks: list[dict]) -> dict:
    return _episode(ranks)["turns"][0]


def _episode(ranks: list[dict]) -> dict:
    return ranks[0]["batch_source"]["pool"][0]["rollouts"][0]["episodes"][0]


POOLS = {
    "a token id past the vocabulary": lambda r: _turn(r)["response_ids"].__setitem__(0, 10**9),
    "a negative token id": lambda r: _turn(r)["prompt_ids"].__setitem__(0, -1),
    "log-probs one short": lambda r: _turn(r)["response_logprobs"].pop(),
    "a NaN log-prob": lambda r: _turn(r)["response_logprobs"].__setitem__(0, math.nan),
    "a NaN reward": lambda r: _episode(r).__setitem__("reward", math.nan),
    "token ids as a tensor": lambda r: _turn(r).__setitem__("prompt_ids", torch.arange(5)),
    "an unknown finish reason": lambda r: _turn(r).__setitem__("finish_reason", "tired"),
    "a judge's flag that is a tensor": lambda r: _episode(r)["info"].__setitem__(
        "malformed", torch.ones(3)
    ),
    "a missing version": lambda r: r[0]["batch_source"]["pool"][0].pop("version"),
    "an entry that is a list": lambda r: r[0]["batch_source"]["pool"].__setitem__(0, [1, 2]),
    "a million entries of None": lambda r: r[0]["batch_source"]["pool"].extend([None] * 10**6),
    "a pool that is a string": lambda r: r[0]["batch_source"].__setitem__("pool", "x" * 10**6),
}


@pytest.mark.parametrize("damage", list(POOLS))
def test_a_tampered_replay_pool_is_one_line_naming_ranks_pt(source, tmp_path, damage):
    """A ranks.pt whose replay pool holds a wrong type, a token the model cannot read, NaN, a
    missing field or a million entries: --resume (its restore, and the CLI) refuses it with one
    line naming ranks.pt, what is wrong in the pool and the older checkpoint to use; no
    traceback (before: a ValueError or KeyError from inside the records, or none at all until
    the first step indexed the embedding out of range)."""
    run = _with_ranks(source, tmp_path, POOLS[damage])
    with pytest.raises(CheckpointError) as caught:
        resume(run)
    message = str(caught.value)
    _check_message(message, run, config=False)
    assert f"{run / STEP / 'ranks.pt'} is damaged (the replay " in message, message
    assert "newest older intact checkpoint is step-0000002" in message, message
    assert outcome(cli_resume, run) == ("refused", None)


GENERATORS = {
    "float32": lambda g: g.float(),
    "half its bytes": lambda g: g[: g.numel() // 2].clone(),
    "zeros (not an mt19937 state)": torch.zeros_like,
    "two rows": lambda g: g.view(2, -1),
    "a billion elements over one byte": lambda g: g[:1].expand(10**9),
    "a list of ints": lambda g: g.tolist(),
    "None": lambda g: None,
}


@pytest.mark.parametrize("damage", list(GENERATORS))
def test_a_tampered_sampler_generator_is_one_line_naming_ranks_pt(source, tmp_path, damage):
    """A ranks.pt whose sampler generator state is not a byte tensor of the generator's size
    (or is one no generator takes): --resume refuses it with one line naming ranks.pt and the
    sampler's generator state, before any generator is set (before: torch's TypeError or
    RuntimeError from `Generator.set_state`)."""

    def edit(ranks):
        sampler = ranks[0]["sampler"]
        sampler["generator"] = GENERATORS[damage](sampler["generator"])

    run = _with_ranks(source, tmp_path, edit)
    with pytest.raises(CheckpointError) as caught:
        resume(run)
    message = str(caught.value)
    _check_message(message, run, config=False)
    assert f"{run / STEP / 'ranks.pt'} is damaged (the sampler's generator state " in message
    assert outcome(cli_resume, run) == ("refused", None)


def test_an_intact_copy_resumes_and_exports(source, tmp_path):
    """The unmutated copy loads through every reader: the refusals above come from the
    damage, not from the copy."""
    run, _ = mutated(source, tmp_path, seed=0)
    shutil.rmtree(run)
    shutil.copytree(source, run, ignore=shutil.ignore_patterns("*.png", ".lock"))
    for read, _ in (*CHEAP.values(), *CLI.values()):
        assert outcome(read, run) == ("loaded", None)
