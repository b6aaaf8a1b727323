"""FrozenLake-Obscure (docs/concepts.md section 6): walk a frozen lake with scrambled controls.

Each task is a small grid with a start, a goal and holes. The four actions `Direction 1` ..
`Direction 4` each move the agent one cell, but which of up/down/left/right each number means is
a permutation drawn per pack: that is the hidden rule, shared by every task of a pack. Reaching
the goal scores 1; falling into a hole or spending the step budget scores 0. Moving into the edge
of the map keeps the agent in place (and says so), which itself tells which way the action points.

Sizes: `full` is the specified size (train 4-5 wide, frozen-tile probability 0.6-0.7, a safe path of
at most 6 moves and 8 actions; eval 6-7 wide, 8 moves and 10 actions) and shows the map as text
rows. `tiny` is what a ~0.35M-parameter model learns on a 2-core CPU in about ten minutes
(measured for the `tiny-cpu` preset; docs/benchmarks.md): a 3x3 lake with one hole,
the goal two moves away, 3 actions, and a compact observation (`pos 1 2`) with the goal and hole
positions in the prompt. With a 4-move path and 5 actions the same model, warm-started for ten
minutes, learned the format but not the use of hints (no rise with pack position); with the
2-move path the hidden controls are still unknown at the first task (the explorer scores 0.30
there) and known from the second on (0.79, then 0.92 and 0.99).

Every map has a safe path from start to goal within the move budget (the layout is redrawn, from
a seed that counts the attempts, until it has one), so every task is solvable.

Hints are scored entry by entry (cod_fast.data.diagnostics): an entry is an action number and its
direction, written `1=up 2=? 3=? 4=left` as the explorer writes them, and what a trajectory shows
is what the explorer reads from the same moves.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

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
ACTIONS = (1, 2, 3, 4)
# `\s*(?:\.\s*)?`, not `\s*\.?\s*`: two adjacent `\s*` retry every split of a run of spaces.
_ACTION_RE = re.compile(r"[`'\"]*\s*direction\s*([1-4])\s*(?:\.\s*)?[`'\"]*", re.IGNORECASE)
_HINT_RE = re.compile(r"([1-4])\s*=\s*(up|down|left|right|\?)", re.IGNORECASE)
_POS_RE = re.compile(r"pos (\d+) (\d+)|row (\d+), col (\d+)")


@dataclass(frozen=True)
class LakeShape:
    """The knobs of one (size, setting)."""

    sides: tuple[int, ...]
    """Map side lengths to draw from (maps are square)."""
    tile_prob: tuple[float, float] | None
    """Range of the per-task probability that a free cell is frozen (None: use `holes`)."""
    holes: int
    """Exact hole count when `tile_prob` is None."""
    path_moves: int
    """Env steps: every map has a safe start-to-goal path of at most this many moves."""
    max_steps: int
    """Agent steps: actions allowed per task (the slack over `path_moves` pays for exploring)."""
    compact: bool
    """Compact text (`pos r c`) instead of drawn map rows."""


SHAPES: dict[tuple[Size, Setting], LakeShape] = {
    ("full", "train"): LakeShape((4, 5), (0.6, 0.7), 0, path_moves=6, max_steps=8, compact=False),
    ("full", "eval"): LakeShape((6, 7), (0.6, 0.7), 0, path_moves=8, max_steps=10, compact=False),
    ("tiny", "train"): LakeShape((3,), None, 1, path_moves=2, max_steps=3, compact=True),
    # Harder but still compact: a bigger lake, one more hole, one more move.
    ("tiny", "eval"): LakeShape((4,), None, 2, path_moves=5, max_steps=6, compact=True),
}
EXPECTED = "expected `Direction N` with N in 1-4, e.g. `Direction 3`"


def _shift(cell: Cell, direction: str) -> Cell:
    dr, dc = DIRECTIONS[direction]
    return cell[0] + dr, cell[1] + dc


def _inside(cell: Cell, side: int) -> bool:
    return 0 <= cell[0] < side and 0 <= cell[1] < side


def safe_distances(
    side: int, holes: frozenset[Cell], goal: Cell, directions: tuple[str, ...] = tuple(DIRECTIONS)
) -> dict[Cell, int]:
    """Moves from every safe cell to `goal` using only `directions` (BFS backwards from the goal;
    with a partial direction set the graph is directed, hence the reversed step)."""
    dist = {goal: 0}
    queue = deque([goal])
    while queue:
        cell = queue.popleft()
        for direction in directions:
            dr, dc = DIRECTIONS[direction]
            prev = (cell[0] - dr, cell[1] - dc)
            if _inside(prev, side) and prev not in holes and prev not in dist:
                dist[prev] = dist[cell] + 1
                queue.append(prev)
    return dist


class FrozenLakeTask(Task):
    """One lake. Hidden state: `mapping` (action number -> direction). The layout is public."""

    env_name = "frozenlake"

    def __init__(
        self,
        pack_seed: int,
        task_index: int,
        shape: LakeShape,
        mapping: dict[int, str],
        side: int,
        start: Cell,
        goal: Cell,
        holes: frozenset[Cell],
    ):
        super().__init__(pack_seed, task_index)
        self.shape, self.mapping, self.side = shape, mapping, side
        self.start, self.goal, self.holes = start, goal, holes
        self.max_steps = shape.max_steps
        self.reset()

    def prompt(self) -> str:
        n, steps = self.side, self.max_steps
        if self.shape.compact:
            holes = " ".join(f"hole {r} {c}" for r, c in sorted(self.holes))
            return (
                f"lake {n}x{n} goal {self.goal[0]} {self.goal[1]} {holes}\n"
                f"act Direction 1-4, e.g. Direction 3; {steps} steps"
            )
        return (
            f"FrozenLake on a {n}x{n} map. Reach the goal G without stepping into a hole H.\n"
            "Map (row 0 at the top, col 0 at the left; S start, F frozen, H hole, G goal):\n"
            f"{self._draw(None)}\n"
            "Actions `Direction 1` to `Direction 4` each move you one cell up, down, left or "
            "right, but which number means which direction is unknown. Moving into the edge "
            f"of the map leaves you in place. You have {steps} actions. Answer with exactly "
            "one action, e.g. `Direction 3`."
        )

    def _draw(self, agent: Cell | None) -> str:
        def tile(cell: Cell) -> str:
            if cell == agent:
                return "A"
            if cell in self.holes:
                return "H"
            return "S" if cell == self.start else "G" if cell == self.goal else "F"

        return "\n".join("".join(tile((r, c)) for c in range(self.side)) for r in range(self.side))

    def _describe(self, event: str) -> str:
        """Where the agent is; `event` is one of '', 'wall', 'hole', 'goal', 'out'."""
        r, c = self.pos
        if self.shape.compact:
            return f"pos {r} {c}" + (f" {event}" if event else "")
        text = {
            "": "",
            "wall": "You hit the edge of the map and stayed in place. ",
            "hole": "You fell into a hole. ",
            "goal": "You reached the goal! ",
            "out": "You are out of actions. ",
        }[event]
        left = self.max_steps - self.steps
        return f"{text}Position: row {r}, col {c}. Actions left: {left}.\n{self._draw(self.pos)}"

    def reset(self) -> str:
        self.pos, self.steps, self.done = self.start, 0, False
        self.outcome = ""  # '', 'goal', 'hole', 'out', 'invalid' or 'too_long'
        self.last_event = ""
        return self._describe("")

    def step(self, action: str) -> StepOutcome:
        if self.done:
            return StepOutcome(self.feedback(), done=True)
        problem = too_long(action)
        if problem is not None:
            return self._refuse("too_long", f"Invalid action ({problem}): {EXPECTED}.")
        match = _ACTION_RE.fullmatch(action.strip())
        if match is None:
            return self._refuse("invalid", f"Invalid action {action.strip()[:40]!r}: {EXPECTED}.")
        self.steps += 1
        target = _shift(self.pos, self.mapping[int(match.group(1))])
        event = ""
        if not _inside(target, self.side):
            event = "wall"  # the position is kept
        else:
            self.pos = target
            if target in self.holes:
                event = self.outcome = "hole"
            elif target == self.goal:
                event = self.outcome = "goal"
        if not self.outcome and self.steps >= self.max_steps:
            self.outcome = "out"
            event = event or "out"
        self.done = bool(self.outcome)
        self.last_event = event
        return StepOutcome(self._describe(event), done=self.done)

    def _refuse(self, outcome: str, observation: str) -> StepOutcome:
        self.done, self.outcome = True, outcome
        return StepOutcome(observation, done=True, valid=False)

    @property
    def reward(self) -> float:
        return 1.0 if self.outcome == "goal" else 0.0

    @property
    def success(self) -> bool:
        return self.outcome == "goal"

    def feedback(self) -> str:
        """The result and the final position (the update episode needs the last move's effect)."""
        r, c = self.pos
        if self.shape.compact:
            result = {
                "goal": "goal",
                "hole": "hole",
                "out": "out of steps",
                "": "unfinished",
                "invalid": "bad action, Direction 1-4",
                "too_long": "action too long, Direction 1-4",
            }[self.outcome]
            return f"{result} at pos {r} {c}"
        result = {
            "goal": f"Reached the goal in {self.steps} actions",
            "hole": f"Fell into a hole after {self.steps} actions",
            "out": "Ran out of actions",
            "": "Not finished",
            "invalid": f"Stopped by an invalid action ({EXPECTED})",
            "too_long": f"Stopped by an action too long to read (over {MAX_ACTION_CHARS} "
            f"characters; {EXPECTED})",
        }[self.outcome]
        return f"{result}; final position row {r}, col {c}."


class FrozenLakeEnv(Environment):
    """FrozenLake with a per-pack permutation of the four directions (docs/concepts.md sec. 6)."""

    name = "frozenlake"
    description = "Reach the goal on a frozen lake; what each of the four actions does is hidden."

    def __init__(self, setting: Setting = "train", size: Size = "full"):
        super().__init__(setting, size)
        self.shape = SHAPES[(size, setting)]

    def mapping(self, pack_seed: int) -> dict[int, str]:
        """The hidden rule: action number -> direction, from pack_seed alone."""
        directions = list(DIRECTIONS)
        rng_for(self.name, "rule", pack_seed, self.setting, self.size).shuffle(directions)
        return dict(zip(ACTIONS, directions, strict=True))

    def task(self, pack_seed: int, task_index: int) -> FrozenLakeTask:
        shape = self.shape
        for attempt in range(10_000):
            rng = rng_for(
                self.name, "task", pack_seed, task_index, self.setting, self.size, attempt
            )
            side = rng.choice(shape.sides)
            cells = [(r, c) for r in range(side) for c in range(side)]
            start, goal = rng.sample(cells, 2)
            free = [cell for cell in cells if cell not in (start, goal)]
            if shape.tile_prob is None:
                holes = frozenset(rng.sample(free, shape.holes))
            else:
                frozen = rng.uniform(*shape.tile_prob)
                holes = frozenset(cell for cell in free if rng.random() >= frozen)
            # At least 2 moves, so no task is won by one lucky first action.
            distance = safe_distances(side, holes, goal).get(start)
            if distance is not None and 2 <= distance <= shape.path_moves:
                return FrozenLakeTask(
                    pack_seed, task_index, shape, self.mapping(pack_seed), side, start, goal, holes
                )
        raise RuntimeError(f"no solvable lake for pack {pack_seed}, task {task_index}")

    def solver(self) -> Agent:
        return FrozenLakeSolver()

    def explorer(self) -> Agent:
        return FrozenLakeExplorer()

    def hint_truth(self, pack_seed: int) -> dict[str, str]:
        """Every action number's direction."""
        return {str(action): d for action, d in self.mapping(pack_seed).items()}

    def hint_entries(self, hints: str | None) -> dict[str, str]:
        """The `N=direction` entries of a hint text, the way the explorer reads its hints (`N=?`
        states nothing; of two entries for one number the later counts)."""
        return {a: d.lower() for a, d in _HINT_RE.findall(hints or "") if d != "?"}

    def knowable_entries(
        self, known: dict[str, str], task: Task, steps: Sequence[tuple[str, str]], feedback: str
    ) -> dict[str, str]:
        """The explorer starts the task from hints stating `known` and reviews the episode's
        moves, as it does between its own tasks (it carries nothing else from task to task)."""
        explorer = FrozenLakeExplorer()
        explorer.start(task, render_hints(known))
        explorer.review(steps, feedback)
        return self.hint_entries(explorer.hints())

    def render_hints(self, entries: dict[str, str]) -> str:
        return render_hints(entries)


def render_hints(entries: dict[str, str]) -> str:
    """The hint format of the explorer, `1=up 2=? 3=? 4=left`: every action, `?` where unknown."""
    return " ".join(f"{a}={entries.get(str(a), '?')}" for a in ACTIONS)


class FrozenLakeSolver(Agent):
    """Reads the hidden mapping and walks a shortest safe path."""

    def start(self, task: Task, hints: str | None) -> None:
        assert isinstance(task, FrozenLakeTask)
        self.task = task
        self.action_of = {direction: action for action, direction in task.mapping.items()}

    def act(self, observation: str) -> str:
        task = self.task
        dist = safe_distances(task.side, task.holes, task.goal)
        best = min(DIRECTIONS, key=lambda d: dist.get(_shift(task.pos, d), 10**6))
        return f"Direction {self.action_of[best]}"


class FrozenLakeExplorer(Agent):
    """Learns the mapping from what its moves do, and carries it in hints like `1=up 2=? ...`.

    It reads only the prompt (and the step budget it states), the observations, the feedback and
    its hints. Each action keeps a
    set of directions it may mean: a move from one cell to another pins it down, a bump against
    the edge narrows it to the blocked directions, and since the mapping is a permutation a
    pinned direction is removed from the other actions.
    """

    def start(self, task: Task, hints: str | None) -> None:
        prompt = task.prompt()
        self.max_steps = task.max_steps
        if prompt.startswith("lake "):  # compact prompt
            self.side = int(re.search(r"lake (\d+)x", prompt).group(1))
            goal = re.search(r"goal (\d+) (\d+)", prompt)
            self.goal = (int(goal.group(1)), int(goal.group(2)))
            self.holes = frozenset(
                (int(r), int(c)) for r, c in re.findall(r"hole (\d+) (\d+)", prompt)
            )
        else:
            rows = [line for line in prompt.splitlines() if re.fullmatch(r"[SFHG]+", line)]
            self.side = len(rows)
            cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
            self.goal = next(cell for cell, ch in cells.items() if ch == "G")
            self.holes = frozenset(cell for cell, ch in cells.items() if ch == "H")
        self.candidates = {action: set(DIRECTIONS) for action in ACTIONS}
        for action, direction in _HINT_RE.findall(hints or ""):
            if direction != "?":
                self._narrow(int(action), {direction.lower()})
        self.pos: Cell | None = None
        self.last_action: int | None = None
        self.steps = 0

    def _narrow(self, action: int, allowed: set[str]) -> None:
        narrowed = self.candidates[action] & allowed
        if not narrowed:  # contradicts what we believed (bad hints): trust the new evidence
            narrowed = set(allowed)
        self.candidates[action] = narrowed
        changed = True
        while changed:  # permutation constraint propagation
            changed = False
            for a, dirs in self.candidates.items():
                if len(dirs) == 1:
                    for b in ACTIONS:
                        if b != a and dirs <= self.candidates[b] and len(self.candidates[b]) > 1:
                            self.candidates[b] -= dirs
                            changed = True
            for direction in DIRECTIONS:
                holders = [a for a in ACTIONS if direction in self.candidates[a]]
                if len(holders) == 1 and len(self.candidates[holders[0]]) > 1:
                    self.candidates[holders[0]] = {direction}
                    changed = True

    def _observe(self, text: str) -> None:
        match = _POS_RE.search(text)
        if match is None:
            return
        r, c = (int(g) for g in match.groups() if g is not None)
        pos = (r, c)
        if self.pos is not None and self.last_action is not None:
            if pos == self.pos:  # a bump: the action points off the map from here
                blocked = {d for d in DIRECTIONS if not _inside(_shift(pos, d), self.side)}
                self._narrow(self.last_action, blocked)
            else:
                delta = (pos[0] - self.pos[0], pos[1] - self.pos[1])
                moved = {d for d, step in DIRECTIONS.items() if step == delta}
                self._narrow(self.last_action, moved)
        self.pos = pos

    def _known(self) -> dict[str, int]:
        return {next(iter(d)): a for a, d in self.candidates.items() if len(d) == 1}

    def act(self, observation: str) -> str:
        self._observe(observation)
        assert self.pos is not None, f"no position in observation {observation!r}"
        left = self.max_steps - self.steps
        known = self._known()
        # 1. A safe path using only known directions that fits the remaining actions: walk it.
        dist = safe_distances(self.side, self.holes, self.goal, tuple(known))
        if dist.get(self.pos, 10**6) <= left:
            choice = known[min(known, key=lambda d: dist.get(_shift(self.pos, d), 10**6))]
        else:
            # 2. Otherwise the action most likely to leave the goal within reach (measured by
            # the plain safe distance, as if every direction were known), averaged over what it
            # may mean; then the shorter expected distance; ties favour unknown actions, whose
            # result also teaches the mapping. A known action that bumps the edge is pure waste.
            full = safe_distances(self.side, self.holes, self.goal)

            def outcome(direction: str) -> tuple[float, float]:
                cell = _shift(self.pos, direction)
                if not _inside(cell, self.side):
                    cell = self.pos  # a bump: same cell, one action fewer
                distance = full.get(cell, 100.0) if cell not in self.holes else 100.0
                return float(distance <= left - 1), distance

            def score(action: int) -> tuple[float, float, bool, int]:
                dirs = self.candidates[action]
                results = [outcome(d) for d in dirs]
                if len(dirs) == 1 and not _inside(_shift(self.pos, next(iter(dirs))), self.side):
                    return (1.0, 0.0, True, action)  # known to bump: never chosen over a move
                reach = sum(r for r, _ in results) / len(dirs)
                distance = sum(d for _, d in results) / len(dirs)
                return (-reach, distance, len(dirs) == 1, action)

            choice = min(ACTIONS, key=score)
        self.last_action = choice
        self.steps += 1
        return f"Direction {choice}"

    def write_hints(self, task: Task, old_hints: str | None) -> str:
        self._observe(task.feedback())  # the last move's effect shows only in the feedback
        return self.hints()

    def hints(self) -> str:
        """What it knows: every action pinned to one direction."""
        return render_hints(
            {str(a): next(iter(d)) for a, d in self.candidates.items() if len(d) == 1}
        )

    def review(self, steps: Sequence[tuple[str, str]], feedback: str) -> None:
        """Learn from a task played by someone else (after `start`): its (observation, action)
        pairs and the feedback, as if it had chosen those actions. An action that does not
        parse moved nothing (it ended the episode), so it teaches nothing."""
        for observation, action in steps:
            self._observe(observation)
            match = None if too_long(action) else _ACTION_RE.fullmatch(action.strip())
            self.last_action = int(match.group(1)) if match else None
        self._observe(feedback)
