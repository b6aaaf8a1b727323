"""Learn2Ask (cod_fast/envs/learn2ask.py): determinism, the pack-wide hidden profiles, the
train/eval/tiny knobs, the reward formula, malformed actions, the scripted agents and the CoD
gain, the hint hooks, the judge hooks, and user cases from a JSONL file."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

import cod_fast.envs.cases
from cod_fast.data.diagnostics import hint_check
from cod_fast.envs.base import MAX_ACTION_CHARS, Agent, play_pack, play_task
from cod_fast.envs.cases import CasesError, load_cases
from cod_fast.envs.check import check_fuzz
from cod_fast.envs.judge import RuleJudge, Verdict
from cod_fast.envs.learn2ask import SHAPES, Learn2AskEnv, Learn2AskExplorer, parse_action
from tests.data.test_diagnostics import _explorer_transcripts
from tests.special_files import DEV_ZERO, lonely_fifo

COMBOS = [(size, setting) for size in ("tiny", "full") for setting in ("train", "eval")]
CASES = Path(__file__).parents[1] / "fixtures" / "learn2ask_cases.jsonl"
K = 4


class RandomAgent(Agent):
    """A random legal action each turn: ask a listed finding or name a candidate."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def start(self, task, hints):
        self.actions = [f"ask {f}" for f in task.findings]
        self.actions += [f"answer {c}" for c in task.candidates]

    def act(self, observation: str) -> str:
        return self.rng.choice(self.actions)


def _script(task) -> list[str]:
    """Every listed finding but the last, then the first candidate."""
    return [f"ask {f}" for f in task.findings[: task.max_steps - 1]] + [
        f"answer {task.candidates[0]}"
    ]


def _run_script(env: Learn2AskEnv, pack_seed: int, task_index: int) -> list[object]:
    task = env.task(pack_seed, task_index)
    trace: list[object] = [task.prompt(), task.reset()]
    for action in _script(task):
        outcome = task.step(action)
        trace += [outcome.observation, outcome.done, task.reward]
        if outcome.done:
            break
    return [*trace, task.feedback()]


def _packs(env, agent_of, packs: range, use_hints: bool = True) -> list[list[float]]:
    return [play_pack(env, agent_of(env), s, K, use_hints=use_hints).rewards for s in packs]


def _gain(rewards: list[list[float]]) -> tuple[float, float]:
    """Mean of (position 3 - position 0) over packs, and its standard error."""
    diffs = [r[-1] - r[0] for r in rewards]
    return statistics.mean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5


# --- determinism, the hidden rule, the knobs ------------------------------------------------------


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_same_seeds_give_same_episode(size, setting):
    """Determinism: fresh environments with the same (pack_seed, task_index) give the same
    prompt, replies, rewards and feedback for a fixed script; other seeds give other episodes
    (the tiny size has few distinct ones, so most rather than all of 20 differ)."""
    traces = [_run_script(Learn2AskEnv(setting, size), 11, 1) for _ in range(2)]
    assert traces[0] == traces[1]
    others = {repr(_run_script(Learn2AskEnv(setting, size), seed, 1)) for seed in range(20)}
    assert len(others) >= (10 if size == "tiny" else 20)


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_profiles_shared_within_pack_and_differ_across_packs(size, setting):
    """The hidden profiles depend on pack_seed alone: every task of a pack has the same
    conditions, findings and profiles; the profiles are pairwise distinct and of the shape's
    size; the patient's facts are the case's profile; packs differ."""
    env = Learn2AskEnv(setting, size)
    shape = SHAPES[(size, setting)]
    rules = set()
    for pack_seed in range(30):
        tasks = [env.task(pack_seed, k) for k in range(K)]
        first = tasks[0]
        for task in tasks:
            assert (task.candidates, task.findings) == (first.candidates, first.findings)
            assert task.profiles == first.profiles
            assert {f for f, r in task.facts.items() if r == "yes"} == task.profiles[task.answer]
        shows = list(first.profiles.values())
        assert len(set(shows)) == len(shows)
        assert all(shape.shows[0] <= len(s) <= shape.shows[1] for s in shows)
        assert len(set().union(*shows)) <= shape.defined
        rules.add(repr(sorted(first.profiles.items())))
        assert len({t.answer for t in [env.task(pack_seed, k) for k in range(12)]}) > 1
    assert len(rules) >= (20 if size == "tiny" else 30)


