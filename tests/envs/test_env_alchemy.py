"""Alchemy-Random (docs/concepts.md section 6): determinism, the hidden recipe graph, settings,
scripted agents and action parsing."""

from __future__ import annotations

import pytest

from cod_fast.envs.alchemy import SETTINGS, AlchemyEnv, AlchemyExplorer, AlchemyTask, pair_key
from cod_fast.envs.base import StepOutcome, Task, play_pack

CONFIGS = [("train", "full"), ("eval", "full"), ("train", "tiny"), ("eval", "tiny")]
K = 4


def position_means(env: AlchemyEnv, packs: range, use_hints: bool) -> list[float]:
    totals = [0.0] * K
    for seed in packs:
        rewards = play_pack(env, env.explorer(), seed, K, use_hints=use_hints).rewards
        totals = [t + r for t, r in zip(totals, rewards, strict=True)]
    return [t / len(packs) for t in totals]


def script(task: AlchemyTask, actions: list[str]) -> list[tuple[str, bool, bool, float]]:
    out = [(task.reset(), False, True, task.reward)]
    for action in actions:
        o = task.step(action)
        out.append((o.observation, o.done, o.valid, task.reward))
        if o.done:
            break
    return out


@pytest.mark.parametrize("setting,size", CONFIGS)
def test_deterministic(setting, size):
    """Same (pack_seed, task_index) -> same prompt, observations and rewards, in a fresh env."""
    for seed in (0, 7, 12345):
        a, b = AlchemyEnv(setting, size).task(seed, 2), AlchemyEnv(setting, size).task(seed, 2)
        assert a.prompt() == b.prompt()
        base = a.graph.base
        actions = [f"<answer>{x} + {y}</answer>" for x in base for y in base]
        assert script(a, actions) == script(b, actions)
        # A replay after reset() gives the same trajectory too.
        assert script(a, actions) == script(b, actions)


@pytest.mark.parametrize("setting,size", CONFIGS)
def test_rule_shared_in_pack_and_differs_across_packs(setting, size):
    """Every task of a pack has the same recipe graph; graphs differ across packs; consecutive
    tasks ask for different targets."""
    env = AlchemyEnv(setting, size)
    graphs = []
    for seed in range(20):
        tasks = [env.task(seed, k) for k in range(K)]
        assert all(t.graph == tasks[0].graph for t in tasks)
        assert all(tasks[k].target != tasks[k + 1].target for k in range(K - 1))
        graphs.append(tasks[0].graph)
    distinct = {tuple(sorted(g.product_of.items())) for g in graphs}
    assert len(distinct) == len(graphs)


def test_train_and_eval_differ_as_spec_says():
    """Train: 8 rounds, 3-4 base, 3-4 tiers counting the base, unlimited materials, no noise.
    Eval: 15 rounds, 4-6 base, limited materials, noise nodes making up at most 30%."""
    for setting, rounds, bases in (("train", 8, {3, 4}), ("eval", 15, {4, 5, 6})):
        env = AlchemyEnv(setting, "full")
        seen_bases, seen_levels, shares = set(), set(), []
        for seed in range(60):
            task = env.task(seed, 0)
            g = task.graph
            assert task.max_steps == rounds
            seen_bases.add(len(g.base))
            seen_levels.add(1 + max(g.tier.values()))  # tier 0 (base) counts as a level
            shares.append(len(g.noise) / (len(g.tier) - len(g.base)))
            for product, (a, b) in g.recipe_of.items():  # tier t from tiers < t, one at t - 1
                assert max(g.tier[a], g.tier[b]) == g.tier[product] - 1
            for element in g.noise:  # noise nodes are dead ends
                assert all(element not in pair for pair in g.product_of)
        assert seen_bases == bases
        assert seen_levels == {3, 4}
        if setting == "train":
            assert task.limited is False and max(shares) == 0
        else:
            assert task.limited is True and min(shares) > 0 and max(shares) <= 0.3 + 1e-9
    tiny = AlchemyEnv("train", "tiny").task(0, 0)
    assert len(tiny.graph.base) == 3 and max(tiny.graph.tier.values()) == 1
    assert all(len(e) == 1 for e in tiny.graph.tier)


@pytest.mark.parametrize("setting,size", CONFIGS)
def test_solver_always_makes_the_target(setting, size):
    """The solver reads the graph; every target is buildable within the rounds (and materials),
    so its mean reward over 40 packs is exactly 1."""
    env = AlchemyEnv(setting, size)
    rewards = [r for seed in range(40) for r in play_pack(env, env.solver(), seed, K).rewards]
    assert sum(rewards) / len(rewards) == 1.0


# Measured over these packs (K = 4), last minus first position with hints: train/full +0.50
# (0.20 -> 0.70), eval/full +0.40 (0.08 -> 0.47), train/tiny +0.25 (0.56 -> 0.81), eval/tiny
# +0.18 (0.29 -> 0.47); without hints no position is further than 0.045 from position 0.
GAIN = {
    ("train", "full"): 0.30,
    ("eval", "full"): 0.25,
    ("train", "tiny"): 0.15,
    ("eval", "tiny"): 0.10,
}


