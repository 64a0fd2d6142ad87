"""A safe arithmetic calculator, the example tool of `ToolEnvironment`: `ast`-parsed,
never `eval`-ed, with limits that keep every evaluation fast and small."""

import ast
import math
import operator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_NODES = 100
MAX_EXPONENT = 100
MAX_INT_BITS = 512


def calculator(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely: a tool for `ToolEnvironment`.

    Accepts numbers (ints and floats, not booleans or complex), the binary operators
    `+ - * / // % **`, unary `+ -` and parentheses — nothing else: no names, calls,
    attributes, subscripts, comparisons. The expression is parsed with `ast`, never
    `eval`-ed. Limits keep every evaluation fast and small: at most 200 characters and
    100 syntax nodes, exponents of magnitude at most 100, integers of at most 512 bits
    (about 154 digits), finite floats.

    **Arguments:**

    - `expression`: e.g. `"(2 + 3) * 4 ** 2"`.

    **Returns:** the value (`int` or `float`). **Raises** `ValueError` naming what is
    not allowed or which limit was hit (division by zero included).
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(
            f"expression has {len(expression)} characters, more than {MAX_EXPRESSION_CHARS}"
        )
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_NODES:
        raise ValueError(f"expression has {nodes} syntax nodes, more than {MAX_NODES}")
    return _evaluate(tree.body)


def _check_value(x: int | float | complex) -> int | float:
    if isinstance(x, complex):
        raise ValueError("the result is a complex number")
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise ValueError(f"an intermediate integer exceeds {MAX_INT_BITS} bits")
    if isinstance(x, float) and not math.isfinite(x):
        raise ValueError("an intermediate value is not finite")
    return x


def _power(base: int | float, exponent: int | float) -> int | float | complex:
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent!r} exceeds the limit of {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if base.bit_length() * exponent > MAX_INT_BITS + 64:
            raise ValueError(f"{base} ** {exponent} exceeds {MAX_INT_BITS} bits")
    return base**exponent


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"only numbers are allowed, got {value!r}")
        return _check_value(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check_value(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        try:
            if isinstance(node.op, ast.Pow):
                value = _power(left, right)
            else:
                value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("numeric overflow") from None
        return _check_value(value)
    raise ValueError(f"{type(node).__name__} is not allowed in an arithmetic expression")
