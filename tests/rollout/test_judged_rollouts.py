"""Judged environments in the rollout path: the driver asks the run's judge for the reward of a
task that offers a `JudgeQuery`, a judge's failure is an environment error of one line, and a
rollout the judge flags as malformed is left out of its pack's advantage group (cod_fast.algo.assign)."""

from __future__ import annotations

import json
import random
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from typer.testing import CliRunner

from cod_fast.algo.advantages import cod_returns, group_advantages
from cod_fast.algo.assign import assign_advantages
from cod_fast.cli.app import app
from cod_fast.config import AlgoConfig, Config, ConfigError, EnvEntry, RolloutConfig
from cod_fast.config.io import load_config
from cod_fast.data.records import Episode, Rollout, Turn
from cod_fast.envs import make_env, register
from cod_fast.envs.base import Environment, Task
from cod_fast.envs.cases import load_cases
from cod_fast.envs.judge import Judge, JudgeError, JudgeQuery, Verdict
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings, RolloutDriver
from cod_fast.rollout.sampler import TextPolicySampler
from cod_fast.run.validate import validate
from cod_fast.train.trainer import Trainer
from tests.envs.test_env_learn2ask import CASES
from tests.rollout_helpers import CHATML, GuessEnv, GuessTask, char_tokenizer, guess_policy
from tests.train.test_trainer import FAST, metrics


class JudgedGuessTask(GuessTask):
    """The guessing task, scored by a judge: the rule says 1 when solved; the reward is the
    verdict's score minus 0.1 per guess after the first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.guesses: list[str] = []

    def step(self, action):
        self.guesses.append(action)
        return super().step(action)

    def judge_query(self) -> JudgeQuery | None:
        if not self.guesses:
            return None
        return JudgeQuery(
            env="judged_guess",
            rubric="Score 1 if the last guess is the secret.",
            reference=f"secret {self.secret}",
            transcript=" ".join(self.guesses),
            answer=self.guesses[-1],
            rule=Verdict(1.0 if self.solved else 0.0),
        )

    def judged_reward(self, verdict: Verdict) -> float:
        return verdict.score - 0.1 * (len(self.guesses) - 1)


class JudgedGuessEnv(GuessEnv):
    name = "judged_guess"

    def task(self, pack_seed: int, task_index: int) -> JudgedGuessTask:
        plain = super().task(pack_seed, task_index)
        return JudgedGuessTask(pack_seed, task_index, plain.secret, plain.fail_on_step)


class ScriptedJudge(Judge):
    """Flags every query whose answer is in `flag`, raises for answers in `fail`, else the
    rule's verdict; remembers what it was asked."""

    name = "scripted"

    def __init__(self, flag=(), fail=()):
        self.flag, self.fail, self.asked = set(flag), set(fail), []

    def score(self, query: JudgeQuery) -> Verdict:
        self.asked.append(query)
        if query.answer.strip() in self.fail:
            raise JudgeError("the endpoint answered 502\nBad Gateway")
        if query.answer.strip() in self.flag:
            return Verdict(0.0, malformed=True, reason="unreadable")
        return query.rule


def _roll(env: Environment, judge: Judge | None = None, group: int = 3, packs: int = 4):
    chat = ChatFormat(char_tokenizer(CHATML))
    driver = RolloutDriver(
        env,
        TextPolicySampler(guess_policy, chat),
        chat,
        DriverSettings(rollout=RolloutConfig(max_response_tokens=200)),
    )
    if judge is not None:
        driver.judge = judge
    specs = make_packs(pack_seeds("judged", packs), 3)
    return driver.run(specs, group_size=group)


def test_rule_judge_scores_like_the_task_itself():
    """With the default (rule) judge a judged task's reward is `judged_reward(rule verdict)`:
    the plain game's reward minus 0.1 per extra guess, episode by episode."""
    plain, judged = _roll(GuessEnv()), _roll(JudgedGuessEnv())
    for a, b in zip(plain, judged, strict=True):
        for ea, eb in zip(a.episodes, b.episodes, strict=True):
            if ea.kind == "solve":
                extra = 0.1 * (len(ea.turns) - 1)
                assert eb.reward == pytest.approx(ea.reward - extra)
                assert "malformed" not in eb.info and "judge" not in eb.info
            else:
                assert eb.reward == ea.reward


