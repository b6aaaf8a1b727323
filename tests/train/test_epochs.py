"""Epochs per RL batch (train.epochs) in the trainer: each batch's mini-batches are trained that
many times over, in order, with the ratio's old log-probs fixed before the first pass, and one
epoch trains exactly as the loop did before it had epochs."""

from __future__ import annotations

import pytest
import torch

import cod_fast.train.trainer as trainer_module
from cod_fast.config.io import load_config
from cod_fast.train.step import train_step
from cod_fast.train.trainer import Trainer
from tests.train.test_trainer import FAST as TRAINER_FAST

pytestmark = pytest.mark.slow  # training runs: seconds each

# A one-layer model, two packs of two members, no warm start, two RL steps of two mini-batches;
# the entropy bonus moves the weights even when every advantage is 0 (an untrained model's).
FAST = [
    *(o for o in TRAINER_FAST if o.startswith(("model.", "rollout."))),
    "rollout.eval_packs=0",
    "train.warm_start_steps=0",
    "train.steps=2",
    "train.mini_batches=2",
    "runtime.checkpoint_every=0",
    "algo.loss.entropy_coef=0.01",
]


class Calls:
    """Every train_step call of a run: its micro-batches (the list object and copies of their
    old log-probs), its result, and the weights after it."""

    def __init__(self, monkeypatch):
        self.batches, self.old, self.results, self.weights = [], [], [], []
        step = train_step  # the real one, however many runs a test records

        def recorded(policy, optimizer, microbatches, **kwargs):
            self.batches.append(microbatches)
            self.old.append([_clone(mb.old_logp) for mb in microbatches])
            self.results.append(step(policy, optimizer, microbatches, **kwargs))
            self.weights.append([p.detach().clone() for p in policy.parameters()])
            return self.results[-1]

        monkeypatch.setattr(trainer_module, "train_step", recorded)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def run(tmp_path, monkeypatch, *extra) -> tuple[Trainer, Calls]:
    calls = Calls(monkeypatch)
    trainer = Trainer(
        load_config("tiny-cpu", overrides=[*FAST, f"runtime.run_dir={tmp_path}", *extra])
    )
    trainer.run()
    trainer.close()
    return trainer, calls


@pytest.mark.parametrize("old_logp", ["bypass", "recompute"])
def test_two_epochs_repeat_the_mini_batches_with_fixed_old_logprobs(
    tmp_path, monkeypatch, old_logp
):
    """train.epochs=2: each RL step trains its two mini-batches, then the same two again (the
    same micro-batches), so AdamW takes twice the steps; the old log-probs of the second pass
    are the first's (none in bypass: the sampler's), while the policy has moved, so the second
    pass's ratios are off 1."""
    trainer, calls = run(tmp_path, monkeypatch, "train.epochs=2", f"algo.old_logp={old_logp}")
    steps = 2 * 2 * 2  # RL steps x epochs x mini-batches
    assert len(calls.batches) == steps
    assert {float(s["step"]) for s in trainer.optimizer.state.values()} == {float(steps)}
    for rl_step in range(2):
        first, second, again_first, again_second = calls.batches[4 * rl_step : 4 * rl_step + 4]
        assert first is again_first and second is again_second and first is not second
        old = calls.old[4 * rl_step : 4 * rl_step + 4]
        for a, b in ((old[0], old[2]), (old[1], old[3])):
            if old_logp == "bypass":
                assert all(t is None for t in a + b)
            else:
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    ratio = [r.metrics["ratio_mean"] for r in calls.results]
    assert abs(ratio[2] - 1) > 1e-6 and abs(ratio[2] - 1) > 10 * abs(ratio[0] - 1)


def test_one_epoch_is_the_first_pass_of_two(tmp_path, monkeypatch):
    """The first pass of train.epochs=2 is the one-epoch step exactly: the same losses,
    gradient norms and metrics, and the same weights after it, as a train.epochs=1 run of one RL
    step; one epoch makes one optimizer step per mini-batch, the loop of before."""
    one = ("train.steps=1", "algo.old_logp=recompute", "train.epochs=1")
    _, calls_one = run(tmp_path / "one", monkeypatch, *one)
    _, calls_two = run(tmp_path / "two", monkeypatch, *one[:2], "train.epochs=2")
    assert (len(calls_one.results), len(calls_two.results)) == (2, 4)
    for a, b in zip(calls_one.results, calls_two.results[:2], strict=True):
        assert (a.loss, a.grad_norm, a.trainable_tokens, a.metrics) == (
            b.loss,
            b.grad_norm,
            b.trainable_tokens,
            b.metrics,
        )
    for a, b in zip(calls_one.weights[-1], calls_two.weights[1], strict=True):
        assert torch.equal(a, b)
    assert not all(
        torch.equal(a, b) for a, b in zip(calls_two.weights[1], calls_two.weights[-1], strict=True)
    )
