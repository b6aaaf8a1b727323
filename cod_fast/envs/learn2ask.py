"""Learn2Ask: a consultation in which the agent asks a patient about findings, then diagnoses.

A pack shares its candidate conditions (named in the prompt) and, hidden, their finding profiles:
which of the listed findings each condition shows, pairwise distinct. Some listed findings are
not defined for the pack; the patient answers `not sure` about them, so asking them is wasted.
Each task is one case: a condition of the pack, drawn per task, whose findings the patient
reports truthfully. What carries over between the tasks of a pack is which findings tell the
conditions apart and which are useless: without that the agent must guess or spend questions,
with it it asks only the questions that discriminate.

Actions: `ask FINDING` (the patient answers yes, no or not sure) and `answer CONDITION`, which
ends the episode. Reward: 1 for the right condition, else 0, minus a cost per question (asking a
finding twice pays twice); running out of turns scores as a wrong answer. A malformed action (an
unknown command, an answer naming no candidate, a finding over MAX_NAME_CHARS) ends the episode
with the shape's floor, -cost x max_steps: what spending every turn on questions gives, so no
valid play scores below it.

Sizes: `full` (train 4-5 conditions and 8 listed findings of which 5 are defined, 9 turns; eval
5-6 conditions, 9 findings, 6 defined, 10 turns; profiles of 2-3 findings; 0.05 a question)
names conditions and findings by words. `tiny` is for a ~0.35M-parameter model: conditions
`a b c` (eval `a b c d`), findings `1`-`5` (eval `1`-`6`), each condition showing one finding of
its own, one-word observations and a one-line feedback.

User cases (`cases=`, a JSONL file read by cod_fast.envs.cases.load_cases) replace the
built-in packs: a pack is a group of cases, a task one case of it, the candidates its answer
and distractors. There an answer may name any condition (free text): a model or endpoint judge
may credit a synonym, the rule judge only the case's answer.

Hints are scored entry by entry (cod_fast.data.diagnostics): an entry is a condition and the findings
it shows, written `a3` at tiny size (a shows 3) and `flu=cough+fever` at full size, as the
explorer writes them.

One case's episode (the shapes, the reading of an action, the reward and the judge hooks) is in
cod_fast.envs.learn2ask_task; this module draws the packs and holds the environment and its
scripted agents.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace

from cod_fast.envs.base import (
    Agent,
    Environment,
    Setting,
    Size,
    Task,
    rng_for,
    too_long,
)
from cod_fast.envs.cases import Case, load_cases
from cod_fast.envs.learn2ask_task import SHAPES, Learn2AskTask, parse_action

CONDITIONS = (
    "flu", "cold", "allergy", "asthma", "migraine",
    "measles", "strep", "sinusitis", "bronchitis", "covid",
)  # fmt: skip
FINDINGS = (
    "fever", "cough", "rash", "headache", "sneezing", "wheezing", "itching",
    "nausea", "chills", "fatigue", "congestion", "dizziness", "vomiting", "swelling",
)  # fmt: skip
LETTERS = "abcd"
_TINY_TOKEN_RE = re.compile(r"([a-d])(\d|\?)|\?(\d+)")
# `+` is outside the name class, so no two parts of a token can match the same characters.
_WORD_TOKEN_RE = re.compile(r"([a-z0-9_'-]+|\?)=([a-z0-9_'-]+(?:\+[a-z0-9_'-]+)*)")


def _reply_of(observation: str) -> str | None:
    text = observation.lower()
    return next((reply for reply in ("not sure", "yes", "no") if text.startswith(reply)), None)


def best_split(
    candidates: Sequence[str],
    findings: Sequence[str],
    value: Callable[[str, str], bool | None],
    skip: set[str],
) -> str | None:
    """The finding (not in `skip`) whose known values (`value(c, f)`: True, False, or None when
    unknown) tell the most pairs of `candidates` apart, the first on ties; None when none tells
    any pair apart."""
    best, most = None, 0
    for f in findings:
        if f not in skip:
            values = [value(c, f) for c in candidates]
            if (pairs := values.count(True) * values.count(False)) > most:
                best, most = f, pairs
    return best


class Learn2AskEnv(Environment):
    """Ask a patient about findings, then name the condition; the profiles are hidden per pack."""

    name = "learn2ask"
    reward_range = (min(shape.floor for shape in SHAPES.values()), 1.0)
    description = "Diagnose by asking a patient about findings; which findings tell is hidden."

    def __init__(self, setting: Setting = "train", size: Size = "full", cases: str | None = None):
        super().__init__(setting, size)
        self.shape = SHAPES[(size, setting)]
        self.groups: dict[str, list[Case]] = {}
        for case in load_cases(cases) if cases is not None else []:
            self.groups.setdefault(case.group, []).append(case)
        self.hint_words = cases is not None or not self.shape.compact
        """Hints in words (`flu=cough+fever`) rather than letters and digits (`a3`)."""

    def profiles(
        self, pack_seed: int
    ) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, frozenset[str]]]:
        """The hidden rule of a built-in pack, from pack_seed alone: (conditions, findings,
        profiles), the first two public and in prompt order."""
        shape = self.shape
        rng = rng_for(self.name, "rule", pack_seed, self.setting, self.size)
        if shape.compact:  # one finding of its own per condition
            conditions = tuple(LETTERS[: shape.conditions[0]])
            findings = tuple(str(i) for i in range(1, shape.findings + 1))
            marks = rng.sample(findings, len(conditions))
            profiles = {c: frozenset({m}) for c, m in zip(conditions, marks, strict=True)}
            return conditions, findings, profiles
        count = rng.randint(*shape.conditions)
        conditions = tuple(sorted(rng.sample(CONDITIONS, count), key=CONDITIONS.index))
        findings = tuple(sorted(rng.sample(FINDINGS, shape.findings), key=FINDINGS.index))
        defined = rng.sample(findings, shape.defined)
        while True:  # until pairwise distinct, so that the solver can tell them apart
            profiles = {
                c: frozenset(rng.sample(defined, rng.randint(*shape.shows))) for c in conditions
            }
            if len(set(profiles.values())) == len(conditions):
                return conditions, findings, profiles

    def task(self, pack_seed: int, task_index: int) -> Learn2AskTask:
        rng = rng_for(self.name, "task", pack_seed, task_index, self.setting, self.size)
        if not self.groups:
            conditions, findings, profiles = self.profiles(pack_seed)
            answer = rng.choice(conditions)
            defined = set().union(*profiles.values())  # a finding nobody shows tells nothing
            facts = {f: "yes" if f in profiles[answer] else "no" for f in sorted(defined)}
            return Learn2AskTask(
                pack_seed, task_index, self.shape, conditions, findings, answer, facts, profiles
            )
        groups = sorted(self.groups)
        cases = self.groups[groups[rng_for(self.name, "group", pack_seed).randrange(len(groups))]]
        case = cases[rng.randrange(len(cases))]
        candidates = [case.answer, *case.distractors]
        rng.shuffle(candidates)
        findings = tuple(sorted({f for c in cases for f in c.facts}))
        shape = replace(self.shape, compact=False)  # user names are words
        return Learn2AskTask(
            pack_seed, task_index, shape, tuple(candidates), findings, case.answer, case.facts, None
        )

    def solver(self) -> Agent:
        return Learn2AskSolver()

    def explorer(self) -> Agent:
        return Learn2AskExplorer()

    def hint_truth(self, pack_seed: int) -> dict[str, str] | None:
        """Every condition and the findings it shows (None with user cases: two cases of one
        condition may differ)."""
        if self.groups:
            return None
        conditions, _, profiles = self.profiles(pack_seed)
        return {c: "+".join(sorted(profiles[c])) for c in conditions}

    def hint_entries(self, hints: str | None) -> dict[str, str]:
        """The profiles a hint text states, read the explorer's way: `a3` (tiny) or
        `flu=cough+fever` (full); `a?` and the not-sure list (`?24`, `?=nausea`) state none; of
        two entries for one condition the later counts."""
        entries = {}
        for token in (hints or "").lower().split():
            if not self.hint_words:
                if (match := _TINY_TOKEN_RE.fullmatch(token)) and match.group(2) not in (None, "?"):
                    entries[match.group(1)] = match.group(2)
            elif (match := _WORD_TOKEN_RE.fullmatch(token)) and match.group(1) != "?":
                shown = sorted(f.replace("_", " ") for f in match.group(2).split("+"))
                entries[match.group(1).replace("_", " ")] = "+".join(shown)
        return entries

    def knowable_entries(
        self, known: dict[str, str], task: Task, steps: Sequence[tuple[str, str]], feedback: str
    ) -> dict[str, str]:
        """The explorer starts the task from hints stating `known`, reviews the episode's
        questions, replies and feedback, and states what it then knows. It carries the
        not-sure findings too, which can complete a profile sooner: on top of `known` alone it
        may state less than in its own play, never more."""
        explorer = Learn2AskExplorer()
        explorer.start(task, self.render_hints(known))
        explorer.review(steps, feedback)
        return self.hint_entries(explorer.hints())

    def render_hints(self, entries: dict[str, str]) -> str:
        if not self.hint_words:
            return " ".join(
                f"{c}{entries.get(c, '?')}" for c in LETTERS[: self.shape.conditions[1]]
            )
        return " ".join(f"{c}={v}".replace(" ", "_") for c, v in entries.items()) or "?"


class Learn2AskSolver(Agent):
    """Reads the pack's profiles and asks the finding that splits the candidates still
    consistent with the replies most evenly, answering once one is left. With user cases it
    reads the answer and gives it at once."""

    def start(self, task: Task, hints: str | None) -> None:
        assert isinstance(task, Learn2AskTask)
        self.task = task

    def act(self, observation: str) -> str:
        task, profiles = self.task, self.task.profiles
        if profiles is None:
            return f"answer {task.answer}"
        asked = {action[4:]: reply for action, reply in task.log}

        def value(c: str, f: str) -> bool | None:
            return f in profiles[c] if f in task.facts else None  # None: not sure

        left = [
            c
            for c in task.candidates
            if all(value(c, f) in (None, r == "yes") for f, r in asked.items())
        ]
        if len(left) == 1:
            return f"answer {left[0]}"
        return f"ask {best_split(left, task.findings, value, set(asked))}"


class Learn2AskExplorer(Agent):
    """Learns the profiles from the replies and the true condition the feedback names, and
    carries them in hints: `a3 b? c? ?24` at tiny size (a shows 3, b and c unknown, 2 and 4 not
    sure), `flu=cough+fever ?=nausea` at full size (flu shows cough and fever and no other
    listed finding; nausea is not sure). A profile is recorded once complete: every listed
    finding asked or not sure, or as many shown as a condition can show (the prompt says).

    It reads only the prompt (and the turn budget), the replies, the feedback and its hints.
    Each turn it keeps the candidates that contradict the fewest replies (an unseen condition
    contradicts none), then: answers when one is left; asks the finding whose known values split
    them most evenly; answers a known condition whose findings all came back yes, or asks the
    next of them; while an unseen candidate may show more, asks a finding its value is unknown
    for (that teaches its profile, through the feedback); else names the candidate the replies
    matched most often. It keeps one turn for the answer.
    """

    def start(self, task: Task, hints: str | None) -> None:
        prompt = task.prompt()
        self.max_steps = task.max_steps
        self.compact = prompt.startswith("which ")
        if self.compact:  # one finding of its own per condition
            heads = re.match(r"which (.*)\? ask (.*)", prompt)
            self.conditions, self.findings = heads.group(1).split(), heads.group(2).split()
            self.most = 1
        else:
            self.conditions = re.search(r"conditions: ([^\n]*)\.\n", prompt).group(1).split(", ")
            self.findings = re.search(r"ask about: ([^\n]*)\.\n", prompt).group(1).split(", ")
            shows = re.search(r"shows \d+ to (\d+)", prompt)
            self.most = int(shows.group(1)) if shows else len(self.findings)
        self.known: dict[str, set[str]] = {}  # complete profiles: the findings shown
        self.useless: set[str] = set()
        for token in (hints or "").lower().split():
            self._read(token)
        self.answers: dict[str, str] = {}
        self.last: str | None = None
        self.steps = 0

    def _read(self, token: str) -> None:
        if self.compact:
            match = _TINY_TOKEN_RE.fullmatch(token)
            if match and match.group(1) in self.conditions and match.group(2) in self.findings:
                self.known[match.group(1)] = {match.group(2)}
            elif match and match.group(3):
                self.useless |= set(match.group(3)) & set(self.findings)
        elif match := _WORD_TOKEN_RE.fullmatch(token):
            name = match.group(1).replace("_", " ")
            shown = {f.replace("_", " ") for f in match.group(2).split("+")} & set(self.findings)
            if name == "?":
                self.useless |= shown
            elif name in self.conditions:
                self.known[name] = shown

    def value(self, condition: str, finding: str) -> bool | None:
        """Whether `condition` shows `finding` as far as known (None: unknown)."""
        if condition in self.known:
            return finding in self.known[condition]
        # At tiny size a finding one condition shows is shown by no other.
        return False if self.compact and any(finding in s for s in self.known.values()) else None

    def _contradictions(self, condition: str) -> int:
        replies = [(f, r == "yes") for f, r in self.answers.items() if r != "not sure"]
        wrong = sum(self.value(condition, f) not in (None, yes) for f, yes in replies)
        too_many = condition not in self.known and sum(yes for _, yes in replies) > self.most
        return wrong + too_many

    def _observe(self, observation: str) -> None:
        reply = _reply_of(observation)
        if self.last is not None and reply is not None:
            self.answers[self.last] = reply
            if reply == "not sure":
                self.useless.add(self.last)
        self.last = None

    def act(self, observation: str) -> str:
        self._observe(observation)
        action = self._decide()
        self.last = action[4:] if action.startswith("ask ") else None
        self.steps += 1
        return action

    def _decide(self) -> str:
        fewest = min(map(self._contradictions, self.conditions))
        left = [c for c in self.conditions if self._contradictions(c) == fewest]
        skip = set(self.answers) | self.useless
        if len(left) == 1 or self.max_steps - self.steps <= 1:
            return f"answer {self._guess(left)}"
        if split := best_split(left, self.findings, self.value, skip):
            return f"ask {split}"
        known = next((c for c in left if c in self.known), None)
        if known is not None:
            pending = [f for f in self.findings if f in self.known[known] and f not in skip]
            return f"ask {pending[0]}" if pending else f"answer {known}"
        seen = sum(r == "yes" for r in self.answers.values())
        unseen = [c for c in left if c not in self.known and seen < self.most]
        for f in self.findings:
            if f not in skip and any(self.value(c, f) is None for c in unseen):
                return f"ask {f}"
        return f"answer {self._guess(left)}"

    def _guess(self, left: list[str]) -> str:
        """The candidate whose known values the replies matched most often (the first on ties)."""
        replies = [(f, r == "yes") for f, r in self.answers.items() if r != "not sure"]
        return max(left, key=lambda c: sum(self.value(c, f) == yes for f, yes in replies))

    def _record(self, feedback: str) -> None:
        """Attribute this task's replies to the condition the feedback names."""
        named = [c for c in self.conditions if feedback.lower().endswith(c)]
        if not named:
            return
        true = max(named, key=len)
        shown = {f for f, reply in self.answers.items() if reply == "yes"}
        if self._contradictions(true):  # wrong hints: forget them
            self.known.pop(true, None)
        complete = len(shown) >= self.most or set(self.findings) <= set(self.answers) | self.useless
        if true not in self.known and complete:
            self.known[true] = shown
            if self.compact:  # its finding is no other's
                for c in [c for c in self.known if c != true and self.known[c] == shown]:
                    del self.known[c]

    def write_hints(self, task: Task, old_hints: str | None) -> str:
        self._record(task.feedback())
        return self.hints()

    def hints(self) -> str:
        """What it knows, in the format `start` reads."""
        useless = [f for f in self.findings if f in self.useless]
        if self.compact:
            marks = [
                c + (min(self.known[c]) if self.known.get(c) else "?") for c in self.conditions
            ]
            return " ".join(marks + [f"?{''.join(useless)}"] * bool(useless))
        words = [
            f"{c}={'+'.join(sorted(self.known[c]))}" for c in self.conditions if self.known.get(c)
        ]
        words += [f"?={'+'.join(useless)}"] * bool(useless)
        return " ".join(word.replace(" ", "_") for word in words) or "?"

    def review(self, steps: Sequence[tuple[str, str]], feedback: str) -> None:
        """Learn from a task played by someone else (after `start`): its (observation, action)
        pairs and the feedback, as if it had chosen those actions."""
        for observation, action in steps:
            self._observe(observation)
            parsed = None if too_long(action) else parse_action(action)
            self.last = parsed[1] if parsed and parsed[0] == "ask" else None
        self._record(feedback)
