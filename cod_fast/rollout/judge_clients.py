"""Judges that read: a Hugging Face model folder or an OpenAI-compatible endpoint scores episodes.

Some environments are best scored by a reader rather than a rule (a free-text diagnosis, an
essay). Such an environment hands each finished solve episode to a judge as a `JudgeQuery`
(cod_fast.envs.judge), and the judge answers with a `Verdict`. Three back ends:

- `rule`: the environment's own rule-based verdict (`RuleJudge`, no reader at all);
- a model folder: a local causal LM run in this process through the trainer's own sampler,
  near-greedy, in float32 on the CPU (`ModelJudge`);
- an `http(s)://` URL: an OpenAI-compatible chat-completions endpoint such as vLLM's or
  llama.cpp's server (`EndpointJudge`), standard library only, each request bounded in time and
  size, the API key sent to the named host alone.

The model and the endpoint read the same (system, user) prompt, `judge_prompt`, and their reply
is read by `parse_verdict`, so a judge can move from one back end to the other unchanged. A judge
that gives no verdict raises `JudgeError` with one line naming the cause and the fix; the rollout
driver then scores the episode like an environment error.

This module sits above the environments: the rollout driver uses it, and the environment layer
knows nothing of it.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
from pathlib import Path

from cod_fast.envs.judge import (
    Judge,
    JudgeError,
    JudgeQuery,
    RuleJudge,
    Verdict,
    judge_prompt,
    parse_verdict,
)

API_KEY_VARS = ("COD_FAST_JUDGE_API_KEY", "OPENAI_API_KEY")
"""Where an endpoint judge's API key comes from, the first one set winning; sent as a bearer
token, never shown in a message."""
NEAR_GREEDY = 1e-3
"""The model judge's temperature: the sampler divides the logits by it, so 0 is refused; at
1e-3 a token needs a logit within ~0.01 of the best one to have any real chance."""
SHOWN_CHARS = 120
"""How much of a server's reply an error message quotes."""
MAX_REPLY_BYTES = 1 << 20
"""The largest reply an endpoint judge reads: far above any chat completion of a few thousand
tokens, far below what would strain the memory of the process."""
READ_BYTES = 1 << 16
"""How much of a reply the endpoint judge reads at a time."""
SPECS = "'rule', the http(s):// URL of an OpenAI-compatible endpoint, or a local model folder"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def judge_problem(spec: str) -> str | None:
    """Why `spec` names no usable judge (one line), or None. Cheap enough for a config check:
    it loads no model and sends no request, so a folder with config.json may still fail to load
    (its tokenizer, its sizes) and a URL may still find no server."""
    if not spec.strip():
        return f"an empty judge; write {SPECS}"
    if spec == "rule":
        return None
    if _is_url(spec):
        try:
            parts = urllib.parse.urlsplit(spec)
            host, _ = parts.hostname, parts.port  # reading a port that is no number raises
        except ValueError as e:
            return f"{spec}: not a URL ({_one_line(e)}); write it as http://HOST:PORT/v1"
        if not host:
            return f"{spec}: a URL without a host; write it as http://HOST:PORT/v1"
        return None
    path = Path(spec)
    if not path.is_dir():
        what = "a file" if path.exists() else "no such folder"
        return f"{spec}: {what}; a judge is {SPECS}"
    if not (path / "config.json").is_file():
        return (
            f"{spec}: a folder without config.json; expected a model folder as `cod-fast export` "
            "or a model's save_pretrained writes it"
        )
    return None


