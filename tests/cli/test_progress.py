"""What the commands show while they run (cod_fast/cli/train_display.py, cod_fast/cli/play.py): plain lines when
stdout is no terminal, bars with an ETA on one, the training curves (cod_fast/data/metrics.py,
cod_fast/run/log.py) and the summary's next commands."""

from __future__ import annotations

import io
import json
import random
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cod_fast.cli import train_display
from cod_fast.cli.app import app
from cod_fast.cli.train_display import _run_eta_text, _step_status, _TrainingProgress, run_eta
from cod_fast.data.metrics import PositionSummary
from cod_fast.data.records import Episode, Rollout, Turn
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.run.log import RunLog
from cod_fast.train.record import BatchSteps, step_record
from cod_fast.train.step import StepResult
from cod_fast.train.trainer import EvalProgress
from tests.rollout_helpers import save_tiny_qwen3
from tests.train.test_trainer import FAST

PLAIN = {"FORCE_COLOR": None, "TTY_COMPATIBLE": None}
"""Environment of a CliRunner run whose stdout is no terminal (these would make rich say it is)."""
PNG = b"\x89PNG\r\n\x1a\n"
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d  ")
"""The local time every printed line of `cod-fast train` starts with."""


def record(step: int, phase: str, reward: float = 0.25, step_s: float = 0.5) -> dict:
    """A metrics.jsonl row with the fields the progress lines and curves read."""
    return {
        "step": step,
        "phase": phase,
        "reward_by_position": [reward, reward + 0.5],
        "reward_mean": reward,
        "cod_gain": 0.5,
        "loss": 1.5 / step,
        "tokens": 1000 * step_s / 0.5,
        "step_s": step_s,
        "tokens_per_s_per_device": 2000.0,
    }


def body(line: str) -> str:
    """A printed line without the local time it starts with (which it must have)."""
    assert STAMP.match(line), line
    return STAMP.sub("", line)


def shown(progress: _TrainingProgress, records: list[dict]) -> str:
    with progress:
        for r in records:
            progress.on_step(r)
        summary = PositionSummary(mean_reward=[0.1, 0.4], success_rate=None, num_packs=3)
        start = EvalProgress("rl step 1", 3, "frozenlake", 3, 0, 1)
        progress.on_eval(start)
        progress.on_eval(EvalProgress("rl step 1", 3, "frozenlake", 3, 1, 1, summary))
        progress.on_saved(3, Path("/runs/x/checkpoints/step-0000003"), 0.25)
    return progress.console.file.getvalue()


def training_progress(terminal: bool, log_every: int = 1) -> _TrainingProgress:
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(runtime=SimpleNamespace(log_every=log_every)),
        warm_steps=2,
        total_steps=5,
    )
    console = Console(file=io.StringIO(), force_terminal=terminal, width=200)
    return _TrainingProgress(trainer, console)


STEPS = [record(1, "warm_start"), record(2, "warm_start"), *(record(s, "rl") for s in (3, 4, 5))]


def test_plain_lines_label_each_phase_and_never_show_demonstrations_as_the_models_reward():
    """Without a terminal: one line per `log_every` steps (and the last), each starting with
    the local time, labelled `warm-start step i/N` or `RL step j/M` with loss, tokens/s,
    elapsed time, the phase's ETA and the run's; a warm-start line says `demo reward` and never
    `reward` alone; an evaluation part is a line as it starts and one with its rewards; a
    checkpoint is a line with its step, seconds and folder."""
    text = shown(training_progress(terminal=False, log_every=2), STEPS)
    lines = [body(line) for line in text.splitlines()]
    assert [line.split("  ")[0] for line in lines] == [
        "warm-start step 2/2",
        "RL step 2/3",
        "RL step 3/3",
        "eval rl step 1 (step 3) frozenlake: started on 3 packs (part 1/1)",
        "eval rl step 1 (step 3) frozenlake: reward by position [0.100 0.400]",
        "checkpoint step 3 (warm start 2 + RL 1) saved in 0.2 s (/runs/x/checkpoints/step-0000003)",
    ]
    warm, rl = lines[0], lines[1]
    assert "demo reward 0.250" in warm and not re.search(r"(?<!demo )reward", warm)
    assert "reward 0.250  CoD gain +0.500" in rl and "demo" not in rl
    for line in lines[:3]:
        timing = r"loss [\d.]+  2,000 tok/s  elapsed \d+:\d\d:\d\d  .*ETA .*  run ETA "
        assert re.search(timing, line), line
    assert "warm start ETA" in warm and "RL ETA" in rl and "CoD gain +0.300" in lines[4]
    assert "run ETA ? (RL pace unknown)" in warm and "run ETA 0:00:00" in lines[2]
    assert "\x1b" not in text