def test_train_eval_and_tiny_knobs():
    """The specified sizes, (conditions, listed findings, defined findings, findings shown,
    turns, cost): full train 4-5 conditions, 8 findings, eval 5-6 and 9, profiles of 2-3; tiny
    3 (eval 4) letters, 5 (eval 6) digits, one finding each. The drawn tasks follow them, and
    reward_range spans the lowest floor (-cost x max_steps) to 1."""
    specified = {
        ("full", "train"): ((4, 5), 8, 5, (2, 3), 9, 0.05),
        ("full", "eval"): ((5, 6), 9, 6, (2, 3), 10, 0.05),
        ("tiny", "train"): ((3, 3), 5, 3, (1, 1), 4, 0.1),
        ("tiny", "eval"): ((4, 4), 6, 4, (1, 1), 5, 0.08),
    }
    for key, knobs in specified.items():
        shape = SHAPES[key]
        assert knobs == (
            shape.conditions, shape.findings, shape.defined, shape.shows, shape.max_steps, shape.cost
        )  # fmt: skip
        env = Learn2AskEnv(key[1], key[0])
        for pack_seed in range(20):
            task = env.task(pack_seed, pack_seed % K)
            assert shape.conditions[0] <= len(task.candidates) <= shape.conditions[1]
            assert len(task.findings) == shape.findings and task.max_steps == shape.max_steps
            assert task.answer in task.candidates
    assert Learn2AskEnv.reward_range == (-0.5, 1.0)
    assert Learn2AskEnv.reward_range[0] == min(-s.cost * s.max_steps for s in SHAPES.values())


@pytest.mark.parametrize("setting", ["train", "eval"])
def test_tiny_text_is_compact(setting):
    """Tiny prompts are two short lines with the action format and an example; observations are
    one word (`yes`, `no`, `not sure`); the feedback is one short line naming the true
    condition."""
    env = Learn2AskEnv(setting, "tiny")
    for pack_seed in range(10):
        task = env.task(pack_seed, 0)
        assert len(task.prompt()) < 80 and "e.g. ask 3" in task.prompt()
        assert task.reset() == f"turns {task.max_steps}"
        replies = {task.step(f"ask {f}").observation for f in task.findings[:3]}
        assert replies <= {"yes", "no", "not sure"}
        assert task.step(f"answer {task.candidates[0]}").observation in ("right", "wrong")
        feedback = task.feedback()
        assert feedback.endswith(f"it was {task.answer}") and len(feedback) < 20


# --- rewards and actions ---------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_reward_is_score_minus_question_cost(size, setting):
    """Reward = 1 for the right condition (else 0) minus cost x questions, repeated questions
    paying again; the patient answers the case's facts, `not sure` for anything else; running
    out of turns scores as wrong, -cost x max_steps; success means the right answer."""
    env = Learn2AskEnv(setting, size)
    cost = SHAPES[(size, setting)].cost
    rng = random.Random(0)
    for pack_seed in range(30):
        task = env.task(pack_seed, 0)
        task.reset()
        asks = [rng.choice([*task.findings, "xyz"]) for _ in range(rng.randrange(task.max_steps))]
        for finding in asks:
            outcome = task.step(f"ask {finding}")
            assert outcome.observation.lower().startswith(task.facts.get(finding, "not sure"))
            assert outcome.valid and not outcome.done
        named = rng.choice(task.candidates)
        assert task.step(f"answer {named}").done
        right = named == task.answer
        assert task.reward == pytest.approx(right - cost * len(asks)) and task.success is right
        assert task.step("ask 1").done and task.reward == pytest.approx(right - cost * len(asks))
        task.reset()
        for _ in range(task.max_steps):
            outcome = task.step(f"ask {task.findings[0]}")
        assert outcome.done and outcome.valid and task.success is False
        assert task.reward == pytest.approx(-cost * task.max_steps)


