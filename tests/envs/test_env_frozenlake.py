"""FrozenLake-Obscure (cod_fast/envs/frozenlake.py): determinism, the per-pack direction
permutation, train/eval/tiny knobs, malformed actions, and the scripted agents' CoD effect."""

from __future__ import annotations

import re

import pytest

from cod_fast.envs.base import play_pack, play_task
from cod_fast.envs.frozenlake import (
    DIRECTIONS,
    SHAPES,
    FrozenLakeEnv,
    FrozenLakeExplorer,
    safe_distances,
)

COMBOS = [(size, setting) for size in ("tiny", "full") for setting in ("train", "eval")]
SCRIPT = [
    "Direction 1",
    "direction 2",
    "Direction 3",
    "Direction 4",
    "Direction 1",
    "Direction 2",
    "Direction 3",
    "Direction 4",
    "Direction 1",
    "Direction 2",
]
K = 4


def _run_script(env: FrozenLakeEnv, pack_seed: int, task_index: int) -> list[object]:
    task = env.task(pack_seed, task_index)
    trace: list[object] = [task.prompt(), task.reset()]
    for action in SCRIPT[: task.max_steps]:
        outcome = task.step(action)
        trace += [outcome.observation, outcome.done, task.reward]
        if outcome.done:
            break
    return [*trace, task.feedback()]


def _position_means(env: FrozenLakeEnv, packs: range, use_hints: bool) -> list[float]:
    totals = [0.0] * K
    for pack_seed in packs:
        result = play_pack(env, env.explorer(), pack_seed, K, use_hints=use_hints)
        totals = [t + r for t, r in zip(totals, result.rewards, strict=True)]
    return [t / len(packs) for t in totals]


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_same_seeds_give_same_episode(size, setting):
    """Determinism: fresh environments with the same (pack_seed, task_index) produce the same
    prompt, observations, rewards and feedback for a fixed action script; other seeds differ."""
    traces = [_run_script(FrozenLakeEnv(setting, size), 17, 2) for _ in range(2)]
    assert traces[0] == traces[1]
    others = {repr(_run_script(FrozenLakeEnv(setting, size), seed, 2)) for seed in range(20)}
    assert len(others) > 10


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_mapping_shared_within_pack_and_differs_across_packs(size, setting):
    """The hidden rule (action -> direction permutation) depends on pack_seed alone: every task of
    a pack has the same mapping, packs draw different permutations of the four directions."""
    env = FrozenLakeEnv(setting, size)
    mappings = []
    for pack_seed in range(60):
        pack = [env.task(pack_seed, k).mapping for k in range(K)]
        assert all(m == pack[0] for m in pack)
        assert sorted(pack[0].values()) == sorted(DIRECTIONS)
        mappings.append(tuple(pack[0].values()))
    assert len(set(mappings)) >= 15  # 24 permutations exist


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_every_map_has_a_safe_path_within_budget(size, setting):
    """Every generated lake has a safe start-to-goal path of 2..path_moves moves (so the solver
    can always win and no task is won by one move), and the map follows the setting's knobs."""
    env = FrozenLakeEnv(setting, size)
    shape = SHAPES[(size, setting)]
    for pack_seed in range(40):
        for k in range(K):
            task = env.task(pack_seed, k)
            distance = safe_distances(task.side, task.holes, task.goal)[task.start]
            assert 2 <= distance <= shape.path_moves
            assert task.side in shape.sides
            assert task.start not in task.holes and task.goal not in task.holes
            if shape.tile_prob is None:
                assert len(task.holes) == shape.holes