def test_the_run_eta_is_the_steps_left_at_each_phases_measured_pace(monkeypatch):
    """A line's `run ETA` is the warm-start steps left at the warm start's mean `step_s` plus
    the RL steps left at RL's, each over the phase's last PACE_STEPS steps; before any RL step
    it is a lower bound that says RL's pace is unknown."""
    monkeypatch.setattr(train_display, "PACE_STEPS", 2)
    progress = training_progress(terminal=False)  # 2 warm-start steps, 3 RL steps
    steps = [
        record(1, "warm_start", step_s=70.0),
        record(2, "warm_start", step_s=80.0),
        *(record(s, "rl", step_s=t) for s, t in ((3, 900.0), (4, 40.0), (5, 50.0))),
    ]
    lines = [body(line) for line in shown(progress, steps).splitlines()]
    etas = [re.search(r"  run ETA (.*)$", line).group(1) for line in lines[:5]]
    assert etas == [
        ">0:01:10 (RL pace unknown)",  # 1 warm-start step left at 70 s
        "? (RL pace unknown)",
        "0:30:00",  # 2 RL steps at 900 s
        "0:07:50",  # 1 RL step at (900 + 40) / 2
        "0:00:00",
    ]


def test_run_eta_adds_each_phases_steps_at_its_pace_and_names_the_unknown():
    """`run_eta` is sum(steps left x seconds per step) over the phases whose pace is known, and
    the phases with steps left and no pace; a phase with no step left needs no pace."""
    rng = random.Random()
    for _ in range(20):
        left = {"warm_start": rng.randrange(0, 3000), "rl": rng.randrange(0, 200)}
        pace = {"warm_start": rng.uniform(0.01, 5.0), "rl": rng.uniform(0.5, 60.0)}
        seconds, unknown = run_eta(left, pace)
        want = left["warm_start"] * pace["warm_start"] + left["rl"] * pace["rl"]
        assert seconds == pytest.approx(want, rel=1e-12) and unknown == [], (left, pace)
        seconds, unknown = run_eta(left, {**pace, "rl": None})
        assert seconds == pytest.approx(left["warm_start"] * pace["warm_start"], rel=1e-12)
        assert unknown == (["rl"] if left["rl"] else [])
    assert run_eta({"warm_start": 0, "rl": 0}, {"warm_start": None, "rl": None}) == (0, [])
    assert _run_eta_text(723.9, []) == "run ETA 0:12:03"
    assert _run_eta_text(723.9, ["rl"]) == "run ETA >0:12:03 (RL pace unknown)"
    assert _run_eta_text(0.0, ["rl"]) == "run ETA ? (RL pace unknown)"
    assert _run_eta_text(0.4, ["rl"]) == "run ETA >0:00:00 (RL pace unknown)"