def test_judge_flags_and_failures_land_on_their_episode():
    """A verdict flagged malformed marks that episode (`info["malformed"]`, the rollout's
    `malformed`) with the judge's reason; a judge that raises ends the episode like an
    environment error: reward `error_reward`, the error one line naming JudgeError."""
    judge = ScriptedJudge(flag={"4"}, fail={"2"})
    rollouts = _roll(JudgedGuessEnv(), judge)
    assert judge.asked, "the driver never asked the judge"
    flagged = failed = 0
    for rollout in rollouts:
        for e in (e for e in rollout.episodes if e.kind == "solve"):
            last = judge_answer(e)
            if last == "4":
                assert e.info["malformed"] is True and e.info["judge"] == "unreadable"
                flagged += 1
            elif last == "2":
                assert e.reward == 0.0 and e.info["error"].startswith("JudgeError: ")
                assert "\n" not in e.info["error"] and "502 Bad Gateway" in e.info["error"]
                failed += 1
            else:
                assert "malformed" not in e.info and "error" not in e.info
        assert rollout.malformed == any(e.info.get("malformed") for e in rollout.episodes)
    assert flagged and failed


def judge_answer(episode: Episode) -> str:
    """The last guess of a solve episode (the chat format decodes one digit per response)."""
    chat = ChatFormat(char_tokenizer(CHATML))
    return chat.decode(episode.turns[-1].response_ids).strip()


def _synthetic(group: int, tasks: int, rng: random.Random, flags: list[bool]) -> list[Rollout]:
    turn = Turn(prompt_ids=[1], response_ids=[2, 3], response_logprobs=[-0.1, -0.2])
    rollouts = []
    for g in range(group):
        episodes = []
        for k in range(tasks):
            info = {"malformed": True} if flags[g] and k == tasks - 1 else {}
            episodes.append(
                Episode(
                    pack_id=7,
                    member=g,
                    kind="solve",
                    task_index=k,
                    turns=[turn],
                    reward=rng.uniform(-1, 1),
                    info=info,
                )
            )
            if k < tasks - 1:
                episodes.append(
                    Episode(
                        pack_id=7,
                        member=g,
                        kind="update",
                        task_index=k,
                        turns=[turn],
                        reward=rng.choice([0.0, -0.1]),
                    )
                )
        rollouts.append(Rollout(pack_id=7, member=g, episodes=episodes))
    return rollouts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("std_norm", [False, True])
def test_malformed_rollouts_leave_the_group(seed, std_norm):
    """A flagged rollout gets no advantage on any episode, and the others' advantages are the
    CoD advantages of the group without it (float64, computed afresh over the kept members);
    a pack left with one member is not trained at all."""
    rng = random.Random(seed)
    group, tasks = rng.randint(3, 7), rng.randint(2, 5)
    flags = [rng.random() < 0.4 for _ in range(group)]
    rollouts = _synthetic(group, tasks, rng, flags)
    algo = AlgoConfig(std_norm=std_norm, red_weight=False)
    assign_advantages(rollouts, algo)
    kept = [r for r, f in zip(rollouts, flags, strict=True) if not f]
    for rollout, flagged in zip(rollouts, flags, strict=True):
        assert rollout.graded == (not flagged and len(kept) >= 2)
    if len(kept) < 2:
        assert all(e.advantage is None for r in rollouts for e in r.episodes)
        return
    r = torch.tensor([x.task_rewards for x in kept], dtype=torch.float64)
    h = torch.tensor([x.hint_rewards for x in kept], dtype=torch.float64)
    solve, update = cod_returns(r, h)
    expected = {
        "solve": group_advantages(solve, std_norm),
        "update": group_advantages(update, std_norm),
    }
    for g, rollout in enumerate(kept):
        for e in rollout.episodes:
            assert e.advantage == pytest.approx(float(expected[e.kind][g, e.task_index]), abs=1e-12)


@register("optioned_guess")
class OptionedGuessEnv(Environment):
    """A plugin environment with a constructor option."""

    name = "optioned_guess"
    description = "guess with a word"

    def __init__(self, setting="train", size="full", word: str = "none"):
        super().__init__(setting, size)
        self.word = word

    def task(self, pack_seed: int, task_index: int) -> Task:
        return GuessEnv().task(pack_seed, task_index)


