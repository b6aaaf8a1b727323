"""Hint-quality and credit diagnostics (cod_fast/data/diagnostics.py): FrozenLake's hint hooks, the
metrics on hand-built records, `eval --hints` with a tiny built-in model, and the new fields of
a training step's metrics and of its evaluations."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from cod_fast.algo.assign import assign_advantages
from cod_fast.cli.app import app
from cod_fast.config import AlgoConfig, ModelConfig, RolloutConfig
from cod_fast.data.diagnostics import HINT_COUNTS, credit_metrics, hint_check, hint_metrics
from cod_fast.data.records import Episode, Rollout, Turn
from cod_fast.envs.base import MAX_ACTION_CHARS, Environment
from cod_fast.envs.frozenlake import DIRECTIONS, FrozenLakeEnv
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.model.loading import load_policy
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings, RolloutDriver
from cod_fast.rollout.sampler import TextPolicySampler
from cod_fast.rollout.scripted import ScriptedDriver
from cod_fast.rollout.torch_sampler import TorchSampler
from cod_fast.train.trainer import Trainer
from tests.rollout_helpers import GuessEnv, save_tiny_qwen3
from tests.train.test_trainer import config, metrics

COMBOS = [(size, setting) for size in ("tiny", "full") for setting in ("train", "eval")]
SEEDS = pack_seeds("diagnostics", 12)


# --- FrozenLake's hooks --------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_frozenlake_truth_is_what_each_action_does(size, setting):
    """hint_truth names, for every action number, the direction the task moves the agent: each
    `Direction N` that moves from the start lands on the neighbour the truth names (one that
    bumps the edge shows nothing)."""
    env = FrozenLakeEnv(setting, size)
    checked = 0
    for seed in SEEDS[:4]:
        truth = env.hint_truth(seed)
        assert sorted(truth) == ["1", "2", "3", "4"]
        assert sorted(truth.values()) == sorted(DIRECTIONS)
        for action, direction in truth.items():
            task = env.task(seed, 0)
            task.step(f"Direction {action}")
            if task.pos != task.start:
                moved = (task.pos[0] - task.start[0], task.pos[1] - task.start[1])
                assert moved == DIRECTIONS[direction], (seed, action, direction)
                checked += 1
    assert checked >= 8


def test_frozenlake_hint_entries_read_the_explorer_format():
    """`N=direction` entries are read in any case and spacing, `N=?` and other text state
    nothing, the later of two entries for one number counts, and render_hints writes text that
    reads back to the entries it was given."""
    env = FrozenLakeEnv("train", "tiny")
    assert env.hint_entries(None) == {} and env.hint_entries("") == {}
    assert env.hint_entries("1=up 2=? 3 = LEFT, Direction 4 =right") == {
        "1": "up",
        "3": "left",
        "4": "right",
    }
    assert env.hint_entries("1=up then 1=down; 5=left 0=up") == {"1": "down"}
    assert env.hint_entries("no hint available.") == {}
    assert env.render_hints({"3": "right"}) == "1=? 2=? 3=right 4=?"
    for seed in SEEDS:
        truth = env.hint_truth(seed)
        assert env.hint_entries(env.render_hints(truth)) == truth
        part = {k: v for k, v in truth.items() if int(k) % 2}
        assert env.hint_entries(env.render_hints(part)) == part


def test_frozenlake_hint_entries_survive_hostile_text():
    """Model text built to make a backtracking pattern quadratic (a digit before 400,000 spaces,
    100,000 open `1 =` entries, a megabyte of digits) is read in one pass: the entries are the
    ones it states and nothing else."""
    env = FrozenLakeEnv("train", "full")
    assert env.hint_entries("1" + " " * 400_000) == {}
    assert env.hint_entries("1 = " * 100_000 + "2=up") == {"2": "up"}
    assert env.hint_entries("1" * 1_000_000 + "=down") == {"1": "down"}
    assert env.hint_entries("=" * 500_000 + "4" + "\t" * 500_000) == {}


def _explorer_transcripts(env: Environment, seed: int, tasks: int):
    """The explorer through a pack as the driver plays a model: each task's (task, (observation,
    action) pairs, feedback), and the hints the explorer writes after it."""
    agent, hints, played, written = env.explorer(), None, [], []
    for k in range(tasks):
        task = env.task(seed, k)
        agent.start(task, hints)
        observation, steps = task.reset(), []
        for _ in range(task.max_steps):
            action = agent.act(observation)
            steps.append((observation, action))
            outcome = task.step(action)
            observation = outcome.observation
            if outcome.done:
                break
        played.append((task, steps, task.feedback()))
        hints = agent.write_hints(task, hints)
        written.append(hints)
    return played, written


@pytest.mark.parametrize(("size", "setting"), COMBOS)
def test_knowable_entries_of_an_explorer_transcript_are_its_hints(size, setting):
    """knowable_entries replays a transcript through the explorer's own reading: folded over the
    explorer's transcript of tasks 0..k, rendered, it is exactly the hints the explorer wrote
    after task k, and never contradicts the truth."""
    env = FrozenLakeEnv(setting, size)
    learned = 0
    for seed in SEEDS:
        played, written = _explorer_transcripts(env, seed, 4)
        truth = env.hint_truth(seed)
        knowable: dict[str, str] = {}
        for k, (task, steps, feedback) in enumerate(played):
            knowable = env.knowable_entries(knowable, task, steps, feedback)
            assert env.render_hints(knowable) == written[k], (seed, k)
            assert all(truth[a] == d for a, d in knowable.items())
            learned += len(knowable)
    assert learned > 0  # the transcripts teach something


def test_knowable_entries_learn_nothing_from_an_action_that_does_not_parse():
    """A move teaches its action's direction; an unreadable action after it (which ends the
    episode where it stands) or one longer than any action an environment reads teaches
    nothing, and is not taken for a bump against the edge."""
    env = FrozenLakeEnv("train", "tiny")
    tried = 0
    for seed in SEEDS:
        truth = env.hint_truth(seed)
        for action in truth:
            task = env.task(seed, 0)
            first = task.reset()
            outcome = task.step(f"Direction {action}")
            if task.pos == task.start or outcome.done:
                continue  # a bump or a move that ends the task: not this test's case
            for junk in ("go left", "Direction 9", "Direction 1" * (MAX_ACTION_CHARS // 10)):
                task = env.task(seed, 0)
                task.reset()
                task.step(f"Direction {action}")
                task.step(junk)
                steps = [(first, f"Direction {action}"), (outcome.observation, junk)]
                knowable = env.knowable_entries({}, task, steps, task.feedback())
                assert knowable == {action: truth[action]}
                tried += 1
    assert tried > 0


def test_driver_scores_the_explorer_hints_as_knowable_and_never_wrong():
    """Through the rollout driver (the scripted explorer as the policy), every update episode's
    hint_check finds no wrong entry and states exactly what its trajectory shows; the unknown
    entries are the rest of the four."""
    env = FrozenLakeEnv("train", "tiny")
    chat = ChatFormat(char_tokenizer())
    driver = ScriptedDriver(
        env, chat, DriverSettings(rollout=RolloutConfig(prompt_style="compact"))
    )
    rollouts = driver.run(make_packs(SEEDS, 4), group_size=1)
    checks = [e.info["hint_check"] for r in rollouts for e in r.episodes if e.kind == "update"]
    assert len(checks) == 3 * len(SEEDS)
    for c in checks:
        assert c["wrong"] == 0 and c["correct"] == c["knowable"] == c["knowable_correct"]
        assert c["correct"] + c["unknown"] == 4


def test_environment_without_hint_entries_records_no_check():
    """An environment that declares no hint entries: update episodes carry no hint_check, the
    hint metrics are empty, and an oracle or explorer hint source is refused in one line."""
    chat = ChatFormat(char_tokenizer())
    policy = TextPolicySampler(
        lambda p: "--- Start of updated hints ---\nx\n--- End of updated hints ---", chat
    )
    rollouts = RolloutDriver(GuessEnv(), policy, chat, DriverSettings()).run(
        make_packs([1, 2], 3), group_size=1
    )
    assert all("hint_check" not in e.info for r in rollouts for e in r.episodes)
    assert not GuessEnv.has_hint_entries() and FrozenLakeEnv.has_hint_entries()
    assert hint_metrics([[None, None]]) == {}
    for source in ("oracle", "explorer"):
        with pytest.raises(ValueError, match="guess declares none") as err:
            RolloutDriver(GuessEnv(), policy, chat, DriverSettings(hint_source=source))
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown hint source"):
        RolloutDriver(GuessEnv(), policy, chat, DriverSettings(hint_source="mine"))  # type: ignore[arg-type]


# --- the metrics on hand-built records -----------------------------------------------------------


def test_hint_check_counts_entries():
    """correct / wrong / unknown against the truth, knowable and knowable_correct against what
    the trajectory showed, counted by hand."""
    truth = {"1": "up", "2": "down", "3": "left", "4": "right"}
    stated = {"1": "up", "2": "left", "4": "right", "9": "up"}
    knowable = {"1": "up", "2": "down", "3": "left"}
    assert hint_check(truth, stated, knowable) == {
        "correct": 2,  # 1 and 4
        "wrong": 2,  # 2 (says left) and 9 (no such entry)
        "unknown": 1,  # 3
        "knowable": 3,
        "knowable_correct": 1,  # 1; 2 is stated wrong, 3 not at all
    }
    assert hint_check(truth, {}, {}) == dict.fromkeys(HINT_COUNTS, 0) | {"unknown": 4}


def test_hint_metrics_average_each_update_index():
    """hint_COUNT_uU is the mean over the rollouts' update episodes U that have a check."""
    a = {"correct": 1, "wrong": 2, "unknown": 1, "knowable": 2, "knowable_correct": 1}
    b = {"correct": 3, "wrong": 0, "unknown": 1, "knowable": 4, "knowable_correct": 3}
    c = {"correct": 4, "wrong": 0, "unknown": 0, "knowable": 4, "knowable_correct": 4}
    out = hint_metrics([[a, c], [b, None], [None, None]])
    assert out["hint_correct_u0"] == (1 + 3) / 2 and out["hint_wrong_u0"] == (2 + 0) / 2
    assert out["hint_knowable_u0"] == 3 and out["hint_knowable_correct_u0"] == 2
    assert out["hint_correct_u1"] == 4 and out["hint_unknown_u1"] == 0
    assert len(out) == 2 * len(HINT_COUNTS)


