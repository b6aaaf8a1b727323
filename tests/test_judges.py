"""The judge back ends of cod_fast.judges: an OpenAI-compatible endpoint (served on the loopback
address by the test itself, its replies scripted per test), a local model folder run through the
trainer's sampler, and `make_judge` / `judge_problem` for every kind of spec."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import transformers
from transformers import AutoTokenizer

from cod_fast.envs.judge import Judge, JudgeError, JudgeQuery, RuleJudge, Verdict, judge_prompt
from cod_fast.judges import (
    API_KEY_VARS,
    EndpointJudge,
    ModelJudge,
    judge_problem,
    make_judge,
)
from cod_fast.rollout.chat import ChatFormat
from cod_fast.tokenizer import CHATML, char_tokenizer
from tests.rollout_helpers import save_tiny_qwen3

QUERY = JudgeQuery(
    env="clinic",
    rubric="Score 1 for the right diagnosis, 0 otherwise.",
    reference="The patient has measles (fever, rash, Koplik spots).",
    transcript="agent: examine mouth\nclinic: white spots inside the cheeks",
    answer="measles",
    rule=Verdict(1.0, reason="exact match"),
)
KEY = "sk-test-7f3a9c"


def completion(content) -> bytes:
    """A chat-completions reply whose first choice says `content`."""
    return json.dumps(
        {"choices": [{"message": {"role": "assistant", "content": content}}]}
    ).encode()


def one_line_error(judge: Judge, match: str) -> str:
    """The JudgeError `judge` raises on QUERY: one line that contains `match`."""
    with pytest.raises(JudgeError) as error:
        judge.score(QUERY)
    message = str(error.value)
    assert "\n" not in message, message
    assert match in message, message
    return message


# --- an OpenAI-compatible endpoint ----------------------------------------------------------------


class Server:
    """What the scripted endpoint answers (`status`, `body`; `hang`: no answer until `release`
    is set) and the requests it received (path, Authorization header, JSON body)."""

    def __init__(self):
        self.status, self.body, self.hang = 200, completion("<score>0.8</score>"), False
        self.release = threading.Event()
        self.requests: list[dict] = []
        self.url = ""


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        server: Server = self.server.script
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        auth = self.headers.get("Authorization")
        server.requests.append({"path": self.path, "authorization": auth, "body": body})
        if server.hang:
            server.release.wait(5.0)  # far past any timeout a test sets; teardown cuts it short
            return
        self.send_response(server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(server.body)))
        self.end_headers()
        self.wfile.write(server.body)

    def log_message(self, format, *args) -> None:  # the test output stays clean
        pass


@pytest.fixture
def server():
    """A ThreadingHTTPServer on 127.0.0.1 (a free port) in a daemon thread, shut down after
    the test."""
    script = Server()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.script = script
    # A short poll: shutdown() waits for the loop's next look at its flag.
    thread = threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    script.url = f"http://127.0.0.1:{httpd.server_port}/v1"
    yield script
    script.release.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture(autouse=True)
def no_api_key(monkeypatch):
    """No API key from the machine running the tests: a test sets the one it needs."""
    for var in API_KEY_VARS:
        monkeypatch.delenv(var, raising=False)


def test_endpoint_reads_the_score_of_the_reply(server):
    """A reply `<score>0.8</score>` is the verdict 0.8, not malformed."""
    verdict = EndpointJudge(server.url, "judge-7b").score(QUERY)
    assert verdict.score == pytest.approx(0.8)
    assert not verdict.malformed


def test_endpoint_reads_the_malformed_flag(server):
    """A reply that flags the trajectory `<malformed/>` is a malformed verdict."""
    server.body = completion("The answer is unreadable. <malformed/>")
    verdict = EndpointJudge(server.url).score(QUERY)
    assert verdict.malformed and verdict.score == 0.0


def test_endpoint_sends_the_judge_prompt_as_a_chat_completion(server):
    """One POST to {base}/chat/completions: the model name, the system and user messages of
    judge_prompt (reference and answer in them), temperature 0, the max_tokens cap, and no
    Authorization header when no key is set."""
    EndpointJudge(server.url + "/", "judge-7b", max_tokens=17).score(QUERY)
    [request] = server.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["authorization"] is None
    system, user = judge_prompt(QUERY)
    body = request["body"]
    assert body["model"] == "judge-7b"
    assert body["messages"] == [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
    ]
    assert QUERY.reference in user and QUERY.answer in user and QUERY.rubric in system
    assert body["temperature"] == 0 and body["max_tokens"] == 17


@pytest.mark.parametrize("var", API_KEY_VARS)
def test_endpoint_sends_the_api_key_as_a_bearer_token(server, monkeypatch, var):
    """The key from COD_FAST_JUDGE_API_KEY (else OPENAI_API_KEY) goes in the Authorization
    header."""
    monkeypatch.setenv(var, KEY)
    EndpointJudge(server.url).score(QUERY)
    assert server.requests[0]["authorization"] == f"Bearer {KEY}"


def test_the_judge_key_wins_over_the_openai_key(server, monkeypatch):
    """With both variables set, the judge's own key is the one sent."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-other")
    monkeypatch.setenv("COD_FAST_JUDGE_API_KEY", KEY)
    EndpointJudge(server.url).score(QUERY)
    assert server.requests[0]["authorization"] == f"Bearer {KEY}"