@pytest.mark.parametrize("size", ["tiny", "full"])
@pytest.mark.parametrize(
    "junk",
    [
        "",
        "ask",
        "answer",
        "answer nobody",
        "diagnose flu",
        "ask " + "x" * 41,
        "askfever",
        "3",
        "__import__('os').system('ls')",
        "a" * (MAX_ACTION_CHARS + 1),
    ],
)
def test_malformed_action_ends_episode(size, junk):
    """A malformed action (an unknown command, an answer naming no candidate, an over-long
    finding or action) ends the episode, valid=False, with the floor reward -cost x max_steps,
    and the observation and feedback state the expected format with an example."""
    task = Learn2AskEnv("train", size).task(6, 0)
    task.reset()
    outcome = task.step(junk)
    shape = SHAPES[(size, "train")]
    assert outcome.done and not outcome.valid and task.success is False
    assert task.reward == pytest.approx(-shape.cost * shape.max_steps)
    example = "e.g. ask 3" if size == "tiny" else f"e.g. `ask {task.findings[0]}`"
    assert example in outcome.observation and example in task.feedback()
    assert task.feedback().endswith(task.answer)


@pytest.mark.parametrize(
    "variant",
    ["  ask   fever ", "ASK Fever", "`ask fever`", "Ask fever.", "`ask fever.`", "'ask fever'"],
)
def test_lenient_parse_of_whitespace_case_and_quotes(variant):
    """Whitespace, case, backticks or quotes and a trailing period are forgiven: the variant
    acts exactly like `ask fever` (on a pack that defines fever)."""
    assert parse_action(variant) == ("ask", "fever")
    env = Learn2AskEnv("train", "full")
    seed = next(s for s in range(100) if "fever" in env.task(s, 0).facts)
    a, b = env.task(seed, 0), env.task(seed, 0)
    assert a.step(variant) == b.step("ask fever")
    assert a.step("  ANSWER  " + a.answer.upper() + ". ") == b.step(f"answer {b.answer}")
    assert a.reward == b.reward and a.success


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_hostile_text_is_answered_in_time(size):
    """The shared fuzz check (cod_fast.envs.check.check_fuzz): every hostile action is answered
    within its time limit, as a malformed action where it is one, with a reward in range."""
    check_fuzz(Learn2AskEnv("train", size))


# --- scripted agents and the CoD effect ------------------------------------------------------------


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_solver_is_always_right_with_few_questions(size, setting):
    """The solver (reads the profiles) names the right condition on every task of 64 packs, with
    mean reward >= 0.8 (measured 0.815-0.889: 1 - cost x its 1.7-2.5 questions)."""
    env = Learn2AskEnv(setting, size)
    results = [play_pack(env, env.solver(), pack_seed, K) for pack_seed in range(64)]
    assert all(all(r.successes) for r in results)
    assert statistics.mean(x for r in results for x in r.rewards) >= 0.8


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_explorer_gains_along_the_pack(size, setting):
    """The CoD effect on 40 packs: the explorer's mean reward at position 3 exceeds position 0
    by >= 0.3 (measured 0.49-0.55 on these packs, standard error about 0.1)."""
    env = Learn2AskEnv(setting, size)
    gain, _ = _gain(_packs(env, Learn2AskEnv.explorer, range(40)))
    assert gain >= 0.3, gain


@pytest.mark.slow
@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_explorer_gains_with_hints_and_not_without(size, setting):
    """Over 256 packs: with hints the explorer's position 3 exceeds position 0 by >= 0.4, with a
    standard error under a third of the gain (measured train / eval: tiny 0.61 / 0.54, full
    0.65 / 0.61, each +- 0.04); without hints the difference stays within 0.12 (measured -0.04
    to -0.00, standard errors 0.03-0.05); the solver (0.82-0.89) stays 0.1 above the explorer's
    last position (0.41-0.70)."""
    env = Learn2AskEnv(setting, size)
    packs = range(256)
    gain, error = _gain(_packs(env, Learn2AskEnv.explorer, packs))
    assert gain >= 0.4 and error < gain / 3, (gain, error)
    flat, _ = _gain(_packs(env, Learn2AskEnv.explorer, packs, use_hints=False))
    assert abs(flat) <= 0.12, flat
    last = statistics.mean(r[-1] for r in _packs(env, Learn2AskEnv.explorer, packs))
    solver = statistics.mean(x for r in _packs(env, Learn2AskEnv.solver, packs) for x in r)
    assert solver > last + 0.1, (solver, last)