def test_environment_options_reach_the_constructor():
    """`rollout.env_options` become keyword arguments of the environment's constructor through
    the run's environments; an option the environment does not take is one line naming it and
    the ones it takes; options beside `rollout.envs` are refused."""
    cfg = RolloutConfig(env="optioned_guess", env_options={"word": "cat"})
    (entry,) = cfg.environments
    assert make_env(entry.name, entry.setting, entry.size, entry.options).word == "cat"
    with pytest.raises(ValueError, match=r"takes no option 'colour'; it takes 'word'") as info:
        make_env("optioned_guess", options={"colour": "red"})
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="takes no option 'word'; it takes none"):
        make_env("frozenlake", options={"word": "x"})
    with pytest.raises(ConfigError, match="env_options"):
        RolloutConfig(env=None, envs=[EnvEntry(name="frozenlake")], env_options={"word": "x"})


@pytest.mark.parametrize(
    ("spec", "words"),
    [("", "judge"), ("http://", "host"), ("/no/such/folder", "no/such/folder")],
)
def test_config_refuses_an_unusable_judge(spec, words):
    """`rollout.judge` is checked against the world by cod_fast.run.validate, not while the
    config is built (nothing is loaded or requested either way): an empty spec, a URL without a
    host and a missing folder are one-line errors naming the key."""
    cfg = Config(rollout=RolloutConfig(judge=spec))
    with pytest.raises(ConfigError, match=r"^rollout.judge: ") as info:
        validate(cfg)
    assert words in str(info.value) and "\n" not in str(info.value)


class GradingHandler(BaseHTTPRequestHandler):
    """An OpenAI-compatible judge that grades learn2ask the way its rule does (the reference's
    condition against the final answer) and flags every 7th episode as malformed."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        user = body["messages"][1]["content"]
        condition = re.search(r"condition: ([^;]+);", user).group(1)
        answer = user.rsplit("Final answer: ", 1)[1].strip()
        self.server.asked.append((body["model"], condition, answer))
        score = f"<score>{int(answer == condition)}</score>"
        flag = " <malformed/>" if len(self.server.asked) % 7 == 0 else ""
        reply = json.dumps({"choices": [{"message": {"content": score + flag}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format, *args) -> None:
        pass


@pytest.mark.slow
def test_a_run_judged_by_an_endpoint_leaves_flagged_rollouts_untrained(tmp_path):
    """tiny-cpu at test size on learn2ask with the user cases of tests/fixtures (warm start on the
    explorer's play of them, then RL) and an OpenAI-compatible judge served on the loopback
    address: every finished solve episode is sent to it (with rollout.judge_model, about the
    user's cases), the run trains to its end, and the RL steps log the flagged share and leave
    those rollouts (and any pack left with one member) untrained, more of them than were
    flagged never; `cod-fast eval` of the run directory then reproduces its last evaluation
    (the run's cases and judge)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), GradingHandler)
    server.asked = []
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        overrides = [
            *FAST,
            f"runtime.run_dir={tmp_path / 'run'}",
            "rollout.env=learn2ask",
            f"rollout.env_options={{cases: {CASES}}}",
            f"rollout.judge={url}",
            "rollout.judge_model=grader",
            "train.steps=3",
        ]
        Trainer(load_config("tiny-cpu", overrides=overrides)).run()
        trained = len(server.asked)
        # `cod-fast eval` of the run directory plays as the run evaluated: the same cases (the
        # run's env_options) and judge, so it reproduces the run's last evaluation. The judge is
        # named again: a run directory may come from anyone, and no endpoint it names is called
        # unless the user names it too.
        out = tmp_path / "eval"
        args = ["eval", "--model", str(tmp_path / "run"), "--out", str(out)]
        refused = CliRunner().invoke(app, args)
        assert refused.exit_code == 2 and f"--judge {url} if you trust it" in refused.output
        assert len(server.asked) == trained
        played = CliRunner().invoke(app, [*args, "--judge", url])
        assert played.exit_code == 0, played.output
    finally:
        server.shutdown()
        server.server_close()
    last = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])
    got = json.loads((out / "eval.json").read_text())["results"]["learn2ask"]["cod"]
    assert got["mean_reward"] == last["mean_reward"] and len(server.asked) > trained
    assert server.asked and {model for model, _, _ in server.asked} == {"grader"}
    assert {condition for _, condition, _ in server.asked} <= {c.answer for c in load_cases(CASES)}
    rl = [r for r in metrics(tmp_path / "run") if r["phase"] == "rl"]
    assert len(rl) == 3
    rollouts = 2 * 2  # packs_per_step x group_size at test size
    flagged = [round(r["malformed_frac"] * rollouts) for r in rl]
    assert sum(flagged) > 0, rl
    for r, count in zip(rl, flagged, strict=True):
        assert count <= r["ungraded_rollouts"] <= rollouts
