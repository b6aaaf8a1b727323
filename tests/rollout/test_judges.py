"""The judge back ends of cod_fast.rollout.judge_clients: an OpenAI-compatible endpoint (served on the loopback
address by the test itself, its replies scripted per test, including hostile ones: redirects,
echoed keys, replies that drip, never end or break HTTP), a local model folder run through the
trainer's sampler, and `make_judge` / `judge_problem` for every kind of spec."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterable
from itertools import chain, repeat

import pytest
import torch
import transformers
from transformers import AutoTokenizer

from cod_fast.envs.judge import Judge, JudgeError, JudgeQuery, RuleJudge, Verdict, judge_prompt
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.judge_clients import (
    API_KEY_VARS,
    MAX_REPLY_BYTES,
    EndpointJudge,
    ModelJudge,
    judge_problem,
    make_judge,
)
from tests.endpoint_server import completion
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


def one_line_error(judge: Judge, match: str) -> str:
    """The JudgeError `judge` raises on QUERY: one line that contains `match`."""
    with pytest.raises(JudgeError) as error:
        judge.score(QUERY)
    message = str(error.value)
    assert "\n" not in message, message
    assert match in message, message
    return message


# --- an OpenAI-compatible endpoint ----------------------------------------------------------------


class RawServer:
    """A bare TCP server on 127.0.0.1 for what no HTTP server would send: it reads each request
    and answers with `chunks`, `pause` seconds after each, then hangs up."""

    def __init__(self):
        self.chunks: Iterable[bytes] = ()
        self.pause = 0.0
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.02)  # the accept loop looks at `stop` this often
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            # The client may hang up at any point: that ends this answer, not the server.
            with conn, contextlib.suppress(OSError):
                conn.settimeout(5.0)
                self._read_request(conn)
                for chunk in self.chunks:
                    conn.sendall(chunk)
                    if self.stop.wait(self.pause):
                        break

    @staticmethod
    def _read_request(conn: socket.socket) -> None:
        """The request's headers and body (Content-Length bytes), or all until the client stops
        sending (a TLS handshake has no blank line)."""
        data = b""
        while b"\r\n\r\n" not in data:
            if not (piece := conn.recv(65536)):
                return
            data += piece
        head, _, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"content-length:\s*(\d+)", head, re.IGNORECASE)
        while length and len(body) < int(length.group(1)):
            body += conn.recv(65536)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.listener.close()


@pytest.fixture
def raw_server():
    server = RawServer()
    yield server
    server.close()


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
    "nested too deeply": (200, b"[" * 200_000, "not JSON (nested too deeply)"),
}


@pytest.mark.parametrize("status, body, match", FAILURES.values(), ids=FAILURES.keys())
def test_endpoint_failures_are_one_line_errors(server, status, body, match):
    """A non-2xx status or a reply without a readable verdict is a one-line JudgeError naming
    the URL and the cause."""
    server.status, server.body = status, body
    message = one_line_error(EndpointJudge(server.url), match)
    assert server.url + "/chat/completions" in message


ECHOES = {
    "a verdict": (200, None, completion(f"<score>1</score> checked with Bearer {KEY}")),
    "a reply without a score": (200, None, completion(f"I cannot tell. Bearer {KEY}")),
    "an error reply": (401, None, f'{{"error": "bad header Bearer {KEY}"}}'.encode()),
    "a reply not JSON": (200, None, f"<html>Bearer {KEY}</html>".encode()),
    "the reason phrase": (403, f"Forbidden for Bearer {KEY}", b""),
    "JSON-escaped": (401, None, ('{"error": "' + KEY.replace("-", "\\u002d") + '"}').encode()),
    "URL-encoded": (401, None, f"key={KEY.replace('-', '%2D')}".encode()),
    "cut by a line break": (200, None, completion(f"<score>1</score> {KEY[:5]}\n{KEY[5:]}")),
    "upper-cased": (401, None, f"unknown key {KEY.upper()}".encode()),
}


@pytest.mark.parametrize("status, reason, body", ECHOES.values(), ids=ECHOES.keys())
def test_endpoint_never_passes_on_an_echoed_key(server, monkeypatch, status, reason, body):
    """A server that echoes the Authorization header, wherever in its reply, gets the key into
    neither an error message nor a verdict's reason (kept in the episode's info): it is blanked
    to ***."""
    monkeypatch.setenv("COD_FAST_JUDGE_API_KEY", KEY)
    server.status, server.reason, server.body = status, reason, body
    try:
        said = EndpointJudge(server.url).score(QUERY).reason
    except JudgeError as error:
        said = str(error)
    assert KEY not in said and "***" in said, said
    assert not any(KEY[i : i + 6] in said for i in range(len(KEY) - 5)), said


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_endpoint_follows_no_redirect(start_server, monkeypatch, status):
    """A redirect is a one-line error naming its status and Location (the key blanked) and the
    fix; the request never reaches the other server, so neither does the key."""
    monkeypatch.setenv("COD_FAST_JUDGE_API_KEY", KEY)
    elsewhere, redirecting = start_server(), start_server()
    location = f"{elsewhere.url}/chat/completions?key={KEY}"
    redirecting.status, redirecting.headers = status, {"Location": location}
    message = one_line_error(EndpointJudge(redirecting.url), f"HTTP {status} redirects to")
    assert elsewhere.requests == []
    assert f"{elsewhere.url}/chat/completions?key=***" in message and KEY not in message
    assert "name the final URL in rollout.judge" in message


def test_endpoint_connects_directly_whatever_the_proxy_variables(start_server, monkeypatch):
    """The request, key and all, goes straight to the named host: a proxy named in the
    environment sees nothing."""
    monkeypatch.setenv("COD_FAST_JUDGE_API_KEY", KEY)
    judge, proxy = start_server(), start_server()
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.setenv(var, proxy.url.removesuffix("/v1"))
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    assert EndpointJudge(judge.url).score(QUERY).score == pytest.approx(0.8)
    assert proxy.requests == [] and judge.requests[0]["authorization"] == f"Bearer {KEY}"


def test_endpoint_refuses_a_key_no_header_can_carry(monkeypatch):
    """A key with a line break (a copy-paste slip) is a one-line JudgeError naming the variable,
    at construction, without the key; http.client would refuse the header with the key in its
    message."""
    monkeypatch.setenv("COD_FAST_JUDGE_API_KEY", f"{KEY}\n")
    with pytest.raises(JudgeError, match="COD_FAST_JUDGE_API_KEY holds a line break") as error:
        EndpointJudge("http://127.0.0.1:9/v1")
    assert KEY not in str(error.value) and "\n" not in str(error.value)


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


def raw_reply(body: bytes, *headers: bytes) -> bytes:
    """A 200 reply: the status line, `headers` (each ending in CRLF), a blank line, `body`."""
    return b"HTTP/1.1 200 OK\r\n" + b"".join(headers) + b"\r\n" + body


VERDICT = completion("<score>1</score>")
SIZED = f"Content-Length: {len(VERDICT)}\r\n".encode()
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Each drips a byte (or an interim reply) every 0.2 s for 10 s, then ends in a good verdict: a
# client bounded per read alone waits it out and scores, and so fails the test.
DRIPS = {
    "the headers": (
        "http",
        b"HTTP/1.1 200 OK\r\nX-Slow: ",
        b"a",
        b"\r\n" + SIZED + b"\r\n" + VERDICT,
    ),
    "the body": ("http", raw_reply(b"", b"Connection: close\r\n"), b" ", VERDICT),
    "interim replies": ("http", b"", CONTINUE, raw_reply(VERDICT, SIZED)),
    # A TLS record header announcing 16 KiB: the handshake waits for every byte of it (CPython
    # bounds a handshake as a whole; this keeps the client's own TLS wrap under the deadline).
    "the TLS handshake": ("https", b"\x16\x03\x03\x40\x00", b"\x00", b""),
}


@pytest.mark.slow  # each waits out its one-second deadline
@pytest.mark.parametrize("scheme, head, drop, tail", DRIPS.values(), ids=DRIPS.keys())
def test_endpoint_that_drips_its_reply_times_out(raw_server, scheme, head, drop, tail):
    """timeout_s bounds the whole request, connect to the reply's last byte: a server that keeps
    each read short of any per-read timeout, one byte every 0.2 s, is cut at 1 s."""
    raw_server.chunks, raw_server.pause = chain([head], repeat(drop, 50), [tail]), 0.2
    url = raw_server.url.replace("http", scheme, 1)
    start = time.monotonic()
    one_line_error(EndpointJudge(url, timeout_s=1.0), "no answer within 1 s")
    assert time.monotonic() - start < 5.0


SPACES = b" " * 65536  # JSON may start with any amount of white space
# Each streams 16 MiB (a gigabyte would look the same to the client) then a good verdict.
ENDLESS = {
    "until closed": (b"Connection: close\r\n", SPACES, VERDICT),
    "a length of 1 GiB": (b"Content-Length: 1073741824\r\n", SPACES, VERDICT),
    "chunked": (
        b"Transfer-Encoding: chunked\r\n",
        b"10000\r\n" + SPACES + b"\r\n",
        f"{len(VERDICT):x}\r\n".encode() + VERDICT + b"\r\n0\r\n\r\n",
    ),
}


@pytest.mark.parametrize("header, piece, tail", ENDLESS.values(), ids=ENDLESS.keys())
def test_endpoint_reads_no_reply_over_the_cap(raw_server, header, piece, tail):
    """A reply over MAX_REPLY_BYTES is a one-line error as soon as the cap is passed, whatever
    its framing; the client reads no further (it neither waits for the rest nor holds it)."""
    raw_server.chunks = chain([raw_reply(b"", header)], repeat(piece, 256), [tail])
    start = time.monotonic()
    judge = EndpointJudge(raw_server.url, timeout_s=30.0)
    one_line_error(judge, f"the reply is over {MAX_REPLY_BYTES} bytes")
    assert time.monotonic() - start < 5.0


def test_endpoint_error_reply_over_the_cap_keeps_its_status(raw_server):
    """An error reply over the cap still says its status (the body is not quoted)."""
    head = b"HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\n\r\n"
    raw_server.chunks = chain([head], repeat(SPACES, 256))
    message = one_line_error(EndpointJudge(raw_server.url), "HTTP 500 Internal Server Error")
    assert f"over {MAX_REPLY_BYTES} bytes" in message


BROKEN = {
    "hangs up at once": b"",
    "hangs up in the status line": b"HTTP/1.1 20",
    "hangs up in the headers": b"HTTP/1.1 200 OK\r\nContent-Ty",
    "no HTTP": b"SSH-2.0-OpenSSH_9.6\r\n",
    "binary": bytes(range(256)) * 4,
    "a status that is no number": b"HTTP/1.1 OK fine\r\n\r\n",
    "a status out of range": b"HTTP/1.1 20000 OK\r\n\r\n",
    "the key as the status": f"HTTP/1.1 {KEY}\r\n\r\n".encode(),
    "a header line over 64 KiB": raw_reply(b"", b"X-Long: " + b"a" * 70_000 + b"\r\n"),
    "too many headers": raw_reply(b"", b"X-Many: y\r\n" * 101),
    "a length that is no number": raw_reply(b"<html>", b"Content-Length: lots\r\n"),
    "a negative length": raw_reply(b"<html>", b"Content-Length: -5\r\n"),
    "a body short of its length": raw_reply(VERDICT, b"Content-Length: 500\r\n"),
    "a chunk size that is no number": raw_reply(b"zz\r\nabc", b"Transfer-Encoding: chunked\r\n"),
    "a negative chunk size": raw_reply(b"-5\r\n" + VERDICT, b"Transfer-Encoding: chunked\r\n"),
    "a chunk short of its size": raw_reply(
        b"ffff\r\n" + VERDICT, b"Transfer-Encoding: chunked\r\n"
    ),
    "no last chunk": raw_reply(b"5\r\nhello\r\n", b"Transfer-Encoding: chunked\r\n"),
}


@pytest.mark.parametrize("answer", BROKEN.values(), ids=BROKEN.keys())
def test_endpoint_that_breaks_http_is_a_judge_error(raw_server, monkeypatch, answer):
    """Whatever bytes come back, the judge raises JudgeError (nothing else): one printable line
    naming the endpoint, without the key."""
    monkeypatch.setenv("COD_FAST_JUDGE_API_KEY", KEY)
    raw_server.chunks = [answer]
    judge = EndpointJudge(raw_server.url, timeout_s=5.0)
    message = one_line_error(judge, f"judge endpoint {judge.url}: ")
    assert message.isprintable() and KEY not in message, message


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
    monkeypatch.setattr(socket, "create_connection", forbidden)
    for spec in ["rule", "http://127.0.0.1:8000/v1", "https://judge.example", str(folder)]:
        assert judge_problem(spec) is None, spec


def test_endpoint_judge_refuses_what_is_no_url():
    """An EndpointJudge built directly from a non-URL or a URL without a host is a one-line
    JudgeError."""
    for url, match in [("127.0.0.1:8000/v1", "not an http(s):// URL"), ("http://", "host")]:
        with pytest.raises(JudgeError, match=re.escape(match)):
            EndpointJudge(url)
