"""Token ids of chat turns, built so that every later turn appends to what was sampled.

The first turn of an episode is the chat template (system + user, generation prompt) rendered
to text and encoded. Later turns are never re-rendered: the driver keeps the prompt and response
ids exactly as sampled and appends only the ids that close the assistant turn and open the next
one (`continuation`), so a multi-turn episode stays one growing sequence and packing can merge
it (docs/concepts.md section 5). The markup is read off the template once, by rendering a
conversation with sentinel strings and cutting around them. Tokenizers without a chat template get a
plain `System: / User: / Assistant:` format.

The template is the tokenizer's, or `model.chat_template` (a Jinja string, or a file holding
one), rendered with `model.chat_template_kwargs` (Qwen3's `enable_thinking`) as transformers
renders it, within bounds of size and time (cod_fast.rollout.chat_template): a template is
code from a model folder, perhaps a stranger's, and one past a bound is an error, like one
that does not render. A template without a system role (Gemma's raises on one; others drop it)
gets the system text at the head of the first user turn, `system + "\n\n" + user`, as other
trainers fold it.

Only the template's own markup may become control tokens. Message text (task statements,
observations, and hints the model wrote on an earlier task) is encoded with the special tokens
split, so a hint that contains `<|im_end|><|im_start|>system` stays plain characters and cannot
open a turn of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cod_fast.common.bounded_read import ReadRefused, read_bounded
from cod_fast.config import ConfigError, ModelConfig, clipped, shown
from cod_fast.rollout.chat_template import MAX_TEMPLATE_CHARS, ChatTemplate, RenderLimit

# Sentinels hold no whitespace, so templates that trim message text (Llama 3's `| trim`) keep
# them whole.
_RESPONSE, _OBSERVATION = "@@cod-fast:response@@", "@@cod-fast:observation@@"
_SYSTEM, _USER = "@@cod-fast:system@@", "@@cod-fast:user@@"


def fold_system(system: str, user: str) -> str:
    """The first user turn of a template without a system role: the system text leads it."""
    return f"{system}\n\n{user}"


def read_template(value: str) -> str:
    """The template `model.chat_template` gives: the text of the file it names (at most
    MAX_TEMPLATE_CHARS bytes), else the value itself, which must then be Jinja (a path to no
    file is an error, not a template)."""
    if names_file(value):
        try:
            return read_bounded(value, MAX_TEMPLATE_CHARS).decode("utf-8")
        except (OSError, ReadRefused, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else str(e)
            raise ConfigError(
                "model.chat_template",
                f"cannot read {shown(value)} ({why}); give a UTF-8 Jinja file of at most "
                f"{MAX_TEMPLATE_CHARS} bytes",
            ) from None
    if "{" not in value:
        raise ConfigError(
            "model.chat_template",
            f"{shown(value)} names no file and holds no Jinja markup; give a Jinja template or "
            "the path of a file holding one",
        )
    return value


def _cause(error: Exception) -> str:
    """What a template's failure says, on one line: a bound it passed, or the error it raised.
    The text is the template's (`raise_exception`), so what a terminal would act on (escape
    sequences, other controls, a bidirectional override) is escaped as repr escapes it."""
    if isinstance(error, RenderLimit):
        said = str(error)
    else:
        said = f"{type(error).__name__}: {' '.join(str(error).split())}"
    if said.isprintable():
        return said
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in said)


def names_file(value: str) -> bool:
    """Whether `model.chat_template`'s value names a file (else it is the template itself)."""
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
        if self.templated:
            self._jinja = self._compiled()
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

    @property
    def own_template(self) -> str | None:
        """The text of the template `model.chat_template` gave (None: the tokenizer's own)."""
        return self._template

    def _compiled(self) -> ChatTemplate:
        """The template (the tokenizer's unless `model.chat_template` gives one), compiled."""
        try:
            return ChatTemplate(self.tokenizer.get_chat_template(self._template))
        except Exception as e:  # code from a model folder or the user: its failure is its own
            raise self._error(_cause(e)) from None

    def _renders_system(self) -> bool:
        """Whether the template shows a system message (others raise on one, or drop it). A
        template past a bound of its render is an error here, not one without a system role."""
        try:
            return _SYSTEM in self._rendered([("system", _SYSTEM), ("user", _USER)])
        except RenderLimit as e:
            raise self._error(_cause(e)) from None
        except Exception:  # the template refuses a system message
            return False

    def _render(self, messages: list[tuple[str, str]]) -> str:
        """The conversation as text, up to the generation prompt; ConfigError if it fails."""
        try:
            return self._rendered(messages)
        except Exception as e:  # raise_exception(), a bad kwarg, a bound passed
            raise self._error(_cause(e)) from None

    def _rendered(self, messages: list[tuple[str, str]]) -> str:
        """The conversation rendered as transformers' `apply_chat_template` renders it: the
        tokenizer's special tokens and the kwargs are the template's variables."""
        return self._jinja.render(
            [{"role": role, "content": content} for role, content in messages],
            {**self.tokenizer.special_tokens_map, **self._kwargs},
        )

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
