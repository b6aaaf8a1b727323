"""Every environment against hostile model text (issue 16): huge and malformed numbers, megabyte
strings, NUL and unicode, nested brackets, repeated and unclosed tags, each environment's own
commands followed by junk. No step raises, none takes long, every reward stays in range."""

from __future__ import annotations

import math
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cod_fast.envs import ENVIRONMENTS, make_env
from cod_fast.envs.base import MAX_ACTION_CHARS, Task

# Generous for a shared 2-core machine: a linear parser reads a megabyte in milliseconds, and the
# quadratic patterns this replaces took 7 to 11 s on 16K digits or 128K characters of tags.
STEP_SECONDS = 0.5
# Rewards are in [0, 1] or another bounded scale (docs/concepts.md section 1); optimal control's
# unparsable answer is -0.1.
REWARD_RANGE = (-1.0, 1.0)

NUMBERS = [
    "1e308",
    "1e309",
    "-1e309",
    "inf",
    "-inf",
    "nan",
    "1" + "0" * 5000,  # past Python's int <-> str digit limit (4300)
    "9" * 16_000,
    "0." + "0" * 20_000 + "1",
    "1e-999999",
    "1e+99999999999999999999",
    "-" * 1000 + "1",
]
HOSTILE = [
    "",
    " ",
    "\x00" * 1000,
    "a" * 1_000_000,
    "a" * (MAX_ACTION_CHARS + 1),
    "\u202e" + "evil" * 100,  # right-to-left override
    "e\u0301" * 5000,  # combining accents
    "\U0001f600" * 5000,
    "(" * 20_000 + ")" * 20_000,
    "[" * 50_000,
    "<answer>" * 50_000,
    "<law>" * 50_000,
    "<answer>" + "x" * 100_000,
    "<answer></answer>" * 20_000,
    "< answer >" * 20_000 + "</ answer >",
    "<answer>" + "<answer>" * 1000 + "1</answer>",
    "\n" * 100_000,
    "right " + "9" * 16_000,
    *NUMBERS,
]
# Each environment's own commands (a valid-looking head), to reach the parsers behind them.
COMMANDS = [
    "direction {x}",
    "Direction 1 {x}",
    "up {x}",
    "right {x}",
    "sample {x} 3",
    "sample 0.1 {x}",
    "regress {x}",
    "summary {x}",
    "answer {x}",
    "<answer>{x}</answer>",
    "<answer>cd {x}</answer>",
    "<answer>ls {x}</answer>",
    "<answer>u + {x}*u^2</answer>",
    "<law>a = {x}, b = {x}</law>",
    "<law>{x}</law>",
    "{x} + {x}",
    "combine {x} + {x}",
]


def _corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    junk = [*NUMBERS, "(" * 5000, "<answer>" * 2000, "\x00", "\U0001f600" * 100, "x" * 20_000]
    return HOSTILE + [cmd.format(x=rng.choice(junk)) for cmd in COMMANDS for _ in range(2)]


def _check_step(task: Task, action: str) -> bool:
    """One step: no exception, bounded time, reward in range; whether the episode goes on."""
    started = time.perf_counter()
    outcome = task.step(action)
    elapsed = time.perf_counter() - started
    assert elapsed < STEP_SECONDS, f"{elapsed:.2f} s on {action[:60]!r} ({len(action)} chars)"
    reward = task.reward
    assert math.isfinite(reward) and REWARD_RANGE[0] <= reward <= REWARD_RANGE[1], reward
    assert isinstance(outcome.observation, str)
    return not outcome.done


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_hostile_corpus(name):
    """Each hostile action, as the first action of a fresh task and again after a harmless one:
    the environment answers it (as a malformed action where it is one) within STEP_SECONDS,
    with a finite reward in range, and its feedback is text."""
    env = make_env(name, "train", "full")
    for i, action in enumerate(_corpus()):
        task = env.task(pack_seed=1000 + i, task_index=i % 4)
        task.prompt()
        task.reset()
        if _check_step(task, action):
            _check_step(task, action[: len(action) // 2])
        assert isinstance(task.feedback(), str)


_TEXT = st.text(
    alphabet=st.sampled_from(list("0123456789.eE+-,=()<>/ \n\x00abcdlrwuxyz^*\u202e")),
    max_size=400,
)
_ACTIONS = st.one_of(
    _TEXT,
    st.builds(lambda c, x: c.format(x=x), st.sampled_from(COMMANDS), _TEXT),
    st.builds(
        lambda tag, n: tag * n,
        st.sampled_from(["<answer>", "<law>", "(", "9"]),
        st.integers(0, 4000),
    ),
)


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(_ACTIONS, min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_random_actions(name, actions, seed):
    """Random episodes of generated text: every step answers in time with a reward in range."""
    task = make_env(name, "train", "tiny").task(pack_seed=seed, task_index=seed % 4)
    task.reset()
    for action in actions:
        if not _check_step(task, action):
            break
    assert isinstance(task.feedback(), str)


@pytest.mark.parametrize(
    "name, action",
    [
        ("pde", "sample 1e308 3"),  # OverflowError before
        ("pde", "sample 1e309 3"),
        ("pde", "sample 0.1 1" + "0" * 5000),  # ValueError past the int digit limit before
        ("pde", "right " + "9" * 16_000),  # 6.9 s with a 1 s timeout before
        ("alchemy", "<answer>" * 50_000),
        ("optimal_control", "<law>" * 50_000),  # 11 s before
        ("terminal", "<answer>" * 50_000),
    ],
    ids=["pde-1e308", "pde-1e309", "pde-huge-count", "pde-digits", "alchemy", "oc", "terminal"],
)
def test_reported_defects_are_invalid_actions(name, action):
    """The actions the probe found: each is answered in time as an invalid action that ends the
    task with the environment's own reward, not an exception."""
    task = make_env(name, "train", "full").task(pack_seed=3, task_index=0)
    task.reset()
    started = time.perf_counter()
    outcome = task.step(action)
    assert time.perf_counter() - started < STEP_SECONDS
    assert outcome.done and not outcome.valid
    assert REWARD_RANGE[0] <= task.reward <= REWARD_RANGE[1]