def real_record(step: int, warm_steps: int, rng: random.Random, **metrics) -> tuple[dict, dict]:
    """A record of step `step` by cod_fast.train.record.step_record, from rollouts of random
    response lengths and an optimizer step of random numbers (and `metrics`: the loss
    metrics, a value None for a NaN); returns it with the numbers it was built from."""
    lengths = [rng.randrange(1, 400) for _ in range(6)]
    rollouts = []
    for pack, length in enumerate(lengths):
        turn = Turn(prompt_ids=[1, 2], response_ids=[5] * length, response_logprobs=[-0.5] * length)
        episode = Episode(
            pack_id=pack, member=0, kind="solve", task_index=0, turns=[turn], reward=pack % 2
        )
        rollouts.append(Rollout(pack_id=pack, member=0, episodes=[episode]))
    nan = {k: float("nan") if v is None else v for k, v in metrics.items()}
    grad_norm = nan.pop("grad_norm", rng.uniform(0.01, 3.0))
    result = StepResult(
        loss=rng.uniform(0, 1), grad_norm=grad_norm, trainable_tokens=9, metrics=nan
    )
    trained = BatchSteps(steps=[result], tokens=rng.randrange(1000, 9000))
    times = (0.0, 0.25, 1.5, 2.0)
    rec = step_record(step, warm_steps, rollouts, ["frozenlake"], {}, trained, 1e-4, times, 1)
    built = {"loss": result.loss, "grad_norm": grad_norm, "tokens_per_s": trained.tokens / 2.0}
    return rec, {**built, "resp": sum(lengths) / len(lengths), **metrics}


def test_step_status_shows_a_steps_health_numbers_from_its_record():
    """An RL step's status (a real step_record) reads reward, CoD gain, loss, KL, entropy,
    gradient norm, clip fraction, mean response length and tokens/s, each from its record."""
    rng = random.Random()
    kl, entropy, clip = rng.uniform(0, 0.01), rng.uniform(0, 3), rng.uniform(0, 0.2)
    rec, n = real_record(5, 2, rng, kl=kl, entropy=entropy, clip_frac=clip)
    assert _step_status(rec) == (
        f"reward 0.500  CoD gain +0.000  loss {n['loss']:.4f}  KL {n['kl']:.2g}  "
        f"ent {n['entropy']:.2f}  gnorm {n['grad_norm']:.3g}  clip {n['clip_frac']:.3f}  "
        f"resp {n['resp']:.0f} tok  {n['tokens_per_s']:,.0f} tok/s"
    )


def test_step_status_leaves_out_what_a_step_does_not_measure():
    """A number the step has no key for (no KL term) is left out, one it measured as NaN (null
    in the record) reads `n/a`; a warm-start step says `demo reward` and shows no clip
    fraction (0 by construction in its loss) but its entropy, gradient norm and lengths."""
    rng = random.Random()
    rec, n = real_record(3, 2, rng, entropy=None, clip_frac=0.1, grad_norm=None)
    status = _step_status(rec)
    assert "KL" not in status and "ent n/a  gnorm n/a  clip 0.100" in status, status
    assert rec["entropy"] is None and "kl" not in rec  # what the status reads
    warm, n = real_record(1, 2, rng, entropy=1.5, clip_frac=0.0)
    status = _step_status(warm)
    assert status.startswith("demo reward 0.500  loss ") and "CoD gain" not in status
    assert f"ent 1.50  gnorm {n['grad_norm']:.3g}  resp {n['resp']:.0f} tok  " in status
    assert "clip" not in status and "KL" not in status


