"""Token ids of chat turns, built so that every later turn appends to what was sampled.

The first turn of an episode is the tokenizer's chat template (system + user, generation prompt)
rendered to text and encoded. Later turns are never re-rendered: the driver keeps the prompt and
response ids exactly as sampled and appends only the ids that close the assistant turn and open
the next one (`continuation`), so a multi-turn episode stays one growing sequence and packing can
merge it (SPEC.md section 5). The continuation text is read off the template once, by rendering
a conversation with sentinel strings and cutting around them. Tokenizers without a chat template
get a plain `System: / User: / Assistant:` format.

Only the template's own markup may become control tokens. Message text (task statements,
observations, and hints the model wrote on an earlier task) is encoded with the special tokens
split, so a hint that contains `<|im_end|><|im_start|>system` stays plain characters and cannot
open a turn of its own.
"""

from __future__ import annotations

from typing import Any

_RESPONSE, _OBSERVATION = "\x1eRESPONSE\x1e", "\x1eOBSERVATION\x1e"
_SYSTEM, _USER = "\x1eSYSTEM\x1e", "\x1eUSER\x1e"


class ChatFormat:
    """Encodes first prompts and continuations for one tokenizer (Hugging Face API)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        if self.templated:
            text = self._render(
                [("system", "S"), ("user", "U"), ("assistant", _RESPONSE), ("user", _OBSERVATION)],
                generation_prompt=True,
            )
            after_response = text.split(_RESPONSE, 1)[1]
            self.close_and_open, self.after_observation = after_response.split(_OBSERVATION, 1)
            text = self._render([("system", _SYSTEM), ("user", _USER)], generation_prompt=True)
            before, rest = text.split(_SYSTEM, 1)
            first = (before, *rest.split(_USER, 1))
        else:
            self.close_and_open, self.after_observation = "\nUser: ", "\nAssistant: "
            first = ("System: ", "\nUser: ", "\nAssistant: ")
        # The first prompt's markup around the system and the user text, as ids.
        self._before, self._between, self._after = (self._markup(part) for part in first)

    def _render(self, messages: list[tuple[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": role, "content": content} for role, content in messages],
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        """Ids of message text: a control string in it stays plain characters."""
        return list(
            self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        )

    def _markup(self, text: str) -> list[int]:
        """Ids of the template's own markup, control tokens included."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def first_prompt(self, system: str, user: str) -> list[int]:
        return self._before + self.encode(system) + self._between + self.encode(user) + self._after

    def continuation(self, response_ids: list[int], observation: str) -> list[int]:
        """Ids to append after a sampled response so the model reads `observation` next."""
        close = self.close_and_open
        if response_ids:
            # A response that ended on a stop token (e.g. <|im_end|>) already closed its turn.
            last = self.tokenizer.decode([response_ids[-1]], skip_special_tokens=False)
            if last and close.startswith(last):
                close = close[len(last) :]
        return self._markup(close) + self.encode(observation) + self._markup(self.after_observation)

    def truncate(self, text: str, max_tokens: int) -> tuple[str, bool]:
        """`text` cut to at most `max_tokens` tokens, and whether it was cut."""
        ids = self.encode(text)
        if len(ids) <= max_tokens:
            return text, False
        return self.decode(ids[:max_tokens]), True
