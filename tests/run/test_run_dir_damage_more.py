"""More damage a received run directory may hold, each refused in one line naming the file or
folder (docs/robustness.md, "A damaged checkpoint is named, not loaded", "Every read is
bounded"): a `.pt` archive whose records would inflate (a zip bomb), an optimizer state out of
AdamW's domain (a negative second moment: finite, yet NaN weights at the first step), a
damaged `tokenizer/` folder, and a full disk while `train` saves its tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.common.rng import rng_state
from cod_fast.model import tokenizer as tk
from cod_fast.model.tokenizer import load_saved_tokenizer
from cod_fast.run.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    read_rank_states,
    save_checkpoint,
)
from tests.special_files import cli_error, on_a_full_disk
from tests.train.test_trainer import FAST

runner = CliRunner()


def _one_line(message: str) -> str:
    assert "\n" not in message.strip() and "Traceback" not in message, message
    return message


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny trained run (two warm-start steps, a checkpoint after each, its bpe tokenizer in
    RUN/tokenizer)."""
    from cod_fast.train.trainer import Trainer
    from tests.train.test_trainer import config

    run = tmp_path_factory.mktemp("trained") / "run"
    trainer = Trainer(config(run, "train.steps=0"))
    trainer.run()
    trainer.close()
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    return run


