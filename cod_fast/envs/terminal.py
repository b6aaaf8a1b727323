"""Terminal (docs/concepts.md section 6): file chores in a simulated shell whose dialect is hidden.

The hidden rule of a pack is the shell dialect: Windows cmd (`dir`, `type`, `copy`, `move`, `del`,
`mkdir`, `cd`, `start`; `\\` paths), Linux bash or macOS zsh (`ls`, `cat`, `cp`, `mv`, `rm`,
`mkdir`, `cd`; `/` paths). Linux and macOS differ visibly: the file opener (`xdg-open` against
`open`), `uname`, the home folder (/home/<user> against /Users/<user>), the shells' error messages
(`bash: x: command not found` against `zsh: command not found: x`) and `ls --color` (Linux only).
The shell (cod_fast.envs.terminal_shell) is pure Python over an in-memory tree: it never touches
the real file system or starts a process, and the command line is only split into words, never
executed. This module holds the goals, the task, the environment and its scripted agents.

A task is a goal of independent conditions (copy a file into a folder, move one, delete one, make
a folder, open a file). Each condition takes one command once the dialect is known, so the
minimal number of commands m is the number of conditions. Reward: 1 when every condition holds
within m commands ("early": any command spent finding out the dialect costs the full reward);
otherwise 0.5 x the fraction of conditions that hold when the episode ends (in [0, 0.5]).
`success` means the goal was complete, early or not.

Settings: train 2-3 conditions, folders 1-2 deep, budget m + 3; eval 3-4 conditions, folders 2-3
deep, budget m + 1; tiny 1-2 conditions (eval 2), three files and a folder in home, short
outputs, budget m + 2 (eval m + 1), every answer at most 32 characters. The scripted explorer
probes with `uname`, reads the dialect off the answer (or off any error message) and writes
`dialect: <name>` as its hint.
"""

from __future__ import annotations

import copy
import functools
import random
import re
from collections.abc import Sequence
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
from cod_fast.envs.terminal_shell import DIALECTS, Shell, dialect_of, tokenize

_HINT = re.compile(r"dialect:\s*(windows|macos|linux)")


def read_dialect(hints: str | None) -> str | None:
    """The dialect a hint states as `dialect: NAME` (any case; the first one counts), the way
    the scripted explorer writes it."""
    found = _HINT.search((hints or "").lower())
    return found.group(1) if found else None


PARTIAL_SCALE = 0.5
"""An incomplete or late goal earns at most this much (times the fraction of conditions met)."""
_ANSWER = Tag("answer")
MAX_LINE_CHARS = 200
"""The longest command line the shell reads (goal commands are a few dozen characters)."""
_CHAINING = re.compile(r"[;|&<>`]|\$\(")
HOME = "home folder"
"""How goals name the home folder itself (a dialect-neutral name)."""
FORMAT = "one command line inside <answer></answer>, e.g. <answer>cd docs</answer>"


@dataclass(frozen=True)
class TerminalSettings:
    """Sizes of one (setting, size) combination."""

    conditions: tuple[int, int]
    """Range of goal conditions (inclusive)."""
    depth: int
    """Deepest folder level below home that files and goal folders may sit at."""
    files: tuple[int, int]
    """Range of files in the tree."""
    slack: int
    """Step budget = minimal commands + slack."""
    short: bool
    """Short file names and terse outputs (tiny)."""


SETTINGS: dict[tuple[str, str], TerminalSettings] = {
    ("train", "full"): TerminalSettings(conditions=(2, 3), depth=2, files=(4, 6), slack=3, short=False),
    ("eval", "full"): TerminalSettings(conditions=(3, 4), depth=3, files=(6, 8), slack=1, short=False),
    ("train", "tiny"): TerminalSettings(conditions=(1, 2), depth=1, files=(3, 3), slack=2, short=True),
    ("eval", "tiny"): TerminalSettings(conditions=(2, 2), depth=1, files=(3, 4), slack=1, short=True),
}  # fmt: skip
_FILES = ("notes.txt", "report.md", "todo.txt", "data.csv", "tmp.log", "draft.doc", "photo.jpg",
          "budget.xls", "readme.txt", "cache.tmp", "song.mp3", "list.txt")  # fmt: skip
