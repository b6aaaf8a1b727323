"""Grid navigation (cod_fast/envs/gridnav.py): determinism, the pack-wide cost map, the
train/eval/tiny knobs, the reward formula, malformed moves, and the scripted agents."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from cod_fast.envs.base import play_pack, play_task
from cod_fast.envs.gridnav import SHAPES, GridNavEnv, plan, rook_targets

COMBOS = [(size, setting) for size in ("tiny", "full") for setting in ("train", "eval")]
SCRIPT = ["right 1", "down 2", "LEFT 1", "up 1", "right 3"]
K = 4


def _run_script(env: GridNavEnv, pack_seed: int, task_index: int) -> list[object]:
    task = env.task(pack_seed, task_index)
    trace: list[object] = [task.prompt(), task.reset()]
    for action in SCRIPT[: task.max_steps]:
        outcome = task.step(action)
        trace += [outcome.observation, outcome.done, task.reward]
        if outcome.done:
            break
    return [*trace, task.feedback()]


def _position_means(env: GridNavEnv, agent_of, packs: range, use_hints: bool) -> list[float]:
    totals = [0.0] * K
    for pack_seed in packs:
        result = play_pack(env, agent_of(env), pack_seed, K, use_hints=use_hints)
        totals = [t + r for t, r in zip(totals, result.rewards, strict=True)]
    return [t / len(packs) for t in totals]


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_same_seeds_give_same_episode(size, setting):
    """Determinism: fresh environments with the same (pack_seed, task_index) produce the same
    prompt, observations, rewards and feedback for a fixed move script; other seeds differ."""
    traces = [_run_script(GridNavEnv(setting, size), 11, 1) for _ in range(2)]
    assert traces[0] == traces[1]
    others = {repr(_run_script(GridNavEnv(setting, size), seed, 1)) for seed in range(20)}
    assert len(others) == 20


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_cost_map_shared_within_pack_and_differs_across_packs(size, setting):
    """The hidden rule (hills, hence costs) depends on pack_seed alone: every task of a pack sees
    the same map; packs differ in their hills; costs are integers in [0, 100)."""
    env = GridNavEnv(setting, size)
    hills = set()
    for pack_seed in range(30):
        maps = [env.task(pack_seed, k).cost_map for k in range(K)]
        assert all(m == maps[0] for m in maps)
        assert all(0 <= cost < 100 for row in maps[0].costs for cost in row)
        hills.add(maps[0].hills)
        tasks = {(env.task(pack_seed, k).start, env.task(pack_seed, k).goal) for k in range(K)}
        assert len(tasks) > 1  # each task has its own start and goal
    assert len(hills) == 30


def test_train_eval_and_tiny_knobs():
    """The specified sizes: full train 8-12 wide with 4 hills, eval 10-14 wide with 5 hills,
    N in [3, 5]; tiny a 5x5 map with 2 hills and N = 3; the drawn maps and tasks follow them."""
    assert (SHAPES[("full", "train")].sides, SHAPES[("full", "train")].hills) == ((8, 12), 4)
    assert (SHAPES[("full", "eval")].sides, SHAPES[("full", "eval")].hills) == ((10, 14), 5)
    assert SHAPES[("full", "train")].moves == SHAPES[("full", "eval")].moves == (3, 5)
    assert SHAPES[("tiny", "train")].sides == (5, 5) and SHAPES[("tiny", "train")].moves == (3, 3)
    for (size, setting), shape in SHAPES.items():
        env = GridNavEnv(setting, size)
        for pack_seed in range(20):
            task = env.task(pack_seed, pack_seed % K)
            m = task.cost_map
            assert (
                shape.sides[0] <= min(m.height, m.width) <= max(m.height, m.width) <= shape.sides[1]
            )
            assert len(m.hills) == shape.hills
            assert shape.moves[0] <= task.moves <= shape.moves[1] and task.max_steps == task.moves
            assert task.start != task.goal


def test_tiny_text_is_compact():
    """Tiny prompts fit two short lines with the move format and an example; tiny observations
    are one line: position and the 3x3 block of one-digit costs (cost // 10, '#' off the map)."""
    task = GridNavEnv("train", "tiny").task(4, 0)
    prompt = task.prompt()
    assert len(prompt) < 80 and "right 2" in prompt
    observation = task.reset()
    assert re.fullmatch(r"pos \d \d near [#\d]{3}/[#\d]{3}/[#\d]{3}", observation)
    r, c = task.start
    near = observation.split("near ")[1].split("/")
    for dy, dx in itertools.product(range(3), range(3)):
        y, x = r + dy - 1, c + dx - 1
        inside = 0 <= y < 5 and 0 <= x < 5
        assert near[dy][dx] == (str(task.cost_map.costs[y][x] // 10) if inside else "#")


def test_full_observation_shows_exact_costs():
    """Full observations show the exact two-digit costs of the 3x3 block around the agent."""
    task = GridNavEnv("train", "full").task(4, 0)
    observation = task.reset()
    block = observation.split("(-- off the map): ")[1].split("/")
    r, c = task.start
    for dy, row in enumerate(block):
        for dx, token in enumerate(row.split()):
            y, x = r + dy - 1, c + dx - 1
            assert token == (
                f"{task.cost_map.costs[y][x]:02d}" if task.cost_map.inside((y, x)) else "--"
            )


def test_reward_is_one_minus_mean_stop_cost_on_success_only():
    """Reward: 1 - mean cost of the cells where the moves stopped / 100 when the last of exactly
    N moves ends on the goal, else 0; success follows."""
    env = GridNavEnv("train", "full")
    for pack_seed in range(20):
        task = env.task(pack_seed, 0)
        task.reset()
        solver = env.solver()
        solver.start(task, None)
        for _ in range(task.moves):
            task.step(solver.act(""))
        stops = solver.path
        expected = 1 - np.mean([task.cost_map.costs[r][c] for r, c in stops]) / 100
        assert task.success and task.reward == pytest.approx(expected)
    missed = 0
    for pack_seed in range(20):
        trace = _run_script(env, pack_seed, 0)
        task = env.task(pack_seed, 0)
        task.reset()
        for action in SCRIPT[: task.moves]:
            task.step(action)
        assert task.done and task.reward == trace[-2]
        if task.pos != task.goal:
            assert task.reward == 0.0 and task.success is False
            missed += 1
    assert missed >= 15


def test_move_past_the_edge_stops_at_the_edge():
    """A move past the edge stops at the edge, still counts as a move, and the observation says
    so; the cost paid is the edge cell's."""
    for size in ("tiny", "full"):
        task = GridNavEnv("train", size).task(2, 0)
        task.reset()
        r = task.start[0]
        outcome = task.step("left 99")
        assert task.pos == (r, 0) and task.steps == 1
        assert task.paid == [task.cost_map.costs[r][0]]
        assert ("edge" in outcome.observation) == (task.start[1] < 99)


@pytest.mark.parametrize("size", ["tiny", "full"])
@pytest.mark.parametrize(
    "junk",
    [
        "",
        "right",
        "right 0",
        "north 2",
        "right two",
        "2 right",
        "right -1",
        "right 2 left 1",
        "__import__('os').system('ls')",
        "Direction 3",
    ],
)
def test_malformed_move_ends_episode(size, junk):
    """A malformed move ends the episode with reward 0, valid=False, and feedback that states the
    expected format with its example (`right 2`)."""
    task = GridNavEnv("train", size).task(6, 0)
    task.reset()
    outcome = task.step(junk)
    assert outcome.done and not outcome.valid
    assert task.reward == 0.0 and task.success is False
    assert "right 2" in outcome.observation and "right 2" in task.feedback()


@pytest.mark.parametrize("variant", ["  right 2 ", "RIGHT 2", "`right 2`", "Right   2", "right 2."])
def test_lenient_parse_of_whitespace_and_case(variant):
    """Whitespace, case, backticks and a trailing period are forgiven: the variant acts exactly
    like `right 2`."""
    env = GridNavEnv("train", "full")
    a, b = env.task(9, 0), env.task(9, 0)
    a.reset()
    b.reset()
    assert a.step(variant) == b.step("right 2")


def test_plan_is_optimal_by_brute_force():
    """The DP planner finds the least total stop cost over every exactly-N rook path (checked by
    enumerating all paths on random 4x5 cost arrays for N = 3 and 4)."""
    rng = np.random.default_rng(0)
    for trial in range(12):
        cost = rng.integers(0, 100, size=(4, 5)).astype(float)
        start, goal, moves = (0, 0), (int(trial % 4), 4), 3 + trial % 2
        best = np.inf
        for stops in itertools.product(*[range(20)] * (moves - 1)):
            cells = [start] + [divmod(s, 5) for s in stops] + [goal]
            if all(b in rook_targets(a, 4, 5) for a, b in itertools.pairwise(cells)):
                best = min(best, sum(cost[c] for c in cells[1:]))
        path = plan(start, goal, moves, cost)
        assert path[-1] == goal and len(path) == moves
        assert sum(cost[c] for c in path) == best


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_solver_succeeds_and_bounds_the_explorer(size, setting):
    """The solver (full cost map) reaches the goal on every task, with mean reward >= 0.8 over 40
    packs (measured 0.84-0.89; the goal cell's own cost is unavoidable), and never scores below
    the explorer on the same task (it is optimal over exactly-N paths)."""
    env = GridNavEnv(setting, size)
    rewards = []
    for pack_seed in range(40):
        solved = play_pack(env, env.solver(), pack_seed, K)
        explored = play_pack(env, env.explorer(), pack_seed, K)
        assert all(solved.successes)
        assert all(s >= e - 1e-12 for s, e in zip(solved.rewards, explored.rewards, strict=True))
        rewards += solved.rewards
    assert np.mean(rewards) >= 0.8


@pytest.mark.slow
@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_explorer_gains_with_hints_and_not_without(size, setting):
    """The CoD effect, a cost reduction here: over 200 packs the explorer's mean reward at
    position 3 exceeds position 0 by >= 0.04 with hints (measured 0.056-0.13 across 200-pack
    windows) and closes at least half its gap to the solver; without hints the difference stays
    within 0.05 (measured |diff| <= 0.037)."""
    env = GridNavEnv(setting, size)
    packs = range(200)
    with_hints = _position_means(env, GridNavEnv.explorer, packs, use_hints=True)
    without = _position_means(env, GridNavEnv.explorer, packs, use_hints=False)
    solver = _position_means(env, GridNavEnv.solver, packs, use_hints=True)
    assert with_hints[-1] - with_hints[0] >= 0.04, with_hints
    assert solver[-1] - with_hints[-1] <= 0.5 * (solver[0] - with_hints[0]), (solver, with_hints)
    assert abs(without[-1] - without[0]) <= 0.05, without
    assert all(play_pack(env, env.explorer(), p, K).successes == [True] * K for p in range(20))


def test_without_hints_every_task_is_played_as_the_first():
    """With use_hints=False the explorer carries nothing between tasks: its reward on each
    position equals a fresh explorer's reward on that task alone."""
    env = GridNavEnv("train", "full")
    for pack_seed in range(20):
        result = play_pack(env, env.explorer(), pack_seed, K, use_hints=False)
        alone = [play_task(env.task(pack_seed, k), env.explorer(), None) for k in range(K)]
        assert result.rewards == alone


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_explorer_hints_record_seen_costs(size):
    """The explorer's hints are the map's rows joined by '/', one character per cell: `?` for an
    unseen cell, else the digit cost // 10, which matches the hidden map; knowledge only grows
    along the pack."""
    env = GridNavEnv("train", size)
    for pack_seed in range(20):
        m = env.cost_map(pack_seed)
        result = play_pack(env, env.explorer(), pack_seed, K)
        seen_before = 0
        for hints in result.hints:
            rows = hints.split("/")
            assert len(rows) == m.height and all(len(row) == m.width for row in rows)
            for r, row in enumerate(rows):
                for c, ch in enumerate(row):
                    assert ch == "?" or int(ch) == m.costs[r][c] // 10
            seen = sum(ch != "?" for ch in hints.replace("/", ""))
            assert seen >= max(seen_before, 9)
            seen_before = seen
