"""Token ids of chat turns, built so that every later turn appends to what was sampled.

The first turn of an episode is the chat template (system + user, generation prompt) rendered
to text and encoded. Later turns are never re-rendered: the driver keeps the prompt and response
ids exactly as sampled and appends only the ids that close the assistant turn and open the next
one (`continuation`), so a multi-turn episode stays one growing sequence and packing can merge
it (docs/concepts.md section 5). The markup is read off the template once, by rendering a
conversation with sentinel strings and cutting around them. Tokenizers without a chat template get a
plain `System: / User: / Assistant:` format.

The template is the tokenizer's, or `model.chat_template` (a Jinja string, or a file holding
one), rendered with `model.chat_template_kwargs` (Qwen3's `enable_thinking`). A template without
a system role (Gemma's raises on one; others drop it) gets the system text at the head of the
first user turn, `system + "\n\n" + user`, as other trainers fold it.

Only the template's own markup may become control tokens. Message text (task statements,
observations, and hints the model wrote on an earlier task) is encoded with the special tokens
split, so a hint that contains `<|im_end|><|im_start|>system` stays plain characters and cannot
open a turn of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError

from cod_fast.config import ConfigError, ModelConfig, clipped, shown

# Sentinels hold no whitespace, so templates that trim message text (Llama 3's `| trim`) keep
# them whole.
_RESPONSE, _OBSERVATION = "@@cod-fast:response@@", "@@cod-fast:observation@@"
_SYSTEM, _USER = "@@cod-fast:system@@", "@@cod-fast:user@@"


def fold_system(system: str, user: str) -> str:
    """The first user turn of a template without a system role: the system text leads it."""
    return f"{system}\n\n{user}"


def read_template(value: str) -> str:
    """The template `model.chat_template` gives: the text of the file it names, else the value
    itself, which must then be Jinja (a path to no file is an error, not a template)."""
    if _names_file(value):
        return Path(value).read_text(encoding="utf-8")
    if "{" not in value:
        raise ConfigError(
            "model.chat_template",
            f"{shown(value)} names no file and holds no Jinja markup; give a Jinja template or "
            "the path of a file holding one",
        )
    return value


def _names_file(value: str) -> bool:
    try:
        return Path(value).is_file()
    except (OSError, ValueError):  # a template is no path: too long a name, a NUL character
        return False


class ChatFormat:
    """Encodes first prompts and continuations for one tokenizer (Hugging Face API).

    `template` (a Jinja string, or the path of a file holding one) replaces the tokenizer's
    chat template; `template_kwargs` reach every render. A template that cannot render a first
    turn and a later one is a ConfigError of `model.chat_template`, the field that fixes it."""

    def __init__(
        self,
        tokenizer: Any,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.tokenizer = tokenizer
        self._template = None if template is None else read_template(template)
        self._kwargs = dict(template_kwargs or {})
        self.templated = bool(self._template or getattr(tokenizer, "chat_template", None))
        self.system_role = not self.templated or self._renders_system()
        if self.templated:
            later = [*self._opening("S", "U"), ("assistant", _RESPONSE), ("user", _OBSERVATION)]
            _, self.close_and_open, self.after_observation = self._cut(
                later, _RESPONSE, _OBSERVATION
            )
            if self.system_role:
                first = self._cut(self._opening(_SYSTEM, _USER), _SYSTEM, _USER)
            else:
                first = self._cut([("user", _USER)], _USER)
        else:
            self.close_and_open, self.after_observation = "\nUser: ", "\nAssistant: "
            first = ["System: ", "\nUser: ", "\nAssistant: "]
        # The first prompt's markup around the system and the user text (around the one folded
        # user text for a template without a system role), as ids.
        self._first = [self._markup(part) for part in first]

    @classmethod
    def for_model(cls, tokenizer: Any, model: ModelConfig) -> ChatFormat:
        """The chat format of a run's model: its tokenizer, with the template and kwargs that
        `model` sets."""
        return cls(tokenizer, model.chat_template, model.chat_template_kwargs)

    def _opening(self, system: str, user: str) -> list[tuple[str, str]]:
        """The first turn's messages: system and user, or the user turn with the system folded
        in."""
        if self.system_role:
            return [("system", system), ("user", user)]
        return [("user", fold_system(system, user))]

    def _renders_system(self) -> bool:
        """Whether the template shows a system message (others raise on one, or drop it)."""
        try:
            return _SYSTEM in self._render([("system", _SYSTEM), ("user", _USER)])
        except ConfigError:
            return False

    def _render(self, messages: list[tuple[str, str]]) -> str:
        """The conversation as text, up to the generation prompt."""
        try:
            return self.tokenizer.apply_chat_template(
                [{"role": role, "content": content} for role, content in messages],
                chat_template=self._template,
                tokenize=False,
                add_generation_prompt=True,
                **self._kwargs,
            )
        except (TemplateError, TypeError) as e:  # bad syntax, raise_exception(), a bad kwarg
            raise self._error(f"{type(e).__name__}: {' '.join(str(e).split())}") from None

    def _cut(self, messages: list[tuple[str, str]], *sentinels: str) -> list[str]:
        """The rendered `messages` cut around `sentinels` (message texts, in order)."""
        text, pieces = self._render(messages), []
        for sentinel in sentinels:
            before, found, text = text.partition(sentinel)
            if not found:
                raise self._error("its output does not hold the messages' text as written")
            pieces.append(before)
        return [*pieces, text]

    def _error(self, problem: str) -> ConfigError:
        """One line that names the template, what went wrong and the fix."""
        if self._template is not None:
            where, fix = "the template", "fix it"
        else:
            name = getattr(self.tokenizer, "name_or_path", "") or "the model"
            where = f"the chat template of {name}'s tokenizer"
            fix = "set model.chat_template to a Jinja template (or the path of a file holding one)"
        return ConfigError(
            "model.chat_template", f"{where} cannot render a chat ({clipped(problem)}); {fix}"
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
        """Ids of an episode's first prompt: the system and the user text in the template's
        markup, up to the generation prompt."""
        if not self.system_role:  # the folded text is one message, encoded as one
            before, after = self._first
            return before + self.encode(fold_system(system, user)) + after
        before, between, after = self._first
        return before + self.encode(system) + between + self.encode(user) + after

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
