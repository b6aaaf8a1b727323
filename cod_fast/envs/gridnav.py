"""Grid navigation (docs/concepts.md section 6): cross a hidden cost map in exactly N rook moves.

A pack shares one cost map, a sum of Gaussian hills whose centres, heights and widths come from
pack_seed: that is the hidden rule. Each task has its own start, goal and move count N (3-5). A
move slides the agent any distance along its row or column (`right 2`); it pays the cost of the
cell where the move stops (cells slid over are free), so the agent chooses N - 1 stopping cells
and the goal. Success (at the goal after exactly N moves) scores 1 - mean paid cost / 100, with
costs in [0, 100); anything else scores 0. A move past the edge stops at the edge.

The agent sees costs only within radius 1 of where it stands (the 3x3 block). The map is the same
for every task of the pack, so what one task saw helps the next; the scripted explorer carries
the cells it saw in its hints, one digit (cost // 10) per cell, `?` where unknown. The CoD gain
here is a lower paid cost, not more successes (the explorer always reaches the goal), so it is
smaller than on environments where the rule decides success.

Sizes: `full` is the specified size (train 8-12 wide with 4 hills, eval 10-14 wide with 5 hills);
`tiny` is a 5x5 map with 2 hills and N = 3, with one-digit costs and one-line observations.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import numpy as np

from cod_fast.envs.base import (
    MAX_ACTION_CHARS,
    Agent,
    Environment,
    Setting,
    Size,
    StepOutcome,
    Task,
    rng_for,
    too_long,
)

Cell = tuple[int, int]
DIRECTIONS: dict[str, Cell] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
# `\s*(?:\.\s*)?`, not `\s*\.?\s*`: two adjacent `\s*` retry every split of a run of spaces.
_MOVE_RE = re.compile(
    r"[`'\"]*\s*(up|down|left|right)\s+(\d{1,3})\s*(?:\.\s*)?[`'\"]*", re.IGNORECASE
)
_POS_RE = re.compile(r"pos (\d+) (\d+)|row (\d+), col (\d+)")
_NEAR_RE = re.compile(r"(?:near |off the map\): )([-#\d /]+)")
PRIOR_COST = 30.0
"""What the explorer assumes an unseen cell costs (a map's mean cost is about 35-40; a lower
guess than that mildly favours looking at unseen cells)."""


@dataclass(frozen=True)
class NavShape:
    """The knobs of one (size, setting)."""

    sides: tuple[int, int]
    """Range (inclusive) of the map's height and width, each drawn per pack."""
    hills: int
    """Gaussian hills in the cost map."""
    sigma: tuple[float, float]
    """Range of a hill's width (standard deviation, in cells)."""
    moves: tuple[int, int]
    """Range (inclusive) of N, the exact number of moves a task asks for."""
    compact: bool
    """One-line observations with one-digit costs (cost // 10) instead of two-digit ones."""


SHAPES: dict[tuple[Size, Setting], NavShape] = {
    ("full", "train"): NavShape((8, 12), 4, (1.0, 2.5), (3, 5), compact=False),
    ("full", "eval"): NavShape((10, 14), 5, (1.0, 2.5), (3, 5), compact=False),
    ("tiny", "train"): NavShape((5, 5), 2, (0.8, 1.5), (3, 3), compact=True),
    # Harder but still small: a wider map, one more hill, sometimes one more move.
    ("tiny", "eval"): NavShape((6, 6), 3, (0.8, 1.5), (3, 4), compact=True),
}
HILL_HEIGHT = (40.0, 100.0)
EXPECTED = "expected a direction (up, down, left, right) and a distance >= 1, e.g. `right 2`"


@dataclass(frozen=True)
class CostMap:
    """The hidden rule of a pack: the hills and the integer costs they add up to."""

    height: int
    width: int
    hills: tuple[tuple[float, float, float, float], ...]
    """(row, col, height, sigma) of each hill."""
    costs: tuple[tuple[int, ...], ...]
    """costs[r][c] = min(99, floor(sum of the hills at (r, c)))."""

    def inside(self, cell: Cell) -> bool:
        return 0 <= cell[0] < self.height and 0 <= cell[1] < self.width


