"""The interface between the rollout driver and whatever generates tokens.

One batched call per driver step: token-id prompts in; sampled token ids, the log-prob of each
sampled token (under the temperature the loss uses) and a finish reason out. Besides sampling, a
`Sampler` gives the trainer its stream's state for checkpoints, takes new weights, frees its
memory while the trainer trains, and shuts down. The torch and vLLM samplers of the trainer
implement it; `TextPolicySampler` puts a scripted text policy behind it, for tests and for
checking environments end to end without a model.

Keyed calls: with `keys` (one 64-bit integer per prompt), response i's randomness is a function
of the sampler's seed, keys[i] and the token's index alone, never of the other prompts in the
call or of earlier calls. Evaluation uses them (the rollout driver derives a key from the pack,
the member, the task and the turn), so an evaluation split over ranks samples exactly what one
rank would. The uniforms come from a counter-based hash (splitmix64's finaliser) on numpy's
uint64, whose arithmetic wraps by definition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from cod_fast.common.values import is_count
from cod_fast.rollout.chat import ChatFormat

if TYPE_CHECKING:
    import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose output bits all depend on every
    input bit."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def key_streams(seed: int, keys: list[int]) -> np.ndarray:
    """One uint64 stream id per key, for `keyed_uniforms` (the seed mixed in once)."""
    ids = np.array([k % 2**64 for k in keys], dtype=np.uint64)
    return _mix(ids ^ _mix(np.array([seed % 2**64], dtype=np.uint64)))


def keyed_uniforms(streams: np.ndarray, step: int) -> np.ndarray:
    """float64 uniforms in [0, 1), one per stream, for token index `step`: 53 bits of
    mix(stream + (step + 1) * golden), a different number for every (stream, step)."""
    with np.errstate(over="ignore"):
        x = _mix(streams + np.uint64(step + 1) * _GOLDEN)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


def request_seed(seed: int, key: int) -> int:
    """A per-request seed for an engine that seeds each request's own generator (vLLM)."""
    return int(key_streams(seed, [key])[0] >> np.uint64(1))  # 63 bits: a valid int64 seed


def sampler_calls(state: Any) -> int:
    """The call count of a sampler's `state_dict()` read back from a checkpoint; ValueError for
    anything else (a damaged or edited ranks.pt)."""
    calls = state.get("calls") if isinstance(state, dict) else None
    if not is_count(calls):
        raise ValueError("the sampler's state holds no call count (a non-negative integer)")
    return calls


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


class Sampler(Protocol):
    """What generates tokens for the rollout driver, and what the trainer asks of it."""

    calls: int
    """`generate` calls so far: where the sampling stream stands."""

    def generate(
        self, prompts: list[list[int]], max_new_tokens: list[int], keys: list[int] | None = None
    ) -> list[Sample]:
        """One response per prompt, at most max_new_tokens[i] tokens for prompt i; with `keys`,
        response i's draws depend on keys[i] alone (see the module docstring)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Where the sampling stream stands (plain data and CPU tensors), for a checkpoint."""
        ...

    def load_state_dict(self, state: Any) -> None:
        """Take back `state_dict()`; ValueError, saying what is wrong, for a state that is not
        one (a damaged or edited checkpoint)."""
        ...

    def push_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the trainer's full weights by Hugging Face name; returns how many tensors
        arrived. The trainer pushes only into a sampler that holds its own copy."""
        ...

    def sleep(self) -> None:
        """Free what sampling holds on the device (weights, KV cache) while the trainer trains;
        the next `push_weights` brings it back. A no-op where nothing is freed."""
        ...

    def close(self) -> None:
        """Free the sampler's engine for good, so that another can start in this process; a
        no-op where there is nothing to free."""
        ...


class TextPolicySampler:
    """Answers each prompt with `policy(prompt_text)`, encoded, ended by the tokenizer's EOS
    token when it fits; log-probs are 0 (a deterministic policy)."""

    def __init__(self, policy: Callable[[str], str], chat: ChatFormat):
        self.policy = policy
        self.chat = chat
        self.calls = 0

    def generate(
        self, prompts: list[list[int]], max_new_tokens: list[int], keys: list[int] | None = None
    ) -> list[Sample]:
        self.calls += 1  # deterministic: keys change nothing
        return [
            text_sample(self.chat, self.policy(self.chat.decode(prompt)), cap)
            for prompt, cap in zip(prompts, max_new_tokens, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        """The call count: a deterministic policy has no other state."""
        return {"calls": self.calls}

    def load_state_dict(self, state: Any) -> None:
        self.calls = sampler_calls(state)

    def push_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """A text policy has no weights: none are taken."""
        return 0

    def sleep(self) -> None:
        """Nothing to free."""

    def close(self) -> None:
        """Nothing to free."""


def text_sample(chat: ChatFormat, text: str, cap: int) -> Sample:
    """`text` as a deterministic policy's response: encoded, ended by the tokenizer's EOS token
    when it fits in `cap` tokens (else cut, finish reason `length`), log-probs 0."""
    eos = chat.tokenizer.eos_token_id
    ids = chat.encode(text) + ([eos] if eos is not None else [])
    finish = "stop" if len(ids) <= cap else "length"
    ids = ids[:cap]
    return Sample(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish)
