"""The endpoint player of cod_fast.rollout.endpoint_player: `openai:URL#MODEL` specs, the text
chat format whose prompts decode back into the chat messages, and the sampler that sends them to
an OpenAI-compatible endpoint (served on the loopback address by the test itself, its replies
scripted per test: failures, retries, timeouts, redirects, the API key)."""

from __future__ import annotations

import json
import time

import pytest

from cod_fast.rollout.chat_endpoint import EndpointError
from cod_fast.rollout.endpoint_player import (
    API_KEY_VARS,
    ASSISTANT,
    ROLES,
    SYSTEM,
    USER,
    EndpointSampler,
    TextChat,
    parse_player_spec,
    player_label,
    player_spec_shown,
)
from cod_fast.rollout.judge_clients import API_KEY_VARS as JUDGE_KEY_VARS
from cod_fast.rollout.sampler import request_seed
from tests.endpoint_server import Server, completion

KEY = "sk-eval-51c0de"
SENTINELS = "".join(map(chr, ROLES))


@pytest.fixture(autouse=True)
def no_api_key(monkeypatch):
    """No API key from the machine running the tests: a test sets the one it needs."""
    for var in {*API_KEY_VARS, *JUDGE_KEY_VARS}:
        monkeypatch.delenv(var, raising=False)


def sampler_of(server: Server, **kwargs) -> EndpointSampler:
    """A sampler of `server` that retries at once (no backoff)."""
    options = {"temperature": 0.7, "top_p": 1.0, "seed": 3, "backoff_s": 0.0} | kwargs
    return EndpointSampler(server.url, "m-7b", **options)


def prompt(chat: TextChat, *turns: str) -> list[int]:
    """A prompt the way the rollout driver builds one: system, user, then (reply, observation)
    pairs, each reply's ids as the sampler returned them."""
    ids = chat.first_prompt(turns[0], turns[1])
    for reply, observation in zip(turns[2::2], turns[3::2], strict=True):
        response = chat.encode(reply)
        ids += response + chat.continuation(response, observation)
    return ids


def one_line(error: pytest.ExceptionInfo, *parts: str) -> str:
    message = str(error.value)
    assert "\n" not in message and message.isprintable(), message
    for part in parts:
        assert part in message, message
    return message


# --- specs ----------------------------------------------------------------------------------------


def test_spec_names_url_and_model():
    """`openai:URL#MODEL` is (URL, MODEL); a spec of another kind (a folder, a hub id) is None."""
    assert parse_player_spec("openai:https://api.example.com/v1#qwen3-max") == (
        "https://api.example.com/v1",
        "qwen3-max",
    )
    assert parse_player_spec("openai:http://127.0.0.1:8000/v1#org/my-model") == (
        "http://127.0.0.1:8000/v1",
        "org/my-model",
    )
    for other in ("runs/model", "Qwen/Qwen3-0.6B", "http://host/v1#m", "openai"):
        assert parse_player_spec(other) is None


@pytest.mark.parametrize(
    "spec, match",
    [
        ("openai:https://api.example.com/v1", "no #MODEL"),
        ("openai:https://api.example.com/v1#", "an empty model name"),
        ("openai:https://api.example.com/v1#  ", "an empty model name"),
        ("openai:ftp://api.example.com/v1#m", "not http(s)://"),
        ("openai:api.example.com/v1#m", "not http(s)://"),
        ("openai:http://host:port/v1#m", "not a URL"),
        ("openai:http:///v1#m", "a URL without a host"),
        ("openai:https://user:sk-secret@api.example.com/v1#m", "carries a user name or password"),
        ("openai:https://user:sk-secret@api.example.com/v1", "carries a user name or password"),
        ("openai:https://api.example.com/v1?key=sk-secret", "no #MODEL"),
    ],
)
def test_malformed_spec_is_one_line_naming_the_fix(spec, match):
    """A malformed spec is a ValueError in one line, naming what is wrong and how to write it;
    neither a password nor a query of the URL is shown."""
    with pytest.raises(ValueError) as error:
        parse_player_spec(spec)
    message = one_line(error, match)
    assert "sk-secret" not in message
    assert "openai:URL#MODEL" in message or "COD_FAST_EVAL_API_KEY" in message or "HOST" in message


def test_label_and_shown_spec_hold_no_query():
    """A matrix row is `MODEL@host` (with the port the URL gives), and files show the spec
    without the URL's query, where a key might be."""
    url = "https://api.example.com:8443/v1?api-key=sk-q"
    assert player_label(url, "qwen3-max") == "qwen3-max@api.example.com:8443"
    assert player_label("https://api.example.com/v1", "m") == "m@api.example.com"
    assert player_spec_shown(url, "m") == "openai:https://api.example.com:8443/v1#m"


# --- the text chat format -------------------------------------------------------------------------


