"""One writer per run directory, and `--resume` that continues exactly one run or refuses
(cod_fast.run.directory): the lock against another process and after SIGKILL, two runs started at
the same moment, and each way a resume cannot continue."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.config.io import load_config
from cod_fast.run.checkpoint import latest_checkpoint
from cod_fast.run.directory import (
    RunDirError,
    config_changes,
    flat_config,
    lock_run_dir,
    unlock_run_dir,
)
from tests.train.test_trainer import FAST

runner = CliRunner()

LOCKER = textwrap.dedent(
    """
    import sys
    from cod_fast.run.directory import RunDirError, lock_run_dir
    try:
        lock_run_dir(sys.argv[1])
    except RunDirError as e:
        print("refused:", e, flush=True)
        sys.exit(2)
    print("locked", flush=True)
    sys.stdin.read()  # hold the lock until the parent closes stdin (or kills this process)
    """
)


def locker(run_dir) -> subprocess.Popen:
    """Another process that takes the run directory's lock and holds it; its first line says
    whether it got it."""
    return subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def train_args(run_dir, *extra: str) -> list[str]:
    args = ["train", "--preset", "tiny-cpu"]
    for override in [*FAST, f"runtime.run_dir={run_dir}", *extra]:
        args += ["--set", override]
    return args


def files(run_dir) -> dict[str, bytes]:
    """Every file of a run directory (but its lock) and its bytes."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.mark.slow  # each other process imports torch
def test_a_second_process_is_refused_until_the_first_lets_go(tmp_path):
    """While one process holds a run directory, another's lock is refused naming the holder's
    pid; the holder may take it again (the CLI and its Trainer both do); once the holder gives
    it back, the other process gets it."""
    run = tmp_path / "run"
    lock_run_dir(run)
    lock_run_dir(run)  # reentrant in one process
    other = locker(run)
    first = other.communicate()[0]
    assert other.returncode == 2 and f"pid {os.getpid()}" in first, first
    unlock_run_dir(run)
    other = locker(run)
    assert other.communicate()[0].startswith("refused")  # still held once
    unlock_run_dir(run)
    other = locker(run)
    assert other.stdout.readline().strip() == "locked"
    other.communicate("")


@pytest.mark.slow
def test_a_killed_writer_leaves_no_stale_lock(tmp_path):
    """The lock is the kernel's (flock): a writer killed with SIGKILL, which runs no cleanup,
    leaves the run directory free for the next process."""
    run = tmp_path / "run"
    holder = locker(run)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(RunDirError, match=f"pid {holder.pid}"):
        lock_run_dir(run)
    holder.kill()
    holder.wait()
    lock_run_dir(run)
    unlock_run_dir(run)


