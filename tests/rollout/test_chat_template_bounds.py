"""Chat templates rendered within bounds of size and time (cod_fast/rollout/chat_template.py):
a template is code from a model folder, perhaps a stranger's, or from the user. Templates that
use the environment's features render the same text as transformers' `apply_chat_template`; a
template that loops for ever stops at the step or the time bound, on any thread; one that would
build gigabytes is refused before it allocates (shown in a process whose address space leaves
512 MiB free, where a large allocation would fail with MemoryError instead); a template over
the size cap is refused before it is compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import cod_fast.rollout.chat_template as chat_template
from cod_fast.config import ConfigError
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.chat_template import MAX_TEMPLATE_CHARS, ChatTemplate
from tests.special_files import DEV_ZERO

FEATURES = """\
{%- macro block(title, body) -%}
[{{ title|upper }}]{{ caller() }}{{ body|trim }}
{%- endmacro -%}
{%- set ns = namespace(count=0, last='') -%}
{{ bos_token }}
{%- for m in messages -%}
  {%- set ns.count = ns.count + 1 -%}
  {%- if loop.first and m.role != 'system' %}{{ 'no system'|center(20) }}{% endif -%}
  {%- if m.role == 'system' -%}{% call block('sys', m.content) %}*{% endcall %}
  {%- else -%}
  {{ '%s %d/%d' % (m.role, loop.index, loop.length) }}|{{ '{0}:{1:>6}'.format(m.role, ns.count) }}
  {{- m.content ~ '#' ~ loop.revindex ~ loop.cycle('a', 'b') }}
  {%- if loop.last %}{% set ns.last = m.content %}{% endif %}
  {%- endif %}
  {% if loop.index == 2 %}{% continue %}{% endif %}{% if m.content|length > 1000 %}{% break %}{% endif %}
{% endfor -%}
{% generation %}{{ messages|map(attribute='role')|list|tojson }}{% endgeneration %}
{{ {'n': ns.count, 'roles': messages|map(attribute='role')|unique|list}|tojson(indent=2) }}
{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(', ') }}
{{ '-' * 10 }}{{ [1, 2] + [3] }}{{ 2 ** 10 }}{{ (ns.last|replace('@', '*'))[:40] }}
{{ 'a b c d e f'|wordwrap(5) }}{{ 'x\\ny'|indent(2, true) }}{{ '%-5s|'|format('ab') }}
{%- for row in range(5)|batch(2) %}{{ row|sum }}{% endfor %}{{ range(7)|slice(3)|list }}
{%- for k, v in {'b': 1, 'a': 2}|dictsort %}{{ k }}={{ v }};{% endfor %}
{{ 'x\\ty'.expandtabs(4) }}{{ 'ab'.ljust(4, '.') }}{{ '-'.join(['a', 'b']) }}{{ 'abc'.replace('b', 'B') }}
{{- 'ab'.zfill(5) }}{{ 'ab'.translate({97: 'A'}) }}{{ (1).to_bytes(2, 'big') }}{{ '{:^7}'.format('c') }}
{%- for x in [[1, [2]], 3] recursive %}{% if x is iterable %}({{ loop(x) }}){% else %}{{ x }}{% endif %}{% endfor %}
{% filter upper %}filtered {{ messages|length }}{% endfilter %}{% set captured %}cap{{ 1 }}{% endset %}{{ captured }}
{{ '%s|%d'.encode() % ('a'.encode(), 1) }}{{ '-'.encode().join(['a'.encode(), 'b'.encode()]) }}
{{ 'ab'.encode().center(6) }}{{ 'ab'.encode().hex(':') }}{{ 'x'.encode('utf-16-le') }}
{{ strftime_now('%%') }}{{ enable_thinking is defined and not enable_thinking }}{{ dict(a=1).items()|list }}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""A template using what real ones use (macros with `caller`, namespaces, loop controls and the
loop's variables, `tojson` with an indent, `strftime_now`, the `generation` tag, recursive
loops, filter and set blocks) and every operation this module sizes, on text and on bytes, at
sizes real ones use."""

CONVERSATIONS = [
    [{"role": "user", "content": " hi @ "}],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "V@"},
    ],
]
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
"""Ten billion turns: hours of rendering, and gigabytes of output, without a bound."""
SILENT_LOOPS = LOOPS.replace("x", "")
"""The same turns with no output (which would meet the text bound first)."""


def _tokenizer():
    tokenizer = char_tokenizer(CHATML)
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    return tokenizer


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("template", [CHATML, FEATURES], ids=["chatml", "features"])
def test_templates_render_as_transformers_renders_them(template, kwargs):
    """The bounded render gives exactly the text of transformers' `apply_chat_template`, with
    the tokenizer's special tokens and the kwargs as variables."""
    tokenizer = _tokenizer()
    for conversation in CONVERSATIONS:
        want = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=True,
            **kwargs,
        )
        got = ChatTemplate(template).render(
            conversation, {**tokenizer.special_tokens_map, **kwargs}
        )
        assert got == want