def test_prompt_decodes_back_into_its_messages():
    """The ids the driver builds (first prompt, replies, continuations) decode into exactly the
    messages that went in, the empty reply included; decode without sentinels is the text."""
    chat = TextChat()
    turns = ["sys\nline 2", "obs 0 ünïcode 🧊", "Direction 1", "obs 1", "", "obs 2"]
    want = [
        {"role": "system", "content": turns[0]},
        {"role": "user", "content": turns[1]},
        {"role": "assistant", "content": turns[2]},
        {"role": "user", "content": turns[3]},
        {"role": "assistant", "content": turns[4]},
        {"role": "user", "content": turns[5]},
    ]
    ids = prompt(chat, *turns)
    assert chat.messages(ids) == want
    assert chat.decode(ids) == "".join(turns)
    assert chat.decode(chat.encode("a🧊b")) == "a🧊b" and len(chat.encode("a🧊b")) == 3


def test_sentinels_in_text_do_not_open_messages():
    """An observation or a reply holding the sentinel characters (a hostile environment, a
    model that writes them) stays one message: each sentinel becomes U+FFFD."""
    chat = TextChat()
    hostile = f"a{SENTINELS}b{chr(ASSISTANT)}"
    ids = prompt(chat, "sys", hostile, hostile, hostile)
    messages = chat.messages(ids)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    clean = "a\ufffd\ufffd\ufffdb\ufffd"
    assert [m["content"] for m in messages[1:]] == [clean] * 3
    assert chat.truncate(hostile, 3) == ("a\ufffd\ufffd", True)
    assert chat.truncate("short", 5) == ("short", False)


def test_messages_refuse_what_is_no_prompt():
    """Ids without a role at the start or without the reply's opening at the end are refused."""
    chat = TextChat()
    for ids in ([], [SYSTEM], [ord("a"), ASSISTANT], [SYSTEM, ord("a"), USER, ord("b")]):
        with pytest.raises(ValueError, match="not a prompt of TextChat"):
            chat.messages(ids)


def test_transcript_shows_the_roles():
    """A transcript (decode with the special tokens kept) marks each message's role."""
    chat = TextChat()
    shown = chat.tokenizer.decode(prompt(chat, "S", "U"), skip_special_tokens=False)
    assert shown == "[system]\nS\n[user]\nU\n[assistant]\n"


# --- the sampler ----------------------------------------------------------------------------------


def test_sampler_sends_each_prompt_as_a_chat_completion(server):
    """One POST per prompt to {url}/chat/completions: the model, the messages, the cap as
    max_tokens, the temperature, the keyed seed (31 bits); top_p 1 left out. Replies come back
    in the prompts' order, as code points, log-probs 0."""
    server.answer = lambda body: (200, completion(body["messages"][-1]["content"].upper()))
    sampler, chat = sampler_of(server), TextChat()
    prompts = [prompt(chat, "sys", f"obs {i}") for i in range(12)]
    keys = [1000 + i for i in range(12)]
    samples = sampler.generate(prompts, [5 + i for i in range(12)], keys=keys)
    assert [chat.decode(s.token_ids) for s in samples] == [f"OBS {i}" for i in range(12)]
    assert all(s.logprobs == [0.0] * len(s.token_ids) for s in samples)
    assert all(s.finish_reason == "stop" for s in samples)
    by_obs = {r["body"]["messages"][-1]["content"]: r for r in server.requests}
    for i, key in enumerate(keys):
        request = by_obs[f"obs {i}"]
        assert request["path"] == "/v1/chat/completions"
        body = request["body"]
        assert body["model"] == "m-7b" and body["max_tokens"] == 5 + i
        assert body["temperature"] == 0.7 and "top_p" not in body
        assert body["seed"] == request_seed(3, key) >> 32 < 2**31
        assert body["messages"] == [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": f"obs {i}"},
        ]
        assert request["authorization"] is None
    assert sampler.calls == 1 and sampler.state_dict() == {"calls": 1}


def test_sampler_reads_the_length_finish_and_sends_top_p(server):
    """finish_reason `length` is the sample's; a reply cut before any content is the empty
    reply; top_p other than 1 is sent."""
    server.body = completion(None, finish_reason="length")
    [sample] = sampler_of(server, top_p=0.9).generate([prompt(TextChat(), "s", "u")], [4])
    assert sample.token_ids == [] and sample.finish_reason == "length"
    assert server.requests[0]["body"]["top_p"] == 0.9


def test_unkeyed_calls_send_seeds_from_the_call_count(server):
    """Without keys, each call's requests carry seeds that differ from call to call."""
    server.body = completion("x")
    sampler = sampler_of(server)
    for _ in range(2):
        sampler.generate([prompt(TextChat(), "s", "u")], [4])
    seeds = [r["body"]["seed"] for r in server.requests]
    assert len(set(seeds)) == 2


def test_server_error_is_tried_again(server):
    """A 500 then a good reply: the sampler tries again and plays on."""
    replies = iter([(500, b'{"error": "busy"}'), (200, completion("Direction 2"))])
    server.answer = lambda body: next(replies)
    [sample] = sampler_of(server).generate([prompt(TextChat(), "s", "u")], [8])
    assert TextChat().decode(sample.token_ids) == "Direction 2"
    assert len(server.requests) == 2