class ModelJudge(Judge):
    """A causal LM folder that reads `judge_prompt` in its chat format and answers near-greedily
    (at most `max_tokens` tokens). Loaded once, in float32 on the CPU, with the loader every
    model of a run goes through (cod_fast.model.loading.load_policy); `close` frees it."""

    name = "model"

    def __init__(self, path: str, *, max_tokens: int = 64, seed: int = 0):
        if problem := judge_problem(path):
            raise JudgeError(f"judge model {problem}; fix rollout.judge")
        # Imported here: the rule and endpoint judges, and config checks, need no torch.
        from cod_fast.config import ModelConfig
        from cod_fast.model.loading import load_policy
        from cod_fast.rollout.chat import ChatFormat
        from cod_fast.rollout.torch_sampler import TorchSampler

        cfg = ModelConfig(name_or_path=path, dtype="float32")
        try:
            model, tokenizer = load_policy(cfg, "cpu")
            self.chat = ChatFormat.for_model(tokenizer, cfg)
        except (ValueError, OSError) as e:  # ModelFolderError, ConfigError, unreadable files
            raise JudgeError(
                f"judge model {path} does not load ({_one_line(e)}); fix the folder or "
                "rollout.judge"
            ) from None
        self.path, self.max_tokens, self.seed = path, max_tokens, seed
        # A judge never trains: frozen weights, so no call can build a graph over them.
        self.model = model.eval().requires_grad_(False)
        self.sampler = TorchSampler(self.model, tokenizer, temperature=NEAR_GREEDY, seed=seed)

    def score(self, query: JudgeQuery) -> Verdict:
        import torch

        if self.sampler is None:
            raise JudgeError(f"judge model {self.path} was closed; make a new judge to score")
        prompt = self.chat.first_prompt(*judge_prompt(query))
        with torch.inference_mode():
            # Keyed by the seed alone: a query gets the same reply whatever was judged before.
            [sample] = self.sampler.generate([prompt], [self.max_tokens], keys=[self.seed])
        reply = self.chat.decode(sample.token_ids)
        try:
            return parse_verdict(reply)
        except JudgeError as e:
            raise JudgeError(
                f"judge model {self.path}: unreadable reply ({e}); use a model that follows the "
                "prompt's <score>S</score> form, or raise rollout.judge_max_tokens"
            ) from None

    def close(self) -> None:
        self.model = self.sampler = None