def test_without_hints_every_task_is_played_as_the_first():
    """With use_hints=False the explorer carries nothing between tasks: its reward on each
    position equals a fresh explorer's reward on that task alone."""
    for size in ("tiny", "full"):
        env = Learn2AskEnv("train", size)
        for pack_seed in range(20):
            result = play_pack(env, env.explorer(), pack_seed, K, use_hints=False)
            alone = [play_task(env.task(pack_seed, k), env.explorer(), None) for k in range(K)]
            assert result.rewards == alone


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_random_play_scores_near_the_floor(size, setting):
    """A random legal action each turn scores about what guessing gives less the questions'
    cost: mean <= 0.2 over 256 packs (measured 0.11-0.13), far below the solver (>= 0.8)."""
    env = Learn2AskEnv(setting, size)
    rewards = [x for s in range(256) for x in play_pack(env, RandomAgent(s), s, K).rewards]
    assert statistics.mean(rewards) <= 0.2


# --- hints ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_explorer_hints_state_only_true_profiles(size, setting):
    """Every profile the explorer's hints state is the true one (hint_check: nothing wrong),
    knowledge only grows along a pack, and the tiny hints stay short (at most 16 characters,
    each digit its own BPE token)."""
    env = Learn2AskEnv(setting, size)
    stated = 0
    for pack_seed in range(40):
        truth = env.hint_truth(pack_seed)
        result = play_pack(env, env.explorer(), pack_seed, K)
        before: dict[str, str] = {}
        for hints in result.hints:
            entries = env.hint_entries(hints)
            assert hint_check(truth, entries, {})["wrong"] == 0, (pack_seed, hints)
            assert before.items() <= entries.items()
            before = entries
            assert size == "full" or len(hints) <= 16
        stated += len(before)
    assert stated >= 40


def test_hint_entries_read_the_explorer_format_and_render_back():
    """Entries are read in any case, `a?`, `a=?`-like text and the not-sure lists state none, the
    later of two entries counts, a megabyte of text is read, and render_hints writes text that
    reads back to its entries."""
    tiny, full = Learn2AskEnv("train", "tiny"), Learn2AskEnv("train", "full")
    assert tiny.hint_entries(None) == {} and full.hint_entries("") == {}
    assert tiny.hint_entries("A3 b? c1 ?24 c5") == {"a": "3", "c": "5"}
    assert full.hint_entries("FLU=fever+cough cold=? ?=rash x=") == {"flu": "cough+fever"}
    assert full.hint_entries("=+" * 500_000) == {} and tiny.hint_entries("a3" * 500_000) == {}
    assert tiny.render_hints({"b": "2"}) == "a? b2 c?" and full.render_hints({}) == "?"
    for env in (tiny, full):
        for pack_seed in range(20):
            truth = env.hint_truth(pack_seed)
            assert env.hint_entries(env.render_hints(truth)) == truth
            part = dict(list(truth.items())[::2])
            assert env.hint_entries(env.render_hints(part)) == part


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_knowable_entries_follow_the_explorer(size, setting):
    """Folded over the explorer's own episodes, knowable_entries states only true profiles and
    never more than the explorer's hints; at tiny size (no not-sure list needed to complete a
    profile) exactly what they state."""
    env = Learn2AskEnv(setting, size)
    for pack_seed in range(24):
        truth, knowable = env.hint_truth(pack_seed), {}
        played, written = _explorer_transcripts(env, pack_seed, K)
        for (task, steps, feedback), hints in zip(played, written, strict=True):
            knowable = env.knowable_entries(knowable, task, steps, feedback)
            stated = env.hint_entries(hints)
            assert (
                knowable.items() <= stated.items() and hint_check(truth, knowable, {})["wrong"] == 0
            )
            if size == "tiny":
                assert knowable == stated


