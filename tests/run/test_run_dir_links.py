"""Nothing cod-fast writes into a run directory or an export folder goes through a symbolic link
(cod_fast.common.safe_write). A run directory may come from someone else: for each writer, an entry
that links to a file or folder outside is refused with one line naming the link and the fix,
before anything is written through it, and what the link points to keeps its bytes and its
mtime (a missing one is not created). The run directory itself, as the user names it, may be a
link."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.common.safe_write import temp_path
from cod_fast.data.metrics import PositionSummary
from cod_fast.distributed.context import DistContext
from cod_fast.model.loading import load_policy
from cod_fast.rollout.choice import _engine_folder
from cod_fast.run.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint
from cod_fast.run.directory import RunDirError, lock_run_dir, unlock_run_dir
from cod_fast.run.log import RunLog
from cod_fast.train.checkpointer import REFERENCE
from cod_fast.train.trainer import Trainer
from tests.run.test_checkpoint_damage import _run
from tests.run.test_run_dir import train_args
from tests.train.test_trainer import config

runner = CliRunner()


def _outside(root: Path, name: str, *, folder: bool = False, missing: bool = False) -> Path:
    """What a link points at, outside the run directory: a file, a folder holding one, or
    (`missing`) nothing yet."""
    target = root / "outside" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        target.mkdir()
        (target / "mine.txt").write_text("the user's own file\n")
    elif not missing:
        target.write_text("the user's own file\n")
    return target


def _state(target: Path) -> tuple | None:
    """What a write through a link would change: the bytes (of a folder: of its files) and the
    mtime; None for nothing there."""
    if not os.path.lexists(target):
        return None
    if target.is_dir():
        found = sorted(target.rglob("*"))
        content = {str(p.relative_to(target)): p.is_file() and p.read_bytes() for p in found}
    else:
        content = target.read_bytes()
    return content, target.stat().st_mtime_ns


def _link(entry: Path, target: Path) -> Path:
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.symlink_to(target, target_is_directory=target.is_dir())
    return entry


def _refusal(message: str, link: Path) -> None:
    """One line that names the link and how to remove it."""
    assert "\n" not in message.strip() and "Traceback" not in message, message
    assert f"{link} is a symbolic link" in message and f"rm {link}" in message, message


def _cli_refusal(result, link: Path) -> None:
    """A refused command: exit code 2, one line on stderr, no traceback."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    _refusal(result.stderr, link)


# --- cod-fast train: the run directory is checked before anything is written ---------------


@pytest.mark.parametrize("missing", [False, True], ids=["target", "missing target"])
def test_resume_refuses_a_linked_lock_and_leaves_its_target(tmp_path, missing):
    """`train --resume` on a received run whose `.lock` links out: refused in one line, and the
    target is neither truncated (it used to get the pid) nor created."""
    run = _run(tmp_path / "run")
    target = _outside(tmp_path, "lock", missing=missing)
    before = _state(target)
    link = _link(run / ".lock", target)
    result = runner.invoke(app, ["train", "--resume", "--set", f"runtime.run_dir={run}"])
    assert _state(target) == before
    _cli_refusal(result, link)


@pytest.mark.parametrize(
    "entry, folder",
    [
        (".lock", False),
        (temp_path("config.yaml").name, False),
        ("metrics.jsonl", False),
        ("eval.jsonl", False),
        (temp_path("rewards.png").name, False),
        (REFERENCE, False),
        ("checkpoints", True),
        ("tb", True),
        ("sampler-model", True),
    ],
)
def test_train_refuses_a_run_directory_holding_a_link(tmp_path, entry, folder):
    """`train` into a folder where an entry the run writes links out: refused before anything
    is written (no run starts), naming the link; the target is unchanged."""
    run = tmp_path / "run"
    target = _outside(tmp_path, "target", folder=folder)
    before = _state(target)
    link = _link(run / entry, target)
    result = runner.invoke(app, train_args(run, "runtime.tensorboard=true"))
    assert _state(target) == before and sorted(os.listdir(run)) == [entry]
    _cli_refusal(result, link)


