"""A safe parser and evaluator for model-written formulas (docs/concepts.md section 6: "Expressions
are parsed by a safe evaluator, never by eval()").

The optimal-control environment reads a feedback law u(x, v, t) and PDE discovery reads a
reaction term R(u) from untrusted model text. Both go through `parse_expression`, which parses
the text with Python's `ast` module and accepts only a small arithmetic language: numbers, the
caller's named variables, `+ - * / **`, unary minus and calls to a fixed set of functions. The
tree is walked by our own interpreter over numpy float64 arrays; nothing the model wrote is ever
compiled or executed. Limits on text length, node count, nesting depth, literal size and exponent
size keep a hostile formula from costing time or memory, and every numerical failure (overflow,
NaN, a guarded function outside its domain, division by zero) becomes an `ExpressionError` that
says what went wrong, so an environment can turn it into a reward and a readable feedback line.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

Value = float | np.ndarray

MAX_CHARS = 200
MAX_NODES = 80
MAX_DEPTH = 16
MAX_EXPONENT = 8.0
MAX_LITERAL = 1e6
EXP_LIMIT = 60.0
"""exp() refuses arguments above this: e^60 ~ 1e26 is already far outside any sane law."""

# Text the model may write that has one obvious meaning: `^` for a power (XOR makes no sense in a
# formula) and typographic minus/times signs.
_LENIENT = {"^": "**", "\u2212": "-", "\u00d7": "*", "\u00b7": "*"}
_CONSTANTS = {"pi": math.pi}


class ExpressionError(ValueError):
    """The formula is not in the accepted language, or evaluating it failed."""


def _guarded_exp(a: np.ndarray) -> np.ndarray:
    if np.any(a > EXP_LIMIT):
        raise ExpressionError(f"exp() argument above {EXP_LIMIT:g} (overflow guard)")
    return np.exp(a)


def _guarded_log(a: np.ndarray) -> np.ndarray:
    if np.any(a <= 0):
        raise ExpressionError("log() of a value <= 0")
    return np.log(a)


def _guarded_sqrt(a: np.ndarray) -> np.ndarray:
    if np.any(a < 0):
        raise ExpressionError("sqrt() of a negative value")
    return np.sqrt(a)


def _fold(op: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def folded(*args: np.ndarray) -> np.ndarray:
        result = args[0]
        for a in args[1:]:
            result = op(result, a)
        return result

    return folded


# name -> (function, smallest and largest argument count)
FUNCTIONS: dict[str, tuple[Callable[..., np.ndarray], int, int]] = {
    "abs": (np.abs, 1, 1),
    "sign": (np.sign, 1, 1),
    "tanh": (np.tanh, 1, 1),
    "sin": (np.sin, 1, 1),
    "cos": (np.cos, 1, 1),
    "exp": (_guarded_exp, 1, 1),
    "log": (_guarded_log, 1, 1),
    "sqrt": (_guarded_sqrt, 1, 1),
    "min": (_fold(np.minimum), 2, 4),
    "max": (_fold(np.maximum), 2, 4),
    "clip": (lambda a, lo, hi: np.minimum(np.maximum(a, lo), hi), 3, 3),
}

_BINARY = {
    ast.Add: np.add,
    ast.Sub: np.subtract,
    ast.Mult: np.multiply,
    ast.Div: np.divide,
    ast.Pow: np.power,
}


def _number(node: ast.expr) -> float | None:
    """The value of a numeric literal, optionally signed (`3`, `-2.5`), else None."""
    sign = 1.0
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        sign = -sign if isinstance(node.op, ast.USub) else sign
        node = node.operand
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return sign * float(node.value)
    return None


@dataclass(frozen=True)
class Expression:
    """A parsed formula. Call it with the variables as keyword arguments (floats or arrays)."""

    text: str
    """The text as parsed (after the lenient rewrites)."""
    variables: frozenset[str]
    """The variables the formula uses (a subset of those allowed)."""
    tree: ast.expr

    def __call__(self, **values: Value) -> Value:
        missing = self.variables - values.keys()
        if missing:
            raise ExpressionError(f"no value for variable(s) {', '.join(sorted(missing))}")
        arrays = {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}
        # Raise on overflow, invalid (NaN-producing) and divide-by-zero; underflow to 0 is fine.
        with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
            try:
                result = _evaluate(self.tree, arrays)
            except FloatingPointError as err:
                raise ExpressionError(f"numerical failure: {err}") from None
        if not np.all(np.isfinite(result)):
            raise ExpressionError("the result is not a finite number")
        return float(result) if np.ndim(result) == 0 else result


def _evaluate(node: ast.expr, values: dict[str, np.ndarray]) -> np.ndarray:
    if isinstance(node, ast.Constant):
        return np.float64(node.value)
    if isinstance(node, ast.Name):
        return values[node.id] if node.id in values else np.float64(_CONSTANTS[node.id])
    if isinstance(node, ast.UnaryOp):
        operand = _evaluate(node.operand, values)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, values), _evaluate(node.right, values)
        if isinstance(node.op, ast.Pow) and np.any(left < 0) and float(right) != int(right):
            raise ExpressionError("a negative number raised to a fractional power")
        if isinstance(node.op, ast.Pow) and float(right) < 0 and np.any(left == 0):
            raise ExpressionError("zero raised to a negative power")
        return _BINARY[type(node.op)](left, right)
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)  # checked at parse time
    function = FUNCTIONS[node.func.id][0]
    return function(*(_evaluate(a, values) for a in node.args))


class _Checker:
    """Walks the tree once, rejecting anything outside the language with a message saying what."""

    def __init__(self, allowed: Collection[str], max_nodes: int, max_depth: int):
        self.allowed = set(allowed)
        self.max_nodes = max_nodes
        self.max_depth = max_depth
        self.nodes = 0
        self.used: set[str] = set()

    def check(self, node: ast.expr, depth: int = 1) -> None:
        self.nodes += 1
        if self.nodes > self.max_nodes:
            raise ExpressionError(f"formula too large (more than {self.max_nodes} parts)")
        if depth > self.max_depth:
            raise ExpressionError(f"formula nested too deeply (more than {self.max_depth} levels)")
        if isinstance(node, ast.Constant):
            self._check_literal(node)
        elif isinstance(node, ast.Name):
            if node.id not in self.allowed and node.id not in _CONSTANTS:
                names = ", ".join(sorted(self.allowed)) or "none"
                raise ExpressionError(f"unknown name {node.id!r} (variables allowed: {names})")
            if node.id in self.allowed:
                self.used.add(node.id)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            self.check(node.operand, depth + 1)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            if isinstance(node.op, ast.Pow):
                self._check_exponent(node.right)
            self.check(node.left, depth + 1)
            self.check(node.right, depth + 1)
        elif isinstance(node, ast.Call):
            self._check_call(node, depth)
        else:
            raise ExpressionError(f"{_describe(node)} is not allowed in a formula")

    def _check_literal(self, node: ast.Constant) -> None:
        if type(node.value) not in (int, float):
            raise ExpressionError(f"only numbers may appear as constants, not {node.value!r}")
        if not math.isfinite(node.value) or abs(node.value) > MAX_LITERAL:
            raise ExpressionError(f"number {node.value!r} out of range (|n| <= {MAX_LITERAL:g})")

    def _check_exponent(self, node: ast.expr) -> None:
        # A constant exponent keeps `**` cheap and its growth predictable (no 9**9**9, no x**x).
        power = _number(node)
        if power is None:
            raise ExpressionError("the exponent of ** must be a number, e.g. u**3")
        if abs(power) > MAX_EXPONENT:
            raise ExpressionError(f"exponent {power:g} too large (|p| <= {MAX_EXPONENT:g})")

    def _check_call(self, node: ast.Call, depth: int) -> None:
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            names = ", ".join(FUNCTIONS)
            raise ExpressionError(f"unknown function {_describe(node.func)} (allowed: {names})")
        if node.keywords:
            raise ExpressionError(f"{node.func.id}() takes no keyword arguments")
        if any(isinstance(arg, ast.Starred) for arg in node.args):
            raise ExpressionError(f"{node.func.id}() takes no *arguments")
        _, lo, hi = FUNCTIONS[node.func.id]
        if not lo <= len(node.args) <= hi:
            count = str(lo) if lo == hi else f"{lo} to {hi}"
            raise ExpressionError(f"{node.func.id}() takes {count} argument(s)")
        for arg in node.args:
            self.check(arg, depth + 1)


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return repr(node.id)
    return f"'{type(node).__name__}'"


def parse_expression(
    text: str,
    variables: Collection[str],
    *,
    max_chars: int = MAX_CHARS,
    max_nodes: int = MAX_NODES,
    max_depth: int = MAX_DEPTH,
) -> Expression:
    """Parse untrusted formula text over the named `variables`; raise `ExpressionError` saying
    what was wrong. Only parsing happens here: no part of the text is executed."""
    if not isinstance(text, str):
        raise ExpressionError("the formula must be text")
    for old, new in _LENIENT.items():
        text = text.replace(old, new)
    text = text.strip()
    if not text:
        raise ExpressionError("empty formula")
    if len(text) > max_chars:
        raise ExpressionError(f"formula too long ({len(text)} characters, at most {max_chars})")
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        detail = getattr(err, "msg", None) or type(err).__name__
        raise ExpressionError(f"not a formula ({detail})") from None
    checker = _Checker(variables, max_nodes, max_depth)
    checker.check(tree)
    return Expression(text=text, variables=frozenset(checker.used), tree=tree)
