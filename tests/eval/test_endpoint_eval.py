"""An API model in `cod-fast eval` and `eval --matrix` (`--model openai:URL#MODEL`): an
OpenAI-compatible endpoint served on the loopback address, answering as FrozenLake's scripted
explorer would from the messages alone, plays as the same explorer does through the token-id
path (TextPolicySampler and the char tokenizer's ChatFormat), update episodes and hints
included; a random player plays worse; the CLI writes eval.json and matrix.json without the key,
and an endpoint that fails ends the command in one line."""

from __future__ import annotations

import contextlib
import json
import random
import re
import threading
import types

import pytest
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.data.metrics import PositionSummary
from cod_fast.envs.frozenlake import FrozenLakeExplorer
from cod_fast.eval.evaluate import EvalPlan, evaluate
from cod_fast.eval.matrix import load_player
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings
from cod_fast.rollout.endpoint_player import API_KEY_VARS
from cod_fast.rollout.hints import hint_block
from cod_fast.rollout.sampler import TextPolicySampler
from tests.endpoint_server import Server, completion, serving
from tests.rollout_helpers import save_tiny_qwen3

KEY = "sk-eval-9e1d2f"
CHAT = ChatFormat(char_tokenizer(CHATML))
"""The reference chat format: what a char-tokenizer model reads as text."""
ONE_AT_A_TIME = threading.Lock()
"""Around CHAT: a fast tokenizer's encode switches its special-token splitting per call."""
PLAN = EvalPlan(("frozenlake",), ("cod",), "eval", "full", packs=6, tasks=4)


def explorer_answer(text: str) -> str:
    """FrozenLake's scripted explorer's answer to a prompt (ChatML text, special tokens dropped),
    read from the text alone: the explorer replays what the prompt shows. Solve prompts: started
    on the task statement and the hints line, then each observation in turn. Update prompts:
    started on the previous hints, then reviewing the steps and the feedback; it writes what it
    knows as the hint block."""
    explorer = FrozenLakeExplorer()
    if "Write the updated hints now" in text:
        body = text.partition("\nuser\nPrevious hints:\nHints: ")[2]
        hints, _, body = body.partition("\n\nLast task:\n")
        statement = body.partition("\n\nStep 1: Observation: ")[0]
        steps = re.findall(r"Step \d+: Observation: (.*?)\nAction: (.*?)\n", body, re.DOTALL)
        feedback = re.search(r"\nFeedback: (.*)\n", body).group(1)
        explorer.start(shown_task(statement), hints)
        explorer.review(steps, feedback)
        return f"Working it out.\n{hint_block(explorer.hints())}"
    system, _, turns = text.removeprefix("system\n").partition("\nuser\n")
    statement, _, hints = system.partition("\n\n## Hints that might help\nHints: ")
    parts = turns.split("\nassistant\n")  # observation, then (reply \n user \n observation)s
    observations = [parts[0]] + [part.partition("\nuser\n")[2] for part in parts[1:-1]]
    explorer.start(shown_task(statement), hints)
    return [explorer.act(observation) for observation in observations][-1]


def shown_task(statement: str) -> types.SimpleNamespace:
    """What the explorer reads of a task: its statement and the step budget that states (in
    the full size's words or the tiny size's)."""
    budget = re.search(r"You have (\d+) actions|; (\d+) steps", statement)
    steps = int(budget.group(1) or budget.group(2))
    return types.SimpleNamespace(prompt=lambda: statement, max_steps=steps)


def as_text(messages: list[dict]) -> str:
    """The messages as the reference chat format shows them to a text policy: built into ids
    the way the rollout driver builds a prompt, then decoded."""
    system, user, *rest = (m["content"] for m in messages)
    with ONE_AT_A_TIME:  # the server answers in threads; the tokenizer's encode is not safe so
        ids = CHAT.first_prompt(system, user)
        for reply, observation in zip(rest[::2], rest[1::2], strict=True):
            response = CHAT.encode(reply)
            ids += response + CHAT.continuation(response, observation)
        return CHAT.decode(ids)


def explorer_server(body: dict) -> tuple[int, bytes]:
    return 200, completion(explorer_answer(as_text(body["messages"])))


def random_server(body: dict) -> tuple[int, bytes]:
    """Random moves and random hints, drawn from the request itself (concurrent requests come
    in any order)."""
    rng = random.Random(json.dumps(body["messages"]))
    if "Write the updated hints now" in body["messages"][-1]["content"]:
        directions = rng.sample(["up", "down", "left", "right"], 4)
        hints = " ".join(f"{a}={d}" for a, d in enumerate(directions, start=1))
        return 200, completion(hint_block(hints))
    return 200, completion(f"Direction {rng.randint(1, 4)}")


@pytest.fixture
def start_server(monkeypatch):
    """Scripted endpoints, as many as a test asks for, each answering with `answer`; no API key
    from the machine running the tests."""
    for var in API_KEY_VARS:
        monkeypatch.delenv(var, raising=False)
    with contextlib.ExitStack() as stack:

        def start(answer=explorer_server) -> Server:
            server = stack.enter_context(serving(Server()))
            server.answer = answer
            return server

        yield start


def played(model: str) -> tuple[PositionSummary, DriverSettings]:
    """PLAN played by `model` as `cod-fast eval` plays it: the summary, and the settings."""
    o, sampler, chat = load_player(model)
    report = evaluate(sampler, chat, PLAN, o["settings"])
    return report["summaries"]["frozenlake"]["cod"], o["settings"]


