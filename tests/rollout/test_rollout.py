"""The interleaved rollout driver, hint parsing, the chat format and advantage assignment."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from cod_fast.algo.assign import assign_advantages
from cod_fast.config import AlgoConfig, RolloutConfig
from cod_fast.data.packing import pack_microbatches, rollout_sequences
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import (
    DriverSettings,
    RolloutDriver,
    _call_with_alarm,
    _EnvTimeout,
    _EnvWorker,
)
from cod_fast.rollout.hints import HINT_END, HINT_START, NO_HINT, context_line, parse_hints
from cod_fast.rollout.sampler import TextPolicySampler
from tests.rollout_helpers import CHATML, GuessEnv, char_tokenizer, guess_policy


def no_cut(text, max_tokens):
    return text, False


def test_hint_parsing_edge_cases():
    """Missing, empty and too-short blocks give the penalty; the last complete block wins;
    surrounding whitespace is stripped; a long block is truncated, not rejected."""
    kw = dict(min_chars=3, hint_penalty=0.1, max_tokens=100, truncate=no_cut)
    assert parse_hints("no block here", **kw).text is None
    assert parse_hints("no block here", **kw).reward == -0.1
    assert parse_hints(f"{HINT_START}\n  \n{HINT_END}", **kw).reward == -0.1
    assert parse_hints(f"{HINT_START}\nab\n{HINT_END}", **kw).text is None
    assert parse_hints(f"{HINT_START} only the start", **kw).text is None
    two = f"{HINT_START}\nold one\n{HINT_END}\nthen\n{HINT_START}\n  new one \n{HINT_END}"
    parsed = parse_hints(two, **kw)
    assert (parsed.text, parsed.reward) == ("new one", 0.0)
    chat = ChatFormat(char_tokenizer())
    cut = parse_hints(
        f"{HINT_START}\n{'x' * 50}\n{HINT_END}",
        min_chars=1,
        hint_penalty=0.1,
        max_tokens=10,
        truncate=chat.truncate,
    )
    assert cut.text == "x" * 10 and cut.truncated and cut.reward == 0.0
    assert context_line(None, first_task=True) == "Hints: null"
    assert context_line(None, first_task=False) == f"Hints: {NO_HINT}"


@pytest.mark.parametrize("template", [None, CHATML], ids=["plain", "chatml"])
def test_continuation_appends_to_sampled_ids(template):
    """A later turn's prompt is the earlier prompt + the sampled response + the continuation,
    and its text is what the chat template renders for the whole conversation."""
    tok = char_tokenizer(template)
    chat = ChatFormat(tok)
    first = chat.first_prompt("sys", "obs one")
    response = [*chat.encode("4"), tok.eos_token_id]
    second = first + response + chat.continuation(response, "higher")
    text = tok.decode(second, skip_special_tokens=False)
    if template:
        want = tok.apply_chat_template(
            [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "obs one"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "higher"},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert text == want
    else:
        assert text.endswith("Assistant: 4<eos>\nUser: higher\nAssistant: ")


def run_guess(
    mode="cod", group=3, packs=2, tasks=3, template=CHATML, max_tokens=200, env=None, timeout=None
):
    chat = ChatFormat(char_tokenizer(template))
    sampler = TextPolicySampler(guess_policy, chat)
    rollout = RolloutConfig(max_response_tokens=max_tokens, env_timeout_s=timeout)
    settings = DriverSettings(rollout=rollout, mode=mode)
    driver = RolloutDriver(env or GuessEnv(), sampler, chat, settings)
    specs = make_packs(pack_seeds("test", packs), tasks)
    return driver.run(specs, group), sampler


def test_driver_interleaves_episodes_and_hints_carry_the_rule():
    """K solve and K-1 update episodes per run in order; hints written after task 0 make every
    later task solved at once; one batched sampler call serves every live run."""
    rollouts, sampler = run_guess()
    assert len(rollouts) == 6
    for rollout in rollouts:
        kinds = [(e.kind, e.task_index) for e in rollout.episodes]
        assert kinds == [("solve", 0), ("update", 0), ("solve", 1), ("update", 1), ("solve", 2)]
        assert rollout.task_rewards == [1.0, 1.0, 1.0]
        assert rollout.hint_rewards == [0.0, 0.0]
        later = [e for e in rollout.episodes if e.kind == "solve" and e.task_index > 0]
        assert all(len(e.turns) == 1 for e in later)  # the hint gave the answer
        assert "Hints: secret=" in ChatFormat(char_tokenizer(CHATML)).decode(
            later[0].turns[0].prompt_ids
        )
    turns = sum(len(e.turns) for r in rollouts for e in r.episodes)
    assert sampler.calls < turns  # batched: many turns per call


def test_task_by_task_mode_has_no_update_episodes():
    """task_by_task: K solve episodes, every one starting from `Hints: null`."""
    rollouts, _ = run_guess(mode="task_by_task")
    chat = ChatFormat(char_tokenizer(CHATML))
    for rollout in rollouts:
        assert [e.kind for e in rollout.episodes] == ["solve"] * 3
        for episode in rollout.episodes:
            assert "Hints: null" in chat.decode(episode.turns[0].prompt_ids)


def test_records_round_trip_through_advantages_and_packer():
    """Driver records -> CoD advantages -> packer: every segment's tokens and log-probs are the
    sampled ones, multi-turn solve episodes become one merged sequence each, budgets hold."""
    rollouts, _ = run_guess(group=4)
    tau = assign_advantages(rollouts, AlgoConfig(red_weight=True))
    assert tau is None or 0.8 <= tau <= 100
    episodes = [e for r in rollouts for e in r.episodes]
    assert all(e.advantage is not None for e in episodes)
    sequences = rollout_sequences(episodes, merge_prefix=True)
    assert len(sequences) == len(episodes)  # every turn appended: one sequence per episode
    batches = pack_microbatches(sequences, token_budget=4096, world_size=2)
    mbs = [mb for rank in batches for mb in rank]
    turns = {(*e.key, j): t for e in episodes for j, t in enumerate(e.turns)}
    for mb in mbs:
        for i, key in enumerate(mb.segment_keys):
            rows = mb.segment_ids == i
            assert mb.targets[rows].tolist() == turns[key].response_ids
            assert mb.rollout_logp[rows].tolist() == turns[key].response_logprobs


def test_environment_error_and_cut_responses_stay_in_their_episode():
    """An environment that raises ends only its own solve episodes (error recorded, reward 0);
    a response cut at the length limit is recorded as `length` and the other runs go on."""
    seeds = pack_seeds("test", 2)
    rollouts, _ = run_guess(env=GuessEnv(failing_pack_seed=seeds[0]), group=2)
    failing = [r for r in rollouts if r.pack_id == 0]
    healthy = [r for r in rollouts if r.pack_id == 1]
    for rollout in failing:
        solves = [e for e in rollout.episodes if e.kind == "solve"]
        assert all("simulated environment failure" in e.info["error"] for e in solves)
        assert rollout.task_rewards == [0.0, 0.0, 0.0]
    assert all(r.task_rewards == [1.0, 1.0, 1.0] for r in healthy)

    cut, _ = run_guess(max_tokens=1, group=2, packs=1)
    for rollout in cut:
        updates = [e for e in rollout.episodes if e.kind == "update"]
        assert all(e.turns[0].finish_reason == "length" for e in updates)
        assert all(e.reward == -0.1 for e in updates)  # a cut update has no hint block
        assert all(e.info["cut"] for e in updates)


def test_length_penalty_from_config():
    """rollout.length_penalty is subtracted from an episode whose response was cut; the driver
    settings come from the rollout config."""
    from cod_fast.config.io import load_config

    cfg = load_config(
        "tiny-cpu",
        overrides=[
            "rollout.max_response_tokens=1",
            "rollout.length_penalty=0.5",
            "rollout.env_timeout_s=null",
        ],
    )
    settings = DriverSettings.from_config(cfg)
    assert settings.rollout.max_response_tokens == 1 and settings.rollout.env_timeout_s is None
    chat = ChatFormat(char_tokenizer(CHATML))
    driver = RolloutDriver(GuessEnv(), TextPolicySampler(guess_policy, chat), chat, settings)
    (rollout,) = driver.run(make_packs(pack_seeds("test", 1), 2), 1)
    update = next(e for e in rollout.episodes if e.kind == "update")
    assert update.reward == -0.1 - 0.5


def test_task_by_task_advantages_assigned_per_task():
    """task_by_task: advantages are per-task GRPO; all-equal rewards give zero advantages."""
    rollouts, _ = run_guess(mode="task_by_task")
    assign_advantages(rollouts, AlgoConfig(algorithm="task_by_task", red_weight=False))
    assert all(e.advantage == 0.0 for r in rollouts for e in r.episodes)


@pytest.mark.parametrize(
    ("algorithm", "setting", "runs"),
    [("cod", None, True), ("task_by_task", None, False), ("task_by_task", True, True)],
)
def test_red_weight_runs_by_default_for_cod_only(monkeypatch, algorithm, setting, runs):
    """RED-weight left unset runs for CoD and not for the task-by-task baseline (plain GRPO,
    docs/concepts.md 3); asked for explicitly, it runs for task-by-task too."""
    import cod_fast.algo.assign as assign

    calls = []
    monkeypatch.setattr(assign, "red_weight", lambda a, n: calls.append(1) or (a, None))
    mode = "task_by_task" if algorithm == "task_by_task" else "cod"
    rollouts, _ = run_guess(mode=mode)
    assign_advantages(rollouts, AlgoConfig(algorithm=algorithm, red_weight=setting))
    assert bool(calls) == runs


@pytest.mark.slow
def test_hanging_environment_times_out_alone():
    """An environment call that never returns is abandoned after env_timeout_s: its episodes
    record a TimeoutError with reward 0, and the other packs finish normally. The healthy calls
    take microseconds, so a 1 s timeout cannot cut one short on a loaded machine (0.05 s could)."""
    seeds = pack_seeds("test", 2)
    rollouts, _ = run_guess(
        env=GuessEnv(failing_pack_seed=seeds[0], failure="hang"), group=1, tasks=2, timeout=1.0
    )
    hung, healthy = rollouts
    assert all("TimeoutError" in e.info["error"] for e in hung.episodes if e.kind == "solve")
    assert hung.task_rewards == [0.0, 0.0] and healthy.task_rewards == [1.0, 1.0]


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["regex", "swallow"])
def test_timeout_stops_the_call_itself(failure):
    """On the main thread the timeout ends the environment call itself: a catastrophic regular
    expression (which holds the GIL, so no other thread could even time it) and a step that
    catches every Exception both end within the timeout plus slack, their episodes score as
    TimeoutError, and no thread is left running them."""
    seeds = pack_seeds("test", 2)
    before = threading.active_count()
    started = time.monotonic()
    rollouts, _ = run_guess(
        env=GuessEnv(failing_pack_seed=seeds[0], failure=failure), group=1, tasks=2, timeout=1.0
    )
    assert time.monotonic() - started < 2 * 1.0 + 3.0  # two timed-out tasks, plus slack
    stuck, healthy = rollouts
    assert all("TimeoutError" in e.info["error"] for e in stuck.episodes if e.kind == "solve")
    assert healthy.task_rewards == [1.0, 1.0]
    assert threading.active_count() == before


def test_alarm_restores_the_previous_handler_and_timer():
    """A timed call puts back the SIGALRM handler it found and re-arms a timer that was set."""
    fired = []

    def handler(signum, frame):
        fired.append(signum)

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        assert _call_with_alarm(lambda: 42, 5.0) == 42
        assert signal.getsignal(signal.SIGALRM) is handler
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.3
        deadline = time.monotonic() + 3.0
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fired == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_env_worker_reuses_one_thread_and_replaces_a_stuck_one():
    """Calls run on one reused thread and return their value or raise their own exception; a
    call past its timeout raises _EnvTimeout and the next call runs on a fresh thread."""
    worker, release = _EnvWorker(), threading.Event()
    idents = {worker.call(threading.get_ident, 1.0) for _ in range(5)}
    assert len(idents) == 1 and threading.get_ident() not in idents
    with pytest.raises(KeyError, match="boom"):
        worker.call(lambda: {}["boom"], 1.0)
    with pytest.raises(_EnvTimeout):
        worker.call(release.wait, 0.05)
    assert worker.call(threading.get_ident, 1.0) not in idents
    assert worker.call(lambda: 41 + 1, 1.0) == 42
    before = threading.active_count()
    worker.close()
    release.set()  # the stuck call returns; its thread ends too
    assert _threads_settle_at(before - 2)


def test_driver_runs_leave_no_threads_behind():
    """Every `run` closes its environment worker: repeated rollouts do not pile up threads."""
    before = threading.active_count()
    for _ in range(3):
        run_guess(group=1, packs=1, tasks=2, timeout=5.0)
    assert _threads_settle_at(before)


def _threads_settle_at(count: int, wait_s: float = 2.0) -> bool:
    """Whether the live thread count reaches `count` within `wait_s` (ended threads take a
    moment to leave after their sentinel)."""
    deadline = time.monotonic() + wait_s
    while threading.active_count() != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count() == count


def test_non_finite_reward_is_an_environment_error():
    """An environment whose reward is NaN ends that episode as an environment error (reward
    error_reward, the cause in info) instead of failing the rollout; other packs go on."""
    seeds = pack_seeds("test", 2)
    rollouts, _ = run_guess(env=GuessEnv(failing_pack_seed=seeds[0], failure="nan"), group=1)
    bad, healthy = rollouts
    solves = [e for e in bad.episodes if e.kind == "solve"]
    assert all("non-finite reward nan" in e.info["error"] for e in solves)
    assert bad.task_rewards == [0.0, 0.0, 0.0] and healthy.task_rewards == [1.0, 1.0, 1.0]
