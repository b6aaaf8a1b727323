"""Optimal control, hidden dynamics (docs/concepts.md section 6): rule, scoring, agents, junk."""

from __future__ import annotations

import numpy as np
import pytest

from cod_fast.envs.base import play_pack, play_task
from cod_fast.envs.optimal_control import (
    FAILED_REWARD,
    UNPARSABLE_REWARD,
    OptimalControlEnv,
    estimate_dynamics,
    parse_dynamics_hint,
)

SETTINGS = [("train", "tiny"), ("train", "full"), ("eval", "tiny"), ("eval", "full")]
SCRIPT = "<law>-0.4*(x-1) - 0.9*v</law>"


def _rewards(env, agent, packs, tasks, use_hints=True, first_seed=0):
    return np.array(
        [play_pack(env, agent, first_seed + s, tasks, use_hints).rewards for s in range(packs)]
    )


@pytest.mark.parametrize(("setting", "size"), SETTINGS)
def test_deterministic_given_seeds(setting, size):
    """Same (pack_seed, task_index) -> same prompt, observations, reward and feedback, from two
    separately built environments."""
    seen = []
    for _ in range(2):
        env = OptimalControlEnv(setting, size)
        run = []
        for seed, index in [(3, 0), (3, 2), (11, 1)]:
            task = env.task(seed, index)
            outcome = (task.prompt(), task.reset())
            run.append((*outcome, task.step(SCRIPT).observation, task.reward, task.feedback()))
        seen.append(run)
    assert seen[0] == seen[1]


def test_hidden_rule_shared_within_pack_and_varies_across_packs():
    """Every task of a pack has the same (a, b), drawn in the specified ranges; packs differ, and
    both signs of b occur."""
    env = OptimalControlEnv("train", "full")
    rules = []
    for seed in range(60):
        within = {env.task(seed, k).dynamics for k in range(4)}
        assert within == {env.rule(seed)}
        rules.append(env.rule(seed))
    assert len(set(rules)) == len(rules)
    assert all(0.55 <= r.a <= 1.2 and 0.35 <= abs(r.b) <= 1.5 for r in rules)
    assert {r.b > 0 for r in rules} == {True, False}
    starts = {(env.task(0, k).setup.x0, env.task(0, k).setup.x_target) for k in range(4)}
    assert len(starts) == 4, "tasks of a pack differ in start and target"


def test_eval_is_harder_than_train():
    """Eval starts farther from a moving target (v* != 0) with a higher control cost and a
    faster start; tiny uses integer starts and targets at rest with a fixed horizon."""

    def setups(setting, size):
        env = OptimalControlEnv(setting, size)
        return [env.task(s, k).setup for s in range(40) for k in range(2)]

    train, evals = setups("train", "full"), setups("eval", "full")
    assert all(s.v_target == 0 and s.cost == 0.01 for s in train)
    assert any(s.v_target != 0 for s in evals) and all(s.cost == 0.03 for s in evals)
    assert max(abs(s.x0 - s.x_target) for s in evals) > max(abs(s.x0 - s.x_target) for s in train)
    assert max(abs(s.v0) for s in evals) > max(abs(s.v0) for s in train)
    for setting in ("train", "eval"):
        tiny = setups(setting, "tiny")
        assert all(s.x0 == int(s.x0) and s.v0 == 0 and s.v_target == 0 for s in tiny)
        assert len({s.horizon for s in tiny}) == 1


def test_dynamics_and_loss_follow_the_spec():
    """v' = a v + b u, x' = x + v', u clipped to [-1, 1]; loss = (x_T - x*)^2 + 2 (v_T - v*)^2
    + c sum u^2 and reward = 1 / (1 + loss)."""
    env = OptimalControlEnv("eval", "full")
    task = env.task(5, 0)
    a, b, s = task.dynamics.a, task.dynamics.b, task.setup
    task.reset()
    task.step("<law>5</law>")  # clipped to u = 1 at every step
    x, v = s.x0, s.v0
    for _ in range(s.horizon):
        v = a * v + b * 1.0
        x = x + v
    loss = (x - s.x_target) ** 2 + 2 * (v - s.v_target) ** 2 + s.cost * s.horizon
    assert task.run.us == [1.0] * s.horizon
    assert task.reward == pytest.approx(1 / (1 + loss))


@pytest.mark.parametrize(
    ("setting", "size", "floor"),
    [
        ("train", "tiny", 0.95),
        ("train", "full", 0.95),
        ("eval", "tiny", 0.9),
        ("eval", "full", 0.9),
    ],
)
def test_solver_reaches_high_reward(setting, size, floor):
    """The solver, designing its law for the true (a, b), scores high at every position
    (measured mean: train 0.99, eval 0.96)."""
    env = OptimalControlEnv(setting, size)
    rewards = _rewards(env, env.solver(), packs=40, tasks=4)
    assert rewards.mean() >= floor