_DIRS = ("docs", "backup", "old", "work", "archive", "photos", "src", "music", "2023", "2024",
         "final", "misc")  # fmt: skip
_TINY_FILES = ("a.txt", "b.log", "c.md", "d.csv")
_TINY_DIRS = ("bk", "old")
_USERS = ("ana", "ben", "kim", "lee", "max", "sam")


@dataclass(frozen=True)
class Condition:
    """One part of the goal; paths are component tuples relative to home."""

    kind: str
    """`copy`, `move` (file `path` into folder `dest`), `delete`, `mkdir` or `open`."""
    path: tuple[str, ...]
    dest: tuple[str, ...] = ()

    def text(self) -> str:
        verb, p = ("make folder" if self.kind == "mkdir" else self.kind), "/".join(self.path)
        if self.kind in ("copy", "move"):
            return f"{verb} {p} into {'/'.join(self.dest) or HOME}"
        return f"{verb} {p}"


def command_for(c: Condition, dialect: str) -> str:
    """The one command that fulfils `c` in `dialect` (paths relative to home)."""
    sep = "\\" if dialect == "windows" else "/"
    p = sep.join(c.path)
    d = (sep.join(c.dest) or ".") if c.kind in ("copy", "move") else ""  # agents never leave home
    if dialect == "windows":
        verbs = {"copy": "copy", "move": "move", "delete": "del", "mkdir": "mkdir", "open": "start"}
    else:
        opener = "open" if dialect == "macos" else "xdg-open"
        mkdir = "mkdir -p" if len(c.path) > 1 else "mkdir"
        verbs = {"copy": "cp", "move": "mv", "delete": "rm", "mkdir": mkdir, "open": opener}
    return f"{verbs[c.kind]} {p} {d}".rstrip()


def plan(conditions: list[Condition], dialect: str) -> list[str]:
    """Commands for every condition, folders first (a copy or move may target a new folder)."""
    ordered = sorted(conditions, key=lambda c: c.kind != "mkdir")
    return [command_for(c, dialect) for c in ordered]


def make_tree(rng: random.Random, s: TerminalSettings) -> tuple[dict, list[Condition]]:
    """A home tree and a goal over it. Every file has a distinct name, so no two conditions touch
    the same file and no condition holds at the start."""
    files, dirs = (_TINY_FILES, _TINY_DIRS) if s.short else (_FILES, _DIRS)
    dir_names = rng.sample(dirs, min(len(dirs), 1 if s.short else 2 + s.depth))
    home: dict = {}
    folders: list[tuple[str, ...]] = [()]
    for name in dir_names:  # each new folder goes under home or a folder that is not too deep
        parent = rng.choice([f for f in folders if len(f) < s.depth])
        folders.append((*parent, name))
        node = home
        for part in parent:
            node = node[part]
        node[name] = {}
    places: list[tuple[str, ...]] = []
    for name in rng.sample(files, rng.randint(*s.files)):
        # Tiny files sit in home, so every answer fits a 32-character response.
        folder = () if s.short else rng.choice(folders)
        node = home
        for part in folder:
            node = node[part]
        node[name] = f"{name.split('.')[0]} v{rng.randint(1, 9)}"
        places.append((*folder, name))
    conditions: list[Condition] = []
    spare = [d for d in dirs if d not in dir_names]
    for _ in range(rng.randint(*s.conditions)):
        kinds = ["copy", "move", "delete", "open"] + (["mkdir"] if spare else [])
        kind = rng.choice(kinds)
        if kind == "mkdir":
            parents = [f for f in folders if len(f) < s.depth]
            new = (*rng.choice(parents), spare.pop(rng.randrange(len(spare))))
            conditions.append(Condition("mkdir", new))
            folders.append(new)  # later copies and moves may target the new folder
            continue
        path = places.pop(rng.randrange(len(places)))
        if kind in ("copy", "move"):
            dest = rng.choice([f for f in folders if f != path[:-1]])
            conditions.append(Condition(kind, path, dest))
        else:
            conditions.append(Condition(kind, path))
    return home, conditions