def test_persistent_server_error_ends_in_one_line_after_the_tries(server):
    """A server that keeps failing: 1 + retries requests, then one line naming the endpoint,
    the status and how many tries."""
    server.status, server.body = 503, b'{"error": "overloaded"}'
    with pytest.raises(EndpointError) as error:
        sampler_of(server, retries=2).generate([prompt(TextChat(), "s", "u")], [8])
    one_line(error, f"player endpoint {server.url}/chat/completions", "HTTP 503", "tried 3 times")
    assert len(server.requests) == 3


def test_refused_key_is_one_line_without_retry_or_key(server, monkeypatch):
    """A 401 (the server echoes the key) is not tried again: one line with the status and the
    key variable to check, the key blanked; the request carried it as a bearer token."""
    monkeypatch.setenv("COD_FAST_EVAL_API_KEY", KEY)
    server.status, server.body = 401, f'{{"error": "bad key Bearer {KEY}"}}'.encode()
    with pytest.raises(EndpointError) as error:
        sampler_of(server).generate([prompt(TextChat(), "s", "u")], [8])
    message = one_line(error, "HTTP 401", "COD_FAST_EVAL_API_KEY", "***")
    assert KEY not in message
    assert [r["authorization"] for r in server.requests] == [f"Bearer {KEY}"]


def test_eval_key_wins_and_the_judge_key_is_not_sent(server, monkeypatch):
    """COD_FAST_EVAL_API_KEY wins over OPENAI_API_KEY; the judge's own key is never the
    player's."""
    server.body = completion("x")
    monkeypatch.setenv("COD_FAST_JUDGE_API_KEY", "sk-judge")
    sampler_of(server).generate([prompt(TextChat(), "s", "u")], [4])
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    sampler_of(server).generate([prompt(TextChat(), "s", "u")], [4])
    monkeypatch.setenv("COD_FAST_EVAL_API_KEY", KEY)
    sampler_of(server).generate([prompt(TextChat(), "s", "u")], [4])
    auths = [r["authorization"] for r in server.requests]
    assert auths == [None, "Bearer sk-openai", f"Bearer {KEY}"]


def test_server_that_never_answers_is_bounded(server):
    """A server that takes the request and never answers: each try ends at timeout_s, and the
    sampler gives up after its tries, with one line."""
    server.hang = True
    timeout_s, retries = 0.25, 1
    start = time.monotonic()
    with pytest.raises(EndpointError) as error:
        sampler_of(server, timeout_s=timeout_s, retries=retries).generate(
            [prompt(TextChat(), "s", "u")], [8]
        )
    took = time.monotonic() - start
    one_line(error, "no answer within 0.25 s", "tried 2 times")
    assert (retries + 1) * timeout_s <= took < (retries + 1) * timeout_s + 1.0
    assert len(server.requests) == retries + 1


def test_redirect_is_refused(start_server, monkeypatch):
    """A redirect is one line naming it; the other server receives nothing, key or request."""
    monkeypatch.setenv("COD_FAST_EVAL_API_KEY", KEY)
    elsewhere, redirecting = start_server(), start_server()
    redirecting.status = 307
    redirecting.headers = {"Location": f"{elsewhere.url}/chat/completions"}
    with pytest.raises(EndpointError) as error:
        sampler_of(redirecting).generate([prompt(TextChat(), "s", "u")], [8])
    one_line(error, "HTTP 307 redirects to", "the player follows no redirect")
    assert elsewhere.requests == [] and len(redirecting.requests) == 1


@pytest.mark.parametrize(
    "body, match",
    [
        (b"<html>gateway</html>", "not JSON"),
        (b'{"choices": []}', "no choices[0].message.content"),
        (completion(None), "not text"),
    ],
)
def test_unreadable_reply_is_one_line_without_retry(server, body, match):
    """Garbage JSON, no choices or no content: one line naming the endpoint, no second try."""
    server.body = body
    with pytest.raises(EndpointError) as error:
        sampler_of(server).generate([prompt(TextChat(), "s", "u")], [8])
    one_line(error, f"player endpoint {server.url}/chat/completions", match)
    assert len(server.requests) == 1


def test_sampler_takes_no_weights_and_keeps_its_call_count(server):
    """An API model takes no weights; its state is the call count, read back as the other
    samplers read theirs."""
    sampler = sampler_of(server)
    with pytest.raises(ValueError, match="takes no weights"):
        sampler.push_weights([])
    sampler.load_state_dict({"calls": 7})
    assert sampler.calls == 7
    with pytest.raises(ValueError, match="call count"):
        sampler.load_state_dict({"calls": -1})
    sampler.sleep()
    sampler.close()


def test_key_no_header_carries_is_refused_without_showing_it(monkeypatch):
    """A key with a line break is refused at construction, naming the variable, not the key."""
    monkeypatch.setenv("COD_FAST_EVAL_API_KEY", f"{KEY}\n")
    with pytest.raises(EndpointError) as error:
        EndpointSampler("http://127.0.0.1:9/v1", "m", temperature=1.0, top_p=1.0, seed=0)
    assert "COD_FAST_EVAL_API_KEY holds a line break" in str(error.value)
    assert KEY not in json.dumps(str(error.value))