@pytest.mark.slow
def test_two_runs_started_together_leave_one_run_and_one_refusal(tmp_path):
    """Four times, two `cod-fast train` on one fresh run directory started at the same moment:
    one finishes and leaves one intact run (its config, one metrics line per step, its
    checkpoint), the other exits 2 with one line saying the folder is taken (or, had it come
    second, that it holds a run already), and writes nothing."""
    cmd = [sys.executable, "-m", "cod_fast.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in range(4):
        run = tmp_path / f"run{attempt}"
        quick = ("train.warm_start_steps=1", "train.steps=0", "rollout.eval_packs=0")
        procs = [
            subprocess.Popen(
                cmd + train_args(run, *quick),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for _ in range(2)
        ]
        results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
        codes = sorted(code for code, _, _ in results)
        assert codes == [0, 2], results
        (refusal,) = [err for code, _, err in results if code == 2]
        assert "another cod-fast process" in refusal or "already has checkpoints" in refusal
        assert "Traceback" not in refusal
        lines = (run / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 1 and latest_checkpoint(run).step == 1, lines


@pytest.mark.slow
def test_resume_refuses_what_it_cannot_continue_and_changes_nothing(tmp_path):
    """--resume on a folder that does not exist, on checkpoint folders whose `latest` pointer
    is gone (naming the newest complete one and how to point at it), and on a run that logged
    steps but kept no checkpoint: each is one line and exit 2, and the folder is left exactly
    as it was (before, a resume started over and emptied metrics.jsonl)."""
    missing = tmp_path / "nothing"
    result = runner.invoke(app, [*train_args(missing), "--resume"])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not missing.exists()

    run = tmp_path / "run"
    assert runner.invoke(app, train_args(run)).exit_code == 0
    (run / "checkpoints" / "latest").unlink()
    before = files(run)
    for resume in (["--resume"], []):
        result = runner.invoke(app, [*train_args(run), *resume])
        assert result.exit_code == 2, result.output
        assert "step-0000004" in result.output and "Traceback" not in result.output
    assert files(run) == before

    shutil.rmtree(run / "checkpoints")
    before = files(run)
    result = runner.invoke(app, [*train_args(run), "--resume"])
    assert result.exit_code == 2 and "logged 4 steps without writing a checkpoint" in result.output
    assert files(run) == before


@pytest.mark.slow
def test_resume_with_other_settings_names_each_changed_field(tmp_path):
    """A resume may change how the run executes and how long it goes on (train.steps,
    runtime.*), nothing else: other environments or seeds are refused naming each field with
    both values, and config.yaml still describes the run; a changed tokenizer is refused; an
    allowed change continues from the checkpoint."""
    run = tmp_path / "run"
    assert runner.invoke(app, train_args(run)).exit_code == 0
    before = files(run)
    changed = ["--set", "rollout.env=terminal", "--set", "train.seed=7"]
    result = runner.invoke(app, [*train_args(run), *changed, "--resume"])
    assert result.exit_code == 2, result.output
    assert "rollout.env: 'frozenlake' -> 'terminal'" in result.output
    assert "train.seed: 0 -> 7" in result.output
    assert files(run) == before

    tokenizer = run / "tokenizer" / "tokenizer.json"
    saved = tokenizer.read_text()
    data = json.loads(saved)
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids that now mean each other's text
    tokenizer.write_text(json.dumps(data))
    result = runner.invoke(app, [*train_args(run, "train.steps=3"), "--resume"])
    assert result.exit_code == 2 and "another tokenizer" in result.output, result.output
    tokenizer.write_text(saved)

    more = train_args(run, "train.steps=3", "runtime.eval_every=1")
    result = runner.invoke(app, [*more, "--resume"])
    assert result.exit_code == 0, result.output
    assert latest_checkpoint(run).step == 5


def test_config_changes_name_what_a_resume_may_not_change():
    """Fields of how a run executes (runtime.*, train.steps, the sampler, kernels) may differ
    from the checkpoint's config; any other field, nested ones and list values included, is
    named with both values."""
    saved = flat_config(load_config("tiny-cpu-mixed"))
    allowed = [
        "train.steps=7",
        "runtime.eval_every=2",
        "runtime.device=cpu",
        "rollout.sampler=vllm",
        "model.attn_impl=sdpa",
    ]
    assert config_changes(saved, load_config("tiny-cpu-mixed", overrides=allowed)) == []
    other = load_config(
        "tiny-cpu-mixed",
        overrides=["algo.loss.eps_high=0.3", "rollout.envs=[{name: frozenlake}]", "train.lr=1e-3"],
    )
    changes = config_changes(saved, other)
    assert [c.split(":")[0] for c in changes] == ["algo.loss.eps_high", "rollout.envs", "train.lr"]
    assert "0.28 -> 0.3" in changes[0]


def test_a_checkpoint_from_before_the_rollout_temperature_key_resumes():
    """A checkpoint's config written when the temperature was the loss's key (no
    rollout.temperature in it) resumes under the same temperature, and a changed one is named
    under the new key."""
    saved = flat_config(load_config("tiny-cpu", overrides=["rollout.temperature=0.8"]))
    del saved["rollout.temperature"]
    assert saved["algo.loss.temperature"] == 0.8
    assert (
        config_changes(saved, load_config("tiny-cpu", overrides=["rollout.temperature=0.8"])) == []
    )
    changes = config_changes(saved, load_config("tiny-cpu"))
    assert changes == ["algo.loss.temperature: 0.8 -> 1.0", "rollout.temperature: 0.8 -> 1.0"]