def _episode(pack, member, kind, index, tokens, advantage, logprobs=None, hints=None, reward=0.0):
    """An episode of one turn whose prompt and response ids are `tokens` (prompt, response)."""
    prompt, response = tokens
    turn = Turn(
        prompt_ids=list(prompt),
        response_ids=list(response),
        response_logprobs=logprobs or [-0.5] * len(response),
    )
    info = {"hints": hints} if kind == "update" else {}
    return Episode(
        pack_id=pack,
        member=member,
        kind=kind,
        task_index=index,
        turns=[turn],
        reward=reward,
        advantage=advantage,
        info=info,
    )


def _hand_built() -> list[Rollout]:
    """Two packs of three members, K = 2 (solve 0, update 0, solve 1).

    Pack 0: solve 0 of members 0 and 1 are copies with advantages +0.5 and -0.5 (they cancel),
    member 2 writes another one (0.0); update 0 all write "1=up"; solve 1 has equal returns
    (advantages 0). Pack 1: every episode distinct; update 0 writes "a", "a", "b"."""
    episodes = {
        (0, 0): [
            _episode(0, 0, "solve", 0, ([1, 2], [3]), 0.5, [-1.0]),
            _episode(0, 0, "update", 0, ([4], [5, 6]), 0.2, [-0.1, -0.3], "1=up"),
            _episode(0, 0, "solve", 1, ([7], [8]), 0.0),
        ],
        (0, 1): [
            _episode(0, 1, "solve", 0, ([1, 2], [3]), -0.5, [-1.0]),
            _episode(0, 1, "update", 0, ([4], [5, 6]), 0.2, [-0.1, -0.3], "1=up"),
            _episode(0, 1, "solve", 1, ([7], [9]), 0.0),
        ],
        (0, 2): [
            _episode(0, 2, "solve", 0, ([1, 2], [4]), 0.0, [-2.0]),
            _episode(0, 2, "update", 0, ([4], [5, 7]), -0.4, [-0.2, -0.2], "1=up"),
            _episode(0, 2, "solve", 1, ([7], [8]), 0.0),
        ],
        (1, 0): [
            _episode(1, 0, "solve", 0, ([11], [1]), 1.0, [-0.5]),
            _episode(1, 0, "update", 0, ([12], [1]), 0.3, [-0.6], "a"),
            _episode(1, 0, "solve", 1, ([13], [1]), 0.6),
        ],
        (1, 1): [
            _episode(1, 1, "solve", 0, ([11], [2]), -0.25, [-0.5]),
            _episode(1, 1, "update", 0, ([12], [2]), 0.3, [-0.6], "a"),
            _episode(1, 1, "solve", 1, ([13], [2]), -0.3),
        ],
        (1, 2): [
            _episode(1, 2, "solve", 0, ([11], [3]), -0.75, [-0.5]),
            _episode(1, 2, "update", 0, ([12], [3]), -0.6, [-0.6], "b"),
            _episode(1, 2, "solve", 1, ([13], [3]), -0.3),
        ],
    }
    return [Rollout(pack_id=p, member=g, episodes=e) for (p, g), e in episodes.items()]


