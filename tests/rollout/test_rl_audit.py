"""What an audit of the RL path verified, kept as regression tests on real rollouts (the rollout
driver on FrozenLake, the tiny-cpu preset's trainer): the CoD advantages equal an independent
per-episode loop over docs/concepts.md section 3's definitions, and the trainer's packed,
prefix-shared loss gradient equals the naive -sum(A log p) / N from the model's own logits."""

from __future__ import annotations

import random

import pytest
import torch

from cod_fast.algo.assign import assign_advantages
from cod_fast.config import AlgoConfig
from cod_fast.data.records import Rollout
from cod_fast.envs.frozenlake import FrozenLakeEnv
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.model.tokenizer import char_tokenizer
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings, RolloutDriver
from cod_fast.rollout.sampler import TextPolicySampler
from cod_fast.train.trainer import Trainer
from tests.train.test_trainer import config

HINTS = "--- Start of updated hints ---\n{}\n--- End of updated hints ---"


def random_player(seed: int):
    """A policy of random moves and random (sometimes empty, sometimes malformed) hints, so that
    rewards and hint rewards differ between the members of a group."""
    rng = random.Random(seed)

    def act(prompt: str) -> str:
        if "Observation:" in prompt:  # an update episode reads the task's trajectory
            if rng.random() < 0.3:
                return "no hints here"  # no hint block: a hint penalty
            return HINTS.format(" ".join(f"{a}=?" for a in range(1, rng.randint(2, 5))))
        return f"Direction {rng.randint(1, 4)}"

    return act


def real_rollouts(driver_sampler, chat, packs: int = 6, group: int = 4) -> list[Rollout]:
    env = FrozenLakeEnv("train", "tiny")
    driver = RolloutDriver([env], driver_sampler, chat, DriverSettings())
    return driver.run(make_packs(pack_seeds("audit", packs), 4), group)


def loop_advantages(rollouts: list[Rollout], std_norm: bool) -> dict[tuple, float]:
    """Section 3 by hand, one episode at a time: solve episode k's return is the mean of the
    task rewards r_k .. r_{K-1}; update episode k's is the same mean with its hint reward h_k
    in place of r_k; the advantage is the return minus the group's mean return of that episode
    (divided by the group's population std + 1e-6 with std_norm)."""
    returns: dict[tuple, float] = {}
    for r in rollouts:
        rewards, hints, k_all = r.task_rewards, r.hint_rewards, len(r.task_rewards)
        for e in r.episodes:
            k = e.task_index
            tail = rewards[k + 1 :]
            first = rewards[k] if e.kind == "solve" else hints[k]
            returns[e.key] = (first + sum(tail)) / (k_all - k)
    out = {}
    for r in rollouts:
        for e in r.episodes:
            same = [
                returns[o.key]
                for q in rollouts
                if q.pack_id == r.pack_id
                for o in q.episodes
                if o.kind == e.kind and o.task_index == e.task_index
            ]
            mean = sum(same) / len(same)
            value = returns[e.key] - mean
            if std_norm:
                std = (sum((x - mean) ** 2 for x in same) / len(same)) ** 0.5
                value /= std + 1e-6
            out[e.key] = value
    return out


@pytest.mark.parametrize("std_norm", [False, True])
def test_cod_advantages_equal_an_independent_per_episode_loop(std_norm):
    chat = ChatFormat(char_tokenizer())
    rollouts = real_rollouts(TextPolicySampler(random_player(1), chat), chat)
    assign_advantages(rollouts, AlgoConfig(red_weight=False, std_norm=std_norm))
    want = loop_advantages(rollouts, std_norm)
    got = {e.key: e.advantage for r in rollouts for e in r.episodes}
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key
    kinds = {e.kind for r in rollouts for e in r.episodes if abs(e.advantage) > 1e-6}
    assert kinds == {"solve", "update"}  # the rollouts exercise both kinds of return


@pytest.mark.slow  # 0.5-1 s: left to the full suite
def test_the_trainers_gradient_equals_the_naive_sum_over_its_own_logits(tmp_path):
    """The trainer's RL update (prefix-shared packing, the fused loss, token-mean over the
    step) on real multi-turn rollouts, with old log-probs recomputed so every ratio is 1: its
    gradient equals that of -sum_t A_t log p(y_t) / N, each turn's log-probs taken from the
    model's full logits over that turn's own context, to float32 rounding."""
    trainer = Trainer(
        config(tmp_path / "run", "algo.old_logp=recompute", "train.grad_clip=1e9", "train.lr=1e-3")
    )
    trainer.batches.driver = RolloutDriver(
        trainer.envs, TextPolicySampler(random_player(2), trainer.chat), trainer.chat,
        trainer.settings,
    )  # fmt: skip
    rollouts = trainer.batches.next(0, trainer.policy, lambda: False).rollouts
    assign_advantages(rollouts, trainer.cfg.algo)
    for group in trainer.optimizer.param_groups:
        group["lr"] = 0.0  # the step's gradient, weights left as they are
    update = trainer._update(rollouts, trainer.cfg.algo.loss, mini_batches=1)
    assert len(update.steps) == 1
    params = dict(trainer.policy.model.named_parameters())
    packed = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}

    model = trainer.policy.model
    model.zero_grad(set_to_none=True)
    terms, count = [], 0
    for r in rollouts:
        for e in r.episodes:
            for turn in e.turns:
                ids = torch.tensor([turn.prompt_ids + turn.response_ids])
                logits = model(ids).logits[0].float()
                start = len(turn.prompt_ids)
                logp = logits[start - 1 : -1].log_softmax(-1)
                picked = logp.gather(1, torch.tensor(turn.response_ids)[:, None]).squeeze(1)
                terms.append(e.advantage * picked.sum())
                count += len(turn.response_ids)
    naive_loss = -torch.stack(terms).sum() / count
    naive_loss.backward()
    assert update.steps[0].trainable_tokens == count
    for name, grad in packed.items():
        naive = params[name].grad
        scale = naive.abs().max().item()
        assert scale > 0, name
        assert (grad - naive).abs().max().item() <= 2e-5 * scale + 1e-9, name
