"""The training loop end to end on the CPU: `cod-fast train` smoke runs, resume, Ctrl-C, bad input,
the reference model, old-log-prob recompute, task-by-task, and export."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import cod_fast.train.trainer as trainer_module
from cod_fast.cli.app import app
from cod_fast.config.io import load_config
from cod_fast.run.checkpoint import latest_checkpoint, read_model_state
from cod_fast.run.directory import RunDirError
from cod_fast.train.step import NonFiniteError
from cod_fast.train.trainer import Trainer

pytestmark = pytest.mark.slow  # runs, processes or benchmarks: seconds each

runner = CliRunner()

# A few seconds per run: a one-layer model, two packs of two members, two warm-start and two RL
# steps, two eval packs, a checkpoint after every step.
FAST = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.intermediate_size=64",
    "rollout.packs_per_step=2",
    "rollout.group_size=2",
    "rollout.eval_packs=2",
    "rollout.max_response_tokens=12",
    "train.warm_start_steps=2",
    "train.warm_start_packs=2",
    "train.steps=2",
    "runtime.checkpoint_every=1",
    "runtime.keep_checkpoints=0",
]
TIMING = {"sample_s", "train_s", "push_s", "step_s", "tokens_per_s_per_device"}


def config(run_dir, *extra):
    return load_config("tiny-cpu", overrides=[*FAST, f"runtime.run_dir={run_dir}", *extra])


def metrics(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}


def test_cli_train_smoke_writes_a_run_directory(tmp_path):
    """`cod-fast train --preset tiny-cpu` with a handful of steps exits 0 and leaves a complete
    run directory: resolved config, one metrics line per step (warm start then RL, with rewards
    by position, loss and timings), the three evaluations, the plot, the tokenizer, checkpoints."""
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny-cpu"]
    for override in [*FAST, f"runtime.run_dir={run}"]:
        args += ["--set", override]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "held-out eval packs" in result.output and "finished at step 4" in result.output
    assert load_config(path=str(run / "config.yaml")) == config(run)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert [r["phase"] for r in lines] == ["warm_start"] * 2 + ["rl"] * 2
    assert [r["phase_step"] for r in lines] == [1, 2, 1, 2]
    for r in lines:
        assert len(r["reward_by_position"]) == 4 and r["tokens"] > 0 and r["step_s"] > 0
        assert r["loss"] is not None and r["grad_norm"] >= 0
    assert lines[-1]["sample_s"] > 0 and lines[0]["sample_s"] == 0  # demonstrations sample nothing
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [(e["label"], e["step"]) for e in evals] == [
        ("start", 0),
        ("after warm start", 2),
        ("end", 4),
    ]
    assert (run / "rewards.png").stat().st_size > 0
    assert (run / "tokenizer" / "tokenizer.json").exists()
    assert latest_checkpoint(run).step == 4
    assert len(list((run / "checkpoints").glob("step-*"))) == 4


def test_resume_after_interruption_reproduces_the_uninterrupted_run(tmp_path):
    """Stop after step 3 (as Ctrl-C does: finish the step, checkpoint, exit), resume in a fresh
    Trainer: final parameters equal the uninterrupted run's bit for bit, and so do the logged
    metrics (timings aside) and evaluations."""
    straight = Trainer(config(tmp_path / "a"))
    straight.run()

    first = Trainer(config(tmp_path / "b"))

    def stop_after_3(record):
        if record["step"] == 3:
            first.stop_requested = True

    summary = first.run(on_step=stop_after_3)
    assert summary["stopped"] and summary["steps"] == 3
    assert latest_checkpoint(tmp_path / "b").step == 3
    torch.manual_seed(12345)  # whatever happened in between, resume restores every generator
    resumed = Trainer(config(tmp_path / "b"))
    resumed.run(resume=True)

    want, got = parameters(straight), parameters(resumed)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert metrics(tmp_path / "a") == metrics(tmp_path / "b")
    evals = [(tmp_path / d / "eval.jsonl").read_text() for d in "ab"]
    assert evals[0] == evals[1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_finishes_the_step_and_checkpoints(tmp_path, sig):
    """A real SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption) during a step lets the step
    finish, saves a checkpoint of it (rewriting the periodic one of the same step), and returns
    `stopped` with the signal; the checkpoint holds the parameters the run ended with."""
    trainer = Trainer(config(tmp_path / "run"))
    handler = signal.getsignal(sig)

    def interrupt(record):
        if record["step"] == 2:
            os.kill(os.getpid(), sig)

    summary = trainer.run(on_step=interrupt)
    assert summary["stopped"] and summary["steps"] == 2 and summary["signal"] == sig
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt.step == 2
    saved = read_model_state(ckpt)
    for name, param in trainer.policy.model.named_parameters():
        assert torch.equal(saved[name], param.detach()), name
    assert signal.getsignal(sig) is handler  # the run's own handler is gone
    assert not list((tmp_path / "run" / "checkpoints").glob(".*step*"))


def test_cli_exits_128_plus_the_signal_after_a_requested_stop(tmp_path, monkeypatch):
    """`cod-fast train` stopped by SIGTERM saves its checkpoint and exits 143 (128 + 15), so a
    job script can tell a preemption from a finished run; `--resume` then finishes the run."""
    run = tmp_path / "run"
    one_step = trainer_module.Trainer._rl_step

    def step_then_term(self):
        record = one_step(self)
        if self.step == 3 and not self.stop_requested:
            os.kill(os.getpid(), signal.SIGTERM)
        return record

    monkeypatch.setattr(trainer_module.Trainer, "_rl_step", step_then_term)
    args = ["train", "--preset", "tiny-cpu"]
    for override in [*FAST, f"runtime.run_dir={run}"]:
        args += ["--set", override]
    result = runner.invoke(app, args)
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert latest_checkpoint(run).step == 3
    monkeypatch.undo()
    resumed = runner.invoke(app, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert latest_checkpoint(run).step == 4


@pytest.mark.skipif(sys.platform != "linux", reason="sysfs (/sys) takes no new folders")
def test_unwritable_run_directory_is_one_line_naming_it():
    """A run directory that cannot be created (here under /sys, read-only even for root) ends
    `cod-fast train` with exit code 2 and one line naming the folder and the cause."""
    run = "/sys/cod_fast_run"
    result = runner.invoke(app, ["train", "--set", f"runtime.run_dir={run}"])
    assert result.exit_code == 2, result.output
    assert run in result.output and "Traceback" not in result.output
    assert "not permitted" in result.output or "Read-only" in result.output, result.output


def test_existing_run_directory_needs_resume(tmp_path):
    """A second run into a directory with checkpoints refuses to overwrite it (clear error, exit
    2 from the CLI) unless --resume is given; with it, a finished run only re-evaluates."""
    run = tmp_path / "run"
    Trainer(config(run)).run()
    with pytest.raises(RunDirError, match="--resume"):
        Trainer(config(run)).run()
    args = ["train", "--preset", "tiny-cpu"]
    for override in [*FAST, f"runtime.run_dir={run}"]:
        args += ["--set", override]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "--resume" in result.stderr
    assert latest_checkpoint(run).step == 4
    resumed = runner.invoke(app, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert len(metrics(run)) == 4


def test_repeated_non_finite_steps_stop_the_run_with_the_cause(tmp_path, monkeypatch):
    """NaN losses skip their steps (nothing updated); after train.max_skipped_steps in a row the
    run stops with an error naming the cause, and the last checkpoint stays as it was."""
    run = tmp_path / "run"

    def nan_step(*args, **kwargs):
        raise NonFiniteError("the step's loss is nan; the step was skipped")

    trainer = Trainer(config(run, "train.max_skipped_steps=2", "train.warm_start_steps=1"))
    real_step = trainer_module.train_step
    calls = []

    def first_real_then_nan(*args, **kwargs):
        calls.append(1)
        return real_step(*args, **kwargs) if len(calls) == 1 else nan_step()

    monkeypatch.setattr(trainer_module, "train_step", first_real_then_nan)
    with pytest.raises(NonFiniteError, match="2 steps in a row") as err:
        trainer.run(on_step=lambda r: None)
    assert "loss is nan" in str(err.value)
    ckpt = latest_checkpoint(run)
    assert ckpt.step == 2  # step 2 was skipped but logged; step 3 (the second skip) stopped it
    saved = read_model_state(ckpt)
    for name, param in trainer.policy.model.named_parameters():
        assert torch.equal(saved[name], param.detach()), name


def test_reference_model_only_with_a_kl_term(tmp_path):
    """beta = 0: no reference model is ever built; beta > 0 with k3: a frozen reference exists,
    the KL metric is logged, and it starts at 0 (the reference is the policy as RL began)."""
    plain = Trainer(config(tmp_path / "a", "train.warm_start_steps=0", "train.steps=1"))
    plain.run()
    assert plain.reference is None and "kl" not in metrics(tmp_path / "a")[-1]

    kl = Trainer(
        config(
            tmp_path / "b",
            "train.warm_start_steps=0",
            "train.steps=1",
            "algo.loss.kl=k3",
            "algo.loss.beta=0.1",
        )
    )
    kl.run()
    assert kl.reference is not None
    assert not any(p.requires_grad for p in kl.reference.parameters())
    record = metrics(tmp_path / "b")[-1]
    assert record["kl"] == pytest.approx(0.0, abs=1e-6)


def test_recomputed_old_logprobs_match_the_sampler(tmp_path):
    """algo.old_logp=recompute: the trainer's log-probs of the sampled tokens equal the sampler's
    (same weights, same temperature), so the first update's ratios are 1 up to float rounding."""
    trainer = Trainer(
        config(
            tmp_path / "run",
            "train.warm_start_steps=0",
            "train.steps=1",
            "algo.old_logp=recompute",
            "algo.loss.rollout_correction=tis",
        )
    )
    trainer.run()
    record = metrics(tmp_path / "run")[-1]
    assert record["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert record["tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)