class EndpointJudge(Judge):
    """An OpenAI-compatible server: one POST to `{url}/chat/completions` per episode, with the
    `judge_prompt` messages, temperature 0 and `max_tokens`; the reply is
    `choices[0].message.content`.

    The API key is the user's, so the client sends it to the named host alone: it connects
    directly (proxy environment variables are not read, so no proxy sees the key), follows no
    redirect (one is an error naming its Location), and blanks the key out of every message and
    verdict reason (a server may echo the request's headers). Each request is bounded: connect,
    send and the whole reply, headers included, within `timeout_s` (a watchdog cuts a server that
    drips a byte at a time), and a reply over MAX_REPLY_BYTES is an error read no further."""

    name = "endpoint"

    def __init__(
        self, url: str, model: str = "default", *, timeout_s: float = 30.0, max_tokens: int = 64
    ):
        problem = judge_problem(url) if _is_url(url) else f"{url}: not an http(s):// URL"
        if problem:
            raise JudgeError(f"judge endpoint {problem}; fix rollout.judge")
        self.url = url.rstrip("/") + "/chat/completions"
        self.model, self.timeout_s, self.max_tokens = model, timeout_s, max_tokens
        var = next((v for v in API_KEY_VARS if os.environ.get(v)), None)
        self._key = os.environ[var] if var else None
        if self._key and not (self._key.isascii() and self._key.isprintable()):
            raise JudgeError(
                f"{var} holds a line break, a control or a non-ASCII character, which no HTTP "
                "header carries; set it to the API key alone"
            )
        parts = urllib.parse.urlsplit(self.url)
        https = parts.scheme == "https"
        self._address = (parts.hostname, parts.port or (443 if https else 80))
        self._target = parts.path + (f"?{parts.query}" if parts.query else "")
        self._tls = ssl.create_default_context() if https else None

    def score(self, query: JudgeQuery) -> Verdict:
        system, user = judge_prompt(query)
        body = {
            "model": self.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "temperature": 0,
            "max_tokens": self.max_tokens,
        }
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        status, reason, location, raw = self._post(json.dumps(body).encode(), headers)
        if 300 <= status < 400 and location is not None:
            raise self._error(
                f"HTTP {status} redirects to {self._shown(location)}",
                "name the final URL in rollout.judge (the judge follows no redirect, so that the "
                "API key goes to the named host alone)",
            )
        if not 200 <= status < 300:
            shown = self._shown(raw) if raw is not None else f"over {MAX_REPLY_BYTES} bytes"
            raise self._error(
                f"HTTP {status} {self._clean(reason)} ({shown})",
                f"check the server's log and rollout.judge_model ({self.model!r})",
            )
        if raw is None:
            raise self._error(
                f"the reply is over {MAX_REPLY_BYTES} bytes",
                "is this an OpenAI-compatible chat-completions endpoint? check rollout.judge",
            )
        try:
            reply = json.loads(raw)["choices"][0]["message"]["content"]
        except RecursionError:  # the parser recurses once per level of nesting
            raise self._error(
                "the reply is not JSON (nested too deeply)",
                "is this an OpenAI-compatible endpoint? check rollout.judge",
            ) from None
        except ValueError:  # not UTF-8, not JSON
            raise self._error(
                f"the reply is not JSON ({self._shown(raw)})",
                "is this an OpenAI-compatible endpoint? check rollout.judge",
            ) from None
        except (KeyError, IndexError, TypeError):
            raise self._error(
                f"the reply has no choices[0].message.content ({self._shown(raw)})",
                "is this an OpenAI-compatible chat-completions endpoint? check rollout.judge",
            ) from None
        if not isinstance(reply, str):
            raise self._error(
                f"choices[0].message.content is {type(reply).__name__}, not text",
                "check the server's log and rollout.judge_model",
            )
        try:
            return parse_verdict(self._blank(reply))  # the verdict's reason quotes the reply
        except JudgeError as e:
            raise self._error(
                f"unreadable reply ({e})",
                "use a model that follows the prompt's <score>S</score>, or raise "
                "rollout.judge_max_tokens",
            ) from None

    def _post(
        self, body: bytes, headers: dict[str, str]
    ) -> tuple[int, str, str | None, bytes | None]:
        """POST `body` to the endpoint: (status, reason, Location header, reply), the reply None
        when it is over MAX_REPLY_BYTES. JudgeError when no reply comes within timeout_s."""
        with _Deadline(self.timeout_s) as deadline:
            connection = self._connect(deadline)
            try:
                connection.request("POST", self._target, body, headers)
                response = connection.getresponse()
                raw = _read_reply(response, deadline)
                return response.status, response.reason, response.getheader("Location"), raw
            except (OSError, http.client.HTTPException) as e:  # TimeoutError is an OSError
                if isinstance(e, TimeoutError) or deadline.expired.is_set():
                    raise self._timeout() from None
                raise self._error(
                    f"the connection failed ({type(e).__name__}: {self._clean(e)})",
                    "is the server running? check rollout.judge",
                ) from None
            finally:
                connection.close()

    def _connect(self, deadline: _Deadline) -> http.client.HTTPConnection:
        """A connection to the endpoint's host, its TLS handshake done, watched by `deadline`.
        JudgeError when there is none. The name lookup is the system's, outside the deadline;
        each address it gives is tried for at most the time left."""
        sock = None
        try:
            sock = socket.create_connection(self._address, timeout=deadline.left())
            deadline.watch(sock)
            if self._tls is None:
                connection = http.client.HTTPConnection(*self._address)
            else:  # wrapped here, so that the watchdog cuts a handshake that drips too
                sock = self._tls.wrap_socket(sock, server_hostname=self._address[0])
                connection = http.client.HTTPSConnection(*self._address, context=self._tls)
        except (OSError, ValueError) as e:  # refused, no such host, a host name that is no name
            if sock is not None:
                sock.close()
            if isinstance(e, TimeoutError) or deadline.expired.is_set():
                raise self._timeout() from None
            raise self._error(
                f"unreachable ({self._clean(e)})", "is the server running? check rollout.judge"
            ) from None
        connection.sock = sock  # already connected: http.client opens no connection of its own
        return connection

    def _timeout(self) -> JudgeError:
        return self._error(
            f"no answer within {self.timeout_s:g} s",
            "is the server overloaded? raise rollout.judge_timeout_s",
        )

    def _blank(self, text: str) -> str:
        """`text` with the API key blanked out (a server may echo the request's headers): the
        key as sent, URL- or JSON-escaped, in any case, and split by whitespace (a reply is
        shown on one line)."""
        if not self._key:
            return text
        return self._key_pattern.sub("***", text)

    @functools.cached_property
    def _key_pattern(self) -> re.Pattern[str]:
        """The key as a server may echo it: each character as sent, backslash-, JSON- or
        URL-escaped (`\\/`, `\\u002d`, `%2D`), in any case, with whitespace anywhere between
        (a line break in a reply); and URL-quoted as a whole (`+` for a space)."""
        key = self._key or ""

        def char(c: str) -> str:
            return rf"(?:\\?{re.escape(c)}|\\u{ord(c):04x}|%{ord(c):02x})"

        plus = urllib.parse.quote_plus(key)
        spelled = [r"\s*".join(map(char, key)), r"\s*".join(map(re.escape, plus))]
        return re.compile("|".join(spelled), re.IGNORECASE)

    def _clip(self, text: object) -> str:
        """`text` (a server's words, an exception) on one line, the key blanked, then clipped:
        blanking first, so that a key cut by a line break is still found, and clipping last,
        so that no part of the key is left."""
        return _one_line(self._blank(str(text)))[:SHOWN_CHARS]

    def _clean(self, text: object) -> str:
        """`text` clipped for a message, control characters escaped (a server chose them)."""
        return repr(self._clip(text))[1:-1]

    def _shown(self, raw: bytes | str) -> str:
        """The start of a server's reply (or a header), quoted, for a message."""
        text = self._clip(raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw)
        return repr(text) if text else "empty"

    def _error(self, cause: str, fix: str) -> JudgeError:
        return JudgeError(self._blank(f"judge endpoint {self.url}: {cause}; {fix}"))