@pytest.mark.slow
@pytest.mark.parametrize("size", ["tiny", "full"])
def test_explorer_shows_the_cod_effect(size):
    """With hints the explorer identifies (a, b) from one task's transitions and the last
    position beats position 0 by a wide margin (measured +0.50 over these 150 packs); without
    hints every position plays the generic law and nothing rises (measured within 0.005)."""
    env = OptimalControlEnv("train", size)
    with_hints = _rewards(env, env.explorer(), packs=150, tasks=4)
    without = _rewards(env, env.explorer(), packs=150, tasks=4, use_hints=False)
    gain = with_hints[:, -1].mean() - with_hints[:, 0].mean()
    flat = without[:, -1].mean() - without[:, 0].mean()
    assert gain >= 0.3, gain
    assert abs(flat) <= 0.05, flat
    assert with_hints[:, 1:].mean() >= 0.9


def test_explorer_hint_identifies_the_dynamics():
    """The hint written after one task holds a and b within 0.03 of the truth (the feedback's
    transitions pin them down), and it parses back."""
    env = OptimalControlEnv("train", "full")
    for seed in range(20):
        task, explorer = env.task(seed, 0), env.explorer()
        play_task(task, explorer, None)
        estimate = parse_dynamics_hint(explorer.write_hints(task, None))
        assert estimate is not None
        assert abs(estimate.a - task.dynamics.a) <= 0.03
        assert abs(estimate.b - task.dynamics.b) <= 0.03


def test_estimate_needs_two_independent_transitions():
    """Least squares returns None when v and u are proportional (a and b not separable)."""
    assert estimate_dynamics([(0, 1.0, 1.0), (0, 2.0, 2.0), (0, 4.0, 4.0)]) is None
    a, b = 0.8, -0.6
    triples, v = [], 0.0
    for u in (1.0, -0.5, 0.25):
        triples.append((0.0, v, u))
        v = a * v + b * u
    triples.append((0.0, v, 0.0))
    estimate = estimate_dynamics(triples)
    assert (estimate.a, estimate.b) == pytest.approx((a, b))


@pytest.mark.parametrize(("setting", "size"), SETTINGS)
@pytest.mark.parametrize(
    "junk",
    [
        "",
        "hello",
        "-0.8*x",
        "<law></law>",
        "<law>x +</law>",
        "<law>import os</law>",
        "<law>y*2</law>",
        "<law>2**x</law>",
        "<law>__import__('os')</law>",
        "<LAW>x.real</LAW>",
    ],
)
def test_malformed_law_ends_the_task_with_the_penalty(setting, size, junk):
    """A missing or unparsable law ends the task (valid=False) with reward -0.1 and feedback
    naming the expected format."""
    task = OptimalControlEnv(setting, size).task(1, 0)
    task.reset()
    outcome = task.step(junk)
    assert outcome.done and not outcome.valid
    assert task.reward == UNPARSABLE_REWARD
    assert "<law>" in outcome.observation and "<law>" in task.feedback()
    assert task.success is False


@pytest.mark.parametrize("law", ["log(x - 100)", "sqrt(-1 - abs(v))", "1/(x - x)", "exp(60*t)"])
def test_law_that_fails_while_running_scores_zero(law):
    """A law that parses but fails at run time (domain error, division by zero, overflow guard)
    ends the task with reward 0 and says why."""
    task = OptimalControlEnv("train", "full").task(2, 0)
    task.reset()
    outcome = task.step(f"<law>{law}</law>")
    assert outcome.done and outcome.valid
    assert task.reward == FAILED_REWARD
    assert "failed" in task.feedback()


def test_lenient_law_formats():
    """Case, spacing around the tags, text before the block and `^` are accepted; the last
    block counts."""
    task = OptimalControlEnv("train", "full").task(4, 1)
    task.reset()
    outcome = task.step("thinking...\n< LAW > 0 </law> then <Law>-0.3*(x-1)^1 - v</law >")
    assert outcome.valid and task.law_text == "-0.3*(x-1)**1 - v"


def test_tiny_texts_fit_a_character_level_model():
    """Tiny uses the same code with short texts: prompt <= 120 characters, observation <= 30,
    the agents' laws <= 32 and the explorer's hints <= 16."""
    env = OptimalControlEnv("train", "tiny")
    for agent in (env.solver(), env.explorer()):
        hints = None
        for k in range(4):
            task = env.task(7, k)
            agent.start(task, hints)
            observation = task.reset()
            action = agent.act(observation)
            task.step(action)
            hints = agent.write_hints(task, hints)
            assert len(task.prompt()) <= 120 and len(observation) <= 30 and len(action) <= 32
            assert hints is None or len(hints) <= 16