def test_the_run_directory_itself_may_be_a_link(tmp_path):
    """The folder the user names may be a link (to a larger disk, say): it is locked and
    written through."""
    real = tmp_path / "disk" / "run"
    real.mkdir(parents=True)
    run = _link(tmp_path / "run", real)
    lock_run_dir(run)
    try:
        RunLog(run).write_config("a: 1\n")
    finally:
        unlock_run_dir(run)
    assert (real / "config.yaml").read_text() == "a: 1\n" and (real / ".lock").is_file()


def test_lock_refuses_a_linked_lock(tmp_path):
    """`lock_run_dir` (what a Trainer takes first): RunDirError, one line."""
    target = _outside(tmp_path, "lock")
    before = _state(target)
    link = _link(tmp_path / "run" / ".lock", target)
    with pytest.raises(RunDirError) as caught:
        lock_run_dir(tmp_path / "run")
    _refusal(str(caught.value), link)
    assert _state(target) == before


# --- the run log: config, logs, plots, TensorBoard ------------------------------------------

SUMMARY = PositionSummary(mean_reward=[0.1, 0.5], success_rate=None, num_packs=2)


def _rewrite_metrics(log: RunLog) -> None:
    """A resume from step 1 of a run that logged two steps: metrics.jsonl is rewritten."""
    log.metrics_path.write_text('{"step": 1}\n{"step": 2}\n')
    log.truncate(1)


LOG_WRITES: dict[str, tuple[str, Callable[[RunLog], object]]] = {
    "config.yaml": (temp_path("config.yaml").name, lambda log: log.write_config("a: 1\n")),
    "metrics.jsonl append": ("metrics.jsonl", lambda log: log.step({"step": 1})),
    "eval.jsonl append": ("eval.jsonl", lambda log: log.evaluation("start", 0, SUMMARY)),
    "metrics.jsonl rewrite": (temp_path("metrics.jsonl").name, _rewrite_metrics),
    "rewards.png": (temp_path("rewards.png").name, lambda log: log.evaluation("s", 0, SUMMARY)),
    "curves.png": (temp_path("curves.png").name, lambda log: log.evaluation("s", 0, SUMMARY)),
}


@pytest.mark.parametrize("write", list(LOG_WRITES))
def test_the_run_log_writes_nothing_through_a_link(tmp_path, write):
    """Each file of the run log (the config's and the logs' temporary files, the appended logs,
    the plots' temporary files) refuses a link in its place: one line, target unchanged."""
    entry, do = LOG_WRITES[write]
    run = tmp_path / "run"
    log = RunLog(run)
    target = _outside(tmp_path, "target")
    before = _state(target)
    link = _link(run / entry, target)
    with pytest.raises(OSError) as caught:
        do(log)
    _refusal(str(caught.value), link)
    assert _state(target) == before


def test_tensorboard_refuses_a_linked_tb_folder(tmp_path):
    """`runtime.report_to=[tensorboard]`: a `tb` that links to a folder outside is refused as
    the trackers start, before an event file is written into it."""
    target = _outside(tmp_path, "tb", folder=True)
    before = _state(target)
    link = _link(tmp_path / "run" / "tb", target)
    with pytest.raises(OSError) as caught:
        RunLog(tmp_path / "run", trackers=["tensorboard"]).truncate(-1)
    _refusal(str(caught.value), link)
    assert _state(target) == before


# --- checkpoints --------------------------------------------------------------------------


def _save(run: Path, step: int) -> Path:
    return save_checkpoint(run, step, {"w": torch.ones(3)}, {"state": {}, "param_groups": []})


@pytest.mark.parametrize(
    "entry, folder",
    [
        ("checkpoints", True),
        ("checkpoints/.step-0000002.tmp", True),
        (f"checkpoints/{temp_path('latest').name}", False),
    ],
)
def test_a_save_writes_nothing_through_a_link(tmp_path, entry, folder):
    """A checkpoints folder, a step's temporary folder or `latest`'s temporary file that links
    out: CheckpointError in one line; the target is unchanged and `latest` still names the
    checkpoint before."""
    run = tmp_path / "run"
    target = _outside(tmp_path, "target", folder=folder)
    before = _state(target)
    if entry != "checkpoints":
        _save(run, 1)
    link = _link(run / entry, target)
    with pytest.raises(CheckpointError) as caught:
        _save(run, 2)
    _refusal(str(caught.value), link)
    assert _state(target) == before
    if entry != "checkpoints":
        assert latest_checkpoint(run).step == 1