@functools.cache
def rook_targets(cell: Cell, height: int, width: int) -> tuple[Cell, ...]:
    """Every cell one rook move away (same row or column, not the cell itself)."""
    r, c = cell
    return tuple(
        [(r, x) for x in range(width) if x != c] + [(y, c) for y in range(height) if y != r]
    )


def _min_over_others(values: np.ndarray, axis: int) -> np.ndarray:
    """For every entry, the least of the OTHER entries along `axis` (its row or its column):
    the smallest one, or the second smallest where the entry is itself the smallest."""
    two = np.partition(values, 1, axis=axis)
    first, second = np.take(two, [0], axis=axis), np.take(two, [1], axis=axis)
    return np.where(values == first, second, first)


def plan(start: Cell, goal: Cell, moves: int, cost: np.ndarray) -> list[Cell]:
    """The stopping cells of an exactly-`moves` rook path from start to goal with the least total
    cost (dynamic programming over (moves left, cell); ties go to the first cell found)."""
    height, width = cost.shape
    # togo[k][r, c]: least cost of the k stops still to pay from (r, c), ending at the goal.
    togo = [np.full((height, width), np.inf)]
    togo[0][goal] = 0.0
    for _ in range(moves):
        entered = cost + togo[-1]  # pay where the move stops, then the rest from there
        togo.append(np.minimum(_min_over_others(entered, 1), _min_over_others(entered, 0)))
    path, cell = [], start
    for k in range(moves, 0, -1):
        cell = min(rook_targets(cell, height, width), key=lambda t, k=k: cost[t] + togo[k - 1][t])
        path.append(cell)
    return path


def move_text(here: Cell, there: Cell) -> str:
    dr, dc = there[0] - here[0], there[1] - here[1]
    if dr:
        return f"{'down' if dr > 0 else 'up'} {abs(dr)}"
    return f"{'right' if dc > 0 else 'left'} {abs(dc)}"