def _refusal(template: str) -> tuple[str, float]:
    """The error line of a ChatFormat with `template` after ChatML's, and the seconds it took."""
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        ChatFormat(char_tokenizer(CHATML), template=CHATML + template)
    message = str(caught.value)
    assert message.startswith("model.chat_template: ") and "\n" not in message
    return message, time.monotonic() - started


def test_a_template_that_loops_for_ever_stops_at_the_step_bound():
    """Two nested loops of 100,000 turns stop at the step bound, in one line naming it."""
    message, seconds = _refusal(LOOPS)
    assert f"more than {chat_template.MAX_RENDER_STEPS} steps" in message
    assert seconds < 15


def test_a_render_stops_at_the_time_bound_on_any_thread(monkeypatch):
    """With the step bound out of reach, silent loops stop at the time bound (lowered here),
    on the main thread and on another one: the bound is checked at every step, no signal
    is needed."""
    monkeypatch.setattr(chat_template, "MAX_RENDER_STEPS", 10**12)
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.2)
    message, seconds = _refusal(SILENT_LOOPS)
    assert "ran for more than 0.2 s" in message and seconds < 15
    caught: list[tuple[str, float]] = []
    worker = threading.Thread(target=lambda: caught.append(_refusal(SILENT_LOOPS)))
    worker.start()
    worker.join(timeout=60)
    assert caught and "ran for more than 0.2 s" in caught[0][0] and caught[0][1] < 15


S = "{% set s = 'x' * 999999 %}"
"""A string just under the text cap, for the templates that multiply it."""
AMPLIFIERS = {
    "repeat": "{{ 'x' * 10**10 }}",
    "center": "{{ 'x'|center(10**10) }}",
    "center-literal": "{{ 'x'|center(10000000000) }}",
    "filter-block": "{% filter center(10**10) %}x{% endfilter %}",
    "map-center": "{{ ['x']|map('center', 10**10)|list }}",
    "ljust": "{{ 'x'.ljust(10**10) }}",
    "indent": "{{ 'x\\ny'|indent(10**10) }}",
    "percent-width": "{{ '%10000000000s' % 'x' }}",
    "format-star": "{{ '%*s'|format(10**10, 'x') }}",
    "str-format-nested": "{{ '{:{}}'.format('x', 10**10) }}",
    "power": "{{ 10**100000000 }}",
    "to-bytes": "{{ (1).to_bytes(10**10, 'big') }}",
    "expandtabs": "{{ 'x\\tx'.expandtabs(10**9) }}",
    "replace": S + "{{ 'abc'|replace('', s) }}",
    "translate": S + "{{ 'xxxx'.translate({120: s}) }}",
    "join": S + "{{ [s, s, s]|join }}",
    "concat": S + "{{ s ~ s ~ s }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "list-printed": S + "{{ [s, s, s] }}",
    "list-repeat": S + "{{ ([s] * 1000)|join|length }}",
    "macro-output": S + "{% macro m() %}{% for i in range(1000) %}{{ s }}{% endfor %}"
    "{% endmacro %}{{ m()|length }}",
    "set-block": S + "{% set b %}{% for i in range(1000) %}{{ s ~ i }}{% endfor %}{% endset %}"
    "{{ b|length }}",
    "tojson-indent": "{{ {'a': 1}|tojson(indent=10**10) }}",
    "wordwrap": S + "{{ ('x ' * 1000)|wordwrap(1, wrapstring=s) }}",
    "batch-fill": "{{ [1]|batch(10**10, 'x')|list|length }}",
    "slice": "{{ [1]|slice(10**10)|list|length }}",
    "sum-lists": "{% set b = range(100000)|list %}{{ ["
    + "b, " * 2000
    + "]|sum(start=[])|length }}",
    "nested-batches": S + "{{ (s" + "|batch(1)" * 50 + "|list)|length }}",
    "recursion": S + "{% macro f(t, n) %}{{ f(t ~ n, n + 1) if n < 900 else t|length }}"
    "{% endmacro %}{{ f(s[:900000], 0) }}",
    "many-texts": "".join(f"{{% set a{i} = 'x' * 1048000 %}}" for i in range(600)) + "ok",
    "many-slices": S + "".join(f"{{% set a{i} = s[{i}:] %}}" for i in range(600)) + "ok",
    "many-splits": "{% set s = 'xy ' * 333333 %}"
    + "".join(f"{{% set a{i} = s.split() %}}" for i in range(40))
    + "ok",
    "many-lists": "".join(f"{{% set a{i} = range(100000)|list %}}" for i in range(200)) + "ok",
    "bytes-percent": "{% set r = '%*d'.encode() % (6000000000, 1) %}ok",
    "encode-names": "{% set t = '\ufbf9' * 999999 %}"
    + "".join(f"{{% set a{i} = t.encode('ascii', 'namereplace') %}}" for i in range(8))
    + "ok",
}
"""Templates that would allocate gigabytes, compute for minutes in one step (`power`,
`sum-lists`), hold a megabyte on each of hundreds of levels (`recursion`) or hold hundreds of
values at once, each within the text bound (`many-...`), unbounded."""