def test_credit_metrics_on_hand_built_records():
    """Zero-variance share, surviving advantage mass, NLL, distinct solve-0 episodes and shared
    hints, each worked out by hand for `_hand_built`."""
    out = credit_metrics(_hand_built())
    assert out["zero_var_s0"] == 0.0  # both packs' solve 0 have a non-zero advantage
    assert out["zero_var_s1"] == 0.5  # pack 0's solve 1 is all zeros
    assert out["zero_var_u0"] == 0.0
    # solve: pack 0 {0.5 - 0.5 copies, 0.0, three distinct solve-1 with 0}, pack 1 all distinct
    surviving = abs(0.5 - 0.5) + 0.0 + (1.0 + 0.25 + 0.75) + (0.6 + 0.3 + 0.3)
    total = 0.5 + 0.5 + (1.0 + 0.25 + 0.75) + (0.6 + 0.3 + 0.3)
    assert out["adv_surviving_solve"] == pytest.approx(surviving / total, rel=1e-12)
    # update: pack 0's members 0 and 1 are copies (+0.2 +0.2 add up), pack 1 all distinct
    surviving = abs(0.2 + 0.2) + 0.4 + (0.3 + 0.3 + 0.6)
    total = 0.2 + 0.2 + 0.4 + (0.3 + 0.3 + 0.6)
    assert out["adv_surviving_update"] == pytest.approx(surviving / total, rel=1e-12)
    solve_logprobs = [-1.0, -1.0, -2.0, -0.5, -0.5, -0.5] + [-0.5] * 6
    assert out["nll_solve"] == pytest.approx(-sum(solve_logprobs) / 12, rel=1e-12)
    update_logprobs = [-0.1, -0.3, -0.1, -0.3, -0.2, -0.2, -0.6, -0.6, -0.6]
    assert out["nll_update"] == pytest.approx(-sum(update_logprobs) / 9, rel=1e-12)
    assert out["distinct_s0"] == (2 + 3) / 2
    assert out["same_hint_u0"] == pytest.approx((3 / 3 + 1 / 3) / 2, rel=1e-12)  # pairs alike


