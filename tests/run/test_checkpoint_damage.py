"""Damaged checkpoints, linked step folders and interrupted exports: a truncated or torn file, or
weights that are not finite, is one line naming the file, the damage and the older intact
checkpoint to use; a symbolic link in a run's checkpoints is refused, and nothing it points to
is read or deleted; an export appears whole or not at all, and replaces only a previous export."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerBase
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.config.io import dump_yaml, load_config
from cod_fast.run import checkpoint as ck
from cod_fast.run.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    read_model_state,
    read_optimizer_state,
    read_rank_states,
    save_checkpoint,
)
from cod_fast.run.export import RUN_CONFIG, export_model
from cod_fast.run.init_from import check_source, initial_weights
from tests.special_files import on_a_full_disk

runner = CliRunner()

READERS = {
    "model.safetensors": read_model_state,
    "optimizer.pt": read_optimizer_state,
    "ranks.pt": read_rank_states,
}


def _save(run_dir: Path, step: int, **kw) -> Path:
    model = {"a": torch.ones(4, 8), "b": torch.arange(6.0)}
    optim = {"state": {0: {"exp_avg": torch.ones(64)}}, "param_groups": [{"lr": 1e-3}]}
    return save_checkpoint(run_dir, step, model, optim, extra={"value": step}, **kw)


def _run(path: Path, steps=(1, 2)) -> Path:
    """A run directory with the tiny-cpu config and small checkpoints: enough for every check
    made before a model is built."""
    path.mkdir(parents=True)
    cfg = load_config("tiny-cpu", overrides=[f"runtime.run_dir={path}"])
    (path / "config.yaml").write_text(dump_yaml(cfg))
    for step in steps:
        _save(path, step)
    return path


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _one_line(message: str) -> str:
    assert "\n" not in message.strip() and "Traceback" not in message, message
    return message


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _cli_error(result) -> str:
    """The one line a refused command prints (exit code 2, no traceback)."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return _one_line(result.stderr)


# --- damaged files ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(READERS))
def test_truncated_file_is_named_with_the_older_checkpoint_to_use(tmp_path, name):
    """A checkpoint file cut to half its size is one CheckpointError line naming the file, that
    it is truncated (of how many bytes), and the older checkpoint with how to resume or export
    it: from `latest_checkpoint` (before anything loads), and from the file's reader when the
    file was cut after the checkpoint was opened."""
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    ckpt = latest_checkpoint(tmp_path)
    _truncate(ckpt.path / name)
    for read in (lambda: latest_checkpoint(tmp_path), lambda: READERS[name](ckpt)):
        with pytest.raises(CheckpointError) as caught:
            read()
        message = _one_line(str(caught.value))
        assert f"{ckpt.path / name} is truncated (" in message, message
        assert "step-0000001" in message and str(tmp_path / "checkpoints" / "latest") in message
        assert f"cod-fast export {tmp_path} --step 1" in message


