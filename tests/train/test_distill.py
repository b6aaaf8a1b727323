"""Mixed-domain runs and on-policy distillation through the trainer and the CLI: per-environment
metrics and evaluations, opd end to end, `cod-fast distill`, and their bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.config import ConfigError
from cod_fast.config.io import load_config
from cod_fast.train.distill import teacher_jobs
from cod_fast.train.preflight import preflight
from cod_fast.train.trainer import Trainer
from tests.train.test_trainer import FAST

runner = CliRunner()
MIXED = ["rollout.env=null", "rollout.envs=[{name: frozenlake}, {name: terminal}]"]


def _config(run_dir, *extra, preset="tiny-cpu"):
    return load_config(preset, overrides=[*FAST, f"runtime.run_dir={run_dir}", *extra])


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _export_start(tmp_path, *extra) -> str:
    """The tiny model after one warm-start step on both environments, exported (the shared
    start of the opd tests: same weights, same tokenizer)."""
    run = tmp_path / "start"
    Trainer(_config(run, *MIXED, "train.steps=0", "train.warm_start_steps=1", *extra)).run()
    out = tmp_path / "start-hf"
    assert runner.invoke(app, ["export", str(run), "--out", str(out)]).exit_code == 0
    return str(out)


@pytest.mark.slow
def test_mixed_run_reports_each_environment(tmp_path):
    """A two-environment run draws packs of both, logs per-environment rewards in
    metrics.jsonl, evaluates each environment at every evaluation (and draws its plot), and
    an environment's evaluation equals that of a run on it alone with the same seed and
    vocabulary (same packs, same sampling noise)."""
    run = tmp_path / "mixed"
    cfg = _config(run, *MIXED, "rollout.packs_per_step=4", "train.warm_start_packs=4")
    Trainer(cfg).run()
    rows = _jsonl(run / "metrics.jsonl")
    seen = {
        env
        for r in rows
        for env in ("frozenlake", "terminal")
        if r[f"{env}/reward_mean"] is not None
    }
    assert seen == {"frozenlake", "terminal"}
    evals = _jsonl(run / "eval.jsonl")
    assert [(e["label"], e["env"]) for e in evals] == [
        (label, env)
        for label in ("start", "after warm start", "end")
        for env in ("frozenlake", "terminal")
    ]
    assert (run / "rewards-frozenlake.png").exists() and (run / "rewards-terminal.png").exists()
    alone = tmp_path / "alone"
    single = _config(
        alone,
        "rollout.env=terminal",
        "train.steps=0",
        "train.warm_start_steps=0",
        f"model.tokenizer_path={run / 'tokenizer'}",
    )
    Trainer(single).run()
    (start,) = [e for e in _jsonl(alone / "eval.jsonl") if e["label"] == "after warm start"]
    mixed_start = next(e for e in evals if e["label"] == "start" and e["env"] == "terminal")
    assert start["mean_reward"] == mixed_start["mean_reward"]


@pytest.mark.slow
def test_opd_with_the_student_as_teacher_changes_nothing(tmp_path):
    """Distilling from a teacher with the student's own weights gives A = teach - logp = 0 on
    every token: zero gradient, a teacher gap of 0 per environment; a different teacher gives a
    gradient and a non-zero gap, and the step reports the teachers' time."""
    start = _export_start(tmp_path)
    other = _export_start(tmp_path / "other", "train.seed=5", f"model.tokenizer_path={start}")
    for teacher, same in ((start, True), (other, False)):
        run = tmp_path / f"opd-{same}"
        cfg = _config(
            run,
            *MIXED,
            "train.warm_start_steps=0",
            "train.steps=1",
            "rollout.packs_per_step=4",
            "rollout.eval_packs=0",
            f"train.init_from={start}",
            "algo.loss.policy=opd",
            f"algo.teachers={{frozenlake: {teacher}, terminal: {teacher}}}",
        )
        preflight(cfg)
        Trainer(cfg).run()
        (row,) = _jsonl(run / "metrics.jsonl")
        gaps = [
            row[f"teacher_gap/{e}"] for e in ("frozenlake", "terminal") if f"teacher_gap/{e}" in row
        ]
        assert gaps and row["teacher_s"] > 0
        if same:
            assert row["grad_norm"] < 1e-5 and max(abs(g) for g in gaps) < 1e-5, row
        else:
            assert row["grad_norm"] > 1e-3 and min(abs(g) for g in gaps) > 1e-3, row