def test_train_eval_and_tiny_knobs():
    """The specified sizes: full train 4-5 wide, 6 env / 8 agent steps, frozen probability
    0.6-0.7; full eval 6-7 wide, 8 / 10 steps; tiny a 3x3 lake with one hole, the goal two moves
    away and 3 steps; tiny eval is larger than tiny train."""
    full_train, full_eval = SHAPES[("full", "train")], SHAPES[("full", "eval")]
    assert (full_train.sides, full_train.path_moves, full_train.max_steps) == ((4, 5), 6, 8)
    assert (full_eval.sides, full_eval.path_moves, full_eval.max_steps) == ((6, 7), 8, 10)
    assert full_train.tile_prob == full_eval.tile_prob == (0.6, 0.7)
    tiny, tiny_eval = SHAPES[("tiny", "train")], SHAPES[("tiny", "eval")]
    assert (tiny.sides, tiny.holes, tiny.path_moves, tiny.max_steps) == ((3,), 1, 2, 3)
    assert tiny.compact and not full_train.compact
    assert min(tiny_eval.sides) > max(tiny.sides) and tiny_eval.max_steps > tiny.max_steps
    # The drawn frozen fraction of full train maps sits near 0.6-0.7 (start and goal excluded).
    env = FrozenLakeEnv("train", "full")
    tasks = [env.task(seed, 0) for seed in range(300)]
    free = sum(t.side * t.side - 2 for t in tasks)
    frozen = 1 - sum(len(t.holes) for t in tasks) / free
    assert 0.6 <= frozen <= 0.75  # measured 0.68; the solvability filter favours fewer holes


def test_tiny_text_is_compact():
    """Tiny prompts state goal, holes and the action format in two short lines, and tiny
    observations are `pos r c` with an optional event word."""
    env = FrozenLakeEnv("train", "tiny")
    task = env.task(3, 0)
    prompt = task.prompt()
    assert len(prompt) < 90 and "Direction 3" in prompt and "hole" in prompt
    assert re.fullmatch(r"pos \d \d", task.reset())
    for action in SCRIPT[: task.max_steps]:
        outcome = task.step(action)
        assert re.fullmatch(r"pos \d \d( wall| hole| goal| out)?", outcome.observation)
        if outcome.done:
            break


def test_wall_bump_keeps_position_and_says_so():
    """Moving into the edge of the map keeps the position, uses an action, and the observation
    says so (compact: `wall`; full: a sentence)."""
    bumps = 0
    for size in ("tiny", "full"):
        env = FrozenLakeEnv("train", size)
        for seed in range(50):
            task = env.task(seed, 0)
            task.reset()
            action = {d: a for a, d in task.mapping.items()}
            for direction in DIRECTIONS:  # find a direction that leaves the map from the start
                r, c = (
                    task.start[0] + DIRECTIONS[direction][0],
                    task.start[1] + DIRECTIONS[direction][1],
                )
                if not (0 <= r < task.side and 0 <= c < task.side):
                    outcome = task.step(f"Direction {action[direction]}")
                    assert task.pos == task.start and task.steps == 1 and not outcome.done
                    assert ("wall" if size == "tiny" else "edge of the map") in outcome.observation
                    bumps += 1
                    break
    assert bumps >= 30  # most starts lie on an edge


def test_holes_goal_and_step_budget_end_the_episode():
    """Falling into a hole ends with reward 0, reaching the goal with reward 1 and success, and
    spending every action without reaching the goal ends with reward 0."""
    env = FrozenLakeEnv("train", "full")
    seen = set()
    for seed in range(200):
        task = env.task(seed, 0)
        reward = play_task(task, FrozenLakeEnv("train", "full").explorer(), None)
        seen.add(task.outcome)
        assert task.done and reward == (1.0 if task.outcome == "goal" else 0.0)
        assert task.success == (task.outcome == "goal")
        if task.outcome == "hole":
            assert task.pos in task.holes
        if task.outcome == "out":
            assert task.steps == task.max_steps
    assert seen == {"goal", "hole", "out"}