def test_damage_without_an_older_checkpoint_says_none_is_left(tmp_path):
    """The only checkpoint's missing optimizer file is named as missing, and the message says
    that no older checkpoint is left, instead of offering one."""
    _save(tmp_path, 1)
    ckpt = latest_checkpoint(tmp_path)
    (ckpt.path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is missing") as caught:
        read_optimizer_state(ckpt)
    assert "no older intact checkpoint" in _one_line(str(caught.value))


def test_an_older_checkpoint_with_a_cut_file_is_not_offered(tmp_path):
    """The checkpoint offered instead is the newest older one whose files have their written
    sizes: step 2 has a truncated ranks.pt, so step 3's damage points at step 1."""
    for step in (1, 2, 3):
        _save(tmp_path, step)
    _truncate(tmp_path / "checkpoints" / "step-0000002" / "ranks.pt")
    ckpt = latest_checkpoint(tmp_path)
    _truncate(ckpt.path / "model.safetensors")
    with pytest.raises(CheckpointError, match="newest older intact checkpoint is step-0000001"):
        read_model_state(ckpt)


def test_torn_meta_json_is_named_and_the_older_checkpoint_still_opens(tmp_path):
    """A meta.json reduced to `{` in the newest folder: `latest_checkpoint` names that file and
    `not valid JSON` (not a bare JSONDecodeError) and offers step 1, which opens by its step."""
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    meta = tmp_path / "checkpoints" / "step-0000002" / "meta.json"
    meta.write_text("{")
    with pytest.raises(CheckpointError) as caught:
        latest_checkpoint(tmp_path)
    message = _one_line(str(caught.value))
    assert str(meta) in message and "is not valid JSON" in message and "step-0000001" in message
    assert ck.checkpoint_at(tmp_path, 1).extra == {"value": 1}


def test_a_meta_json_over_its_bound_is_refused_unread(tmp_path, monkeypatch):
    """A meta.json larger than cod-fast writes (or /dev/zero in its place) is damage named in
    one line, not read whole."""
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    meta = tmp_path / "checkpoints" / "step-0000002" / "meta.json"
    meta.write_text(meta.read_text() + " " * 1000)  # valid JSON, larger than a cap at step 1's
    older = tmp_path / "checkpoints" / "step-0000001" / "meta.json"
    monkeypatch.setattr(ck, "MAX_META_BYTES", older.stat().st_size)
    with pytest.raises(CheckpointError) as caught:
        latest_checkpoint(tmp_path)
    message = _one_line(str(caught.value))
    assert f"{meta} is more than" in message and "step-0000001" in message


def test_non_finite_weights_name_the_first_bad_tensor(tmp_path):
    """Weights that load but hold NaN or inf are refused at load, naming the first bad tensor
    and how many of its values are bad (not an index error later, in the sampler)."""
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    path = latest_checkpoint(tmp_path).path / "model.safetensors"
    weights = load_file(path)
    weights["b"][[1, 4]] = torch.tensor([float("nan"), float("inf")])
    save_file(weights, path)
    with pytest.raises(CheckpointError) as caught:
        read_model_state(latest_checkpoint(tmp_path))
    message = _one_line(str(caught.value))
    assert str(path) in message and "non-finite values in tensor b (2 of its 6" in message
    assert "step-0000001" in message


def test_non_finite_weights_of_an_exported_folder_are_refused(tmp_path):
    """`--init-from` a model folder whose weights are all NaN: CheckpointError naming the file
    and the tensor, before the weights reach a model."""
    save_file({"w": torch.full((3, 2), float("nan"))}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors holds non-finite values in "):
        initial_weights(str(tmp_path))


# --- symbolic links --------------------------------------------------------------------------


def _link_step_folder(run: Path, outside: Path) -> Path:
    """Replace the run's newest step folder with a link to a copy of it outside the run, whose
    meta.json says step 99: a checkpoint read through the link would say so."""
    folder = latest_checkpoint(run).path
    shutil.copytree(folder, outside)
    (outside / "meta.json").write_text('{"step": 99, "extra": {}}')
    shutil.rmtree(folder)
    folder.symlink_to(outside, target_is_directory=True)
    return folder


@pytest.mark.parametrize("linked", ["step folder", "meta.json", "model.safetensors", "latest"])
def test_a_symbolic_link_in_the_checkpoints_is_refused(tmp_path, linked):
    """A step folder, a checkpoint file or `latest` that is a symbolic link is refused naming it
    and where it points, wherever that is; the fix is a real copy."""
    run = tmp_path / "run"
    _save(run, 1)
    folder = latest_checkpoint(run).path
    outside = tmp_path / "outside"
    if linked == "step folder":
        link = _link_step_folder(run, outside)
    else:
        link = folder / linked if linked != "latest" else run / "checkpoints" / "latest"
        outside.mkdir()
        shutil.copy(link, outside / linked)
        link.unlink()
        link.symlink_to(outside / linked)
    with pytest.raises(CheckpointError) as caught:
        read_model_state(latest_checkpoint(run))
    message = _one_line(str(caught.value))
    assert f"{link} is a symbolic link (to {outside}" in message and "copy" in message, message


def test_rotation_passes_a_linked_folder_by(tmp_path):
    """`keep` never deletes through a symbolic link nor fails on one: with step 1 a link to a
    folder outside the run, saving steps 2 and 3 with keep=1 removes step 2 only, and the
    folder outside is unchanged."""
    run = tmp_path / "run"
    _save(run, 1)
    outside = tmp_path / "outside"
    _link_step_folder(run, outside)
    before = _files(outside)
    _save(run, 2, keep=1)
    _save(run, 3, keep=1)
    left = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert left == ["step-0000001", "step-0000003"] and _files(outside) == before


def test_cli_refuses_a_linked_step_folder(tmp_path):
    """`cod-fast train --resume` and `cod-fast export` on a run whose newest step folder links
    out of it: exit 2 and one line naming the link, nothing outside read (the copy's step 99
    never shows) or changed, and no export written."""
    run = _run(tmp_path / "run")
    outside = tmp_path / "outside"
    link = _link_step_folder(run, outside)
    before = _files(outside)
    resume = runner.invoke(app, ["train", "--resume", "--set", f"runtime.run_dir={run}"])
    export = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "hf")])
    for result in (resume, export):
        message = _cli_error(result)
        assert f"{link} is a symbolic link" in message and "step 99" not in result.output
    assert _files(outside) == before and not (tmp_path / "hf").exists()


def test_init_from_a_run_with_a_torn_meta_json_is_a_config_error(tmp_path):
    """`train.init_from` naming a run whose newest meta.json is torn: the preflight's check
    says why (the file, the damage) instead of raising out of it."""
    run = _run(tmp_path / "run")
    (latest_checkpoint(run).path / "meta.json").write_text("{")
    assert "meta.json is not valid JSON" in check_source(str(run))


