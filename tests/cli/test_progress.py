"""What the commands show while they run (cod_fast/cli/train_display.py, cod_fast/cli/play.py): plain lines when
stdout is no terminal, bars with an ETA on one, the training curves (cod_fast/data/metrics.py,
cod_fast/run/log.py) and the summary's next commands."""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.cli.train_display import _TrainingProgress
from cod_fast.data.metrics import PositionSummary
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.run.log import RunLog
from cod_fast.train.trainer import EvalProgress
from tests.rollout_helpers import save_tiny_qwen3
from tests.train.test_trainer import FAST

PLAIN = {"FORCE_COLOR": None, "TTY_COMPATIBLE": None}
"""Environment of a CliRunner run whose stdout is no terminal (these would make rich say it is)."""
PNG = b"\x89PNG\r\n\x1a\n"


def record(step: int, phase: str, reward: float = 0.25) -> dict:
    """A metrics.jsonl row with the fields the progress lines and curves read."""
    return {
        "step": step,
        "phase": phase,
        "reward_by_position": [reward, reward + 0.5],
        "reward_mean": reward,
        "cod_gain": 0.5,
        "loss": 1.5 / step,
        "tokens": 1000,
        "step_s": 0.5,
        "tokens_per_s_per_device": 2000.0,
    }


def shown(progress: _TrainingProgress, records: list[dict]) -> str:
    with progress:
        for r in records:
            progress.on_step(r)
        summary = PositionSummary(mean_reward=[0.1, 0.4], success_rate=None, num_packs=3)
        start = EvalProgress("rl step 1", 3, "frozenlake", 3, 0, 1)
        progress.on_eval(start)
        progress.on_eval(EvalProgress("rl step 1", 3, "frozenlake", 3, 1, 1, summary))
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
    """Without a terminal: one line per `log_every` steps (and the last), labelled `warm-start
    step i/N` or `RL step j/M` with loss, tokens/s, elapsed time and ETA; a warm-start line
    says `demo reward` and never `reward` alone; an evaluation is one line with its rewards."""
    text = shown(training_progress(terminal=False, log_every=2), STEPS)
    lines = text.splitlines()
    assert [line.split("  ")[0] for line in lines] == [
        "warm-start step 2/2",
        "RL step 2/3",
        "RL step 3/3",
        "eval rl step 1 (step 3) frozenlake: reward by position [0.100 0.400]",
    ]
    warm, rl = lines[0], lines[1]
    assert "demo reward 0.250" in warm and not re.search(r"(?<!demo )reward", warm)
    assert "reward 0.250  CoD gain +0.500" in rl and "demo" not in rl
    for line in lines[:3]:
        assert re.search(r"loss [\d.]+  2,000 tok/s  elapsed \d+:\d\d:\d\d  .*ETA ", line), line
    assert "warm start ETA" in warm and "CoD gain +0.300" in lines[3]
    assert "\x1b" not in text


def test_a_terminal_gets_bars_with_an_eta_and_no_plain_lines():
    """On a terminal the phases are bars (`warm-start step`, `RL step`) with an ETA column and
    the last step's numbers; the per-step plain lines are not printed there."""
    text = shown(training_progress(terminal=True), STEPS)
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    assert re.search(r"warm-start step +2/2", plain) and re.search(r"RL step +3/3", plain)
    assert "ETA 0:00:00" in plain
    assert "demo reward 0.250" in plain
    assert "elapsed 0:" not in plain  # the plain lines' wording
    assert "eval rl step 1 (step 3) frozenlake" in plain  # an evaluation's result stays


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
    sets = [*FAST, f"runtime.run_dir={run}", "runtime.log_every=2"]
    args = ["train", "--preset", "tiny-cpu", *(a for s in sets for a in ("--set", s))]
    return CliRunner().invoke(app, args, env=PLAIN), run


@pytest.mark.slow
def test_train_without_a_terminal_prints_plain_progress_lines(train_result):
    """Two warm-start and two RL steps with log_every=2: one line at warm-start step 2/2 and one
    at RL step 2/2, one line per evaluation (start, after warm start, end), no escape codes."""
    result, _ = train_result
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    steps = [line for line in lines if re.match(r"(warm-start|RL) step \d", line)]
    assert [line.split("  ")[0] for line in steps] == ["warm-start step 2/2", "RL step 2/2"]
    assert "demo reward" in steps[0] and "ETA" in steps[1]
    evals = [line.split(" frozenlake")[0] for line in lines if line.startswith("eval ")]
    assert evals == ["eval start (step 0)", "eval after warm start (step 2)", "eval end (step 4)"]
    assert "\x1b" not in result.output


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
