"""Alchemy-Random (docs/concepts.md section 6): find a hidden recipe graph, craft a target element.

The hidden rule of a pack is a random recipe graph. Base elements (tier 0) combine pairwise into
higher tiers: an element of tier t has exactly one recipe, one ingredient of tier t - 1 and one of
any lower tier, so its tier is 1 + the highest ingredient tier. Every other pair makes nothing.
Names are random opaque tokens, so nothing can be guessed from them. Each task of a pack asks for
a different target in the same graph; one action is one combination, `<answer>A + B</answer>`.
Reward is 1 when the target is made within the round budget, else 0 (the environment defines no
partial credit, so none is invented here).

Settings. The specified "3-4 tiers" count the base as tier 0, so train and eval have 2-3 tiers of
made elements (tiny's "2 tiers" are the base and one made tier):
- train: 8 rounds, 3-4 base elements, unlimited materials (an element once owned stays owned);
  targets are tier 2+ and need at most 6 combinations;
- eval: 15 rounds, 4-6 base elements, limited materials (4 units of every base element; a
  combination uses one unit of each ingredient whether or not it makes something, a product gives
  one unit; running out ends the task), and 10-30% of the made elements are noise nodes: makeable
  dead ends that are an ingredient of nothing;
- tiny: 3 base elements and 3 made ones, 3 rounds, one-letter names, one-line observations
  (`a+b=d`); tiny eval: 4 base elements with 2 units each, a noise node, 4 rounds.

What carries across tasks is the graph, so the scripted explorer writes what it found as hints,
`a+b=d d+c=e; nothing: a+a b+c` (recipes only in tiny, where hints must stay near 16
characters), and chains known recipes backwards to the next target.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from cod_fast.envs.base import (
    Agent,
    Environment,
    Setting,
    Size,
    StepOutcome,
    Tag,
    Task,
    rng_for,
    too_long,
)

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_ANSWER = Tag("answer")
EXPECTED = "expected one combination like <answer>A + B</answer>"
_PAIR = re.compile(r"^\s*([a-z0-9]+)\s*\+\s*([a-z0-9]+)\s*$")
_RECIPE = re.compile(r"([a-z0-9]+)\s*\+\s*([a-z0-9]+)\s*=\s*([a-z0-9]+)")
_FAILED = re.compile(r"([a-z0-9]+)\s*\+\s*([a-z0-9]+)")
_RESULT = re.compile(r"([a-z0-9]+)\s*\+\s*([a-z0-9]+)\s*(?:=|->)\s*([a-z0-9]+)")
NOTHING = "nothing"
UNLIMITED = 10**9


@dataclass(frozen=True)
class AlchemySettings:
    """Sizes of one (setting, size) combination."""

    base: tuple[int, int]
    """Range of base elements (inclusive)."""
    tiers: tuple[int, int]
    """Range of tiers above the base (inclusive)."""
    widths: tuple[tuple[int, int], ...]
    """Range of elements at tier 1, 2, ... (the last entry repeats for higher tiers)."""
    rounds: int
    """Combinations allowed per task (the agent's step budget)."""
    min_target_tier: int
    """Lowest tier a target may have."""
    max_build: int
    """Largest number of combinations a target may need with every recipe known."""
    stock: int | None
    """Units of every base element at the start; None means unlimited materials."""
    noise: tuple[float, float]
    """Range of the share of non-base elements that are noise (dead-end) nodes."""
    letters: bool
    """One-letter names and terse observations (tiny)."""


SETTINGS: dict[tuple[str, str], AlchemySettings] = {
    ("train", "full"): AlchemySettings(
        base=(3, 4), tiers=(2, 3), widths=((3, 4), (2, 3), (1, 2)), rounds=8,
        min_target_tier=2, max_build=6, stock=None, noise=(0.0, 0.0), letters=False,
    ),
    ("eval", "full"): AlchemySettings(
        base=(4, 6), tiers=(2, 3), widths=((3, 5), (2, 3), (1, 2)), rounds=15,
        min_target_tier=2, max_build=8, stock=4, noise=(0.1, 0.3), letters=False,
    ),
    ("train", "tiny"): AlchemySettings(
        base=(3, 3), tiers=(1, 1), widths=((3, 3),), rounds=3,
        min_target_tier=1, max_build=1, stock=None, noise=(0.0, 0.0), letters=True,
    ),
    ("eval", "tiny"): AlchemySettings(
        base=(4, 4), tiers=(1, 1), widths=((3, 3),), rounds=4,
        min_target_tier=1, max_build=1, stock=2, noise=(0.2, 0.3), letters=True,
    ),
}  # fmt: skip


def pair_key(a: str, b: str) -> tuple[str, str]:
    """Combination is unordered: `a + b` and `b + a` are the same pair."""
    return (a, b) if a <= b else (b, a)


@dataclass(frozen=True)
class RecipeGraph:
    """The hidden rule of a pack."""

    base: tuple[str, ...]
    tier: dict[str, int]
    recipe_of: dict[str, tuple[str, str]]
    """Product -> its one (sorted) ingredient pair."""
    product_of: dict[tuple[str, str], str]
    """Sorted ingredient pair -> product; a pair that is absent makes nothing."""
    noise: frozenset[str]
    """Makeable elements that are an ingredient of nothing (eval only)."""


def _names(rng: random.Random, count: int, letters: bool) -> list[str]:
    if letters:
        return rng.sample("abcdefghijklmnopqrstuvwxyz", count)
    names: set[str] = set()
    while len(names) < count:  # consonant-vowel-consonant-vowel-consonant: opaque, pronounceable
        names.add("".join(rng.choice(_CONSONANTS if i % 2 == 0 else _VOWELS) for i in range(5)))
    return rng.sample(sorted(names), count)


def make_graph(rng: random.Random, s: AlchemySettings) -> RecipeGraph:
    """A random recipe graph: real elements tier by tier, then noise nodes no recipe uses."""
    n_base = rng.randint(*s.base)
    n_tiers = rng.randint(*s.tiers)
    widths = [rng.randint(*s.widths[min(t, len(s.widths) - 1)]) for t in range(n_tiers)]
    n_real = sum(widths)
    # The share is of all non-base elements, so noise = share / (1 - share) of the real ones;
    # rounding down keeps it at most the share, and eval always gets at least one dead end.
    share = rng.uniform(*s.noise)
    n_noise = max(int(share * n_real / (1 - share)), 1 if share else 0)
    names = _names(rng, n_base + n_real + n_noise, s.letters)
    base = tuple(names[:n_base])
    pool = iter(names[n_base:])
    tier = dict.fromkeys(base, 0)
    levels: list[list[str]] = [list(base)]
    recipe_of: dict[str, tuple[str, str]] = {}

    def add(element: str, t: int) -> None:
        # One ingredient from the tier just below fixes the tier; the other is a base element half
        # of the time, which keeps build trees (and so the rounds a target needs) small.
        lower = [e for level in levels[:t] for e in level]
        for _ in range(100):
            a = rng.choice(levels[t - 1])
            b = rng.choice(levels[0]) if rng.random() < 0.5 else rng.choice(lower)
            key = pair_key(a, b)
            if key not in recipe_of.values():
                recipe_of[element] = key
                tier[element] = t
                return
        raise RuntimeError("recipe graph: no free ingredient pair")  # widths keep pairs plentiful

    for t, width in enumerate(widths, start=1):
        levels.append([])
        for _ in range(width):
            element = next(pool)
            add(element, t)
            levels[t].append(element)
    noise = []
    for _ in range(n_noise):  # added last, so no real element is made from them
        element = next(pool)
        add(element, rng.randint(1, n_tiers))
        noise.append(element)
    product_of = {pair: product for product, pair in recipe_of.items()}
    return RecipeGraph(base, tier, recipe_of, product_of, frozenset(noise))


def plan_build(
    target: str, have: dict[str, int], recipe_of: dict[str, tuple[str, str]], limited: bool
) -> list[tuple[str, str]] | None:
    """Combinations that make `target` from `have` with known recipes (backward chaining), or
    None. With limited materials every use takes a unit, so a twice-needed element is made twice."""
    stock = dict(have)
    steps: list[tuple[str, str]] = []

    def obtain(x: str, depth: int) -> bool:
        if stock.get(x, 0) > 0:
            if limited:
                stock[x] -= 1
            return True
        if x not in recipe_of or depth > 12:  # depth guards against cyclic (model-written) hints
            return False
        a, b = recipe_of[x]
        if not (obtain(a, depth + 1) and obtain(b, depth + 1)):
            return False
        steps.append((a, b))
        if not limited:
            stock[x] = UNLIMITED
        return True

    return steps if obtain(target, 0) else None


class AlchemyTask(Task):
    """Make `target` within `max_steps` combinations. Hidden: `graph`."""

    env_name = "alchemy"

    def __init__(
        self, pack_seed: int, task_index: int, graph: RecipeGraph, target: str, s: AlchemySettings
    ):
        super().__init__(pack_seed, task_index)
        self.graph = graph
        self.target = target
        self.settings = s
        self.max_steps = s.rounds
        self.limited = s.stock is not None
        self.reset()

    def prompt(self) -> str:
        base = " ".join(self.graph.base)
        tier = self.graph.tier[self.target]
        a, b = self.graph.base[:2]
        if self.settings.letters:
            stock = f" x{self.settings.stock} each" if self.limited else ""
            return (
                f"Alchemy. Base: {base}{stock}. Make {self.target} (tier {tier}) in "
                f"{self.max_steps} rounds. Reply <answer>{a} + {b}</answer>."
            )
        materials = (
            f"Each base element starts with {self.settings.stock} units; a combination uses one "
            "unit of each ingredient, even when it makes nothing, and a product gives one unit."
            if self.limited
            else "Elements are not used up."
        )
        return (
            "You are an alchemist. Elements combine in pairs into higher-tier elements by hidden "
            "recipes (an element of tier t comes from one of tier t-1 and one of a lower tier; "
            "most pairs make nothing). The recipes are the same for every task of this session.\n"
            f"Base elements (tier 0): {base}. {materials}\n"
            f"Goal: make {self.target} (tier {tier}) within {self.max_steps} rounds, one "
            "combination per round.\n"
            f"Answer with exactly one combination, e.g. <answer>{a} + {b}</answer>"
        )

    def _inventory(self) -> str:
        owned = [e for e, n in self.have.items() if n > 0]
        if self.limited:
            return ", ".join(f"{e} x{self.have[e]}" for e in owned)
        return ", ".join(owned)

    def reset(self) -> str:
        units = UNLIMITED if self.settings.stock is None else self.settings.stock
        self.have: dict[str, int] = dict.fromkeys(self.graph.base, units)
        self.rounds_used = 0
        self.made = False
        self.malformed: str | None = None  # why an action was refused, for the feedback
        self.last_result = ""
        if self.settings.letters:
            return f"have {self._inventory()}"
        return f"You have: {self._inventory()}. Round 1 of {self.max_steps}."

    def _combine(self, a: str, b: str) -> str:
        """Apply one combination; returns its result line."""
        need = {a: 2} if a == b else {a: 1, b: 1}
        missing = [e for e, n in need.items() if self.have.get(e, 0) < n]
        if missing:  # a legal action, just a wasted round
            return f"no {missing[0]}" if self.settings.letters else f"You have no {missing[0]}."
        if self.limited:
            for e, n in need.items():
                self.have[e] -= n
        product = self.graph.product_of.get(pair_key(a, b))
        if product is None:
            return f"{a}+{b}={NOTHING}" if self.settings.letters else f"{a} + {b} -> {NOTHING}."
        self.have[product] = self.have.get(product, 0) + (1 if self.limited else UNLIMITED)
        self.made = self.made or product == self.target
        if self.settings.letters:
            return f"{a}+{b}={product}"
        return f"{a} + {b} -> {product} (tier {self.graph.tier[product]})."

    def step(self, action: str) -> StepOutcome:
        problem = too_long(action)
        block = None if problem else _ANSWER.last_block(action)
        pair = _PAIR.match(block.lower()) if block is not None else None
        if pair is None:
            self.malformed = f"{problem}; {EXPECTED}" if problem else EXPECTED
            return StepOutcome(f"Invalid action: {self.malformed}.", done=True, valid=False)
        self.rounds_used += 1
        self.last_result = self._combine(*pair.groups())
        stuck = sum(self.have.values()) < 2  # limited materials used up
        done = self.made or stuck or self.rounds_used >= self.max_steps
        if self.settings.letters:
            return StepOutcome(self.last_result, done=done)
        if self.made:
            status = f"Goal {self.target} made!"
        elif stuck:
            status = "No materials left."
        elif done:
            status = "No rounds left."
        else:
            status = (
                f"You have: {self._inventory()}. Round {self.rounds_used + 1} of {self.max_steps}."
            )
        return StepOutcome(f"{self.last_result} {status}", done=done)

    @property
    def reward(self) -> float:
        return 1.0 if self.made else 0.0

    @property
    def success(self) -> bool:
        return self.made

    def feedback(self) -> str:
        # The last result is repeated: the update episode sees each observation only before an
        # action, so without it the final discovery would be lost.
        if self.malformed:
            return f"Invalid action: {self.malformed}. Reward 0."
        if self.settings.letters:
            return f"{self.last_result}. {'made' if self.made else 'not made'} {self.target}"
        if self.made:
            return f"Last: {self.last_result} Made {self.target} in {self.rounds_used} rounds. Reward 1."
        return f"Last: {self.last_result} {self.target} was not made. Reward 0."


class AlchemySolver(Agent):
    """Reads the hidden graph and plays the backward-chained build (an upper bound)."""

    def start(self, task: Task, hints: str | None) -> None:
        assert isinstance(task, AlchemyTask)
        self.task = task

    def act(self, observation: str) -> str:
        t = self.task
        steps = plan_build(t.target, t.have, t.graph.recipe_of, t.limited)
        a, b = steps[0] if steps else (t.graph.base[0], t.graph.base[0])
        return f"<answer>{a} + {b}</answer>"


class AlchemyExplorer(Agent):
    """Knows only the prompt, the observations, the feedback and its hints.

    Hints: found recipes `a+b=c`, then (unless `remember_failures` is off, as in tiny, where hints
    must stay about 16 characters) the pairs that made nothing: `a+b=d d+c=e; nothing: a+a b+c`.
    It builds the target from known recipes when it can; otherwise it tries an untested pair,
    preferring the highest tier below the target's (a tier-t target needs a tier t-1 ingredient)
    and, among those, the pair that known recipes can supply in the fewest rounds.
    """

    def __init__(self, remember_failures: bool = True):
        self.remember_failures = remember_failures

    def start(self, task: Task, hints: str | None) -> None:
        text = task.prompt()
        base = re.search(r"Base(?: elements \(tier 0\))?: ([a-z0-9 ]+?)(?: x\d+ each)?\.", text)
        goal = re.search(r"[Mm]ake ([a-z0-9]+) \(tier (\d+)\)\D+(\d+) rounds", text)
        stock = re.search(r"x(\d+) each|starts with (\d+) units", text)
        assert base and goal, "alchemy prompt format changed"
        self.base = base.group(1).split()
        self.target, self.target_tier, self.rounds = (
            goal.group(1),
            int(goal.group(2)),
            int(goal.group(3)),
        )
        self.limited = stock is not None
        units = int(next(g for g in stock.groups() if g)) if stock else UNLIMITED
        self.have = dict.fromkeys(self.base, units)
        self.recipes: dict[str, tuple[str, str]] = {}  # product -> pair; hints first
        found, _, failed = (hints or "").lower().partition(f"{NOTHING}:")
        for a, b, c in _RECIPE.findall(found):
            self.recipes.setdefault(c, pair_key(a, b))
        self.failed = list(dict.fromkeys(pair_key(a, b) for a, b in _FAILED.findall(failed)))
        self.tried = set(self.recipes.values()) | set(self.failed)
        self.last: tuple[str, str] | None = None
        self.used = 0

    def _tier(self, x: str, depth: int = 0) -> int:
        if x in self.base:
            return 0
        if x not in self.recipes or depth > 12:  # depth: model-written hints may be cyclic
            return 99  # unknown, never preferred
        a, b = self.recipes[x]
        return 1 + max(self._tier(a, depth + 1), self._tier(b, depth + 1))

    def _observe(self, text: str) -> None:
        """Book the result of the last combination (its materials and what it made)."""
        seen = _RESULT.search(text.lower())
        if self.last is None or seen is None:  # "no x": nothing was used
            return
        a, b = self.last
        if self.limited:
            for e, n in ({a: 2} if a == b else {a: 1, b: 1}).items():
                self.have[e] -= n
        product = seen.group(3)
        if product == NOTHING:
            self.failed += [] if pair_key(a, b) in self.failed else [pair_key(a, b)]
        else:
            self.recipes.setdefault(product, pair_key(a, b))
            self.have[product] = self.have.get(product, 0) + (1 if self.limited else UNLIMITED)

    def act(self, observation: str) -> str:
        self._observe(observation)
        steps = plan_build(self.target, self.have, self.recipes, self.limited)
        self.last = steps[0] if steps else self._explore()
        self.tried.add(pair_key(*self.last))
        self.used += 1
        return f"<answer>{self.last[0]} + {self.last[1]}</answer>"

    def _explore(self) -> tuple[str, str]:
        # Reachable elements: owned ones (cost 0) and those known recipes can still build.
        cost = {e: 0 for e, n in self.have.items() if n > 0}
        for c in self.recipes:
            steps = None if c in cost else plan_build(c, self.have, self.recipes, self.limited)
            if steps:
                cost[c] = len(steps)
        left = self.rounds - self.used
        best: tuple[tuple[int, int], tuple[str, str]] | None = None
        names = sorted(cost)
        for i, a in enumerate(names):
            for b in names[i:]:
                key = pair_key(a, b)
                if key in self.tried or (a == b and self.have.get(a, 0) < 2):
                    continue
                top = max(self._tier(a), self._tier(b))
                # A product above the target's tier is useless, and so is a pair whose
                # ingredients cannot be made in the rounds left.
                if top >= self.target_tier or cost[a] + cost[b] + 1 > left:
                    continue
                score = (top, -cost[a] - cost[b])
                if best is None or score > best[0]:
                    best = (score, key)
        if best is None:
            fallback = (names or self.base)[0]
            return fallback, fallback
        for x in best[1]:
            if cost[x]:  # make the missing ingredient first
                return plan_build(x, self.have, self.recipes, self.limited)[0]
        return best[1]

    def write_hints(self, task: Task, old_hints: str | None) -> str | None:
        self._observe(task.feedback())  # the feedback repeats the last combination's result
        self.last = None
        failed = self.failed if self.remember_failures else []
        if not self.recipes and not failed:
            return old_hints
        order = sorted(self.recipes, key=self._tier)  # low tiers first: they feed everything
        text = " ".join(f"{a}+{b}={c}" for c in order for a, b in [self.recipes[c]])
        if failed:
            text += f"; {NOTHING}: " + " ".join(f"{a}+{b}" for a, b in failed)
        return text.lstrip("; ")


class AlchemyEnv(Environment):
    """Alchemy-Random: a hidden recipe graph per pack; make a different target in every task."""

    name = "alchemy"
    reward_range = (0.0, 1.0)
    description = "Combine elements by hidden recipes to make a target element."

    def __init__(self, setting: Setting = "train", size: Size = "full"):
        super().__init__(setting, size)
        self.settings = SETTINGS[(setting, size)]

    def graph(self, pack_seed: int) -> RecipeGraph:
        # Graphs are redrawn until enough targets are buildable, so every pack has a full set.
        rng = rng_for(self.name, "rule", pack_seed, self.setting, self.size)
        while True:
            graph = make_graph(rng, self.settings)
            if len(self.targets(graph)) >= 2:
                return graph

    def targets(self, graph: RecipeGraph) -> list[str]:
        """Real elements a task may ask for: tier high enough, buildable within the limits."""
        s = self.settings
        out = []
        for element, tier in graph.tier.items():
            if tier < s.min_target_tier or element in graph.noise:
                continue
            start = dict.fromkeys(graph.base, UNLIMITED if s.stock is None else s.stock)
            steps = plan_build(element, start, graph.recipe_of, s.stock is not None)
            if steps is not None and len(steps) <= s.max_build:
                out.append(element)
        return sorted(out)

    def task(self, pack_seed: int, task_index: int) -> AlchemyTask:
        graph = self.graph(pack_seed)
        # A per-pack order of the targets: consecutive tasks ask for different elements, and each
        # position draws uniformly, so no position is easier by construction.
        order = self.targets(graph)
        rng_for(self.name, "targets", pack_seed, self.setting, self.size).shuffle(order)
        return AlchemyTask(
            pack_seed, task_index, graph, order[task_index % len(order)], self.settings
        )

    def solver(self) -> Agent:
        return AlchemySolver()

    def explorer(self) -> Agent:
        return AlchemyExplorer(remember_failures=not self.settings.letters)
