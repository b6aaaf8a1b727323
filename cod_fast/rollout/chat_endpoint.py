"""One bounded, trusted client of an OpenAI-compatible chat-completions endpoint.

Two parts of cod-fast send chat messages to a server the user names: the endpoint judge
(cod_fast.rollout.judge_clients), which scores free-text answers, and the endpoint player
(cod_fast.rollout.endpoint_player), which plays the environments in `cod-fast eval --model
openai:URL#MODEL`. Both go through `ChatEndpoint`, standard library only:

- the API key is the user's, so it goes to the named host alone: the client connects directly
  (proxy environment variables are not read, so no proxy sees the key), follows no redirect (one
  is an error naming its Location), and blanks the key out of every message (a server may echo
  the request's headers);
- each request is bounded: connect, send and the whole reply, headers included, within
  `timeout_s` (a watchdog cuts a server that drips a byte at a time), and a reply over
  MAX_REPLY_BYTES is an error read no further;
- every failure is one `EndpointError`, one line naming the endpoint (its URL without
  credentials or query), the cause and the fix, and saying whether another try may succeed
  (`transient`: a timeout, a dropped connection, a 5xx, 408 or 429 status).
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
from dataclasses import dataclass
from typing import Any

from cod_fast.common.errors import CodFastError

SHOWN_CHARS = 120
"""How much of a server's reply an error message quotes."""
MAX_REPLY_BYTES = 1 << 20
"""The largest reply read: far above any chat completion of a few thousand tokens, far below
what would strain the memory of the process."""
READ_BYTES = 1 << 16
"""How much of a reply is read at a time."""
TRANSIENT_STATUSES = frozenset({408, 429})
"""Statuses below 500 that another try may cure: a request timeout and a rate limit."""


class EndpointError(RuntimeError, CodFastError):
    """An endpoint that gave no completion, in one line (cause and fix, the key blanked);
    `transient` when another try may succeed."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True)
class EndpointNames:
    """What an endpoint's messages call it and the settings that fix it."""

    who: str
    """The endpoint's role, leading each message: "judge endpoint"."""
    url_setting: str
    """Where its URL is set: "rollout.judge"."""
    model_setting: str
    """Where its model name is set: "rollout.judge_model"."""
    timeout_fix: str
    """What to do when it does not answer in time: "raise rollout.judge_timeout_s"."""
    key_note: str = ""
    """Added to the fix of an error status (a key that is refused shows as one)."""


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def url_problem(url: str) -> str | None:
    """Why `url`, an http(s):// URL, names no endpoint (one line), or None. Sends nothing."""
    try:
        parts = urllib.parse.urlsplit(url)
        host, _ = parts.hostname, parts.port  # reading a port that is no number raises
    except ValueError as e:
        return f"{url}: not a URL ({one_line(e)}); write it as http://HOST:PORT/v1"
    if not host:
        return f"{url}: a URL without a host; write it as http://HOST:PORT/v1"
    return None