@pytest.mark.slow
@pytest.mark.parametrize("setting,size", CONFIGS)
def test_explorer_shows_the_cod_effect(setting, size):
    """With hints the explorer's reward at the last position is clearly above position 0; with
    hints off every position is alike (targets are drawn alike at every position)."""
    env = AlchemyEnv(setting, size)
    packs = range(1000) if size == "tiny" else range(300)  # tiny is cheap and noisier
    with_hints = position_means(env, packs, use_hints=True)
    without = position_means(env, packs, use_hints=False)
    assert with_hints[-1] - with_hints[0] >= GAIN[(setting, size)], with_hints
    assert max(abs(r - without[0]) for r in without) <= 0.08, without
    assert with_hints[0] == without[0]  # position 0 never has hints


class PublicView(Task):
    """What a model sees of a task: its text. The explorer must play from this alone."""

    def __init__(self, task: Task):
        self._task = task
        self.max_steps = task.max_steps

    def prompt(self):
        return self._task.prompt()

    def reset(self):
        return self._task.reset()

    def step(self, action) -> StepOutcome:
        return self._task.step(action)

    @property
    def reward(self):
        return self._task.reward

    def feedback(self):
        return self._task.feedback()


def test_explorer_reads_only_public_text_and_its_hints_round_trip():
    """The explorer plays the same through a text-only view of the task, and the hints it writes
    parse back to the same recipes and dead-end pairs."""
    env = AlchemyEnv("train", "full")
    for seed in range(10):
        explorer, hints = env.explorer(), None
        reference = play_pack(env, env.explorer(), seed, K).rewards
        for k in range(K):
            view = PublicView(env.task(seed, k))
            explorer.start(view, hints)
            observation = view.reset()
            for _ in range(view.max_steps):
                outcome = view.step(explorer.act(observation))
                observation = outcome.observation
                if outcome.done:
                    break
            assert view.reward == reference[k]
            hints = explorer.write_hints(view, hints)
            reread = AlchemyExplorer()
            reread.start(view, hints)
            assert reread.recipes == explorer.recipes
            assert reread.failed == explorer.failed
            for product, pair in explorer.recipes.items():  # and what it wrote is true
                assert view._task.graph.product_of[pair] == product


def test_tiny_hints_are_short_recipes():
    """Tiny hints are only the found recipes (`a+b=c`), about 16 characters."""
    env = AlchemyEnv("train", "tiny")
    lengths = []
    for seed in range(100):
        for hint in play_pack(env, env.explorer(), seed, K).hints:
            assert hint is None or "nothing" not in hint
            lengths.append(len(hint or ""))
    assert max(lengths) <= 17
    task = env.task(0, 0)
    assert len(task.prompt()) < 90 and len(task.reset()) < 20


@pytest.mark.parametrize("size", ["full", "tiny"])
@pytest.mark.parametrize(
    "junk",
    [
        "",
        "a + b",
        "<answer></answer>",
        "<answer>a b</answer>",
        "<answer>a + b + c</answer>",
        "<answer>a +</answer>",
        "<answer>a + b",
        "<answer>import os; os.system('ls') + b</answer>",
        "\x00\x01 garbage",
    ],
)
def test_malformed_action_ends_episode(size, junk):
    """Junk ends the episode: valid False, done, reward 0, feedback naming the expected format."""
    task = AlchemyEnv("train", size).task(3, 0)
    task.reset()
    outcome = task.step(junk)
    assert outcome.done and not outcome.valid
    assert task.reward == 0.0 and task.success is False
    assert "<answer>A + B</answer>" in outcome.observation
    assert "<answer>A + B</answer>" in task.feedback()


def test_lenient_parsing_and_wasted_rounds():
    """Case and spaces do not matter, the last <answer> block counts, and `A + B` with an element
    the agent lacks is a legal but wasted round (not a malformed action)."""
    task = AlchemyEnv("train", "full").task(5, 0)
    task.reset()
    (a, b), product = next(iter(task.graph.product_of.items()))
    if task.graph.tier[product] != 1:
        (a, b), product = next(
            (p, c) for p, c in task.graph.product_of.items() if task.graph.tier[c] == 1
        )
    outcome = task.step(f"thinking... <answer>x + y</answer> <ANSWER>  {a.upper()}+ {b} </Answer>")
    assert outcome.valid and product in outcome.observation
    outcome = task.step("<answer>zzzzz + zzzzz</answer>")
    assert outcome.valid and not outcome.done and task.rounds_used == 2


def test_limited_materials_are_used_up():
    """Eval: a combination takes one unit of each ingredient even when it makes nothing; an
    element without units cannot be used, and running out of materials ends the episode."""
    env = AlchemyEnv("eval", "tiny")
    task = env.task(0, 0)
    task.reset()
    stock = SETTINGS[("eval", "tiny")].stock
    base = task.graph.base
    dud = next(
        pair_key(x, y) for x in base for y in base if pair_key(x, y) not in task.graph.product_of
    )
    task.step(f"<answer>{dud[0]} + {dud[1]}</answer>")
    assert task.have[dud[0]] == stock - (2 if dud[0] == dud[1] else 1)
    task = env.task(0, 0)
    task.reset()
    task.step(f"<answer>{base[0]} + {base[0]}</answer>")  # stock is 2: both units used
    outcome = task.step(f"<answer>{base[0]} + {base[1]}</answer>")
    assert "no " + base[0] in outcome.observation