_RUN_AMPLIFIERS = """
import json, resource, sys, time
from cod_fast.rollout.chat import ChatFormat
from cod_fast.model.tokenizer import CHATML, char_tokenizer
tokenizer = char_tokenizer(CHATML)
ChatFormat(tokenizer)
status = open("/proc/self/status").read()
size = int(status.split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + 2**29, resource.RLIM_INFINITY))
results = {}
for name, template in json.loads(sys.stdin.read()).items():
    started = time.monotonic()
    try:
        ChatFormat(tokenizer, template=CHATML + template)
        results[name] = ("rendered", 0.0)
    except Exception as e:  # MemoryError included: the unbounded render's failure
        results[name] = (f"{type(e).__name__}: {e}"[:500], time.monotonic() - started)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def amplified() -> dict[str, tuple[str, float]]:
    """Each AMPLIFIERS template's error line and seconds, from one process whose address
    space leaves 512 MiB free."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-c", _RUN_AMPLIFIERS],
        input=json.dumps(AMPLIFIERS),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow  # a process of its own
@pytest.mark.parametrize("name", AMPLIFIERS)
def test_amplifying_templates_are_refused_before_they_allocate(amplified, name):
    """Each template is refused in one line naming the bound it would pass (not MemoryError,
    which a large allocation would raise under the address-space limit, nor RecursionError),
    within a second."""
    message, seconds = amplified[name]
    assert message.startswith("ConfigError: model.chat_template: ") and "\n" not in message
    cause = message.removeprefix("ConfigError: ")
    assert "more than" in cause and "Error" not in cause, message
    assert seconds < 1.0