class TerminalTask(Task):
    """Reach the goal in the shell. Hidden: `dialect` (and the `user` name behind home)."""

    env_name = "terminal"

    def __init__(
        self,
        pack_seed: int,
        task_index: int,
        rule: tuple[str, str],
        rng: random.Random,
        s: TerminalSettings,
    ):
        super().__init__(pack_seed, task_index)
        self.dialect, self.user = rule
        self.settings = s
        self.start_tree, self.conditions = make_tree(rng, s)
        self.min_steps = len(self.conditions)
        self.max_steps = self.min_steps + s.slack
        self.reset()

    def prompt(self) -> str:
        goal = "; ".join(c.text() for c in self.conditions)
        m, n = self.min_steps, self.max_steps
        if self.settings.short:
            return f"Shell. Goal: {goal}. Best in {m} cmds, max {n}. Reply <answer>cd bk</answer>."
        lines = "\n".join(f"- {c.text()}" for c in self.conditions)
        return (
            "You are at a command line in your home folder. The shell is Windows cmd, macOS or "
            "Linux; you are not told which, and it is the same for every task of this session.\n"
            f"Goal:\n{lines}\n"
            "Paths are written with / here; use your shell's own separator. Full reward for "
            f"finishing in at most {m} commands; otherwise a partial score. At most {n} commands.\n"
            f"Answer with {FORMAT}"
        )

    def reset(self) -> str:
        tree = copy.deepcopy(self.start_tree)
        self.shell = Shell(self.dialect, self.user, tree, self.settings.short)
        self.steps = 0
        self.malformed: str | None = None  # why an action was refused, for the feedback
        self.last_output = ""
        return "ready" if self.settings.short else "(home folder; no command run yet)"

    def holds(self, c: Condition) -> bool:
        """Whether condition `c` holds in the current tree."""
        sh = self.shell
        here = sh.get([*sh.home, *c.path])
        if c.kind == "mkdir":
            return isinstance(here, dict)
        if c.kind == "delete":
            return here is None
        if c.kind == "open":
            return (*sh.home, *c.path) in sh.opened
        original = functools.reduce(dict.__getitem__, c.path, self.start_tree)
        there = sh.get([*sh.home, *c.dest, c.path[-1]])
        return there == original and (here == original if c.kind == "copy" else here is None)

    def met(self) -> int:
        return sum(self.holds(c) for c in self.conditions)

    def step(self, action: str) -> StepOutcome:
        problem = too_long(action)
        block = None if problem else _ANSWER.last_block(action)
        line = block.strip() if block is not None else ""
        readable = bool(line) and len(line) <= MAX_LINE_CHARS and "\n" not in line
        words = tokenize(line) if readable and not _CHAINING.search(line) else None
        if not words:
            self.malformed = f"{problem}; expected {FORMAT}" if problem else f"expected {FORMAT}"
            return StepOutcome(f"Invalid action: {self.malformed}.", done=True, valid=False)
        self.steps += 1
        output = self.shell.run(words)
        self.last_output = output or ("ok" if self.settings.short else "(no output)")
        done = self.met() == len(self.conditions) or self.steps >= self.max_steps
        return StepOutcome(self.last_output, done=done)

    @property
    def success(self) -> bool:
        return not self.malformed and self.met() == len(self.conditions)

    @property
    def reward(self) -> float:
        if self.success and self.steps <= self.min_steps:
            return 1.0
        return 0.0 if self.malformed else PARTIAL_SCALE * self.met() / len(self.conditions)

    def feedback(self) -> str:
        if self.malformed:
            return f"Invalid action: {self.malformed}. Reward 0."
        met, total, r = self.met(), len(self.conditions), self.reward
        if self.settings.short:
            return f"{met}/{total} done in {self.steps} cmds. reward {r:.2f}"
        late = " but not within the minimum" if self.success and r < 1 else ""
        return (
            f"Last output: {self.last_output}\nGoal: {met} of {total} parts done in {self.steps} "
            f"commands (minimum {self.min_steps}){late}. Reward {r:.3f}."
        )