def test_a_terminal_gets_bars_with_an_eta_and_no_plain_lines():
    """On a terminal the phases are bars (`warm-start step`, `RL step`) with an ETA column and
    the last step's numbers with the run's ETA, and no local time; the per-step plain lines and
    the evaluation's start line are not printed there; the lines printed (an evaluation's
    result, a checkpoint) start with the local time."""
    text = shown(training_progress(terminal=True), STEPS)
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    assert re.search(r"warm-start step +2/2", plain) and re.search(r"RL step +3/3", plain)
    assert "ETA 0:00:00" in plain and "run ETA 0:00:00" in plain
    final = plain.replace("\r", "\n").splitlines()[-2:]  # the bars as the run ends
    assert final[0].startswith("warm-start step") and "run ETA" not in final[0], final
    assert final[1].startswith("RL step") and final[1].endswith("run ETA 0:00:00"), final
    assert "demo reward 0.250" in plain
    assert "elapsed 0:" not in plain  # the plain lines' wording
    assert "started on" not in plain
    printed = [
        line for line in plain.splitlines() if "eval rl step 1" in line or "saved in" in line
    ]
    assert [body(line).split(" (")[0] for line in printed] == [
        "eval rl step 1",
        "checkpoint step 3",
    ]
    bars = [line for line in plain.splitlines() if "step " in line and line not in printed]
    assert bars and not any(STAMP.search(line.strip()) for line in bars), bars


@pytest.mark.slow
def test_curves_png_is_drawn_with_rewards_png(tmp_path):
    """RunLog draws curves.png (reward, CoD gain, loss, KL, entropy, tokens/s against step) where
    it draws rewards.png, rows without some fields (no KL term) included; both are PNG files."""
    log = RunLog(tmp_path)
    log.evaluation("start", 0, PositionSummary([0.1, 0.2], None, 2), env="frozenlake")
    for r in STEPS:
        log.step({**r, **({"kl": 0.01, "entropy": 1.2} if r["phase"] == "rl" else {})})
    log.close()
    for name in ("curves.png", "rewards.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG, name


@pytest.fixture(scope="module")
def train_result(tmp_path_factory):
    """A tiny `cod-fast train` through CliRunner (stdout no terminal), a line every 2 steps."""
    run = tmp_path_factory.mktemp("progress") / "run"
    sets = [*FAST, f"runtime.run_dir={run}", "runtime.log_every=2", "runtime.checkpoint_every=2"]
    args = ["train", "--preset", "tiny-cpu", *(a for s in sets for a in ("--set", s))]
    return CliRunner().invoke(app, args, env=PLAIN), run


@pytest.mark.slow
def test_train_without_a_terminal_prints_plain_progress_lines(train_result):
    """Two warm-start and two RL steps with log_every=2 and checkpoint_every=2: each line
    starts with the local time; a line at warm-start step 2/2 and one at RL step 2/2 with the
    run's ETA, two lines per evaluation (as it starts and its result: start, after warm start,
    end), a line per checkpoint (steps 2 and 4) with its folder; no escape codes."""
    result, run = train_result
    assert result.exit_code == 0, result.output
    lines = [body(line) for line in result.stdout.splitlines() if STAMP.match(line)]
    steps = [line for line in lines if re.match(r"(warm-start|RL) step \d", line)]
    assert [line.split("  ")[0] for line in steps] == ["warm-start step 2/2", "RL step 2/2"]
    assert "demo reward" in steps[0] and "run ETA ? (RL pace unknown)" in steps[0]
    assert "run ETA 0:00:00" in steps[1] and " gnorm " in steps[1] and " tok  " in steps[1]
    evals = [line.split(" frozenlake")[0] for line in lines if line.startswith("eval ")]
    assert evals == [
        *["eval start (step 0)"] * 2,
        *["eval after warm start (step 2)"] * 2,
        *["eval end (step 4)"] * 2,
    ]
    assert sum("frozenlake: started on 2 packs (part 1/1)" in line for line in lines) == 3
    saved = [line for line in lines if line.startswith("checkpoint ")]
    folders = [run / "checkpoints" / f"step-{s:07d}" for s in (2, 4)]
    assert [re.sub(r"in [\d.]+ s", "in S s", line) for line in saved] == [
        f"checkpoint step 2 (warm start) saved in S s ({folders[0]})",
        f"checkpoint step 4 (warm start 2 + RL 2) saved in S s ({folders[1]})",
    ]
    assert "\x1b" not in result.output


@pytest.mark.slow
def test_a_resumed_run_says_which_checkpoint_it_took_back(train_result, tmp_path):
    """`--resume` with one more RL step prints `resumed from checkpoint step 4 (FOLDER)`
    before its step's line, and the checkpoint of step 5."""
    _, finished = train_result
    run = shutil.copytree(finished, tmp_path / "run")
    args = ["train", str(run), "--resume", "--set", "train.steps=3"]  # its own config, 1 more step
    result = CliRunner().invoke(app, args, env=PLAIN)
    assert result.exit_code == 0, result.output
    lines = [body(line) for line in result.stdout.splitlines() if STAMP.match(line)]
    resumed = f"resumed from checkpoint step 4 ({run / 'checkpoints' / 'step-0000004'})"
    assert lines[0] == resumed, lines
    assert lines[1].startswith("RL step 3/3  ") and "run ETA 0:00:00" in lines[1]
    assert lines[2].startswith("checkpoint step 5 (warm start 2 + RL 3) saved in ")


@pytest.mark.slow
def test_train_writes_curves_and_its_summary_names_the_next_commands(train_result):
    """The run directory holds curves.png (a PNG); the summary names the run directory, its
    checkpoints, and the export and eval commands with their real options."""
    result, run = train_result
    assert result.exit_code == 0, result.output
    assert (run / "curves.png").read_bytes()[:8] == PNG
    latest = "the latest at step 4 (warm start 2 + RL 2)"
    assert f"checkpoints   {run / 'checkpoints'}, {latest}" in result.stdout
    assert "finished at step 4 (warm start 2 + RL 2) in" in result.stdout
    assert f"cod-fast export {run} --out {run}-model" in result.stdout
    assert f"cod-fast eval --model {run}-model" in result.stdout


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), char_tokenizer(CHATML))