def test_task_by_task_rolls_out_no_update_episodes(tmp_path, monkeypatch):
    """The tiny-cpu-tbt preset: no update episodes (no hint metric), GRPO-style loss; its
    evaluations play the CoD protocol (update episodes), like the CoD arm's, each followed by
    one in its own mode, labelled so."""
    cfg = load_config(
        "tiny-cpu-tbt", overrides=[*FAST, f"runtime.run_dir={tmp_path / 'run'}", "train.steps=1"]
    )
    modes = []
    evaluate = trainer_module.evaluate

    def record_mode(sampler, chat, plan, settings, *args, **kwargs):
        modes.append(settings.mode)
        return evaluate(sampler, chat, plan, settings, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "evaluate", record_mode)
    trainer = Trainer(cfg)
    trainer.run()
    assert trainer.settings.mode == "task_by_task"
    assert modes == ["cod", "task_by_task"] * 3
    labels = [json.loads(line)["label"] for line in (tmp_path / "run" / "eval.jsonl").open()]
    assert labels[:2] == ["start", "start (own mode)"] and labels[-1] == "end (own mode)"
    record = metrics(tmp_path / "run")[-1]
    assert record["phase"] == "rl" and "hint_valid_frac" not in record


def test_warm_start_hint_noise_reaches_the_demonstrations(tmp_path):
    """`train.warm_start_hint_noise=1`: the first update episode of most packs carries another
    pack's hints (the agents are alike up to there, so a clean run shows each pack's own)."""

    def first_hints(noise, name):
        caps = ["rollout.max_response_tokens=24"]
        packs = "train.warm_start_packs=6"
        cfg = config(tmp_path / name, *caps, packs, f"train.warm_start_hint_noise={noise}")
        rollouts = Trainer(cfg)._demonstrations()
        return [next(e.info["hints"] for e in r.episodes if e.kind == "update") for r in rollouts]

    clean, noisy = first_hints(0.0, "clean"), first_hints(1.0, "noisy")
    assert None not in clean
    assert sum(n != c for n, c in zip(noisy, clean, strict=True)) >= 3, (clean, noisy)