FAILURES = {
    "server error": (500, b'{"error": "out of memory"}', "HTTP 500"),
    "not found": (404, b'{"error": "model judge-7b does not exist"}', "HTTP 404"),
    "not JSON": (200, b"<html>gateway</html>", "not JSON"),
    "no choices": (200, b'{"object": "error"}', "no choices[0].message.content"),
    "empty choices": (200, b'{"choices": []}', "no choices[0].message.content"),
    "no text": (200, completion(None), "not text"),
    "no score": (200, completion("I think it is right."), "unreadable reply"),
}


@pytest.mark.parametrize("status, body, match", FAILURES.values(), ids=FAILURES.keys())
def test_endpoint_failures_are_one_line_errors(server, status, body, match):
    """A non-2xx status or a reply without a readable verdict is a one-line JudgeError naming
    the URL and the cause."""
    server.status, server.body = status, body
    message = one_line_error(EndpointJudge(server.url), match)
    assert server.url + "/chat/completions" in message


def test_endpoint_errors_never_show_the_api_key(server, monkeypatch):
    """A server that echoes the request's Authorization header in its error reply does not get
    the key into the message."""
    monkeypatch.setenv("COD_FAST_JUDGE_API_KEY", KEY)
    server.status, server.body = 401, f'{{"error": "bad header Bearer {KEY}"}}'.encode()
    message = one_line_error(EndpointJudge(server.url), "HTTP 401")
    assert KEY not in message and "***" in message


def test_endpoint_that_never_answers_times_out(server):
    """A server that accepts the request and never answers is a JudgeError after timeout_s."""
    server.hang = True
    one_line_error(EndpointJudge(server.url, timeout_s=0.3), "no answer within 0.3 s")


def test_endpoint_on_a_closed_port_is_unreachable():
    """Nothing listening at the URL is a JudgeError that asks whether the server runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    message = one_line_error(EndpointJudge(f"http://127.0.0.1:{port}/v1"), "unreachable")
    assert "is the server running?" in message


# --- a local model folder -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A 2-layer Qwen3 with random weights and the ChatML character tokenizer, saved as a real
    model folder."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("judge"), char_tokenizer(CHATML))


@pytest.fixture(scope="module")
def model_judge(folder):
    judge = ModelJudge(str(folder), max_tokens=24)
    yield judge
    judge.close()


def test_model_judge_sends_the_prompt_through_chat_format_and_sampler(
    model_judge, folder, monkeypatch
):
    """The sampler gets exactly judge_prompt(query) in the folder's chat format, with the
    max_tokens cap, in inference mode; the ids it returns are decoded (a stop token dropped)
    and parsed: `<score>1</score>` is the verdict 1."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sampler, seen = model_judge.sampler, {}
    real = sampler.generate

    def generate(prompts, caps, keys=None):
        seen.update(prompts=prompts, caps=caps, inference=torch.is_inference_mode_enabled())
        [sample] = real(prompts, caps, keys)  # the real decode runs; its reply is replaced
        ids = tokenizer.encode("<score>1</score>", add_special_tokens=False)
        return [dataclasses.replace(sample, token_ids=[*ids, tokenizer.eos_token_id])]

    monkeypatch.setattr(sampler, "generate", generate)
    verdict = model_judge.score(QUERY)
    assert verdict.score == 1.0 and not verdict.malformed
    assert seen["prompts"] == [ChatFormat(tokenizer).first_prompt(*judge_prompt(QUERY))]
    assert seen["caps"] == [24] and seen["inference"]


