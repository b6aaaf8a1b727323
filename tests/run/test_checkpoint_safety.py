"""Checkpoints from untrusted run directories, kills mid-write and full disks (issue 16):
nothing in a run directory runs code, a kill at any moment leaves a loadable checkpoint, and a
failed write names the folder and the cause and loses nothing already written."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cod_fast.common.rng import rng_state, set_rng_state
from cod_fast.model.tokenizer import CHATML, char_tokenizer, load_saved_tokenizer
from cod_fast.run import checkpoint as ck
from cod_fast.run.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    read_model_state,
    read_optimizer_state,
    read_rank_states,
    save_checkpoint,
)


def _save(run_dir: Path, step: int, value: float = 0.0, **kw) -> Path:
    model = {"w": torch.full((3, 2), value)}
    optim = {"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 1e-3}]}
    return save_checkpoint(run_dir, step, model, optim, extra={"value": value}, **kw)


class _Payload:
    """A pickle that creates a file when it is loaded (what a crafted checkpoint could do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


@pytest.mark.parametrize("name", ["ranks.pt", "optimizer.pt"])
def test_crafted_pickle_is_refused_not_run(tmp_path, name):
    """A `.pt` file whose pickle calls a function is refused with a message naming the file,
    and the function never runs."""
    _save(tmp_path, 1)
    ckpt = latest_checkpoint(tmp_path)
    marker = tmp_path / "PWNED"
    torch.save({"rng": _Payload(marker)}, ckpt.path / name)
    reader = read_rank_states if name == "ranks.pt" else read_optimizer_state
    with pytest.raises(CheckpointError, match=name):
        reader(ckpt)
    assert not marker.exists()


def test_rng_state_round_trips_through_a_safe_load(tmp_path):
    """Every generator's state survives save and a weights_only load: the draws after a restore
    equal the draws after the save."""
    save_checkpoint(tmp_path, 1, {}, {}, rank_states=[rng_state()])
    draws = (random.random(), float(np.random.standard_normal()), float(torch.rand(())))
    random.random(), np.random.standard_normal(), torch.rand(())  # move every generator on
    set_rng_state(read_rank_states(latest_checkpoint(tmp_path))[0])
    again = (random.random(), float(np.random.standard_normal()), float(torch.rand(())))
    assert again == draws


def test_latest_must_name_a_checkpoint_of_the_run(tmp_path):
    """A `latest` pointer that leads out of the checkpoints folder is refused."""
    _save(tmp_path, 1)
    (tmp_path / "checkpoints" / "latest").write_text("../../elsewhere")
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        latest_checkpoint(tmp_path)


def test_kill_between_the_renames_of_a_rewrite_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    """Rewriting step 2 (a stop right after a periodic checkpoint) killed after the old folder
    moved aside and before the new one moved in: `latest` still loads, with the new state, and
    the next save clears the leftovers."""
    _save(tmp_path, 2, value=1.0)
    renames = []
    real_rename = Path.rename

    def rename(self, target):
        renames.append(self.name)
        if len(renames) == 2:  # the new folder's move into place: the process dies here
            raise KeyboardInterrupt
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, value=2.0)
    monkeypatch.setattr(Path, "rename", real_rename)
    assert not (tmp_path / "checkpoints" / "step-0000002").exists()
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.step == 2 and ckpt.extra == {"value": 2.0}
    assert float(read_model_state(ckpt)["w"][0, 0]) == 2.0

    _save(tmp_path, 3, value=3.0)
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["latest", "step-0000002", "step-0000003"], left
    step2 = ck.Checkpoint(tmp_path / "checkpoints" / "step-0000002", 2, {})
    assert float(read_model_state(step2)["w"][0, 0]) == 2.0  # the newer state of step 2 kept


def test_interrupted_save_leaves_the_previous_checkpoint_and_is_cleaned(tmp_path, monkeypatch):
    """A save killed while writing leaves `latest` on the previous step, and its temporary
    folder is removed by the next save."""
    _save(tmp_path, 1, value=1.0)

    def dies(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ck.torch, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, value=2.0)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path).step == 1
    assert (tmp_path / "checkpoints" / ".step-0000002.tmp").exists()
    _save(tmp_path, 3)
    assert not list((tmp_path / "checkpoints").glob(".step-*"))
    assert [p.name for p in sorted((tmp_path / "checkpoints").glob("step-*"))] == [
        "step-0000001",
        "step-0000003",
    ]


# A full disk, made real: the process may not grow a file past 64 KiB (root included), and
# SIGXFSZ is ignored, so the write fails with EFBIG as it would with ENOSPC.
_FULL_DISK = """
import json, resource, signal, sys, torch
from cod_fast.run.checkpoint import CheckpointError, save_checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
try:
    save_checkpoint(sys.argv[1], 2, {"w": torch.zeros(100_000)}, {"big": torch.zeros(100_000)})
except CheckpointError as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.mark.slow  # a process of its own: seconds
def test_full_disk_names_the_folder_and_keeps_the_previous_checkpoint(tmp_path):
    """A write that the file system refuses raises CheckpointError naming the folder and the
    cause; the previous checkpoint stays `latest` and loads, and no temporary folder is left."""
    _save(tmp_path, 1, value=1.0)
    result = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    message = json.loads(result.stdout)["error"]
    assert str(tmp_path / "checkpoints") in message and "step 2" in message
    assert "File too large" in message, message
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.step == 1 and float(read_model_state(ckpt)["w"][0, 0]) == 1.0
    assert not list((tmp_path / "checkpoints").glob(".step-*"))


def test_saved_tokenizer_folder_runs_no_code(tmp_path):
    """A tokenizer folder whose config points at Python code (`auto_map`) loads as data: the
    code never runs and the vocabulary is the saved one."""
    saved = tmp_path / "tokenizer"
    char_tokenizer(CHATML).save_pretrained(saved)
    marker = tmp_path / "PWNED"
    (saved / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast): pass\n"
    )
    config = json.loads((saved / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    config["tokenizer_class"] = "EvilTokenizer"
    (saved / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_saved_tokenizer(saved)
    assert not marker.exists()
    assert loaded.encode("abc", add_special_tokens=False) == char_tokenizer(CHATML).encode(
        "abc", add_special_tokens=False
    )


def test_old_pickled_numpy_state_is_refused_with_a_clear_message(tmp_path):
    """A ranks.pt with a pickled numpy array (what earlier versions wrote) is refused, naming the
    file, rather than loaded with code execution enabled."""
    _save(tmp_path, 1)
    ckpt = latest_checkpoint(tmp_path)
    with open(ckpt.path / "ranks.pt", "wb") as f:
        pickle.dump([{"rng": {"numpy": np.random.get_state()}}], f)
    with pytest.raises(CheckpointError, match=r"ranks\.pt"):
        read_rank_states(ckpt)
    assert os.path.exists(ckpt.path / "ranks.pt")