# --- judge hooks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_judge_query_and_rule_judge_give_the_reward(size, setting):
    """judge_query is None before the episode ends; after it, the query holds the rubric, the
    true condition in the reference, every question in the transcript and the condition named
    as the answer, and judged_reward of the RuleJudge's verdict is the reward (on solver,
    explorer, random and malformed episodes)."""
    env = Learn2AskEnv(setting, size)
    judge, checked = RuleJudge(), 0
    for pack_seed in range(40):
        for agent in (env.solver(), env.explorer(), RandomAgent(pack_seed)):
            task = env.task(pack_seed, pack_seed % K)
            agent.start(task, None)
            observation = task.reset()
            assert task.judge_query() is None
            while not task.done:
                observation = task.step(agent.act(observation)).observation
            query = task.judge_query()
            assert (
                query.rubric.startswith("Score 1")
                and f"condition: {task.answer}" in query.reference
            )
            assert query.answer == task.given and query.rule.score == float(task.success)
            assert all(f"{a} -> {r}" in query.transcript for a, r in task.log)
            assert task.judged_reward(judge.score(query)) == pytest.approx(task.reward)
            checked += 1
        task = env.task(pack_seed, 0)
        task.step("diagnose it")
        assert task.judged_reward(judge.score(task.judge_query())) == task.reward
    assert checked == 120


# --- user cases ----------------------------------------------------------------------------------


def test_cases_file_loads_and_plays():
    """The example file loads (names lower-cased, whitespace normalised); a pack's tasks come
    from one group, show the answer and its distractors, and the patient answers the case's
    facts (`not sure` otherwise); the solver answers right at once, the explorer plays to the
    end, and the same seeds give the same tasks."""
    cases = load_cases(CASES)
    assert len(cases) == 7 and {c.group for c in cases} == {"respiratory", "head"}
    migraine = next(c for c in cases if c.answer == "migraine")
    assert migraine.facts["headache"] == "yes" and "light sensitivity" in migraine.facts
    for size in ("tiny", "full"):
        env = Learn2AskEnv("train", size, cases=str(CASES))
        for pack_seed in range(12):
            tasks = [env.task(pack_seed, k) for k in range(K)]
            groups = {next(c.group for c in cases if c.answer == t.answer) for t in tasks}
            assert len(groups) == 1
            for task in tasks:
                case = next(c for c in cases if c.answer == task.answer)
                assert sorted(task.candidates) == sorted([case.answer, *case.distractors])
                for finding in [*task.findings, "Light  Sensitivity"]:
                    expected = case.facts.get(" ".join(finding.lower().split()), "not sure")
                    task.reset()
                    assert task.step(f"ask {finding}").observation.lower().startswith(expected)
            assert repr(env.task(pack_seed, 1).prompt()) == repr(tasks[1].prompt())
            solved = play_pack(env, env.solver(), pack_seed, K)
            assert solved.rewards == [1.0] * K
            explored = play_pack(env, env.explorer(), pack_seed, K)
            assert all(r is not None for r in explored.successes)
        assert env.hint_truth(0) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"facts": {"fever": "yes"}, "answer": "flu"', "not JSON"),
        ('["flu"]', "not a JSON object"),
        ('{"facts": {"fever": "yes"}, "distractors": ["cold"]}', "missing field 'answer'"),
        (
            '{"facts": {"fever": "maybe"}, "answer": "flu", "distractors": ["cold"]}',
            "field 'facts'",
        ),
        ('{"facts": ["fever"], "answer": "flu", "distractors": ["cold"]}', "field 'facts'"),
        (
            '{"facts": {"fever": "yes"}, "answer": "flu", "distractors": []}',
            "field 'distractors' lists no",
        ),
        ('{"facts": {"a": "no"}, "answer": "flu", "distractors": ["Flu"]}', "repeats the answer"),
        ('{"facts": {"a": "no"}, "answer": "f=u", "distractors": ["cold"]}', "field 'answer'"),
        ('{"facts": {"a": "no"}, "answer": "flu", "distractors": ["c"], "group": 3}', "'group'"),
        ("", "no cases"),
    ],
)
def test_bad_cases_file_is_one_line_naming_the_place_and_fix(tmp_path, text, message):
    """Each bad cases file raises CasesError (a ValueError) in one line that names the file,
    the line, the field and the fix."""
    good = '{"facts": {"fever": "yes"}, "answer": "flu", "distractors": ["cold"]}'
    path = tmp_path / "cases.jsonl"
    path.write_text(f"{good}\n\n{text}\n" if text else "\n\n", encoding="utf-8")
    with pytest.raises(CasesError) as error:
        Learn2AskEnv("train", "full", cases=str(path))
    line = str(error.value)
    assert isinstance(error.value, ValueError) and "\n" not in line
    assert message in line and (f"{path}:3: " in line or f"{path}: no cases" in line)
    assert "; " in line  # the fix follows