def parse_goal(prompt: str) -> list[Condition]:
    """The goal conditions from a task prompt (what the explorer knows of the task)."""
    goal = prompt.split("Goal:", 1)[1].split("Paths are")[0].split(". Best in")[0]
    out = []
    for part in re.split(r"\n- |; |\n", goal):
        m = re.match(rf"\s*(copy|move|delete|make folder|open) (\S+)(?: into ({HOME}|\S+))?", part)
        if m:
            kind = "mkdir" if m.group(1) == "make folder" else m.group(1)
            dest = tuple(m.group(3).split("/")) if m.group(3) not in (None, HOME) else ()
            out.append(Condition(kind, tuple(m.group(2).split("/")), dest))
    return out


class TerminalSolver(Agent):
    """Reads the hidden dialect and types the minimal plan."""

    def start(self, task: Task, hints: str | None) -> None:
        assert isinstance(task, TerminalTask)
        self.queue = plan(task.conditions, task.dialect)

    def act(self, observation: str) -> str:
        return f"<answer>{self.queue.pop(0) if self.queue else 'cd .'}</answer>"


class TerminalExplorer(Agent):
    """Knows only the prompt, the outputs and its hint `dialect: <name>`.

    Without a hint it probes with `uname` (a Windows error, `Darwin` or `Linux`); an error met
    later that names another shell also resets its belief and replans the remaining goal.
    """

    def start(self, task: Task, hints: str | None) -> None:
        self.goal = parse_goal(task.prompt())
        self.dialect = read_dialect(hints)
        self.next = 0  # index of the next command of the plan
        self.sent: str | None = None

    def act(self, observation: str) -> str:
        seen = dialect_of(observation) if self.sent else None
        if seen and seen != self.dialect:  # a wrong or missing belief
            if self.dialect is not None:
                self.next -= 1  # the command just sent failed: redo it in the right dialect
            self.dialect = seen
        if self.dialect is None:
            self.sent = "uname"
        else:
            commands = plan(self.goal, self.dialect)
            self.sent = commands[self.next] if self.next < len(commands) else "cd ."
            self.next += 1
        return f"<answer>{self.sent}</answer>"

    def write_hints(self, task: Task, old_hints: str | None) -> str | None:
        return f"dialect: {self.dialect}" if self.dialect else old_hints


class TerminalEnv(Environment):
    """Terminal: file chores in a shell whose dialect (Windows / macOS / Linux) is hidden."""

    name = "terminal"
    reward_range = (0.0, 1.0)
    description = "Do file chores in a simulated shell whose dialect is hidden."

    def __init__(self, setting: Setting = "train", size: Size = "full"):
        super().__init__(setting, size)
        self.settings = SETTINGS[(setting, size)]

    def rule(self, pack_seed: int) -> tuple[str, str]:
        """The hidden rule: (dialect, user)."""
        rng = rng_for(self.name, "rule", pack_seed, self.setting, self.size)
        return rng.choice(DIALECTS), rng.choice(_USERS)

    def task(self, pack_seed: int, task_index: int) -> TerminalTask:
        rng = rng_for(self.name, "task", pack_seed, task_index, self.setting, self.size)
        return TerminalTask(pack_seed, task_index, self.rule(pack_seed), rng, self.settings)

    def solver(self) -> Agent:
        return TerminalSolver()

    def explorer(self) -> Agent:
        return TerminalExplorer()

    def hint_truth(self, pack_seed: int) -> dict[str, str]:
        """The one entry: the pack's dialect."""
        return {"dialect": self.rule(pack_seed)[0]}

    def hint_entries(self, hints: str | None) -> dict[str, str]:
        """`dialect: NAME` as the explorer reads it (any case; the first one counts)."""
        dialect = read_dialect(hints)
        return {"dialect": dialect} if dialect else {}

    def knowable_entries(
        self, known: dict[str, str], task: Task, steps: Sequence[tuple[str, str]], feedback: str
    ) -> dict[str, str]:
        """What the explorer believes after the episode: its belief before, replaced by the
        dialect any output of a command gives away (the observations after the first; the
        explorer reads nothing else)."""
        dialect = known.get("dialect")
        for observation, _ in steps[1:]:
            dialect = dialect_of(observation) or dialect
        return {"dialect": dialect} if dialect else {}

    def render_hints(self, entries: dict[str, str]) -> str:
        return f"dialect: {entries['dialect']}" if "dialect" in entries else "dialect: ?"
