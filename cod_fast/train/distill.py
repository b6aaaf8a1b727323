"""`cod-fast distill`: single-domain teachers, then one student distilled on mixed packs.

The student's config names a teacher folder per environment (`algo.teachers`). Each folder that
does not hold a model yet is made here: a teacher run of the teacher preset (default `tiny-cpu`)
on that environment alone, with the student's tokenizer (`model.tokenizer_path`, so teacher and
student score the same tokens) and seed, in `FOLDER-run`; its last checkpoint is exported to
FOLDER. Then the student trains (its warm start, then `opd` steps scored by the teachers). Every
run is an ordinary `cod-fast train` run directory: checkpoints, resume, metrics and plots as RL.
Rerunning the command after an interruption continues where it stopped: finished teachers are
kept, an unfinished teacher run resumes, and the student resumes with `--resume`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cod_fast.config import Config
from cod_fast.config.io import load_config

TEACHER_PRESET = "tiny-cpu"


@dataclass(frozen=True)
class TeacherJob:
    """A teacher the student lacks: the run that trains it and the folder it is exported to."""

    env: str
    config: Config
    folder: Path


def student_tokenizer_folder(student: Config) -> Path:
    """Where the student's run keeps its tokenizer (cod_fast.run.vocab.run_tokenizer)."""
    return Path(student.runtime.run_dir) / "tokenizer"


def has_model(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def teacher_jobs(
    student: Config, preset: str = TEACHER_PRESET, overrides: Sequence[str] = ()
) -> list[TeacherJob]:
    """The teacher runs still to do, one per environment whose teacher folder holds no model:
    `preset` on that environment alone (its size and setting as in the student's run), with the
    student's tokenizer and seed, then `overrides`."""
    jobs = []
    for entry in student.rollout.environments:
        folder = Path(student.algo.teachers[entry.name])  # type: ignore[index]
        if has_model(folder):
            continue
        shared = student.model.tokenizer_path or student_tokenizer_folder(student)
        tokenizer = f"model.tokenizer_path={shared}"  # used by built-in teachers only
        config = load_config(
            preset,
            overrides=[
                "rollout.envs=[]",
                f"rollout.env={entry.name}",
                f"rollout.env_size={entry.size}",
                f"rollout.env_setting={entry.setting}",
                tokenizer,
                f"train.seed={student.train.seed}",
                f"runtime.run_dir={folder}-run",
                *overrides,
            ],
        )
        jobs.append(TeacherJob(entry.name, config, folder))  # type: ignore[arg-type]
    return jobs