def test_model_judge_reply_without_a_score_is_unreadable(model_judge):
    """A random tiny model writes no `<score>`: a one-line JudgeError saying the reply was
    unreadable, the same on every call (decoding is keyed, so the reply does not depend on what
    was judged before), and no parameter takes part in a graph."""
    first = one_line_error(model_judge, "unreadable reply")
    assert "no <score>NUMBER</score>" in first
    assert one_line_error(model_judge, "unreadable reply") == first
    assert all(not p.requires_grad and p.grad is None for p in model_judge.model.parameters())
    assert next(model_judge.model.parameters()).dtype == torch.float32


def test_model_judge_after_close_refuses_to_score(folder):
    """close() lets go of the model; a later score is a JudgeError, not an AttributeError."""
    judge = ModelJudge(str(folder))
    judge.close()
    assert judge.model is None
    one_line_error(judge, "was closed")


def test_model_folder_that_does_not_load_is_a_one_line_error(folder, tmp_path):
    """A folder whose config.json does not fit its tokenizer is refused by the project's
    loader; the judge says so in one line."""
    bad = shutil.copytree(folder, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"vocab_size": 50}))
    with pytest.raises(JudgeError, match=r"does not load .*vocab_size=50") as error:
        ModelJudge(str(bad))
    assert "\n" not in str(error.value)


# --- make_judge and judge_problem ---------------------------------------------------------------


def test_make_judge_builds_each_kind(folder):
    """'rule' is the RuleJudge, an http(s) URL an endpoint (model 'default' unless named), a
    model folder a ModelJudge, loaded once per process: asked again, the same judge."""
    assert isinstance(make_judge("rule"), RuleJudge)
    endpoint = make_judge("https://judge.example/v1", timeout_s=2.0, max_tokens=9)
    assert isinstance(endpoint, EndpointJudge)
    assert (endpoint.url, endpoint.model) == (
        "https://judge.example/v1/chat/completions",
        "default",
    )
    assert (endpoint.timeout_s, endpoint.max_tokens) == (2.0, 9)
    assert make_judge("http://127.0.0.1:8000/v1", model="judge-7b").model == "judge-7b"
    judge = make_judge(str(folder), max_tokens=5)
    assert isinstance(judge, ModelJudge) and judge.max_tokens == 5
    assert make_judge(str(folder), max_tokens=5) is judge


def bad_specs(tmp_path) -> dict[str, tuple[str, str]]:
    """Each kind of unusable spec and what its problem says."""
    (tmp_path / "weights.bin").write_bytes(b"")
    (tmp_path / "no-config").mkdir()
    return {
        "empty": ("", "an empty judge"),
        "blank": ("   ", "an empty judge"),
        "URL without host": ("http://", "without a host"),
        "URL without host, a path": ("https:///v1", "without a host"),
        "port no number": ("http://judge:port/v1", "not a URL"),
        "broken IPv6 host": ("http://[::1/v1", "not a URL"),
        "missing folder": (str(tmp_path / "missing"), "no such folder"),
        "a file": (str(tmp_path / "weights.bin"), "a file"),
        "no config.json": (str(tmp_path / "no-config"), "without config.json"),
    }


def test_judge_problem_names_each_bad_spec(tmp_path):
    """Every unusable spec has a one-line problem, and make_judge refuses it with that line."""
    for name, (spec, match) in bad_specs(tmp_path).items():
        problem = judge_problem(spec)
        assert problem is not None and match in problem and "\n" not in problem, name
        with pytest.raises(JudgeError) as error:
            make_judge(spec)
        assert str(error.value) == f"rollout.judge: {problem}", name


def test_judge_problem_passes_good_specs_without_loading_or_requesting(folder, monkeypatch):
    """'rule', URLs with a host and a model folder with config.json are fine, and the check
    neither loads a model nor sends a request."""

    def forbidden(*args, **kwargs):
        raise AssertionError("judge_problem loaded a model or sent a request")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", forbidden)
    monkeypatch.setattr("urllib.request.urlopen", forbidden)
    for spec in ["rule", "http://127.0.0.1:8000/v1", "https://judge.example", str(folder)]:
        assert judge_problem(spec) is None, spec


def test_endpoint_judge_refuses_what_is_no_url():
    """An EndpointJudge built directly from a non-URL or a URL without a host is a one-line
    JudgeError."""
    for url, match in [("127.0.0.1:8000/v1", "not an http(s):// URL"), ("http://", "host")]:
        with pytest.raises(JudgeError, match=re.escape(match)):
            EndpointJudge(url)