def test_surviving_mass_bounds():
    """1 when every episode is distinct, 0 when each group is one sequence whose copies'
    advantages cancel; a batch with no advantage at all has no surviving share (nan)."""
    distinct = [
        Rollout(pack_id=0, member=g, episodes=[_episode(0, g, "solve", 0, ([1], [g + 1]), a)])
        for g, a in enumerate([0.3, -0.1, -0.2])
    ]
    assert credit_metrics(distinct)["adv_surviving_solve"] == pytest.approx(1.0)
    copies = [
        Rollout(pack_id=0, member=g, episodes=[_episode(0, g, "solve", 0, ([1], [2]), a)])
        for g, a in enumerate([0.3, -0.1, -0.2])
    ]
    out = credit_metrics(copies)
    assert out["adv_surviving_solve"] == pytest.approx(0.0, abs=1e-15)
    assert out["distinct_s0"] == 1 and out["zero_var_s0"] == 0.0
    zeros = [
        Rollout(pack_id=0, member=g, episodes=[_episode(0, g, "solve", 0, ([1], [g + 1]), 0.0)])
        for g in range(2)
    ]
    out = credit_metrics(zeros)
    assert math.isnan(out["adv_surviving_solve"]) and out["zero_var_s0"] == 1.0


def test_zero_variance_follows_equal_returns_through_assign_advantages():
    """After assign_advantages (std_norm on, RED-weight on), a group whose members' rewards are
    equal at every position counts as zero-variance at every position, whatever float rounding
    the mean of equal returns leaves (returns of 0.1 do not average back to 0.1 exactly)."""
    rollouts = [
        Rollout(
            pack_id=0,
            member=g,
            episodes=[
                _episode(0, g, "solve", 0, ([1], [g + 1]), None, reward=0.1),
                _episode(0, g, "update", 0, ([2], [g + 1]), None, reward=0.0),
                _episode(0, g, "solve", 1, ([3], [g + 1]), None, reward=0.1),
            ],
        )
        for g in range(3)
    ]
    assign_advantages(rollouts, AlgoConfig(std_norm=True, red_weight=True))
    out = credit_metrics(rollouts)
    assert out["zero_var_s0"] == out["zero_var_s1"] == out["zero_var_u0"] == 1.0