class GridNavTask(Task):
    """One start/goal/N on the pack's cost map. Hidden state: `cost_map`."""

    env_name = "grid_nav"

    def __init__(
        self,
        pack_seed: int,
        task_index: int,
        shape: NavShape,
        cost_map: CostMap,
        start: Cell,
        goal: Cell,
        moves: int,
    ):
        super().__init__(pack_seed, task_index)
        self.shape, self.cost_map = shape, cost_map
        self.start, self.goal, self.moves = start, goal, moves
        self.max_steps = moves
        self.reset()

    def prompt(self) -> str:
        h, w, n = self.cost_map.height, self.cost_map.width, self.moves
        (sr, sc), (gr, gc) = self.start, self.goal
        if self.shape.compact:
            return f"grid {h}x{w} goal {gr} {gc} moves {n}\nact up/down/left/right N, e.g. right 2"
        return (
            f"Grid navigation on a map of {h} rows and {w} columns (row 0 at the top, col 0 "
            "at the left). Every cell has a cost from 0 to 99; you see the costs of the 3x3 "
            f"block around you. Go from row {sr}, col {sc} to the goal at row {gr}, col {gc} "
            f"in exactly {n} moves. A move slides you any distance along your row or column "
            "and you pay the cost of the cell where it stops (cells slid over are free); a "
            "move past the edge stops at the edge. Reaching the goal with the last move "
            "scores 1 - (mean paid cost)/100; anything else scores 0. Answer with one move: "
            "a direction (up, down, left, right) and a distance, e.g. `right 2`."
        )

    def _near(self) -> str:
        """Costs of the 3x3 block around the agent, row by row ('#'/'--' off the map)."""
        r, c = self.pos
        rows = []
        for y in (r - 1, r, r + 1):
            cells = []
            for x in (c - 1, c, c + 1):
                inside = self.cost_map.inside((y, x))
                cost = self.cost_map.costs[y][x] if inside else -1
                if self.shape.compact:
                    cells.append(str(cost // 10) if inside else "#")
                else:
                    cells.append(f"{cost:02d}" if inside else "--")
            rows.append(("" if self.shape.compact else " ").join(cells))
        return "/".join(rows)

    def _describe(self, event: str) -> str:
        r, c = self.pos
        left = self.moves - self.steps
        if self.shape.compact:
            return f"pos {r} {c} near {self._near()}" + (f" {event}" if event else "")
        text = {
            "": "",
            "edge": "The move stopped at the edge of the map. ",
            "goal": "You reached the goal. ",
            "out": "You are out of moves. ",
        }[event]
        return (
            f"{text}Position: row {r}, col {c}. Moves left: {left}. Costs of the 3x3 block "
            f"centred on you, row by row (-- off the map): {self._near()}"
        )

    def reset(self) -> str:
        self.pos, self.steps, self.done = self.start, 0, False
        self.paid: list[int] = []
        self.outcome = ""  # '', 'goal', 'out', 'invalid' or 'too_long'
        return self._describe("")

    def step(self, action: str) -> StepOutcome:
        if self.done:
            return StepOutcome(self.feedback(), done=True)
        problem = too_long(action)
        if problem is not None:
            return self._refuse("too_long", f"Invalid move ({problem}): {EXPECTED}.")
        match = _MOVE_RE.fullmatch(action.strip())
        if match is None or int(match.group(2)) < 1:
            return self._refuse("invalid", f"Invalid move {action.strip()[:40]!r}: {EXPECTED}.")
        dr, dc = DIRECTIONS[match.group(1).lower()]
        distance = int(match.group(2))
        r = min(max(self.pos[0] + dr * distance, 0), self.cost_map.height - 1)
        c = min(max(self.pos[1] + dc * distance, 0), self.cost_map.width - 1)
        clipped = (r, c) != (self.pos[0] + dr * distance, self.pos[1] + dc * distance)
        self.pos = (r, c)
        self.paid.append(self.cost_map.costs[r][c])
        self.steps += 1
        event = "edge" if clipped else ""
        if self.steps >= self.moves:
            self.done = True
            self.outcome = event = "goal" if self.pos == self.goal else "out"
        return StepOutcome(self._describe(event), done=self.done)

    def _refuse(self, outcome: str, observation: str) -> StepOutcome:
        self.done, self.outcome = True, outcome
        return StepOutcome(observation, done=True, valid=False)

    @property
    def reward(self) -> float:
        if self.outcome != "goal":
            return 0.0
        return 1.0 - sum(self.paid) / (100.0 * len(self.paid))

    @property
    def success(self) -> bool:
        return self.outcome == "goal"

    def feedback(self) -> str:
        """The result, and the final position with its 3x3 costs (the last move's reveal)."""
        r, c = self.pos
        mean = sum(self.paid) / len(self.paid) if self.paid else 0.0
        if self.shape.compact:
            result = {
                "goal": f"goal mean cost {mean:.0f}",
                "out": "missed goal",
                "": "unfinished",
                "invalid": "bad action, expected e.g. right 2",
                "too_long": "action too long, expected e.g. right 2",
            }
            return f"{result[self.outcome]} at pos {r} {c} near {self._near()}"
        result = {
            "goal": f"Reached the goal; mean paid cost {mean:.1f}",
            "out": "Did not end on the goal",
            "": "Not finished",
            "invalid": f"Stopped by an invalid move ({EXPECTED})",
            "too_long": f"Stopped by a move too long to read (over {MAX_ACTION_CHARS} "
            f"characters; {EXPECTED})",
        }
        return (
            f"{result[self.outcome]}. Final position row {r}, col {c}; the 3x3 block "
            f"around it (-- off the map): {self._near()}"
        )


class GridNavEnv(Environment):
    """Rook moves over a pack-wide hidden cost map (docs/concepts.md section 6)."""

    name = "grid_nav"
    reward_range = (0.0, 1.0)
    description = "Reach the goal in exactly N rook moves over a hidden, pack-wide cost map."

    def __init__(self, setting: Setting = "train", size: Size = "full"):
        super().__init__(setting, size)
        self.shape = SHAPES[(size, setting)]

    def cost_map(self, pack_seed: int) -> CostMap:
        """The hidden rule, from pack_seed alone."""
        rng = rng_for(self.name, "rule", pack_seed, self.setting, self.size)
        height, width = rng.randint(*self.shape.sides), rng.randint(*self.shape.sides)
        hills = tuple(
            (
                rng.uniform(0, height - 1),
                rng.uniform(0, width - 1),
                rng.uniform(*HILL_HEIGHT),
                rng.uniform(*self.shape.sigma),
            )
            for _ in range(self.shape.hills)
        )
        costs = tuple(
            tuple(
                min(
                    99,
                    int(
                        sum(
                            h * math.exp(-((r - y) ** 2 + (c - x) ** 2) / (2 * s * s))
                            for y, x, h, s in hills
                        )
                    ),
                )
                for c in range(width)
            )
            for r in range(height)
        )
        return CostMap(height, width, hills, costs)

    def task(self, pack_seed: int, task_index: int) -> GridNavTask:
        cost_map = self.cost_map(pack_seed)
        rng = rng_for(self.name, "task", pack_seed, task_index, self.setting, self.size)
        cells = [(r, c) for r in range(cost_map.height) for c in range(cost_map.width)]
        while True:  # start and goal at least 2 apart, so the route is a real choice
            start, goal = rng.sample(cells, 2)
            if abs(start[0] - goal[0]) + abs(start[1] - goal[1]) >= 2:
                break
        return GridNavTask(
            pack_seed, task_index, self.shape, cost_map, start, goal, rng.randint(*self.shape.moves)
        )

    def solver(self) -> Agent:
        return GridNavSolver()

    def explorer(self) -> Agent:
        return GridNavExplorer()


class GridNavSolver(Agent):
    """Reads the whole cost map and follows the cheapest exactly-N rook path."""

    def start(self, task: Task, hints: str | None) -> None:
        assert isinstance(task, GridNavTask)
        self.task = task
        costs = np.array(task.cost_map.costs, dtype=float)
        self.path = plan(task.start, task.goal, task.moves, costs)

    def act(self, observation: str) -> str:
        return move_text(self.task.pos, self.path[self.task.steps])


class GridNavExplorer(Agent):
    """Plans with the costs it has seen (unseen cells at PRIOR_COST), replanning after every
    observation, and keeps every cell it saw in hints: one digit (cost // 10) per cell, rows
    separated by '/', '?' for unseen, e.g. `00?1/0123/...`.

    It reads only the prompt, the observations, the feedback and its hints.
    """

    def start(self, task: Task, hints: str | None) -> None:
        prompt = task.prompt()
        self.compact = prompt.startswith("grid ")
        if self.compact:
            dims = re.search(r"grid (\d+)x(\d+) goal (\d+) (\d+) moves (\d+)", prompt)
            h, w, gr, gc, n = (int(g) for g in dims.groups())
        else:
            h, w = (int(g) for g in re.search(r"(\d+) rows and (\d+) columns", prompt).groups())
            gr, gc = (int(g) for g in re.search(r"goal at row (\d+), col (\d+)", prompt).groups())
            n = int(re.search(r"exactly (\d+) moves", prompt).group(1))
        self.height, self.width, self.goal, self.moves = h, w, (gr, gc), n
        self.known: dict[Cell, float] = {}
        rows = (hints or "").strip().split("/")
        if len(rows) == h and all(len(row) == w for row in rows):  # else: not our hints
            for r, row in enumerate(rows):
                for c, digit in enumerate(row):
                    if digit.isdigit():
                        self.known[(r, c)] = int(digit) * 10 + 5.0
        self.steps = 0

    def _observe(self, text: str) -> tuple[int, int] | None:
        """Record the 3x3 costs around the position in `text`; return that position."""
        pos, near = _POS_RE.search(text), _NEAR_RE.search(text)
        if pos is None or near is None:
            return None
        r, c = (int(g) for g in pos.groups() if g is not None)
        for dy, row in enumerate(near.group(1).strip().split("/")):
            tokens = list(row) if self.compact else row.split()
            for dx, token in enumerate(tokens):
                if token.isdigit():  # one digit is cost // 10: take the middle of its decade
                    cell = (r + dy - 1, c + dx - 1)
                    self.known[cell] = int(token) * 10 + 5.0 if self.compact else float(token)
        return r, c

    def act(self, observation: str) -> str:
        here = self._observe(observation)
        assert here is not None, f"no position in observation {observation!r}"
        cost = np.full((self.height, self.width), PRIOR_COST)
        for cell, value in self.known.items():
            cost[cell] = value
        path = plan(here, self.goal, self.moves - self.steps, cost)
        self.steps += 1
        return move_text(here, path[0])

    def write_hints(self, task: Task, old_hints: str | None) -> str:
        self._observe(task.feedback())  # the last move's reveal shows only in the feedback
        return "/".join(
            "".join(
                str(min(9, int(self.known[(r, c)]) // 10)) if (r, c) in self.known else "?"
                for c in range(self.width)
            )
            for r in range(self.height)
        )