def test_api_player_plays_as_the_same_policy_through_token_ids(start_server):
    """The explorer behind an endpoint and the explorer as a text policy over the char
    tokenizer's ChatFormat score the same at every position (hence the same CoD gain) and write
    the same hints: text in place of token ids changes nothing the environment sees. The update
    episodes ran (the endpoint was asked for hints) and their hints reached the next task."""
    server = start_server()
    api, settings = played(f"openai:{server.url}#explorer")
    reference = evaluate(TextPolicySampler(explorer_answer, CHAT), CHAT, PLAN, settings)
    reference = reference["summaries"]["frozenlake"]["cod"]
    assert api.mean_reward == reference.mean_reward
    assert api.cod_gain == reference.cod_gain and api.gain_std_error == reference.gain_std_error
    assert api.hints == reference.hints and api.hints["hint_correct_u0"] > 0
    asked = [r["body"]["messages"] for r in server.requests]
    updates = [m for m in asked if "Write the updated hints now" in m[-1]["content"]]
    assert len(updates) == PLAN.packs * (PLAN.tasks - 1)
    carried = [m for m in asked if re.search(r"Hints: 1=(up|down|left|right|\?) ", m[0]["content"])]
    assert carried, "no solve prompt showed hints the endpoint wrote"


def test_random_player_plays_worse(start_server):
    """A random player over the same endpoint path plays, and scores below the explorer."""
    explorer, _ = played(f"openai:{start_server().url}#explorer")
    rand, _ = played(f"openai:{start_server(random_server).url}#random")
    assert len(rand.mean_reward) == PLAN.tasks
    assert sum(rand.mean_reward) < sum(explorer.mean_reward)


def test_eval_command_writes_eval_json_without_the_key(start_server, monkeypatch, tmp_path):
    """`cod-fast eval --model openai:URL#MODEL` plays and writes eval.json; the key went to the
    server as a bearer token and appears nowhere in eval.json or the output."""
    monkeypatch.setenv("COD_FAST_EVAL_API_KEY", KEY)
    server = start_server()
    out = tmp_path / "eval"
    args = ["eval", "--model", f"openai:{server.url}#m", "--env", "frozenlake"]
    result = CliRunner().invoke(app, [*args, "--packs", "2", "--tasks", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = (out / "eval.json").read_text()
    assert len(json.loads(written)["results"]["frozenlake"]["cod"]["mean_reward"]) == 3
    assert {r["authorization"] for r in server.requests} == {f"Bearer {KEY}"}
    assert KEY not in written and KEY not in result.output


def test_failing_endpoint_ends_the_command_in_one_line(start_server, monkeypatch, tmp_path):
    """An endpoint that refuses the key (echoing it) ends `cod-fast eval` with exit code 2 and
    one red line naming the endpoint and the status, no traceback, the key blanked."""
    monkeypatch.setenv("COD_FAST_EVAL_API_KEY", KEY)
    server = start_server(lambda body: (401, f'{{"error": "bad {KEY}"}}'.encode()))
    args = ["eval", "--model", f"openai:{server.url}#m", "--packs", "1", "--tasks", "2"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert f"player endpoint {server.url}/chat/completions: HTTP 401" in line
    assert "Traceback" not in result.output and KEY not in result.output
    assert len(server.requests) == 1  # no retry of a refused key


@pytest.mark.parametrize("spec", ["openai:http://127.0.0.1:9/v1", "openai:ftp://host/v1#m"])
def test_malformed_spec_is_refused_in_one_line(spec, tmp_path):
    """A spec without #MODEL, or not http(s), is one red line naming the form to write."""
    result = CliRunner().invoke(app, ["eval", "--model", spec, "--out", str(tmp_path)])
    assert result.exit_code == 2 and "openai:URL#MODEL" in result.output, result.output


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Qwen3 with random weights and a character tokenizer, saved like a real model."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), char_tokenizer(CHATML))


def test_matrix_puts_api_models_beside_a_model_folder(
    start_server, tiny_model_dir, monkeypatch, tmp_path
):
    """`eval --matrix` with two API models and a model folder: one row each, the API models
    labelled MODEL@host:port, their paths without the URL's query, no key in matrix.json; the
    explorer's row is the one `cod-fast eval` of it reports."""
    monkeypatch.setenv("COD_FAST_EVAL_API_KEY", KEY)
    explorer, rand = start_server(), start_server(random_server)
    models = [f"openai:{explorer.url}?tag=x#explorer", f"openai:{rand.url}#random"]
    args = ["eval", "--matrix", "--env", "frozenlake", "--strategy", "cod", "--size", "tiny"]
    args += ["--packs", "2", "--tasks", "2", "--max-response-tokens", "6", "--out", str(tmp_path)]
    for model in [*models, str(tiny_model_dir)]:
        args += ["--model", model]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    written = (tmp_path / "matrix.json").read_text()
    matrix = json.loads(written)
    hosts = [url.removeprefix("http://").removesuffix("/v1") for url in (explorer.url, rand.url)]
    assert [row["label"] for row in matrix["models"]] == [
        f"explorer@{hosts[0]}",
        f"random@{hosts[1]}",
        tiny_model_dir.name,
    ]
    assert matrix["models"][0]["path"] == f"openai:{explorer.url}#explorer"
    assert "tag=x" not in written and KEY not in written and KEY not in result.output
    assert len(matrix["cells"]) == 3
