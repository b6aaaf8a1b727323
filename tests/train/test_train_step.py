"""One training step on the tiny Qwen3: accumulation, non-finite guards, checkpoint and resume."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from cod_fast import LossConfig
from cod_fast.common.rng import set_rng_state
from cod_fast.config import ModelConfig
from cod_fast.data.packing import (
    build_microbatch,
    pack_microbatches,
    rollout_sequences,
    step_totals,
    with_entropy_coef,
)
from cod_fast.distributed.context import DistContext
from cod_fast.distributed.fsdp import load_model_state, model_state
from cod_fast.distributed.optim_state import load_optimizer_state, optimizer_state
from cod_fast.model.loading import lm_head_weight, load_policy, packed_hidden_states
from cod_fast.model.policy import Policy
from cod_fast.ops import aggregation_denominator, linear_policy_loss
from cod_fast.run.checkpoint import (
    latest_checkpoint,
    read_model_state,
    read_optimizer_state,
    read_rank_states,
    save_checkpoint,
)
from cod_fast.train.step import NonFiniteError, runnable, train_step
from tests.data.test_layout_invariance import random_episode

ONE = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
KEEP_ALL = LossConfig(policy="rec_one_side", eps_low=0.99, eps_high=100.0)


def batch(seed: int, budget: int, world_size: int = 1):
    rng = random.Random(seed)
    episodes = [random_episode(rng, p, "solve", k) for p in range(3) for k in range(2)]
    batches = pack_microbatches(rollout_sequences(episodes), budget, world_size)
    tokens, segments = step_totals(batches)
    return batches, aggregation_denominator(KEEP_ALL, tokens, segments)


def fresh(seed=1):
    model, _ = load_policy(TINY, "cpu", seed=seed)
    return Policy(model), torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_steps_reduce_the_loss_on_a_fixed_batch():
    """With every token kept the surrogate is -A logp with fixed weights: steps lower it."""
    model, opt = fresh()
    (mbs,), denominator = batch(0, 4096)
    losses = [
        train_step(
            model, opt, mbs, denominator=denominator, loss_config=KEEP_ALL, grad_clip=1.0
        ).loss
        for _ in range(4)
    ]
    assert losses[-1] < losses[0]


def test_micro_batch_split_gives_the_same_update():
    """One micro-batch or several with the step's denominator: the same parameters after."""
    params = []
    for budget in (4096, 60):
        model, opt = fresh()
        batches, denominator = batch(0, budget)
        mbs = [mb for rank in batches for mb in rank]
        assert (len(mbs) > 1) == (budget == 60)
        train_step(model, opt, mbs, denominator=denominator, loss_config=KEEP_ALL, grad_clip=1e9)
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(params[0], params[1], atol=1e-6, rtol=1e-5)