# --- eval --hints --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_player():
    """The built-in tiny model (random weights, character tokenizer) with a torch sampler."""
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model, tokenizer = load_policy(cfg, "cpu", seed=0)
    return TorchSampler(model, tokenizer, temperature=1.0, seed=0), ChatFormat(tokenizer)


def _solve_contexts(chat, rollout: Rollout) -> list[str]:
    """The hint line of each solve episode's first prompt, by task."""
    solves = sorted((e for e in rollout.episodes if e.kind == "solve"), key=lambda e: e.task_index)
    return [
        next(line for line in chat.decode(e.turns[0].prompt_ids).splitlines() if "Hints:" in line)
        for e in solves
    ]


@pytest.mark.slow
def test_hint_sources_put_their_hints_in_the_prompts(tiny_player):
    """With a tiny built-in model: `oracle` shows the hidden rule in the env's hint format
    before every task k > 0, `explorer` hints that never contradict it, `none` `Hints: null` at
    every task; none of them samples an update episode. `own` keeps the model's update episodes,
    each with its hint_check."""
    sampler, chat = tiny_player
    env = FrozenLakeEnv("train", "tiny")
    packs = make_packs(SEEDS[:3], 3)
    by_seed = {spec.pack_id: spec.pack_seed for spec in packs}

    def play(source):
        settings = DriverSettings(rollout=RolloutConfig(max_response_tokens=8), hint_source=source)
        return RolloutDriver(env, sampler, chat, settings).run(packs, group_size=1)

    for rollout in play("oracle"):
        oracle = env.render_hints(env.hint_truth(by_seed[rollout.pack_id]))
        assert all(e.kind == "solve" for e in rollout.episodes)
        assert _solve_contexts(chat, rollout) == ["Hints: null"] + [f"Hints: {oracle}"] * 2
    for rollout in play("explorer"):
        truth = env.hint_truth(by_seed[rollout.pack_id])
        assert all(e.kind == "solve" for e in rollout.episodes)
        first, *later = _solve_contexts(chat, rollout)
        assert first == "Hints: null"
        for line in later:
            entries = env.hint_entries(line)
            assert line == f"Hints: {env.render_hints(entries)}"
            assert all(truth[a] == d for a, d in entries.items())
    for rollout in play("none"):
        assert all(e.kind == "solve" for e in rollout.episodes)
        assert _solve_contexts(chat, rollout) == ["Hints: null"] * 3
    own = play("own")
    updates = [e for r in own for e in r.episodes if e.kind == "update"]
    assert len(updates) == 2 * len(packs) and all("hint_check" in e.info for e in updates)