def _copy(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


# --- a zip bomb in a .pt file ------------------------------------------------------------------


def _deflated(path: Path, scratch: Path) -> None:
    """`path` (a real ranks.pt) rewritten as a reviewer did: its states with a 64 MiB tensor of
    zeros added, every record of the archive deflated (about 100 KB on disk)."""
    states = torch.load(path, weights_only=True)
    states[0]["pad"] = torch.zeros(2**24)
    torch.save(states, scratch)
    del states
    with zipfile.ZipFile(scratch) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            with src.open(info) as r, dst.open(info.filename, "w") as w:
                shutil.copyfileobj(r, w, 2**20)
    scratch.unlink()


def _claims_more(path: Path, scratch: Path) -> None:
    """`path` with its records stored, as torch.save writes them, but the central directory
    claiming 1 GiB for its largest record (torch would allocate it before reading)."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        largest = max(z.infolist(), key=lambda i: i.file_size)
        at = z.start_dir  # the first header of the central directory
    name = largest.filename.encode()
    while data[at + 46 : at + 46 + len(name)] != name:  # the name follows a 46-byte header
        at = data.index(b"PK\x01\x02", at + 4)
    struct.pack_into("<II", data, at + 20, 2**30, 2**30)  # compressed, uncompressed size
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("inflate", "damage"),
    [(_deflated, "is compressed"), (_claims_more, "its records claim 1,07")],
    ids=["deflated", "claims-1GiB"],
)
def test_a_pt_file_that_would_inflate_is_refused_before_torch_reads_it(
    tmp_path, monkeypatch, inflate, damage
):
    """torch.save stores every record of its archive uncompressed, and torch.load inflates
    whatever the archive says (3 MB became 3.5 GB of memory): a ranks.pt with a compressed
    record, or records claiming more bytes than the file holds, is one CheckpointError line
    naming the file and the damage, and torch.load is never called on it."""
    save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, {}, rank_states=[rng_state()])
    save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {}, rank_states=[rng_state()])
    ckpt = latest_checkpoint(tmp_path)
    assert read_rank_states(ckpt)[0].keys() == rng_state().keys()  # a real one, loaded intact
    inflate(ckpt.path / "ranks.pt", tmp_path / "scratch.pt")
    if inflate is _deflated:  # a real bomb: torch alone inflates it
        assert torch.load(ckpt.path / "ranks.pt", weights_only=True)[0]["pad"].numel() == 2**24
    loads = []

    def load(*args, **kwargs):  # stands in for torch's reader, which would inflate the record
        loads.append(args)
        raise RuntimeError("torch.load was called")

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(CheckpointError) as caught:
        read_rank_states(ckpt)
    message = _one_line(str(caught.value))
    assert f"{ckpt.path / 'ranks.pt'} " in message and "torch.load" not in message, message
    assert damage in message and "step-0000001" in message and loads == []


# --- an optimizer state out of AdamW's domain ----------------------------------------------------


def _slots(edit: Callable[[dict], None]) -> Callable[[dict], None]:
    def change(state: dict) -> None:
        for slots in state["state"].values():
            edit(slots)

    return change


def _groups(key: str, value) -> Callable[[dict], None]:
    def change(state: dict) -> None:
        for group in state["param_groups"]:
            group[key] = value

    return change


def _neg_sq(slots: dict) -> None:
    slots["exp_avg_sq"] = -torch.ones_like(slots["exp_avg_sq"])


def _neg_max_sq(slots: dict) -> None:
    slots["max_exp_avg_sq"] = -torch.ones_like(slots["exp_avg_sq"])


def _neg_step(slots: dict) -> None:
    slots["step"] = torch.tensor(-3.0)


OUT_OF_DOMAIN = {
    "exp_avg_sq<0": (_slots(_neg_sq), "exp_avg_sq"),
    "max_exp_avg_sq<0": (_slots(_neg_max_sq), "max_exp_avg_sq"),
    "step<0": (_slots(_neg_step), "step"),
    "beta1=1": (_groups("betas", (1.0, 0.999)), "betas"),
    "beta2<0": (_groups("betas", (0.9, -0.5)), "betas"),
    "eps=0": (_groups("eps", 0.0), "eps"),
    "weight_decay<0": (_groups("weight_decay", -0.1), "weight_decay"),
    "lr<0": (_groups("lr", -1e-3), "lr"),
}


@pytest.mark.slow  # a training run and a resume per case: seconds
@pytest.mark.parametrize("damage", list(OUT_OF_DOMAIN))
def test_an_optimizer_state_out_of_adamws_domain_is_refused_at_resume(trained, tmp_path, damage):
    """optimizer.pt edited to hold finite values AdamW never holds (a negative second moment
    turns every weight NaN at the first resumed step, and a NaN checkpoint becomes `latest`):
    `cod-fast train --resume` stops with exit 2 and one line naming optimizer.pt and the
    slot or hyperparameter, before any step."""
    run = _copy(trained, tmp_path)
    path = latest_checkpoint(run).path / "optimizer.pt"
    state = torch.load(path, weights_only=True)
    assert state["state"] and state["param_groups"]  # a real AdamW state, stepped
    edit, named = OUT_OF_DOMAIN[damage]
    edit(state)
    torch.save(state, path)
    before = (run / "metrics.jsonl").read_bytes()
    own = ["--config", str(run / "config.yaml"), "--set", f"runtime.run_dir={run}"]
    message = cli_error(runner.invoke(app, ["train", "--resume", *own]))
    assert f"{path} is damaged (the optimizer checkpoint's {named} " in message, message
    assert (run / "metrics.jsonl").read_bytes() == before


# --- a damaged tokenizer folder ----------------------------------------------------------------


def _config(folder: Path, text: str) -> None:
    (folder / "tokenizer_config.json").write_text(text)


def _eos_list(folder: Path) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = [1]
    _config(folder, json.dumps(config))


def _vocab_entry_removed(folder: Path) -> None:
    """A token the merges use deleted from the vocabulary (`Token out of vocabulary`)."""
    data = json.loads((folder / "tokenizer.json").read_text())
    merge = data["model"]["merges"][0]
    del data["model"]["vocab"][merge[0] if isinstance(merge, list) else merge.split()[0]]
    (folder / "tokenizer.json").write_text(json.dumps(data))


def _fifo(folder: Path) -> None:
    (folder / "tokenizer_config.json").unlink()
    os.mkfifo(folder / "tokenizer_config.json")  # opening it for reading would wait for ever


TOKENIZER_DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "config-list": (lambda f: _config(f, "[1,2]"), "tokenizer_config.json"),
    "config-deep": (lambda f: _config(f, "[" * 100_000), "tokenizer_config.json"),
    "config-garbage": (lambda f: _config(f, "{garbage"), "tokenizer_config.json"),
    "eos-list": (_eos_list, ""),
    "vocab-entry-removed": (_vocab_entry_removed, ""),
    "tokenizer-binary": (
        lambda f: (f / "tokenizer.json").write_bytes(bytes(range(256))),
        "tokenizer.json",
    ),
    "config-fifo": (_fifo, "tokenizer_config.json"),
}
"""Damage to a saved tokenizer folder, and the file its message names (where one does)."""


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory) -> Path:
    """A bpe tokenizer folder as a run saves it (warmstart.run_tokenizer), on a small corpus."""
    folder = tmp_path_factory.mktemp("saved") / "tokenizer"
    corpus = ["Action: Direction 3\npos 1 2\n", "the hints say: go left, then down"] * 20
    tk.bpe_tokenizer(corpus, vocab_size=160).save_pretrained(folder)
    assert load_saved_tokenizer(folder).encode("pos 1 2")  # intact, it loads
    return folder


@pytest.mark.parametrize("damage", list(TOKENIZER_DAMAGE))
def test_a_damaged_tokenizer_folder_is_one_value_error(saved_tokenizer, tmp_path, damage):
    """`load_saved_tokenizer` on a folder with a damaged file (JSON of another shape, nested
    100,000 deep, not JSON, a special token of another type, a vocabulary missing a token its
    merges use, a named pipe): one ValueError line naming the folder (and the file where it
    can tell), and the fix, within seconds (a pipe is not waited on)."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(saved_tokenizer, folder)
    damage_it, file = TOKENIZER_DAMAGE[damage]
    damage_it(folder)
    with pytest.raises(ValueError) as caught:
        load_saved_tokenizer(folder)
    message = _one_line(str(caught.value))
    assert str(folder) in message and f"{folder / file}" in message, message
    assert "restore" in message and "copy of the run" in message, message


def test_a_tokenizer_file_over_its_bound_is_refused_unread(saved_tokenizer, tmp_path, monkeypatch):
    """A tokenizer file larger than the bound (lowered here to one byte under tokenizer.json's
    size, the folder's largest file) is refused in one line naming it and the bound, before
    transformers opens the folder."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(saved_tokenizer, folder)
    cap = (folder / "tokenizer.json").stat().st_size - 1
    assert all(p.stat().st_size <= cap for p in folder.iterdir() if p.name != "tokenizer.json")
    monkeypatch.setattr(tk, "MAX_TOKENIZER_FILE_BYTES", cap)
    opened = []
    monkeypatch.setattr(tk.PreTrainedTokenizerFast, "from_pretrained", opened.append)
    with pytest.raises(ValueError) as caught:
        load_saved_tokenizer(folder)
    message = _one_line(str(caught.value))
    assert f"{folder / 'tokenizer.json'} is more than {cap} bytes" in message, message
    assert opened == []


@pytest.mark.slow  # a training run and exports: seconds
@pytest.mark.parametrize("damage", list(TOKENIZER_DAMAGE))
def test_export_of_a_run_with_a_damaged_tokenizer_is_one_line(trained, tmp_path, damage):
    """`cod-fast export` of a run whose tokenizer/ is damaged: exit 2, one line naming the run's
    tokenizer folder and the fix, no export written."""
    run = _copy(trained, tmp_path)
    TOKENIZER_DAMAGE[damage][0](run / "tokenizer")
    result = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "hf")])
    message = cli_error(result)
    assert f"{run / 'tokenizer'}" in message and "restore" in message, message
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow  # a training run and four commands: seconds
def test_every_reader_of_a_runs_tokenizer_refuses_its_damage_in_one_line(trained, tmp_path):
    """A tokenizer_config.json reduced to `[1,2]` (a TypeError inside transformers before):
    `--resume`, `--set train.init_from=RUN` and `eval --model RUN` each stop with exit 2 and one
    line naming the run's tokenizer folder."""
    run = _copy(trained, tmp_path)
    _config(run / "tokenizer", "[1,2]")
    own = ["--config", str(run / "config.yaml"), "--set"]
    commands = {
        "resume": ["train", "--resume", *own, f"runtime.run_dir={run}"],
        "init_from": [
            "train",
            *own,
            f"runtime.run_dir={tmp_path / 'fresh'}",
            "--set",
            f"train.init_from={run}",
        ],
        "eval": ["eval", "--model", str(run), "--packs", "1", "--out", str(tmp_path / "eval")],
    }
    for name, args in commands.items():
        message = cli_error(runner.invoke(app, args))
        assert f"{run / 'tokenizer'}" in message, (name, message)


# --- a full disk while `train` saves its tokenizer -----------------------------------------------

# A full disk while `train` saves its tokenizer (the `tokenizers` library reports it as a plain
# Exception, "File too large (os error 27)").


@pytest.mark.slow  # a process of its own: seconds
def test_a_full_disk_while_train_saves_its_tokenizer_is_one_line(tmp_path):
    """`cod-fast train` of the built-in model with a bpe tokenizer, on a disk that refuses the
    tokenizer's file: exit 2, one `error:` line naming the tokenizer folder, the cause and the
    fix (free space, another runtime.run_dir), no traceback, and no tokenizer folder left."""
    run = tmp_path / "run"
    sets = [
        a for s in [*FAST, "model.tokenizer=bpe", f"runtime.run_dir={run}"] for a in ("--set", s)
    ]
    error = on_a_full_disk(["train", *sets], 3000)
    assert f"{run / 'tokenizer'}" in error and "File too large" in error, error
    assert "free space there" in error and "runtime.run_dir" in error, error
    assert not (run / "tokenizer").exists() and not list(run.glob(".tokenizer*"))