def test_nan_advantages_skip_the_step():
    """A NaN advantage raises NonFiniteError naming the cause, and no parameter changes."""
    model, opt = fresh()
    (mbs,), denominator = batch(0, 4096)
    mbs[0].advantages[3] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteError, match="advantages"):
        train_step(model, opt, mbs, denominator=denominator, loss_config=KEEP_ALL, grad_clip=1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def run(model, opt, steps, run_dir=None, save_at=None):
    for step in range(steps):
        seed = int(torch.randint(0, 2**31 - 1, (1,)))  # data drawn from the RNG being restored
        (mbs,), denominator = batch(seed, 4096)
        train_step(model, opt, mbs, denominator=denominator, loss_config=KEEP_ALL, grad_clip=1.0)
        if save_at == step + 1:
            save_checkpoint(
                run_dir,
                step + 1,
                model_state(model, ONE),
                optimizer_state(model, opt, ONE),
                extra={"data_position": step + 1},
            )


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    """Train 4 steps straight, or 2 steps, checkpoint, restore into a fresh model and optimizer
    (different init), 2 more steps: the parameters are identical."""
    torch.manual_seed(123)
    straight, opt = fresh()
    run(straight, opt, 4)

    torch.manual_seed(123)
    first, opt = fresh()
    run(first, opt, 2, tmp_path, save_at=2)
    torch.manual_seed(999)  # whatever happens between, the restore puts the RNG back
    resumed, opt2 = fresh(seed=7)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.step == 2 and ckpt.extra == {"data_position": 2}
    load_model_state(resumed, read_model_state(ckpt), ONE)
    load_optimizer_state(resumed, opt2, read_optimizer_state(ckpt), ONE)
    set_rng_state(read_rank_states(ckpt)[0])
    run(resumed, opt2, 2)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_checkpoint_is_atomic_and_latest_moves(tmp_path):
    """A later checkpoint replaces `latest`; a leftover temporary folder never counts; `keep`
    prunes older checkpoints."""
    model, opt = fresh()
    state, optim = model_state(model, ONE), optimizer_state(model, opt, ONE)
    save_checkpoint(tmp_path, 1, state, optim)
    (tmp_path / "checkpoints" / ".step-0000002.tmp").mkdir()  # an interrupted write
    assert latest_checkpoint(tmp_path).step == 1
    save_checkpoint(tmp_path, 3, state, optim, keep=1)
    assert latest_checkpoint(tmp_path).step == 3
    assert [p.name for p in (tmp_path / "checkpoints").glob("step-*")] == ["step-0000003"]
    assert latest_checkpoint(tmp_path / "nothing") is None


@pytest.mark.parametrize(
    "config",
    [
        LossConfig(policy="opd"),
        LossConfig(policy="rec_one_side", kl="k3", beta=0.1),
        KEEP_ALL,
    ],
    ids=["opd", "kl", "plain"],
)
def test_an_empty_bin_runs_every_loss_and_reports_the_same_metrics(config):
    """A rank whose bin is empty runs a one-token placeholder (FSDP2 needs every rank's
    forward); it carries the empty teacher / reference log-probs its loss requires, so it
    trains nothing, raises nothing, and reports the metric names a real micro-batch does
    (the ranks all-reduce them by name)."""
    policy, _ = fresh()
    (mbs,), denominator = batch(0, 4096)
    real = mbs[0]
    n = real.num_trainable
    real.teacher_logp, real.ref_logp = -torch.rand(n), -torch.rand(n)
    if config.policy != "opd":
        real.teacher_logp = None
    if config.beta == 0:
        real.ref_logp = None
    empty = runnable(build_microbatch([]), config)
    outputs = [policy(mb, loss_config=config, denominator=denominator) for mb in (real, empty)]
    assert outputs[1].loss.item() == 0
    assert sorted(outputs[0].metrics) == sorted(outputs[1].metrics)


def test_update_entropy_weights_reach_the_loss():
    """With update_entropy_coef set (and entropy_coef 0), the step's gradients are those of the
    loss with each token's episode-kind entropy weight (packing.with_entropy_coef): an entropy
    bonus on the update episodes' tokens, none on the solve episodes'."""
    rng = random.Random(5)
    kinds = ("solve", "update", "solve", "update")
    episodes = [random_episode(rng, p, kind, k) for p in range(2) for k, kind in enumerate(kinds)]
    (mbs,) = pack_microbatches(rollout_sequences(episodes), 4096)
    cfg = dataclasses.replace(KEEP_ALL, update_entropy_coef=0.5)
    denominator = aggregation_denominator(cfg, *step_totals([mbs]))
    policy, _ = fresh()
    train_step(policy, torch.optim.SGD(policy.parameters(), lr=0.0), mbs,
               denominator=denominator, loss_config=cfg, grad_clip=1e9)  # fmt: skip
    step = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    for mb in mbs:
        mb = with_entropy_coef(mb, cfg)
        assert mb.entropy_coef is not None and mb.entropy_coef.unique().numel() == 2
        linear_policy_loss(
            packed_hidden_states(policy.model, mb)[mb.trainable_idx],
            lm_head_weight(policy.model), mb.targets, mb.advantages, mb.segment_ids,
            rollout_logp=mb.rollout_logp, loss_config=cfg, denominator=denominator,
            entropy_coef=mb.entropy_coef,
        ).loss.backward()  # fmt: skip
    for got, want in zip(step, (p.grad for p in policy.parameters()), strict=True):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5)
