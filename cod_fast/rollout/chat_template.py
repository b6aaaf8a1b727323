"""Chat templates rendered as transformers renders them, within bounds of size and time.

A chat template is Jinja code from a model folder (possibly a stranger's) or from the user.
transformers renders it in jinja2's ImmutableSandboxedEnvironment, which keeps it away from
Python's internals but bounds neither time nor memory: two nested `range(100000)` loops run for
hours, and `'x' * 10**10` or `'x'|center(10**10)` allocate gigabytes before anything could look
at the result. `ChatTemplate` renders in the same environment (trim_blocks, lstrip_blocks, loop
controls, transformers' `tojson`, `raise_exception`, `strftime_now` and `{% generation %}` tag),
so a template renders the same text, within these bounds:

- the template holds at most MAX_TEMPLATE_CHARS characters: compiling costs time and memory in
  proportion (measured: about 2 s and 300 MB at the cap for the densest markup);
- a render takes at most MAX_RENDER_STEPS steps (a loop turn, a call, a lookup, an operator, a
  filter, an output) and RENDER_SECONDS seconds, both checked at every step, so the bound holds
  on any thread, no signal needed; its calls nest at most MAX_CALL_DEPTH deep;
- no text it builds or outputs is longer than MAX_TEXT_CHARS. The operations that can make more
  text than they are given (`*`, `**`, `+`, `%` and `~`, on text and on bytes; the joins of a
  block's output; `str.format`; the padding, joining, replacing, wrapping and formatting filters
  and methods of strings and bytes; `str.encode`, `bytes.decode` and `bytes.hex`;
  `int.to_bytes`) are sized from their arguments before they run
  (cod_fast.rollout.template_sizes), and every value a filter, a call or an output turns into
  text is measured first (`text_size`, which stops counting past the cap), so a list holding
  the same megabyte string a thousand times is refused, not printed;
- all it makes together is at most MAX_RENDER_CHARS (16,777,216) characters: each value made
  by an operator, `~`, a slice, a filter or a call, each block's join and each output is
  measured as it is made (`text_size`) and counted, whether or not it is still held (a
  macro's text once, where its block is joined). Counting what is made, not what is held, is
  cheap and conservative: without it, 2,000 `{% set %}` statements of a megabyte each held
  2.5 GB.

A template past a bound raises RenderLimit, naming it. Three helpers whose output grows without
a useful bound and that no chat template uses are left out: the `lipsum` global and the
`urlize` and `pprint` filters (a template naming them fails to compile). Not bounded exactly: a
single operation within the caps runs to its end (sorting 100,000 items, escaping a megabyte);
a few make text a few times longer than they are given, unsized, and count once made (escaping;
upper-casing, which makes `FFI` of the one-letter ligature `ffi`); text inside a container's
repr may print a few times longer than measured (escapes); and the value that passes
MAX_RENDER_CHARS is refused once made. What a render holds is so bounded by MAX_RENDER_CHARS
times what Python spends on one character of it: 1 to 4 bytes in a text, more in a container
of short ones (the worst found: about 300 MB, lists of one-letter words outside Latin-1 from
`s.split()`, 84 bytes a word counted as 5 characters).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import nodes, pass_environment, pass_eval_context
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.filters import do_join, do_sum, make_attrgetter
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cod_fast.rollout.template_sizes import (
    FILTER_SIZES,
    MAX_TEXT_CHARS,
    METHOD_SIZES,
    as_int,
    call_arguments,
    format_size,
    joined_size,
    percent_size,
    signature_after_context,
    text_size,
    total_size,
)

MAX_TEMPLATE_CHARS = 2**18
"""The longest template compiled: real ones are 1-20 KB."""
MAX_RENDER_CHARS = 16 * MAX_TEXT_CHARS
"""The most text one render may make, all its values together, held or not: real renders make
a few KB."""
MAX_INT_BITS = 2**16
"""The largest integer a render may compute (Python prints at most 4300 digits, 14,000 bits)."""
MAX_RENDER_STEPS = 100_000
"""The most steps of one render: real templates take under a few hundred for cod-fast's
conversations of four messages."""
RENDER_SECONDS = 5.0
"""The longest one render may take: real ones take milliseconds."""
MAX_CALL_DEPTH = 64
"""The deepest calls may nest (a macro calling itself holds its arguments on every level):
real templates nest a few, to render a nested JSON schema."""

_STEPS = "cod-fast steps"
"""The filter that counts each loop turn, under a name no template can write."""


class RenderLimit(Exception):
    """A template past one of the bounds; the message names it (not the template, nor the fix)."""


@dataclass
class _Budget:
    """What is left of one render's bounds, and what it has used."""

    steps: int
    deadline: float
    written: int = 0
    """The characters of every output so far, a block's included (kept until it is joined)."""
    made: int = 0
    """The size of every value made so far (`text_size`), against MAX_RENDER_CHARS."""
    depth: int = 0
    """How many calls are under way, one inside another."""