def test_a_rewrite_removes_a_link_where_the_old_folder_goes(tmp_path):
    """Rewriting step 1 moves its folder aside, to `.step-0000001.old`: a link there is removed
    itself (its folder outside keeps its files), and the rewrite completes."""
    run = tmp_path / "run"
    _save(run, 1)
    target = _outside(tmp_path, "old", folder=True)
    before = _state(target)
    link = _link(run / "checkpoints" / ".step-0000001.old", target)
    _save(run, 1)
    assert not os.path.lexists(link) and _state(target) == before
    assert latest_checkpoint(run).step == 1


# --- a real run: the KL reference, and the export of that run ------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, tuple | None]:
    """A two-step run with a KL term whose `reference.safetensors` is a link to a file outside
    when RL begins (planted after the run's start-up check): (run, target, target's state)."""
    root = tmp_path_factory.mktemp("trained")
    run = root / "run"
    kl = ["train.warm_start_steps=1", "train.steps=1", "algo.loss.kl=k3", "algo.loss.beta=0.05"]
    trainer = Trainer(config(run, *kl))
    target = _outside(root, "reference")
    before = _state(target)
    _link(run / REFERENCE, target)
    try:
        trainer.run()
    finally:
        trainer.close()
    return run, target, before


@pytest.mark.slow  # a trained run: a few seconds
def test_the_reference_replaces_a_link_and_leaves_its_target(trained):
    """The KL reference is written beside its place and renamed into it: a link there is
    replaced by the run's own file, and what it pointed to is unchanged."""
    run, target, before = trained
    reference = run / REFERENCE
    assert not reference.is_symlink() and reference.stat().st_size > 0
    assert _state(target) == before


@pytest.mark.slow  # a trained run: a few seconds
def test_export_refuses_a_linked_temporary_folder(trained, tmp_path):
    """`cod-fast export --out OUT` where the folder it writes first (`.OUT.export-tmp`) links to
    a folder outside: exit 2, one line, nothing written there, no OUT."""
    run, _, _ = trained
    out = tmp_path / "hf"
    target = _outside(tmp_path, "elsewhere", folder=True)
    before = _state(target)
    link = _link(tmp_path / ".hf.export-tmp", target)
    result = runner.invoke(app, ["export", str(run), "--out", str(out)])
    assert _state(target) == before and not out.exists()
    _cli_refusal(result, link)


@pytest.mark.slow  # a trained run: a few seconds
def test_export_removes_a_link_where_the_previous_export_goes(trained, tmp_path):
    """Replacing an earlier export moves it to `.OUT.export-old`: a link there is removed itself
    (its folder outside keeps its files), and the new export takes OUT's place."""
    run, _, _ = trained
    out = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(run), "--out", str(out)]).exit_code == 0
    target = _outside(tmp_path, "elsewhere", folder=True)
    before = _state(target)
    link = _link(tmp_path / ".hf.export-old", target)
    result = runner.invoke(app, ["export", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert not os.path.lexists(link) and _state(target) == before
    assert (out / "config.json").is_file()


# --- the vLLM engine's model folder --------------------------------------------------------

ONE_PROCESS = {"rank": 0, "world_size": 1, "local_rank": 0, "device": torch.device("cpu")}


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_the_engine_folder_is_written_anew(tmp_path, role):
    """`sampler-model` (`-rollout` for rollout workers) is a new folder each time: a link to a
    folder outside is refused in one line, and a stale folder whose `config.json` links out is
    replaced without writing through that link."""
    cfg = config(tmp_path / "run")
    model, tokenizer = load_policy(cfg.model)
    ctx = DistContext(**ONE_PROCESS, mesh=None, role=role)
    name = "sampler-model" if role == "trainer" else "sampler-model-rollout"
    folder = tmp_path / "run" / name

    target = _outside(tmp_path, "elsewhere", folder=True)
    before = _state(target)
    _link(folder, target)
    with pytest.raises(OSError) as caught:
        _engine_folder(cfg, model, tokenizer, ctx)
    _refusal(str(caught.value), folder)
    assert _state(target) == before

    folder.unlink()
    config_json = _outside(tmp_path, "config.json")
    before = _state(config_json)
    _link(folder / "config.json", config_json)
    assert _engine_folder(cfg, model, tokenizer, ctx) == str(folder)
    assert _state(config_json) == before and not (folder / "config.json").is_symlink()