@pytest.mark.parametrize("size", ["tiny", "full"])
@pytest.mark.parametrize(
    "junk",
    [
        "",
        "Direction 5",
        "Direction 0",
        "direction",
        "up",
        "3",
        "Direction 1 Direction 2",
        "__import__('os').system('ls')",
        "Direction -1",
        "Direction 2, please",
    ],
)
def test_malformed_action_ends_episode(size, junk):
    """A malformed action ends the episode with reward 0, valid=False, and feedback that names
    the expected format (`Direction N`)."""
    task = FrozenLakeEnv("train", size).task(5, 1)
    task.reset()
    outcome = task.step(junk)
    assert outcome.done and not outcome.valid
    assert task.reward == 0.0 and task.success is False
    assert "Direction" in outcome.observation and "Direction" in task.feedback()


@pytest.mark.parametrize(
    "variant", ["  direction 3 ", "DIRECTION 3", "`Direction 3`", "Direction 3.", "Direction   3"]
)
def test_lenient_parse_of_whitespace_and_case(variant):
    """Whitespace, case, backticks and a trailing period are forgiven: the variant acts exactly
    like `Direction 3`."""
    env = FrozenLakeEnv("train", "full")
    a, b = env.task(8, 0), env.task(8, 0)
    a.reset()
    b.reset()
    assert a.step(variant) == b.step("Direction 3")
    assert a.pos == b.pos


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_solver_always_reaches_the_goal(size, setting):
    """The solver, which reads the mapping, reaches the goal on every task (reward 1.0 over 40
    packs of 4): the natural bound, since every map has a safe path within the budget."""
    env = FrozenLakeEnv(setting, size)
    for pack_seed in range(40):
        assert play_pack(env, env.solver(), pack_seed, K).rewards == [1.0] * K


@pytest.mark.slow
@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_explorer_gains_with_hints_and_not_without(size, setting):
    """The CoD effect: over 400 packs the explorer's mean reward at position 3 exceeds position 0
    by >= 0.3 with hints (measured 0.35-0.55 across 200-pack windows), and by at most 0.12 in
    absolute value without hints (binary rewards: the standard error of the difference is about
    0.035 here; measured |diff| <= 0.11 on 200-pack windows)."""
    env = FrozenLakeEnv(setting, size)
    packs = range(400)
    with_hints = _position_means(env, packs, use_hints=True)
    without = _position_means(env, packs, use_hints=False)
    assert with_hints[-1] - with_hints[0] >= 0.3, with_hints
    assert abs(without[-1] - without[0]) <= 0.12, without
    assert with_hints[0] == without[0]


def test_without_hints_every_task_is_played_as_the_first():
    """With use_hints=False the explorer carries nothing between tasks: its reward on each
    position equals a fresh explorer's reward on that task alone."""
    env = FrozenLakeEnv("train", "full")
    for pack_seed in range(30):
        result = play_pack(env, env.explorer(), pack_seed, K, use_hints=False)
        alone = [play_task(env.task(pack_seed, k), env.explorer(), None) for k in range(K)]
        assert result.rewards == alone


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_explorer_hints_are_fixed_format_and_true(size):
    """The explorer's hints read `1=<dir> 2=<dir> 3=<dir> 4=<dir>` with `?` for unknown, every
    named direction agrees with the pack's hidden mapping, and it reads them back."""
    env = FrozenLakeEnv("train", size)
    fmt = re.compile(r"1=(\S+) 2=(\S+) 3=(\S+) 4=(\S+)")
    for pack_seed in range(50):
        result = play_pack(env, env.explorer(), pack_seed, K)
        mapping = env.mapping(pack_seed)
        for hints in result.hints:
            match = fmt.fullmatch(hints)
            assert match is not None, hints
            for action, direction in enumerate(match.groups(), start=1):
                assert direction in ("?", mapping[action])
        explorer = FrozenLakeExplorer()
        explorer.start(env.task(pack_seed, 0), result.hints[-1])
        known = {a: d.pop() for a, d in explorer.candidates.items() if len(d) == 1}
        assert all(mapping[a] == d for a, d in known.items())
        assert len(known) >= result.hints[-1].count("=") - result.hints[-1].count("?")