def test_teacher_jobs_train_what_the_student_lacks(tmp_path):
    """`cod-fast distill` plans one teacher run per environment whose folder holds no model:
    the teacher preset on that environment alone with the student's tokenizer and seed, in
    FOLDER-run; a folder that holds a model is kept."""
    teachers = {e: str(tmp_path / e) for e in ("frozenlake", "terminal")}
    student = load_config(
        "tiny-cpu-opd",
        overrides=[
            f"runtime.run_dir={tmp_path / 'student'}",
            "train.seed=3",
            f"algo.teachers={{frozenlake: {teachers['frozenlake']}, terminal: {teachers['terminal']}}}",
        ],
    )
    jobs = teacher_jobs(student, overrides=["train.steps=5"])
    assert [j.env for j in jobs] == ["frozenlake", "terminal"]
    for job in jobs:
        (env,) = job.config.rollout.environments
        assert env.name == job.env and (env.size, env.setting) == ("tiny", "train")
        assert job.config.model.tokenizer_path == str(tmp_path / "student" / "tokenizer")
        assert job.config.train.seed == 3 and job.config.train.steps == 5
        assert job.config.runtime.run_dir == f"{teachers[job.env]}-run"
        assert job.config.algo.loss.policy == "rec_one_side" and not job.config.algo.teachers
    (tmp_path / "terminal").mkdir()
    (tmp_path / "terminal" / "config.json").write_text("{}")
    assert [j.env for j in teacher_jobs(student)] == ["frozenlake"]


def test_missing_teacher_or_tokenizer_folder_is_one_line_with_the_fix(tmp_path):
    """Training a distillation whose teacher folder does not exist names algo.teachers.ENV and
    `cod-fast distill`; a tokenizer_path without tokenizer.json names model.tokenizer_path."""
    cfg = load_config("tiny-cpu-opd", overrides=[f"runtime.run_dir={tmp_path}/s"])
    with pytest.raises(ConfigError, match=r"algo.teachers.frozenlake: .*cod-fast distill"):
        preflight(cfg)
    bad = load_config(overrides=[f"model.tokenizer_path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model.tokenizer_path: .* tokenizer.json"):
        preflight(bad)
    result = runner.invoke(
        app, ["train", "--preset", "tiny-cpu-opd", "--set", f"runtime.run_dir={tmp_path}/s"]
    )
    assert result.exit_code == 2 and "cod-fast distill" in result.output


@pytest.mark.slow
def test_cli_distill_trains_teachers_then_the_student(tmp_path):
    """`cod-fast distill` trains and exports each missing teacher with the student's tokenizer,
    then the student with opd; run again it keeps the teachers and resumes the student."""
    teachers = f"{{frozenlake: {tmp_path}/t/frozenlake, terminal: {tmp_path}/t/terminal}}"
    tiny = [
        *FAST[:4],
        "rollout.eval_packs=0",
        "train.warm_start_steps=1",
        "train.steps=1",
        "rollout.packs_per_step=2",
        "rollout.group_size=2",
        "train.warm_start_packs=2",
    ]
    args = [
        "distill",
        "--set",
        f"runtime.run_dir={tmp_path}/student",
        "--set",
        f"algo.teachers={teachers}",
    ]
    for o in tiny:
        args += ["--set", o, "--teacher-set", o]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    for env in ("frozenlake", "terminal"):
        folder = tmp_path / "t" / env
        assert (folder / "config.json").exists()
        assert (folder / "tokenizer.json").read_text() == (
            tmp_path / "student" / "tokenizer" / "tokenizer.json"
        ).read_text()
    rows = _jsonl(tmp_path / "student" / "metrics.jsonl")
    assert rows[-1]["phase"] == "rl" and "teacher_s" in rows[-1]
    again = runner.invoke(app, [*args, "--resume"])
    assert again.exit_code == 0 and "teacher for" not in again.output, again.output