def test_missing_cases_file_is_one_line(tmp_path):
    """A cases path that does not exist raises CasesError in one line naming it."""
    path = tmp_path / "absent.jsonl"
    with pytest.raises(CasesError, match=r"absent\.jsonl: cannot read it") as error:
        load_cases(path)
    assert "\n" not in str(error.value)


def test_a_cases_path_to_no_regular_file_is_refused_without_reading(tmp_path):
    """/dev/zero (endless) and a named pipe no one writes (opening it would block) are refused
    at once as what they are, in one line naming the path and the fix."""
    with lonely_fifo(tmp_path) as fifo:
        for path, kind in ((DEV_ZERO, "character device"), (fifo, "named pipe")):
            with pytest.raises(CasesError) as error:
                load_cases(path)
            line = str(error.value)
            assert line.startswith(f"{path}: ") and kind in line and "\n" not in line, line


@pytest.mark.parametrize(
    ("bound", "value", "said"),
    [
        ("MAX_CASES_BYTES", 200, "more than 200 bytes"),
        ("MAX_CASES", 2, "more than 2 cases"),
        ("MAX_LINE_CHARS", 100, "more than 100 characters"),
    ],
)
def test_a_cases_file_past_a_bound_is_one_line_naming_it(tmp_path, monkeypatch, bound, value, said):
    """A cases file larger than the cap, with more cases than the cap or with a line longer
    than the cap is refused in one line naming the file (and the line), the bound and the fix;
    a file within all three loads. (The bounds are lowered here: 64 MiB, 1,000,000 cases and
    65,536 characters a line in a run.)"""
    good = '{"facts": {"fever": "yes"}, "answer": "flu", "distractors": ["cold"]}'
    path = tmp_path / "cases.jsonl"
    path.write_text(f"{good}\n" * 2, encoding="utf-8")
    assert len(load_cases(path)) == 2
    long = '{"facts": {"f": "no"},' + " " * 50 + '"answer": "a", "distractors": ["b"]}'
    path.write_text(f"{good}\n" * 3 + f"{long}\n", encoding="utf-8")
    monkeypatch.setattr(cod_fast.envs.cases, bound, value)
    with pytest.raises(CasesError) as error:
        load_cases(path)
    line = str(error.value)
    assert line.startswith(f"{path}") and said in line and "; " in line and "\n" not in line, line


