"""Every environment against hostile model text: huge and malformed numbers, megabyte strings,
NUL and unicode, nested brackets, repeated and unclosed tags, each environment's own commands
followed by junk. No step raises, none takes long, every reward stays in range. The corpus and
the step contract are `cod-fast envs check`'s (cod_fast.envs.check), so plugins meet the same."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cod_fast.envs import ENVIRONMENTS, make_env
from cod_fast.envs.check import COMMANDS, check_fuzz, check_step


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_hostile_corpus(name):
    """Each hostile action (cod_fast.envs.check.hostile_corpus), as the first action of a fresh
    task and again after a harmless one: the environment answers it (as a malformed action where
    it is one) within STEP_SECONDS, with a finite reward in its range, and its feedback is
    text."""
    check_fuzz(make_env(name, "train", "full"))


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
    env = make_env(name, "train", "tiny")
    task = env.task(pack_seed=seed, task_index=seed % 4)
    task.reset()
    for action in actions:
        if check_step(task, action, env.reward_range).done:
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
    env = make_env(name, "train", "full")
    task = env.task(pack_seed=3, task_index=0)
    task.reset()
    outcome = check_step(task, action, env.reward_range)  # in time, the reward in range
    assert outcome.done and not outcome.valid
