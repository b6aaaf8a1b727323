"""The safe formula parser and evaluator shared by optimal control and PDE discovery."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from cod_fast.envs.expr import ExpressionError, parse_expression

LAW = ("x", "v", "t")


@pytest.mark.parametrize(
    ("text", "values", "expected"),
    [
        ("-0.8*x - 1.2*v", {"x": 1.0, "v": 2.0}, -3.2),
        ("2 + 3*x**2", {"x": 2.0}, 14.0),
        ("x^3", {"x": -2.0}, -8.0),  # `^` reads as a power
        ("-(x - 1)/4", {"x": 3.0}, -0.5),
        ("clip(5*x, -1, 1) + abs(v) + sign(t)", {"x": 1.0, "v": -2.0, "t": -3.0}, 2.0),
        ("min(x, v, 0.5) + max(x, v)", {"x": 1.0, "v": -2.0}, -1.0),
        ("tanh(0) + sin(pi/2) + cos(0) + exp(0) + log(1) + sqrt(4)", {}, 5.0),
        ("x**-2", {"x": 2.0}, 0.25),
        ("1.5e-1 * x \u2212 v", {"x": 2.0, "v": 0.5}, -0.2),  # typographic minus
    ],
)
def test_evaluates_the_arithmetic_language(text, values, expected):
    """Numbers, variables, + - * / **, unary minus and the whitelisted functions evaluate as in
    ordinary arithmetic (with `^` and a typographic minus read leniently)."""
    assert parse_expression(text, LAW)(**values) == pytest.approx(expected)


def test_evaluates_over_arrays_and_reports_used_variables():
    """A formula applies elementwise to numpy arrays; `variables` names what it reads."""
    formula = parse_expression("0.5*u - 1.2*u^3 + sin(u)", ["u", "w"])
    u = np.linspace(-2, 2, 7)
    np.testing.assert_allclose(formula(u=u), 0.5 * u - 1.2 * u**3 + np.sin(u))
    assert formula.variables == {"u"}
    assert parse_expression("3", ["u"])(u=u) == 3.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("__import__('os').system('echo hacked')", "unknown function"),
        ("x.real", "Attribute"),
        ("(lambda: 1)()", "unknown function"),
        ("lambda: 1", "Lambda"),
        ("[x for x in v]", "ListComp"),
        ("x[0]", "Subscript"),
        ("x if v else t", "IfExp"),
        ("x < v", "Compare"),
        ("x and v", "BoolOp"),
        ("'text'", "only numbers"),
        ("True", "only numbers"),
        ("1j", "only numbers"),
        ("1e400", "out of range"),
        ("abs(x=1)", "keyword"),
        ("max(*x)", r"\*arguments"),
        ("abs(x, v)", "argument"),
        ("y + 1", "unknown name 'y'"),
        ("open", "unknown name 'open'"),
        ("2**x", "exponent"),
        ("9**9**9", "exponent"),
        ("x**100", "too large"),
        ("", "empty"),
        ("x +", "not a formula"),
        ("x = 1", "not a formula"),
        ("x" + "+x" * 150, "too long"),
        ("-" * 30 + "x", "nested too deeply"),
    ],
)
def test_rejects_everything_outside_the_language(text, message):
    """Anything but the small arithmetic language is refused at parse time with a message that
    names what was wrong; nothing of the text runs."""
    with pytest.raises(ExpressionError, match=message):
        parse_expression(text, LAW)


def test_parse_never_runs_model_text(tmp_path):
    """A formula that would have a side effect if executed is rejected, and no effect happens."""
    target = tmp_path / "pwned"
    text = f"__import__('os').system('touch {target}')"
    with pytest.raises(ExpressionError):
        parse_expression(text, LAW)
    assert not os.path.exists(target)


@pytest.mark.parametrize(
    ("text", "values", "message"),
    [
        ("log(x)", {"x": -1.0}, "log"),
        ("log(x)", {"x": 0.0}, "log"),
        ("sqrt(x)", {"x": np.array([1.0, -1.0])}, "sqrt"),
        ("exp(x)", {"x": 100.0}, "exp"),
        ("1/x", {"x": 0.0}, "divide by zero"),
        ("x**-1", {"x": 0.0}, "zero raised"),
        ("x**0.5", {"x": -4.0}, "fractional power"),
        ("x*1e6*1e6*1e6*1e6*1e6*1e6*1e6*1e6*1e6*1e6*1e6*1e6*1e6*1e6", {"x": 1e300}, "overflow"),
        ("x*v", {"x": 1.0}, "no value"),
    ],
)
def test_numerical_failures_raise_expression_error(text, values, message):
    """Overflow, NaN-producing operations, guarded functions outside their domain and missing
    variables become an ExpressionError naming the problem, never inf, NaN or a crash."""
    with pytest.raises(ExpressionError, match=message):
        parse_expression(text, LAW)(**values)


def _balanced(leaves: int) -> str:
    return "x" if leaves == 1 else f"({_balanced(leaves // 2)}+{_balanced(leaves // 2)})"


def test_limits_are_configurable():
    """A shallow but large formula hits the node limit; the caller can tighten the length, size
    and depth limits."""
    with pytest.raises(ExpressionError, match="too large"):
        parse_expression(_balanced(64), LAW, max_chars=1000)
    with pytest.raises(ExpressionError, match="too long"):
        parse_expression("x + v", LAW, max_chars=3)
    with pytest.raises(ExpressionError, match="too large"):
        parse_expression("x + v + t", LAW, max_nodes=3)
    with pytest.raises(ExpressionError, match="nested"):
        parse_expression("sin(sin(x))", LAW, max_depth=2)
    assert parse_expression("x*pi", LAW)(x=1.0) == pytest.approx(math.pi)