def test_export_writes_a_hugging_face_model(tmp_path):
    """`cod-fast export` turns the latest checkpoint into a folder that from_pretrained loads,
    with the trained weights: its logits equal the trainer's model's."""
    run = tmp_path / "run"
    trainer = Trainer(config(run, "train.steps=0", "train.warm_start_steps=1"))
    trainer.run()
    result = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([trainer.tokenizer.encode("pos 1 2\nDirection 3")])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trainer.policy.model(ids).logits)
    missing = runner.invoke(app, ["export", str(tmp_path / "nothing"), "--out", str(tmp_path)])
    assert missing.exit_code == 2 and "config.yaml" in missing.stderr


def test_init_from_starts_where_the_source_ended(tmp_path):
    """`--init-from` a run directory or its exported folder: the new run starts from the source's
    final weights (equal tensor for tensor, unlike the model's own init) and tokenizer, with a
    fresh optimizer and its own step count, and trains on from there; a bad source is refused
    before any compute."""
    source = tmp_path / "warm"
    warm = ["train.steps=0", "train.warm_start_steps=2", "runtime.checkpoint_every=0"]
    args = ["train", "--preset", "tiny-cpu"]
    for override in [*FAST, *warm]:
        args += ["--set", override]
    assert runner.invoke(app, [*args, "--set", f"runtime.run_dir={source}"]).exit_code == 0
    exported = tmp_path / "hf"
    assert runner.invoke(app, ["export", str(source), "--out", str(exported)]).exit_code == 0
    want = read_model_state(latest_checkpoint(source))

    for start in (source, exported):
        run = tmp_path / f"from-{start.name}"
        cfg = config(run, "train.warm_start_steps=0", "train.steps=1", f"train.init_from={start}")
        trainer = Trainer(cfg)
        fresh = parameters(trainer)
        trainer._restore_or_start(resume=False)
        got = parameters(trainer)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
        assert any(not torch.equal(fresh[n], want[n]) for n in want)
        assert trainer.step == 0 and not trainer.optimizer.state
        assert (run / "tokenizer" / "tokenizer.json").read_text() == (
            source / "tokenizer" / "tokenizer.json"
        ).read_text()
        trainer.run(resume=True)  # the run directory now has its config: go on as a resume
        assert latest_checkpoint(run).step == 1

    missing = runner.invoke(app, [*args, "--init-from", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "train.init_from" in missing.output


def test_rl_learning_rate_warms_up_linearly_over_its_own_steps(tmp_path):
    """train.lr_warmup=4: RL step j (counted from the end of the warm start) logs lr x j/4, and
    a resumed run continues the ramp where it stopped (the lr is a function of the step)."""
    extra = ["train.steps=3", "train.lr=0.004", "train.lr_warmup=4"]
    Trainer(config(tmp_path / "a", *extra)).run()
    rl = [r["lr"] for r in metrics(tmp_path / "a") if r["phase"] == "rl"]
    assert rl == pytest.approx([0.001, 0.002, 0.003], rel=1e-12)
    warm = [r["lr"] for r in metrics(tmp_path / "a") if r["phase"] == "warm_start"]
    assert all(lr != 0.001 for lr in warm)


@pytest.mark.parametrize("carry", [False, True])
def test_carry_optimizer_keeps_the_warm_starts_adam_moments(tmp_path, carry):
    """With train.carry_optimizer RL's AdamW has taken every step of the run (its moments come
    from the warm start); without, a fresh optimizer has taken only the RL steps."""
    trainer = Trainer(config(tmp_path / "run", f"train.carry_optimizer={str(carry).lower()}"))
    trainer.run()
    steps = {float(s["step"]) for s in trainer.optimizer.state.values()}
    assert steps == {4.0 if carry else 2.0}
    assert all(g["lr"] == trainer.cfg.train.lr for g in trainer.optimizer.param_groups)