def test_explorer_hints_are_what_the_moves_showed():
    """`explorer` hints, under a policy that makes moves, state entries (across these packs)
    and never one the hidden rule contradicts; the first task reads `Hints: null`."""
    env = FrozenLakeEnv("train", "tiny")
    chat = ChatFormat(char_tokenizer())
    policy = TextPolicySampler(lambda prompt: f"Direction {1 + len(prompt) % 4}", chat)
    packs = make_packs(SEEDS, 4)
    settings = DriverSettings(rollout=RolloutConfig(prompt_style="compact"), hint_source="explorer")
    stated = 0
    rollouts = RolloutDriver(env, policy, chat, settings).run(packs, group_size=1)
    for rollout, spec in zip(rollouts, packs, strict=True):
        truth = env.hint_truth(spec.pack_seed)
        first, *later = _solve_contexts(chat, rollout)
        assert first == "Hints: null" and all(e.kind == "solve" for e in rollout.episodes)
        for line in later:
            entries = env.hint_entries(line)
            assert line == f"Hints: {env.render_hints(entries)}"
            assert all(truth[a] == d for a, d in entries.items())
            stated += len(entries)
    assert stated > 0


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), char_tokenizer(CHATML))


def _eval(model_dir, out, *flags):
    args = ["eval", "--model", str(model_dir), "--size", "tiny", "--packs", "2", "--tasks", "3"]
    return CliRunner().invoke(app, [*args, "--max-response-tokens", "6", *flags, "--out", str(out)])


@pytest.mark.slow
def test_eval_hints_option(tiny_model_dir, tmp_path):
    """`cod-fast eval --hints`: eval.json names the hint source; with the model's own hints it
    holds the hint quality of each update episode, with oracle hints none (no update episode
    ran); an environment without hint entries, an unknown source or --matrix is one line."""
    own = _eval(tiny_model_dir, tmp_path / "own")
    assert own.exit_code == 0, own.output
    report = json.loads((tmp_path / "own" / "eval.json").read_text())
    row = report["results"]["frozenlake"]["cod"]
    assert report["hint_source"] == "own"
    for u in (0, 1):
        assert row[f"hint_correct_u{u}"] + row[f"hint_wrong_u{u}"] + row[f"hint_unknown_u{u}"] == 4
    oracle = _eval(tiny_model_dir, tmp_path / "oracle", "--hints", "oracle")
    assert oracle.exit_code == 0, oracle.output
    report = json.loads((tmp_path / "oracle" / "eval.json").read_text())
    assert report["hint_source"] == "oracle"
    assert not any(k.startswith("hint_") for k in report["results"]["frozenlake"]["cod"])
    for flags, says in (
        (["--env", "alchemy", "--hints", "oracle"], "alchemy declares none"),
        (["--hints", "explorer", "--cross-domain"], "declares none"),
        (["--hints", "mine"], "unknown --hints 'mine'"),
        (["--hints", "none", "--matrix"], "--matrix"),
    ):
        result = _eval(tiny_model_dir, tmp_path / "bad", *flags)
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(errors) == 1 and says in errors[0], result.output


# --- a training step -----------------------------------------------------------------------------


@pytest.mark.slow
def test_training_records_carry_the_diagnostics(tmp_path):
    """One warm-start and one RL step of the quick tiny-cpu setup: the RL record holds every
    credit diagnostic and the hint quality of each update episode; the warm start's scripted
    explorer never writes a wrong entry; the evaluations carry the hint quality too."""
    run = tmp_path / "run"
    Trainer(config(run, "train.warm_start_steps=1", "train.steps=1", "rollout.eval_packs=1")).run()
    warm, rl = metrics(run)
    for u in range(3):
        # The explorer states only what its moves showed (its blocks may be cut by the cap).
        assert warm[f"hint_wrong_u{u}"] == 0
        assert warm[f"hint_correct_u{u}"] == warm[f"hint_knowable_correct_u{u}"]
        for record in (warm, rl):
            counts = [record[f"hint_{c}_u{u}"] for c in ("correct", "wrong", "unknown")]
            assert sum(counts) == 4  # every FrozenLake entry is one of the three
    keys = [f"zero_var_s{k}" for k in range(4)] + [f"zero_var_u{u}" for u in range(3)]
    keys += ["adv_surviving_solve", "adv_surviving_update", "nll_solve", "nll_update"]
    keys += ["distinct_s0", "same_hint_u0"]
    for key in keys:
        assert key in rl and key not in warm, key
    assert 1 <= rl["distinct_s0"] <= 2 and 0 <= rl["same_hint_u0"] <= 1 and rl["nll_solve"] > 0
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert all("hint_correct_u0" in e for e in evals)