# --- exports ---------------------------------------------------------------------------------


def test_export_refuses_a_folder_of_other_files(tmp_path):
    """`cod-fast export --out DIR` where DIR holds files of its own (no cod_fast_run.yaml):
    refused with one line naming them, before any model is built, and DIR is unchanged."""
    run = _run(tmp_path / "run")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        export_model(run, out)
    result = runner.invoke(app, ["export", str(run), "--out", str(out)])
    assert "notes.txt" in _cli_error(result) and RUN_CONFIG in result.stderr
    assert _files(out) == {"notes.txt": b"keep me"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny trained run (two warm-start steps, a checkpoint after each)."""
    from cod_fast.train.trainer import Trainer
    from tests.train.test_trainer import config  # the fastest trainer settings the tests share

    run = tmp_path_factory.mktemp("trained") / "run"
    Trainer(config(run, "train.steps=0")).run()
    return run


@pytest.mark.slow  # a training run and exports: seconds
def test_cli_truncated_model_is_one_line_and_the_advice_works(trained, tmp_path):
    """The newest checkpoint's model.safetensors cut in half: `cod-fast export`, `--resume` and
    `--init-from RUN` each stop with exit 2 and one line naming the file and step-0000001;
    doing what the line says (`export --step 1`, step-0000001 into latest, then --resume)
    works."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    model = run / "checkpoints" / "step-0000002" / "model.safetensors"
    _truncate(model)
    own = ["--config", str(run / "config.yaml"), "--set"]  # the run's settings, moved here
    resume = ["train", "--resume", *own, f"runtime.run_dir={run}"]
    commands = [
        ["export", str(run), "--out", str(tmp_path / "hf")],
        resume,
        ["train", "--init-from", str(run), *own, f"runtime.run_dir={tmp_path / 'fresh'}"],
    ]
    for args in commands:
        message = _cli_error(runner.invoke(app, args))
        assert f"{model} is truncated" in message and "step-0000001" in message, message
    assert not (tmp_path / "hf").exists()

    older = ["export", str(run), "--step", "1", "--out", str(tmp_path / "hf")]
    assert runner.invoke(app, older).exit_code == 0
    (run / "checkpoints" / "latest").write_text("step-0000001")
    resumed = runner.invoke(app, resume)
    assert resumed.exit_code == 0, resumed.output
    assert latest_checkpoint(run).step == 2
    assert read_model_state(latest_checkpoint(run))  # step 2 written anew, whole


@pytest.mark.slow  # exports: seconds
def test_export_interrupted_leaves_the_previous_export_or_none(trained, tmp_path, monkeypatch):
    """A failure while the tokenizer is written (a kill, for the folder) leaves no export when
    there was none, the previous export unchanged when there was one, and no temporary folder;
    what a killed export leaves beside the folder is removed by the next export."""
    out = tmp_path / "hf"

    def dies(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedTokenizerBase, "save_pretrained", dies)
        with pytest.raises(KeyboardInterrupt):
            export_model(trained, out)
    assert list(tmp_path.iterdir()) == []

    export_model(trained, out, step=1)
    before = _files(out)
    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedTokenizerBase, "save_pretrained", dies)
        with pytest.raises(KeyboardInterrupt):
            export_model(trained, out, step=2)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"] and _files(out) == before

    killed = tmp_path / ".hf.export-tmp"  # a SIGKILL leaves the folder being written
    killed.mkdir()
    (killed / "config.json").write_text("{}")
    export_model(trained, out, step=2)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"] and _files(out) != before


@pytest.mark.slow  # exports: seconds
def test_export_replaces_a_previous_export_as_a_whole(trained, tmp_path):
    """Exporting over an earlier export leaves nothing of it (a stale shard index would make
    vLLM skip the new weights); an existing empty folder takes an export too."""
    out = tmp_path / "hf"
    out.mkdir()
    export_model(trained, out)
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    export_model(trained, out)
    assert not (out / "model.safetensors.index.json").exists()
    assert {"config.json", "model.safetensors", RUN_CONFIG, "tokenizer.json"} <= set(_files(out))


@pytest.mark.slow  # a process of its own: seconds
def test_export_on_a_full_disk_is_one_line_and_keeps_the_previous_export(trained, tmp_path):
    """A write the file system refuses while `cod-fast export` writes the weights: exit 2, one
    line naming --out and the cause, the previous export unchanged, nothing left beside it."""
    out = tmp_path / "hf"
    export_model(trained, out, step=1)
    before = _files(out)
    error = on_a_full_disk(["export", str(trained), "--out", str(out)], 64 * 1024)
    assert error.startswith(f"error: could not write the export to {out}: ")
    assert "File too large" in error and "a previous export there is intact" in error
    assert _files(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