PLAY = ["--env", "frozenlake", "--size", "tiny", "--tasks", "2", "--max-response-tokens", "4"]


@pytest.mark.slow
def test_eval_and_matrix_report_their_stages_on_stderr(tiny_model, tmp_path):
    """`eval` and `eval --matrix` say on stderr what they load and evaluate, how many of its
    tasks are played (a line per quarter, the last at all of them), and when they are done;
    stdout keeps the result table."""
    args = ["eval", "--model", str(tiny_model), *PLAY, "--packs", "2", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args, env=PLAIN)
    assert result.exit_code == 0, result.output
    assert f"loading {tiny_model}..." in result.stderr
    assert "evaluating on frozenlake (cod): 2 packs of 2 tasks each..." in result.stderr
    counts = re.findall(r"^evaluating on .*: frozenlake/cod: (\d+)/4 tasks$", result.stderr, re.M)
    assert counts and counts[-1] == "4" and counts == sorted(counts, key=int), result.stderr
    assert re.search(r"^done in [\d.]+ s$", result.stderr, re.M)
    assert "CoD gain" in result.stdout and "\x1b" not in result.output
    matrix = CliRunner().invoke(app, [*args, "--matrix", "--strategy", "cod"], env=PLAIN)
    assert matrix.exit_code == 0, matrix.output
    assert "evaluating 1 model(s) on 1 environment(s) x 1 strategies..." in matrix.stderr
    assert "model 1/1:" in matrix.stderr and "done in" in matrix.stderr
    assert re.search(r": frozenlake/cod: 4/4 tasks$", matrix.stderr, re.M), matrix.stderr


@pytest.mark.slow
def test_rollout_json_keeps_stdout_for_records(tiny_model):
    """`rollout --json` reports its stages on stderr only: stdout is one JSON object per pack."""
    args = ["rollout", "--model", str(tiny_model), *PLAY, "--packs", "2", "--json"]
    result = CliRunner().invoke(app, args, env=PLAIN)
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["pack_id"] for line in result.stdout.splitlines()] == [0, 1]
    assert "playing 2 packs of 2 tasks in frozenlake..." in result.stderr
    assert "playing 2 packs of 2 tasks in frozenlake: 4/4 tasks" in result.stderr
