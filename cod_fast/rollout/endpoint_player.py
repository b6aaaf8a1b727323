"""An API model as a player: `--model openai:URL#MODEL` plays the environments through text.

An OpenAI-compatible chat-completions endpoint (a frontier model's API, a vLLM or llama.cpp
server) plays packs beside the trained models, with the same packs, seeds, environment parser
and CoD protocol: it writes its own hints in the update episodes. It reads and writes text, not
token ids, so the rollout driver gets two stand-ins:

- `TextChat`, the chat format: its "token ids" are the Unicode code points of the text, and the
  role boundaries are sentinel code points from the private-use area, so a prompt the driver
  built decodes back into the exact chat messages (`messages`). Environment and model text never
  holds a sentinel: `encode` replaces each with U+FFFD. Lengths that the format counts (the hint
  cap `rollout.max_hint_tokens`) are then characters.
- `EndpointSampler`, the sampler: one chat completion per prompt, several at once, the
  response's text as code points. `max_tokens` is the response cap, in the API's own tokens;
  the seed is sent per request (best effort: servers honour it or not). The log-probs are 0: an
  API model is evaluated, never trained.

A request that fails with a timeout, a dropped connection or a 5xx, 408 or 429 status is tried
again, up to `retries` more times; any failure left then ends the evaluation with the endpoint's
one-line EndpointError (cod_fast.rollout.chat_endpoint), rather than scoring an episode the
model never played. The API key comes from COD_FAST_EVAL_API_KEY, else OPENAI_API_KEY.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from cod_fast.envs.base import derive_seed
from cod_fast.rollout.chat_endpoint import (
    ChatEndpoint,
    EndpointError,
    EndpointNames,
    shown_url,
    url_problem,
)
from cod_fast.rollout.sampler import Sample, request_seed, sampler_calls

if TYPE_CHECKING:
    import torch

SPEC_PREFIX = "openai:"
SPEC_FORM = "openai:URL#MODEL, e.g. openai:https://api.example.com/v1#qwen3-max"
API_KEY_VARS = ("COD_FAST_EVAL_API_KEY", "OPENAI_API_KEY")
"""Where the player's API key comes from, the first one set winning; sent to the named host
alone, never shown or written."""
TIMEOUT_S = 300.0
"""One request's bound, connect to the reply's last byte: a long answer of a slow API model
takes minutes."""
RETRIES = 2
"""Further tries of a request that failed in a way another try may cure."""
WORKERS = 8
"""Requests in flight at once: a batch of prompts is one completion per prompt."""
PLAYER_NAMES = EndpointNames(
    who="player endpoint",
    url_setting="--model",
    model_setting="the model name after # in --model",
    timeout_fix="try again later, or lower --max-response-tokens",
    key_note=" and the API key (COD_FAST_EVAL_API_KEY, else OPENAI_API_KEY)",
)

SYSTEM, USER, ASSISTANT = 0xF0000, 0xF0001, 0xF0002
"""The sentinels that open a message of each role (plane 15, a private-use area)."""
ROLES = {SYSTEM: "system", USER: "user", ASSISTANT: "assistant"}
SHOWN_ROLES = {SYSTEM: "[system]\n", USER: "\n[user]\n", ASSISTANT: "\n[assistant]\n"}
"""How a transcript shows the sentinels (`decode(..., skip_special_tokens=False)`)."""
REPLACEMENT = 0xFFFD
"""What a sentinel in environment or model text becomes."""


def parse_player_spec(spec: str) -> tuple[str, str] | None:
    """(URL, model) of an `openai:URL#MODEL` spec, None for a spec of another kind (a folder);
    ValueError naming the fix for a malformed one (which shows no password and no query the URL
    may carry)."""
    if not spec.startswith(SPEC_PREFIX):
        return None
    url, found, model = spec[len(SPEC_PREFIX) :].partition("#")
    try:
        netloc = urllib.parse.urlsplit(url).netloc
    except ValueError:  # a bracketed host that is no IPv6 address: url_problem says so below
        netloc = ""
    if "@" in netloc:
        raise ValueError(
            "--model: the URL carries a user name or password; drop it and set the API key in "
            f"{API_KEY_VARS[0]}"
        )
    shown = re.sub(r"\?[^#]*", "?...", spec)
    if not found:
        raise ValueError(f"--model {shown}: no #MODEL after the URL; write {SPEC_FORM}")
    if not model.strip():
        raise ValueError(f"--model {shown}: an empty model name after #; write {SPEC_FORM}")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--model {shown}: the URL is not http(s)://; write {SPEC_FORM}")
    if problem := url_problem(url.partition("?")[0]):
        raise ValueError(f"--model {problem}")
    return url, model


def player_label(url: str, model: str) -> str:
    """How a matrix row names an endpoint player: `MODEL@host` (with the port when the URL gives
    one), never the key or the URL's query."""
    parts = urllib.parse.urlsplit(url)
    return f"{model}@{parts.netloc.rpartition('@')[2]}"


def player_spec_shown(url: str, model: str) -> str:
    """The spec as files and logs show it: the URL without credentials or query."""
    return f"{SPEC_PREFIX}{shown_url(url)}#{model}"