class _Deadline:
    """One request's overall deadline. `left()` is the time left, TimeoutError once there is
    none; `watch(sock)` arms a watchdog that shuts the socket down at the deadline, which ends
    any read or write on it. The socket's own timeout bounds each operation alone, so a server
    that sends a byte at a time would never trip it. Leaving the `with` block stops the watchdog."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.expired = threading.Event()
        self._cutter: socket.socket | None = None
        self._watchdog: threading.Timer | None = None

    def __enter__(self) -> _Deadline:
        return self

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0 or self.expired.is_set():
            raise TimeoutError("the deadline has passed")
        return left

    def watch(self, sock: socket.socket) -> None:
        delay = self.left()
        # A second handle on the same socket: still a plain one once TLS wraps (detaches) `sock`.
        self._cutter = sock.dup()
        self._watchdog = threading.Timer(delay, self._cut)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _cut(self) -> None:
        self.expired.set()
        with contextlib.suppress(OSError):  # a socket the peer has already closed
            self._cutter.shutdown(socket.SHUT_RDWR)

    def __exit__(self, *exc: object) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog.join()  # a cut under way ends before its socket is closed
            self._cutter.close()


def _read_reply(response: http.client.HTTPResponse, deadline: _Deadline) -> bytes | None:
    """The body of `response`, read in pieces: None once it is over MAX_REPLY_BYTES (read no
    further), TimeoutError when the watchdog cut it short, IncompleteRead when the server closed
    before the length it announced."""
    pieces, size = [], 0
    while piece := response.read1(READ_BYTES):
        size += len(piece)
        if size > MAX_REPLY_BYTES:
            return None
        pieces.append(piece)
    deadline.left()
    if response.length:  # read1 takes an early close for the end
        raise http.client.IncompleteRead(b"".join(pieces), response.length)
    return b"".join(pieces)


def make_judge(
    spec: str, *, model: str | None = None, timeout_s: float = 30.0, max_tokens: int = 64
) -> Judge:
    """The judge `spec` names: `rule`, an http(s):// endpoint URL (serving `model`, default
    "default"), else a model folder (loaded once per process and shared: not to be closed).
    JudgeError, in one line, for a spec `judge_problem` refuses or a model folder that does not
    load."""
    if problem := judge_problem(spec):
        raise JudgeError(f"rollout.judge: {problem}")
    if spec == "rule":
        return RuleJudge()
    if _is_url(spec):
        return EndpointJudge(spec, model or "default", timeout_s=timeout_s, max_tokens=max_tokens)
    return _loaded_model_judge(spec, max_tokens)


@functools.lru_cache(maxsize=1)
def _loaded_model_judge(path: str, max_tokens: int) -> ModelJudge:
    """One loaded judge model per process: every rollout driver of a run (training, and each
    evaluation, which makes a driver per environment) shares it instead of loading the folder
    again. Its replies depend on the query alone (keyed sampling), so sharing changes none."""
    return ModelJudge(path, max_tokens=max_tokens)
