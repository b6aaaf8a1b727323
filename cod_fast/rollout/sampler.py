"""The interface between the rollout driver and whatever generates tokens.

One batched call per driver step: token-id prompts in; sampled token ids, the log-prob of each
sampled token (under the temperature the loss uses) and a finish reason out. The torch and vLLM
samplers of the trainer implement it; `TextPolicySampler` puts a scripted text policy behind it,
for tests and for checking environments end to end without a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from cod_fast.rollout.chat import ChatFormat


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


class Sampler(Protocol):
    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        """One response per prompt, at most max_new_tokens[i] tokens for prompt i."""
        ...


class TextPolicySampler:
    """Answers each prompt with `policy(prompt_text)`, encoded, ended by the tokenizer's EOS
    token when it fits; log-probs are 0 (a deterministic policy)."""

    def __init__(self, policy: Callable[[str], str], chat: ChatFormat):
        self.policy = policy
        self.chat = chat
        self.calls = 0

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        self.calls += 1
        return [
            text_sample(self.chat, self.policy(self.chat.decode(prompt)), cap)
            for prompt, cap in zip(prompts, max_new_tokens, strict=True)
        ]


def text_sample(chat: ChatFormat, text: str, cap: int) -> Sample:
    """`text` as a deterministic policy's response: encoded, ended by the tokenizer's EOS token
    when it fits in `cap` tokens (else cut, finish reason `length`), log-probs 0."""
    eos = chat.tokenizer.eos_token_id
    ids = chat.encode(text) + ([eos] if eos is not None else [])
    finish = "stop" if len(ids) <= cap else "length"
    ids = ids[:cap]
    return Sample(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish)