def _raise_exception(message: str) -> None:
    """transformers' `raise_exception`: a template's own refusal of a conversation."""
    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    """transformers' `strftime_now`: today's date in a template (Llama 3.1's system header)."""
    return datetime.now().strftime(format)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`, transformers' mark of the assistant's text:
    its body, as transformers renders it when no assistant mask is asked for."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator with `~` sized before it joins and each slice counted once it is
    made (Jinja writes both in place, where no sandbox hook sees them)."""

    @optimizeconst
    def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
        if not isinstance(node.arg, nodes.Slice):
            super().visit_Getitem(node, frame)
            return
        # Jinja's own slice, `value[start:stop:step]`, a copy handed to the environment.
        self.write("environment.made(")
        self.visit(node.node, frame)
        self.write("[")
        self.visit(node.arg, frame)
        self.write("])")

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        # The same join as Jinja's own visit_Concat picks, handed to the environment to size.
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"environment.joined({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment with every step counted and every text sized
    before it is built (see the module docstring)."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, loopcontrols],
            finalize=self._output,
            # Constant folding re-evaluates each nested expression once per level above it:
            # 200 nested filters compiled for seconds. Folding saves nothing in a render.
            optimized=False,
        )
        self.budget: _Budget | None = None  # None while compiling (constant outputs call hooks)
        del self.globals["lipsum"], self.filters["urlize"], self.filters["pprint"]
        self.filters.update(tojson=self._tojson, join=self._join, sum=self._sum)
        self.filters = {name: self._sized(name, f) for name, f in self.filters.items()}
        self.filters[_STEPS] = self._stepped
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)

    def made(self, value: Any) -> Any:
        """`value`, which the render has just made, counted against MAX_RENDER_CHARS."""
        if self.budget is not None:
            self._charge(text_size(value, MAX_RENDER_CHARS - self.budget.made))
        return value

    def _charge(self, size: int) -> None:
        """Count `size` characters made; RenderLimit once the render has made too many. Made,
        not held: counting what each value still holds would cost more than the render."""
        if self.budget is None:
            return
        self.budget.made += size
        if self.budget.made > MAX_RENDER_CHARS:
            raise RenderLimit(
                f"the text it makes would be more than {MAX_RENDER_CHARS} characters in all"
            )

    def step(self) -> None:
        """Count one step of the render; RenderLimit past the step or time budget."""
        if self.budget is None:
            return
        self.budget.steps -= 1
        if self.budget.steps < 0:
            raise RenderLimit(
                f"it took more than {MAX_RENDER_STEPS} steps (loop turns, calls, lookups)"
            )
        if time.monotonic() > self.budget.deadline:
            raise RenderLimit(f"it ran for more than {RENDER_SECONDS} s")

    @staticmethod
    def fits(size: int, what: str) -> None:
        """RenderLimit if `what` would be longer than MAX_TEXT_CHARS."""
        if size > MAX_TEXT_CHARS:
            raise RenderLimit(f"{what} would be more than {MAX_TEXT_CHARS} characters long")

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in list(tree.find_all(nodes.For)):  # every loop turn is a step
            loop.iter = nodes.Filter(loop.iter, _STEPS, [], [], None, None, lineno=loop.lineno)
        return tree

    def _stepped(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            self.step()
            yield item

    def _output(self, value: Any) -> Any:
        """Each `{{ ... }}`, measured before Jinja turns it into text: all of a render's outputs
        together, wherever they go, are at most MAX_TEXT_CHARS (a block holds its outputs
        until it ends, and Jinja does not show them to the sandbox before)."""
        self.step()
        size = text_size(value)
        if self.budget is not None:
            self.budget.written += size
            self._charge(size)
            size = self.budget.written
        self.fits(size, "the outputs")
        return value

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """The join of a block's output (a macro, `set`, `filter` or `call` block)."""
        pieces = list(pieces)
        size = sum(map(len, pieces))
        self.fits(size, "a block's output")
        self._charge(size)
        return "".join(pieces)

    def joined(self, join: Callable[[Iterable[Any]], str], parts: tuple[Any, ...]) -> str:
        """`a ~ b ~ ...`, sized before `join` (Jinja's) builds it."""
        self.step()
        size = total_size(parts)
        self.fits(size, "a joined text (~)")
        self._charge(size)
        return join(parts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.step()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*" and ints:
            self._int_fits(left.bit_length() + right.bit_length())
        elif operator == "*" and (isinstance(left, int) or isinstance(right, int)):
            times, text = (left, right) if isinstance(left, int) else (right, left)
            if isinstance(text, (str, bytes, bytearray, list, tuple)):
                self.fits(text_size(text) * max(times, 0), f"the product of {operator}")
        elif operator == "**" and ints and right > 0 and abs(left) > 1:
            self._int_fits(left.bit_length() * right)
        elif operator == "+" and not ints:
            self.fits(total_size((left, right)), "a sum (+)")
        elif operator == "%" and isinstance(left, (str, bytes, bytearray)):
            # Bytes take the same fields; read as Latin-1, each byte is one character.
            fmt = left if isinstance(left, str) else left.decode("latin-1")
            self.fits(percent_size(fmt, right), "a formatted text (%)")
        return self.made(super().call_binop(context, operator, left, right))

    def _int_fits(self, bits: int) -> None:
        if bits > MAX_INT_BITS:
            raise RenderLimit(f"an integer would be more than {MAX_INT_BITS} bits long")

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.step()
        return super().getitem(obj, argument)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.step()
        for value in (*args, *kwargs.values()):
            self.fits(text_size(value), "a value given to a call")
        owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
        if isinstance(owner, (str, bytes, bytearray, int)) and name in METHOD_SIZES:
            if name == "join" and args:  # counted, then joined: a generator is read once
                args = (list(args[0]), *args[1:])
            arguments = call_arguments(obj, args, kwargs)
            if arguments is not None:
                self.fits(METHOD_SIZES[name](owner, arguments), f"the result of .{name}()")
        if isinstance(obj, LoopContext) and args:  # a recursive loop's next level
            args = (self._stepped(args[0]), *args[1:])
        budget = self.budget
        if budget is None:
            return super().call(context, obj, *args, **kwargs)
        if budget.depth >= MAX_CALL_DEPTH:
            raise RenderLimit(f"its calls nest more than {MAX_CALL_DEPTH} deep")
        budget.depth += 1
        try:
            result = super().call(context, obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        # A macro's text was counted where its block was joined.
        return result if isinstance(obj, Macro) else self.made(result)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        format_call = super().wrap_str_format(value)
        if format_call is None:
            return None
        fmt, by_name = value.__self__, value.__name__ == "format_map"

        def sized(*args: Any, **kwargs: Any) -> str:
            given = args[0] if by_name and args and isinstance(args[0], Mapping) else kwargs
            self.fits(format_size(fmt, [*args, *given.values()]), "a formatted text")
            return format_call(*args, **kwargs)

        return sized

    def _sized(self, name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        """The filter `f` with a step counted, its arguments measured, and for one that can
        return more than it is given, its result sized from its arguments, before it runs."""
        passes = int(getattr(f, "jinja_pass_arg", None) is not None)  # a context comes first
        size = FILTER_SIZES.get(name)
        signature = signature_after_context(f) if size else None

        @functools.wraps(f)
        def sized(*args: Any, **kwargs: Any) -> Any:
            self.step()
            for value in (*args[passes:], *kwargs.values()):
                self.fits(text_size(value), f"a value given to the filter {name}")
            if size and signature:
                try:
                    bound = signature.bind(*args[passes:], **kwargs)
                except TypeError:  # the filter itself says what is wrong
                    pass
                else:
                    bound.apply_defaults()
                    self.fits(size(bound.arguments), f"the output of the filter {name}")
            result = f(*args, **kwargs)
            # A lazy result (map, select, batch, ...) is read where no hook sees it: each item
            # it yields is a step.
            return self._stepped(result) if isinstance(result, Iterator) else self.made(result)

        return sized

    def _tojson(
        self,
        x: Any,
        ensure_ascii: bool = False,
        indent: int | str | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        """transformers' `tojson` (json.dumps, HTML left unescaped), sized as it is written:
        indentation makes it longer than the value's own text."""
        self.fits(as_int(indent), "the indent of tojson")
        encoder = json.JSONEncoder(
            ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )
        chunks, size = [], 0
        for chunk in encoder.iterencode(x):  # the same text json.dumps returns
            size += len(chunk)
            self.fits(size, "the output of the filter tojson")
            chunks.append(chunk)
        return "".join(chunks)

    @pass_eval_context
    def _join(self, eval_ctx: Any, value: Iterable[Any], d: str = "", attribute: Any = None) -> str:
        """Jinja's `join`, its items read and sized first."""
        items = list(value)
        if attribute is not None:
            items = list(map(make_attrgetter(self, attribute), items))
        self.fits(joined_size(d, items), "a joined text")
        return do_join(eval_ctx, items, d)

    @pass_environment
    def _sum(
        self, environment: Any, iterable: Iterable[Any], attribute: Any = None, start: Any = 0
    ):
        """Jinja's `sum`, its items read and sized first: summing lists concatenates them."""
        items = list(iterable)
        self.fits(text_size(items), "the items of the filter sum")
        return do_sum(environment, items, attribute, start)


class ChatTemplate:
    """A chat template compiled once, rendered within the bounds of this module as transformers'
    `render_jinja_template` renders it, one render at a time (its budget lives on its
    environment). RenderLimit for a template over MAX_TEMPLATE_CHARS; Jinja's errors for one
    that does not compile."""

    def __init__(self, source: str):
        if len(source) > MAX_TEMPLATE_CHARS:
            raise RenderLimit(
                f"it is {len(source)} characters long, more than {MAX_TEMPLATE_CHARS}"
            )
        self._env = _BoundedEnvironment()
        self._template = self._env.from_string(source)

    def render(self, messages: list[dict[str, str]], variables: Mapping[str, Any]) -> str:
        """`messages` rendered up to the generation prompt, with `variables` (the tokenizer's
        special tokens and the user's kwargs) as the template's variables. RenderLimit past a
        bound; whatever the template raises otherwise."""
        env = self._env
        env.budget = _Budget(MAX_RENDER_STEPS, time.monotonic() + RENDER_SECONDS)
        pieces, size = [], 0
        try:
            for piece in self._template.generate(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **variables,
            ):
                env.step()
                size += len(piece)
                env.fits(size, "the output")
                pieces.append(piece)
        finally:
            env.budget = None
        return "".join(pieces)