def shown_url(url: str) -> str:
    """`url` as messages and files show it: scheme, host, port and path, without the user name,
    password or query it may carry."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def api_key(key_vars: tuple[str, ...]) -> str | None:
    """The API key from the first of `key_vars` that is set (None: send no key); EndpointError
    for one that no HTTP header carries, naming the variable, never the key."""
    var = next((v for v in key_vars if os.environ.get(v)), None)
    key = os.environ[var] if var else None
    if key and not (key.isascii() and key.isprintable()):
        raise EndpointError(
            f"{var} holds a line break, a control or a non-ASCII character, which no HTTP "
            "header carries; set it to the API key alone"
        )
    return key


class ChatEndpoint:
    """An OpenAI-compatible server: one POST to `{url}/chat/completions` per `complete` call,
    with the key from the first of `key_vars` that is set as a bearer token. Safe to call from
    several threads at once: each call opens its own connection."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        key_vars: tuple[str, ...],
        timeout_s: float,
        names: EndpointNames,
    ):
        if problem := (url_problem(url) if is_url(url) else f"{url}: not an http(s):// URL"):
            raise EndpointError(f"{names.who} {problem}; fix {names.url_setting}")
        full = url.rstrip("/") + "/chat/completions"
        self.url = shown_url(full)
        self.model, self.timeout_s, self.names = model, timeout_s, names
        self._key = api_key(key_vars)
        parts = urllib.parse.urlsplit(full)
        https = parts.scheme == "https"
        self._address = (parts.hostname, parts.port or (443 if https else 80))
        self._target = parts.path + (f"?{parts.query}" if parts.query else "")
        self._tls = ssl.create_default_context() if https else None

    def complete(
        self,
        messages: list[dict[str, str]],
        *,
        temperature: float,
        max_tokens: int,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> tuple[str, str]:
        """(content, finish reason) of one chat completion of `messages`; `top_p` and `seed`
        are sent when given. A reply without content that the server cut at `max_tokens` (a
        model that spent them all thinking) is the empty text."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": temperature,
            "max_tokens": max_tokens,
        }
        if top_p is not None:
            body["top_p"] = top_p
        if seed is not None:
            body["seed"] = seed
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        status, reason, location, raw = self._post(json.dumps(body).encode(), headers)
        return self._read(status, reason, location, raw)

    def _read(
        self, status: int, reason: str, location: str | None, raw: bytes | None
    ) -> tuple[str, str]:
        """The completion in a reply, or the EndpointError it amounts to."""
        names = self.names
        check = f"check {names.url_setting}"
        if 300 <= status < 400 and location is not None:
            raise self.error(
                f"HTTP {status} redirects to {self.shown(location)}",
                f"name the final URL in {names.url_setting} (the {names.who.split()[0]} follows "
                "no redirect, so that the API key goes to the named host alone)",
            )
        if not 200 <= status < 300:
            shown = self.shown(raw) if raw is not None else f"over {MAX_REPLY_BYTES} bytes"
            raise self.error(
                f"HTTP {status} {self.clean(reason)} ({shown})",
                f"check the server's log and {names.model_setting} ({self.model!r})"
                + names.key_note,
                transient=status >= 500 or status in TRANSIENT_STATUSES,
            )
        if raw is None:
            raise self.error(
                f"the reply is over {MAX_REPLY_BYTES} bytes",
                f"is this an OpenAI-compatible chat-completions endpoint? {check}",
            )
        try:
            choice = json.loads(raw)["choices"][0]
            content, finish = choice["message"]["content"], choice.get("finish_reason")
        except RecursionError:  # the parser recurses once per level of nesting
            raise self.error(
                "the reply is not JSON (nested too deeply)",
                f"is this an OpenAI-compatible endpoint? {check}",
            ) from None
        except ValueError:  # not UTF-8, not JSON
            raise self.error(
                f"the reply is not JSON ({self.shown(raw)})",
                f"is this an OpenAI-compatible endpoint? {check}",
            ) from None
        except (KeyError, IndexError, TypeError):
            raise self.error(
                f"the reply has no choices[0].message.content ({self.shown(raw)})",
                f"is this an OpenAI-compatible chat-completions endpoint? {check}",
            ) from None
        if content is None and finish == "length":
            content = ""
        if not isinstance(content, str):
            raise self.error(
                f"choices[0].message.content is {type(content).__name__}, not text",
                f"check the server's log and {names.model_setting}",
            )
        return content, "length" if finish == "length" else "stop"

    def _post(
        self, body: bytes, headers: dict[str, str]
    ) -> tuple[int, str, str | None, bytes | None]:
        """POST `body` to the endpoint: (status, reason, Location header, reply), the reply None
        when it is over MAX_REPLY_BYTES. EndpointError when no reply comes within timeout_s."""
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
                raise self.error(
                    f"the connection failed ({type(e).__name__}: {self.clean(e)})",
                    f"is the server running? check {self.names.url_setting}",
                    transient=True,
                ) from None
            finally:
                connection.close()

    def _connect(self, deadline: _Deadline) -> http.client.HTTPConnection:
        """A connection to the endpoint's host, its TLS handshake done, watched by `deadline`.
        EndpointError when there is none. The name lookup is the system's, outside the
        deadline; each address it gives is tried for at most the time left."""
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
            raise self.error(
                f"unreachable ({self.clean(e)})",
                f"is the server running? check {self.names.url_setting}",
            ) from None
        connection.sock = sock  # already connected: http.client opens no connection of its own
        return connection

    def _timeout(self) -> EndpointError:
        return self.error(
            f"no answer within {self.timeout_s:g} s",
            f"is the server overloaded? {self.names.timeout_fix}",
            transient=True,
        )

    def blank(self, text: str) -> str:
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
        return one_line(self.blank(str(text)))[:SHOWN_CHARS]

    def clean(self, text: object) -> str:
        """`text` clipped for a message, control characters escaped (a server chose them)."""
        return repr(self._clip(text))[1:-1]

    def shown(self, raw: bytes | str) -> str:
        """The start of a server's reply (or a header), quoted, for a message."""
        text = self._clip(raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw)
        return repr(text) if text else "empty"

    def message(self, cause: str, fix: str) -> str:
        """One line naming the endpoint, `cause` and `fix`, the key blanked."""
        return self.blank(f"{self.names.who} {self.url}: {cause}; {fix}")

    def error(self, cause: str, fix: str, *, transient: bool = False) -> EndpointError:
        return EndpointError(self.message(cause, fix), transient=transient)


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