class CodePoints:
    """The tokenizer of `TextChat`: text as its Unicode code points. What a transcript
    (cod_fast.data.transcript) and a text policy (cod_fast.rollout.sampler.text_sample) ask of
    a tokenizer."""

    eos_token_id = None
    """No end-of-text id: a reply ends where the API's text ends."""

    def encode(self, text: str) -> list[int]:
        """The code points of `text`, a sentinel among them replaced by U+FFFD."""
        return [REPLACEMENT if ord(c) in ROLES else ord(c) for c in text]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; the sentinels dropped, or shown as `[role]` lines."""
        if skip_special_tokens:
            return "".join(chr(i) for i in ids if i not in ROLES)
        return "".join(SHOWN_ROLES.get(i) or chr(i) for i in ids)


class TextChat:
    """The chat format of an endpoint player, with what the rollout driver asks of ChatFormat
    (cod_fast.rollout.chat): a first prompt, the continuation after a response, encoding,
    decoding and truncation of text, here in code points with sentinels between messages."""

    own_template = None
    """No chat template: the server applies its model's own."""
    system_role = True

    def __init__(self) -> None:
        self.tokenizer = CodePoints()

    def encode(self, text: str) -> list[int]:
        """Code points of message text: a sentinel in it becomes U+FFFD."""
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def first_prompt(self, system: str, user: str) -> list[int]:
        """A system and a user message, then the opening of the assistant's reply."""
        return [SYSTEM, *self.encode(system), USER, *self.encode(user), ASSISTANT]

    def continuation(self, response_ids: list[int], observation: str) -> list[int]:
        """After a response, the user message `observation` and the next reply's opening."""
        return [USER, *self.encode(observation), ASSISTANT]

    def truncate(self, text: str, max_tokens: int) -> tuple[str, bool]:
        """`text` cut to at most `max_tokens` characters, and whether it was cut."""
        ids = self.encode(text)
        if len(ids) <= max_tokens:
            return text, False
        return self.decode(ids[:max_tokens]), True

    def messages(self, prompt_ids: list[int]) -> list[dict[str, str]]:
        """The chat messages a prompt holds, in order, without the assistant opening it ends
        with; ValueError for ids that are no prompt of this format."""
        if len(prompt_ids) < 2 or prompt_ids[0] not in ROLES or prompt_ids[-1] != ASSISTANT:
            raise ValueError("not a prompt of TextChat: no role at its start, or no reply opened")
        messages, start = [], 0
        for i in range(1, len(prompt_ids)):
            if prompt_ids[i] in ROLES:
                messages.append(self._message(prompt_ids[start:i]))
                start = i
        return messages

    def _message(self, ids: list[int]) -> dict[str, str]:
        return {"role": ROLES[ids[0]], "content": self.decode(ids[1:])}


class EndpointSampler:
    """The `Sampler` (cod_fast.rollout.sampler) of an endpoint player: each prompt becomes one
    chat completion, up to WORKERS at once, answers in the prompts' order. Keyed calls send the
    seed `request_seed(seed, key)` cut to 31 bits (an integer every server's field holds), so a
    server that honours seeds answers a pack the same whatever shares its calls; unkeyed calls
    derive the keys from the call count."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        temperature: float,
        top_p: float,
        seed: int,
        timeout_s: float = TIMEOUT_S,
        retries: int = RETRIES,
        backoff_s: float = 1.0,
        workers: int = WORKERS,
    ):
        self.endpoint = ChatEndpoint(
            url, model, key_vars=API_KEY_VARS, timeout_s=timeout_s, names=PLAYER_NAMES
        )
        self.chat = TextChat()
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.retries, self.backoff_s = retries, backoff_s
        self.calls = 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="cod-fast-endpoint")

    def generate(
        self, prompts: list[list[int]], max_new_tokens: list[int], keys: list[int] | None = None
    ) -> list[Sample]:
        """One completion per prompt, at most max_new_tokens[i] of the API's tokens; an
        EndpointError, in one line, when a request still fails after its tries."""
        if keys is None:
            keys = [derive_seed("unkeyed", self.calls, i) for i in range(len(prompts))]
        self.calls += 1
        futures = [
            self._pool.submit(self._complete, prompt, cap, key)
            for prompt, cap, key in zip(prompts, max_new_tokens, keys, strict=True)
        ]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:  # the evaluation ends: send no more requests
                future.cancel()
            raise

    def _complete(self, prompt: list[int], cap: int, key: int) -> Sample:
        messages = self.chat.messages(prompt)
        seed = request_seed(self.seed, key) >> 32
        for attempt in range(self.retries + 1):
            try:
                text, finish = self.endpoint.complete(
                    messages,
                    temperature=self.temperature,
                    # 1 is every API's default: left out for the servers that refuse top_p.
                    top_p=None if self.top_p == 1.0 else self.top_p,
                    max_tokens=cap,
                    seed=seed,
                )
                break
            except EndpointError as e:
                if not e.transient:
                    raise
                if attempt == self.retries:
                    tries = "once" if self.retries == 0 else f"{self.retries + 1} times"
                    raise EndpointError(f"{e} (tried {tries})") from None
                time.sleep(self.backoff_s * 2**attempt)
        ids = self.chat.encode(text)
        return Sample(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish)

    def state_dict(self) -> dict[str, Any]:
        """The call count: the server holds any other state."""
        return {"calls": self.calls}

    def load_state_dict(self, state: Any) -> None:
        self.calls = sampler_calls(state)

    def push_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        raise ValueError(
            f"{self.endpoint.url} is an API model: it takes no weights; train a model folder"
        )

    def sleep(self) -> None:
        """Nothing to free: the model lives on the server."""

    def close(self) -> None:
        """Stop the request threads (after the requests under way)."""
        self._pool.shutdown(cancel_futures=True)