def test_a_huge_name_is_echoed_clipped(tmp_path):
    """A name that is not one (here 60,000 characters) is named in the error in a few hundred
    characters, not echoed whole."""
    path = tmp_path / "cases.jsonl"
    case = {"facts": {"fever": "yes"}, "answer": "x" * 60_000, "distractors": ["cold"]}
    path.write_text(json.dumps(case) + "\n", encoding="utf-8")
    with pytest.raises(CasesError, match="field 'answer'") as error:
        load_cases(path)
    assert len(str(error.value)) < 500


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_explorer_reads_wrong_hints_without_harm(size):
    """Wrong hints (the pack's profiles given to the wrong conditions, another pack's, a finding
    wrongly marked not sure) are read without error: the explorer still ends with a valid
    answer, and the profile it then states for the true condition agrees with every reply the
    patient gave."""
    env = Learn2AskEnv("train", size)
    for pack_seed in range(40):
        task = env.task(pack_seed, 0)
        truth = env.hint_truth(pack_seed)
        values = list(truth.values())
        rotated = dict(zip(truth, values[1:] + values[:1], strict=True))
        other = env.hint_truth(pack_seed + 1000)
        noise = f"?{task.findings[0]}" if size == "tiny" else f"?={task.findings[0]}"
        hints = f"{env.render_hints(other)} {env.render_hints(rotated)} {noise}"
        explorer = Learn2AskExplorer()
        play_task(task, explorer, hints)
        assert task.done and task.outcome in ("right", "wrong")
        stated = env.hint_entries(explorer.write_hints(task, hints)).get(task.answer)
        if stated is not None:
            shown = set(stated.split("+"))
            for action, reply in task.log[:-1]:
                assert reply == "not sure" or (action[4:] in shown) == (reply == "yes")


@pytest.mark.slow
def test_a_run_refuses_a_bad_cases_file_before_starting(tmp_path):
    """`cod-fast train` on learn2ask with `rollout.env_options={cases: FILE}` and a missing
    file stops before writing anything, in one line naming the key and the file (a run on
    a good file: tests/rollout/test_judged_rollouts.py)."""
    from typer.testing import CliRunner

    from cod_fast.cli.app import app

    run, cases = tmp_path / "bad", tmp_path / "missing.jsonl"
    args = ["train", "--preset", "tiny-cpu", "--set", f"runtime.run_dir={run}"]
    args += ["--set", "rollout.env=learn2ask", "--set", f"rollout.env_options={{cases: {cases}}}"]
    bad = CliRunner().invoke(app, args)
    assert bad.exit_code == 2, bad.output
    line = bad.output.strip()
    assert "\n" not in line and line.startswith("error: rollout.env_options: environment learn2ask")
    assert "missing.jsonl" in line
    assert not run.exists() or [p.name for p in run.iterdir()] == [".lock"]


def test_envs_commands_take_the_cases_as_an_option():
    """`cod-fast envs solve learn2ask --option cases=FILE` plays the user's cases (the solver,
    which reads each case's answer, scores 1 on every task); an option the environment does
    not take, or one without `=`, is one line and exit code 2."""
    from typer.testing import CliRunner

    from cod_fast.cli.app import app

    runner = CliRunner()
    solve = ["envs", "solve", "learn2ask", "--packs", "4", "--size", "tiny"]
    played = runner.invoke(app, [*solve, "--option", f"cases={CASES}"])
    assert played.exit_code == 0, played.output
    solver = next(line for line in played.output.splitlines() if "solver" in line)
    assert solver.count("1.000") == 4, played.output
    for bad, said in (
        ("colour=red", "takes no option 'colour'; it takes 'cases'"),
        ("x", "KEY=VALUE"),
    ):
        refused = runner.invoke(app, [*solve, "--option", bad])
        assert refused.exit_code == 2 and said in refused.output, refused.output
        assert len(refused.output.strip().splitlines()) == 1


def test_a_user_case_takes_a_free_text_answer_for_the_judge():
    """With user cases an answer outside the candidates is a valid, wrong answer by the rule
    (not a malformed action) that a judge may credit: its query carries the text, and a verdict
    of 1 gives 1 less the questions' cost; in a built-in pack the same answer is malformed."""
    env = Learn2AskEnv("train", "full", cases=str(CASES))
    task = env.task(3, 0)
    task.reset()
    task.step(f"ask {next(iter(task.facts))}")
    outcome = task.step("answer influenza a")
    assert outcome.done and outcome.valid and task.success is False
    query = task.judge_query()
    assert query.answer == "influenza a" and query.rule.score == 0.0
    assert task.reward == pytest.approx(-task.shape.cost)
    assert task.judged_reward(RuleJudge().score(query)) == task.reward
    assert task.judged_reward(Verdict(1.0)) == pytest.approx(1 - task.shape.cost)
    built_in = Learn2AskEnv("train", "full").task(3, 0)
    built_in.reset()
    assert not built_in.step("answer influenza a").valid