def test_a_template_over_the_size_cap_is_refused_before_it_compiles(tmp_path):
    """A template of more than MAX_TEMPLATE_CHARS characters, given as text, as a file or as
    a tokenizer's own, is refused in one line naming the cap (and for the tokenizer's, the
    field that replaces it); a file that is not UTF-8, or /dev/zero, is one line too."""
    huge = "{{ x }}" * (MAX_TEMPLATE_CHARS // 7 + 1)
    path = tmp_path / "huge.jinja"
    path.write_text(huge, encoding="utf-8")
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(b"{{ x }}\xff\xfe")
    cases = [
        (ChatFormat, (char_tokenizer(CHATML),), {"template": huge}, "characters long"),
        (ChatFormat, (char_tokenizer(CHATML),), {"template": str(path)}, "more than"),
        (ChatFormat, (char_tokenizer(huge),), {}, "set model.chat_template"),
        (ChatFormat, (char_tokenizer(CHATML),), {"template": str(binary)}, "decode"),
        (ChatFormat, (char_tokenizer(CHATML),), {"template": DEV_ZERO}, "names no file"),
    ]
    for make, args, kwargs, said in cases:
        started = time.monotonic()
        with pytest.raises(ConfigError) as caught:
            make(*args, **kwargs)
        message = str(caught.value)
        assert message.startswith("model.chat_template: ") and said in message, message
        assert str(MAX_TEMPLATE_CHARS) in message or said in ("decode", "names no file")
        assert "\n" not in message and len(message) < 400 and time.monotonic() - started < 5


RESULTS = {
    "repeat": "'x' * 1000000",
    "slice": "s[1:]",
    "filter": "s|upper",
    "method": "s.upper()",
    "concat": "s ~ ''",
    "percent": "'%s' % s",
    "format": "'{}'.format(s)",
    "int": "x + 1",
}
"""Operations that each make a new value of about a megabyte (for `int`, an integer of 64,000
bits, whose text is 21,000 characters), well within the text bound."""


@pytest.mark.parametrize("name", RESULTS)
def test_the_text_a_render_makes_is_bounded_in_all(name):
    """Each value a render makes, by each kind of operation, counts against MAX_RENDER_CHARS
    whether or not it is still held: 20 values of a megabyte (800 integers) are refused in one
    line naming that bound (2,000 such statements held 2.5 GB), three quarters as many
    render."""
    result = RESULTS[name]
    count = 800 if name == "int" else 20  # 800 integers of 21,000 characters: 17 million
    head = "{% set s = 'x' * 1000000 %}{% set x = (2**32 - 1) ** 2000 %}"
    held = "".join(f"{{% set a{i} = {result} %}}" for i in range(count)) + "ok"
    message, _ = _refusal(head + held)
    bound = chat_template.MAX_RENDER_CHARS
    assert f"more than {bound} characters" in message and "in all" in message, message
    fits = "".join(f"{{% set a{i} = {result} %}}" for i in range(count * 3 // 4)) + "ok"
    assert ChatTemplate(head + fits).render([], {}) == "ok"


BYTES = {
    "percent": "'%*d'.encode() % (2000000, 1)",
    "percent-bytearray": "b % (2000000, 1)",
    "replace": "'aaaaaa'.encode().replace('a'.encode(), ('x' * 250000).encode())",
    "hex": "('x' * 1000000).encode().hex(':')",
    "encode": "('\ufbf9' * 20000).encode('ascii', 'namereplace')",
    "decode": "(-1).to_bytes(300000, 'big', signed=True).decode('ascii', 'backslashreplace')",
    "repeat-bytearray": "b * 500000",
}
"""Operations on bytes (and a bytearray `b`, which a template only gets as a variable) that
would make 1.5 to 3 megabytes from a few or from a few hundred thousand."""


@pytest.mark.parametrize("name", BYTES)
def test_bytes_are_sized_as_text_is(name):
    """`%`, `*` and the methods that can make more than they are given are sized before they
    run on bytes (and bytearrays) as on text: past MAX_TEXT_CHARS, refused in one line."""
    template = ChatTemplate(f"{{% set r = {BYTES[name]} %}}ok")
    with pytest.raises(chat_template.RenderLimit) as caught:
        template.render([], {"b": bytearray(b"%*d")})
    assert f"more than {chat_template.MAX_TEXT_CHARS} characters" in str(caught.value)


def test_the_error_line_holds_no_control_character():
    """What a template's error says reaches the terminal: escape sequences (title, colour, a
    C1 control, a bidirectional override) in `raise_exception` come out escaped as repr
    escapes them, the rest of the text as written."""
    raised = "\x1b]0;title\x07 \x1b[31mred\x9b2J \u202etxt\x7f\r"
    message, _ = _refusal(f"{{{{ raise_exception('{raised}') }}}}")
    bad = [c for c in message if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c == "\u202e"]
    assert not bad, ascii(message)
    assert "\\x1b]0;title\\x07 \\x1b[31mred\\x9b2J \\u202etxt\\x7f" in message, message
