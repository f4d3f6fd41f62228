"""The Workflows expression language: tokenizer, precedence parser and evaluator.

Only a value that is *entirely* ``${...}`` is an expression; text mixed with ``${}`` stays a
literal string, as in Cloud Workflows. Expressions are parsed once at load time so syntax errors
and unknown functions surface before anything runs.

Operator precedence follows the "Order of operations" table of the Workflows data types page:
``.``/``[]``/call > ``not`` > unary ``-`` > ``* / // %`` > ``+ -`` > comparisons/``in`` > ``and`` > ``or``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import WorkflowError, error, index_error, key_error, type_error, value_error

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class ExpressionSyntaxError(ValueError):
    """An expression does not parse; the loader turns it into a WorkflowSyntaxError."""


# --------------------------------------------------------------------------- values


@dataclass(frozen=True)
class FunctionRef:
    """A reference to a function used as a value (``${http.default_retry_predicate}``)."""

    name: str


def wtype(value: Any) -> str:
    """The Workflows type name of a runtime value, as ``get_type`` returns it. Google's list of those
    names (the expression helpers page, "Type functions") could not be read past its if() section here;
    these are the data types page's names, lower-cased, as aajanki/ts2workflows declares get_type's
    result ('boolean' | 'bytes' | 'double' | 'integer' | 'list' | 'map' | 'string' | 'null',
    types/workflowslib.d.ts at c58222f)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bytes | bytearray):
        return "bytes"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "map"
    if isinstance(value, FunctionRef):
        return "function"
    return type(value).__name__


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_int(value: int) -> int:
    """Integers are 64-bit signed in Workflows; leaving the range is an error, not a bigint."""
    if value < INT64_MIN or value > INT64_MAX:
        raise value_error("integer overflow")
    return value


def to_display_string(value: Any) -> str:
    """String form used by ``string()`` and implicit ``+`` conversion."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return value
    raise type_error(f"cannot convert {wtype(value)} to string")


def weq(a: Any, b: Any) -> bool:
    """Workflows equality: numbers compare by value, booleans are not numbers, deep for containers."""
    if is_number(a) and is_number(b):
        return bool(a == b)
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(weq(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(weq(a[k], b[k]) for k in a)
    if type(a) is not type(b):
        return False
    return bool(a == b)


# --------------------------------------------------------------------------- AST


@dataclass
class Node:
    pass


@dataclass
class Literal(Node):
    value: Any


@dataclass
class Var(Node):
    name: str


@dataclass
class Attr(Node):
    obj: Node
    name: str


@dataclass
class Index(Node):
    obj: Node
    index: Node


@dataclass
class Call(Node):
    name: str
    args: list[Node]


@dataclass
class Unary(Node):
    op: str
    operand: Node


@dataclass
class Binary(Node):
    op: str
    left: Node
    right: Node


@dataclass
class ListLit(Node):
    items: list[Node]


@dataclass
class MapLit(Node):
    items: list[tuple[Node, Node]]


def dotted_name(node: Node) -> str | None:
    """``a.b.c`` for a pure chain of names, else None."""
    if isinstance(node, Var):
        return node.name
    if isinstance(node, Attr):
        base = dotted_name(node.obj)
        return None if base is None else f"{base}.{node.name}"
    return None


def children(node: Node) -> list[Node]:
    """The direct sub-expressions of a node."""
    if isinstance(node, Attr):
        return [node.obj]
    if isinstance(node, Index):
        return [node.obj, node.index]
    if isinstance(node, Call):
        return list(node.args)
    if isinstance(node, Unary):
        return [node.operand]
    if isinstance(node, Binary):
        return [node.left, node.right]
    if isinstance(node, ListLit):
        return list(node.items)
    if isinstance(node, MapLit):
        return [n for kv in node.items for n in kv]
    return []


def walk(node: Node) -> list[Node]:
    """All nodes of a tree, used by load-time checks."""
    out: list[Node] = [node]
    for child in children(node):
        out.extend(walk(child))
    return out


# --------------------------------------------------------------------------- tokenizer

_KEYWORDS = {
    "and": "and",
    "AND": "and",
    "or": "or",
    "OR": "or",
    "not": "not",
    "NOT": "not",
    "in": "in",
    "IN": "in",
}
_CONSTANTS: dict[str, Any] = {
    "true": True,
    "True": True,
    "TRUE": True,
    "false": False,
    "False": False,
    "FALSE": False,
    "null": None,
}
_PUNCT = [
    "//",
    "==",
    "!=",
    "<=",
    ">=",
    "<",
    ">",
    "+",
    "-",
    "*",
    "/",
    "%",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    ".",
]
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", '"': '"', "'": "'", "\\": "\\", "/": "/"}


@dataclass
class Token:
    kind: str  # num, str, name, op, kw, const, end
    value: Any
    pos: int
    text: str = ""


def tokenize(src: str) -> list[Token]:
    tokens: list[Token] = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if c.isspace():
            i += 1
            continue
        if c.isdigit():
            j = i
            while j < n and src[j].isdigit():
                j += 1
            is_float = False
            if j < n and src[j] == "." and j + 1 < n and src[j + 1].isdigit():
                is_float = True
                j += 1
                while j < n and src[j].isdigit():
                    j += 1
            if j < n and src[j] in "eE":
                k = j + 1
                if k < n and src[k] in "+-":
                    k += 1
                if k < n and src[k].isdigit():
                    is_float = True
                    j = k
                    while j < n and src[j].isdigit():
                        j += 1
            text = src[i:j]
            tokens.append(Token("num", float(text) if is_float else int(text), i))
            i = j
            continue
        if c in "\"'":
            quote, j, buf = c, i + 1, []
            while True:
                if j >= n:
                    raise ExpressionSyntaxError(f"unterminated string at position {i}")
                ch = src[j]
                if ch == quote:
                    j += 1
                    break
                if ch == "\\":
                    if j + 1 >= n:
                        raise ExpressionSyntaxError("dangling backslash in string")
                    esc = src[j + 1]
                    if esc == "u":
                        hexdigits = src[j + 2 : j + 6]
                        if len(hexdigits) != 4 or any(h not in "0123456789abcdefABCDEF" for h in hexdigits):
                            raise ExpressionSyntaxError(f"bad \\u escape at position {j}")
                        buf.append(chr(int(hexdigits, 16)))
                        j += 6
                        continue
                    if esc not in _ESCAPES:
                        raise ExpressionSyntaxError(f"unknown escape \\{esc} at position {j}")
                    buf.append(_ESCAPES[esc])
                    j += 2
                    continue
                buf.append(ch)
                j += 1
            tokens.append(Token("str", "".join(buf), i))
            i = j
            continue
        if c.isalpha() or c == "_":
            j = i
            while j < n and (src[j].isalnum() or src[j] == "_"):
                j += 1
            word = src[i:j]
            if word in _KEYWORDS:
                tokens.append(Token("kw", _KEYWORDS[word], i, word))
            elif word in _CONSTANTS:
                tokens.append(Token("const", _CONSTANTS[word], i, word))
            else:
                tokens.append(Token("name", word, i, word))
            i = j
            continue
        for p in _PUNCT:
            if src.startswith(p, i):
                tokens.append(Token("op", p, i))
                i += len(p)
                break
        else:
            raise ExpressionSyntaxError(f"unexpected character {c!r} at position {i}")
    tokens.append(Token("end", None, n))
    return tokens


# --------------------------------------------------------------------------- parser


class _Parser:
    def __init__(self, src: str) -> None:
        self.src = src
        self.tokens = tokenize(src)
        self.pos = 0

    def peek(self) -> Token:
        return self.tokens[self.pos]

    def next(self) -> Token:
        tok = self.tokens[self.pos]
        self.pos += 1
        return tok

    def at(self, kind: str, value: Any = None) -> bool:
        tok = self.peek()
        return tok.kind == kind and (value is None or tok.value == value)

    def expect(self, kind: str, value: Any = None) -> Token:
        if not self.at(kind, value):
            tok = self.peek()
            want = value if value is not None else kind
            got = "end of expression" if tok.kind == "end" else repr(tok.value)
            raise ExpressionSyntaxError(f"expected {want!r} but found {got} at position {tok.pos}")
        return self.next()

    def parse(self) -> Node:
        node = self.parse_or()
        if not self.at("end"):
            tok = self.peek()
            raise ExpressionSyntaxError(f"unexpected {tok.value!r} at position {tok.pos}")
        return node

    def parse_or(self) -> Node:
        node = self.parse_and()
        while self.at("kw", "or"):
            self.next()
            node = Binary("or", node, self.parse_and())
        return node

    def parse_and(self) -> Node:
        node = self.parse_cmp()
        while self.at("kw", "and"):
            self.next()
            node = Binary("and", node, self.parse_cmp())
        return node

    def parse_cmp(self) -> Node:
        node = self.parse_add()
        while True:
            tok = self.peek()
            if tok.kind == "op" and tok.value in ("==", "!=", "<", "<=", ">", ">="):
                self.next()
                node = Binary(tok.value, node, self.parse_add())
            elif tok.kind == "kw" and tok.value == "in":
                self.next()
                node = Binary("in", node, self.parse_add())
            else:
                return node

    def parse_add(self) -> Node:
        node = self.parse_mul()
        while self.peek().kind == "op" and self.peek().value in ("+", "-"):
            op = self.next().value
            node = Binary(op, node, self.parse_mul())
        return node

    def parse_mul(self) -> Node:
        node = self.parse_unary()
        while self.peek().kind == "op" and self.peek().value in ("*", "/", "//", "%"):
            op = self.next().value
            node = Binary(op, node, self.parse_unary())
        return node

    def parse_unary(self) -> Node:
        if self.at("kw", "not"):
            self.next()
            return Unary("not", self.parse_unary())
        if self.at("op", "-"):
            self.next()
            operand = self.parse_unary()
            if isinstance(operand, Literal) and is_number(operand.value):
                return Literal(-operand.value)
            return Unary("-", operand)
        return self.parse_postfix()

    def parse_postfix(self) -> Node:
        node = self.parse_primary()
        while True:
            if self.at("op", "."):
                self.next()
                tok = self.next()
                if tok.kind not in ("name", "kw", "const"):
                    raise ExpressionSyntaxError(f"expected a name after '.' at position {tok.pos}")
                node = Attr(node, tok.text)
            elif self.at("op", "["):
                self.next()
                idx = self.parse_or()
                self.expect("op", "]")
                node = Index(node, idx)
            elif self.at("op", "("):
                name = dotted_name(node)
                if name is None:
                    raise ExpressionSyntaxError(
                        f"only named functions can be called (position {self.peek().pos})"
                    )
                self.next()
                args: list[Node] = []
                if not self.at("op", ")"):
                    args.append(self.parse_or())
                    while self.at("op", ","):
                        self.next()
                        args.append(self.parse_or())
                self.expect("op", ")")
                node = Call(name, args)
            else:
                return node

    def parse_primary(self) -> Node:
        tok = self.next()
        if tok.kind in ("num", "str", "const"):
            return Literal(tok.value)
        if tok.kind == "name":
            return Var(tok.value)
        if tok.kind == "op" and tok.value == "(":
            node = self.parse_or()
            self.expect("op", ")")
            return node
        if tok.kind == "op" and tok.value == "[":
            items: list[Node] = []
            if not self.at("op", "]"):
                items.append(self.parse_or())
                while self.at("op", ","):
                    self.next()
                    if self.at("op", "]"):
                        break
                    items.append(self.parse_or())
            self.expect("op", "]")
            return ListLit(items)
        if tok.kind == "op" and tok.value == "{":
            pairs: list[tuple[Node, Node]] = []
            if not self.at("op", "}"):
                while True:
                    key = self.parse_or()
                    self.expect("op", ":")
                    pairs.append((key, self.parse_or()))
                    if not self.at("op", ","):
                        break
                    self.next()
                    if self.at("op", "}"):
                        break
            self.expect("op", "}")
            return MapLit(pairs)
        got = "end of expression" if tok.kind == "end" else repr(tok.value)
        raise ExpressionSyntaxError(f"unexpected {got} at position {tok.pos}")


def parse_expression(src: str) -> Node:
    """Parse the text between ``${`` and ``}``."""
    if not src.strip():
        raise ExpressionSyntaxError("empty expression")
    return _Parser(src).parse()


# --------------------------------------------------------------------------- templates


@dataclass
class Expr:
    """A compiled ``${...}`` value."""

    source: str
    node: Node = field(repr=False)


def is_expression(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${") and value.endswith("}")


def compile_value(value: Any) -> Any:
    """Replace every whole-value ``${...}`` string in a YAML value with a compiled :class:`Expr`. A map
    key written as ``${...}`` is a dynamic key, evaluated when the map is ("when using dynamic keys in
    a map defined with braces, wrap the expression in quotes": cloud.google.com/workflows/docs/reference/
    syntax/maps, "Map definition"); it stays the key's text here and is parsed now (and once)."""
    if is_expression(value):
        return Expr(value, parse_expression(value[2:-1]))
    if isinstance(value, dict):
        for key in value:
            if is_expression(key):
                _key_expression(key)
        return {k: compile_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [compile_value(v) for v in value]
    return value


@functools.cache
def _key_expression(key: str) -> Expr:
    return Expr(key, parse_expression(key[2:-1]))


def expressions_in(value: Any) -> list[Expr]:
    if isinstance(value, Expr):
        return [value]
    if isinstance(value, dict):
        keys = [_key_expression(k) for k in value if is_expression(k)]
        return keys + [e for v in value.values() for e in expressions_in(v)]
    if isinstance(value, list):
        return [e for v in value for e in expressions_in(v)]
    return []


# --------------------------------------------------------------------------- evaluation


class Context(Protocol):
    """What the evaluator needs from the engine."""

    def lookup(self, name: str) -> tuple[bool, Any]: ...

    def call_function(self, name: str, args: list[Any]) -> Any: ...

    def function_ref(self, name: str) -> FunctionRef | None: ...


def evaluate_value(value: Any, ctx: Context) -> Any:
    """Evaluate a compiled YAML value (literals are copied, expressions evaluated)."""
    if isinstance(value, Expr):
        return evaluate(value.node, ctx)
    if isinstance(value, dict):
        return {_evaluate_key(k, ctx): evaluate_value(v, ctx) for k, v in value.items()}
    if isinstance(value, list):
        return [evaluate_value(v, ctx) for v in value]
    return value


def _evaluate_key(key: Any, ctx: Context) -> Any:
    if not is_expression(key):
        return key
    evaluated = evaluate(_key_expression(key).node, ctx)
    if not isinstance(evaluated, str):
        raise type_error(f"map keys must be strings, got {wtype(evaluated)} from {key}")
    return evaluated


def evaluate(node: Node, ctx: Context) -> Any:
    if isinstance(node, Literal):
        return node.value
    if isinstance(node, Var):
        found, value = ctx.lookup(node.name)
        if found:
            return value
        ref = ctx.function_ref(node.name)
        if ref is not None:
            return ref
        raise key_error(f"variable '{node.name}' is not defined")
    if isinstance(node, Attr):
        name = dotted_name(node)
        if name is not None:
            root = name.split(".", 1)[0]
            found, _ = ctx.lookup(root)
            if not found:
                ref = ctx.function_ref(name)
                if ref is not None:
                    return ref
        obj = evaluate(node.obj, ctx)
        return get_key(obj, node.name)
    if isinstance(node, Index):
        obj = evaluate(node.obj, ctx)
        idx = evaluate(node.index, ctx)
        return get_index(obj, idx)
    if isinstance(node, Call):
        args = [evaluate(a, ctx) for a in node.args]
        return ctx.call_function(node.name, args)
    if isinstance(node, ListLit):
        return [evaluate(i, ctx) for i in node.items]
    if isinstance(node, MapLit):
        out: dict[str, Any] = {}
        for k_node, v_node in node.items:
            key = evaluate(k_node, ctx)
            if not isinstance(key, str):
                raise type_error(f"map keys must be strings, got {wtype(key)}")
            out[key] = evaluate(v_node, ctx)
        return out
    if isinstance(node, Unary):
        operand = evaluate(node.operand, ctx)
        if node.op == "not":
            if not isinstance(operand, bool):
                raise type_error(f"'not' expects a boolean, got {wtype(operand)}")
            return not operand
        if not is_number(operand):
            raise type_error(f"unary '-' expects a number, got {wtype(operand)}")
        return check_int(-operand) if isinstance(operand, int) else -operand
    if isinstance(node, Binary):
        if node.op in ("and", "or"):
            left = evaluate(node.left, ctx)
            if not isinstance(left, bool):
                raise type_error(f"'{node.op}' expects booleans, got {wtype(left)}")
            if node.op == "and" and not left:
                return False
            if node.op == "or" and left:
                return True
            right = evaluate(node.right, ctx)
            if not isinstance(right, bool):
                raise type_error(f"'{node.op}' expects booleans, got {wtype(right)}")
            return right
        return binary(node.op, evaluate(node.left, ctx), evaluate(node.right, ctx))
    raise TypeError(f"unknown node {node!r}")


def get_key(obj: Any, key: str) -> Any:
    if not isinstance(obj, dict):
        raise type_error(f"cannot access key '{key}' of {wtype(obj)}")
    if key not in obj:
        raise key_error(f"key not found: {key}")
    return obj[key]


def get_index(obj: Any, idx: Any) -> Any:
    if isinstance(obj, dict):
        if not isinstance(idx, str):
            raise type_error(f"map keys must be strings, got {wtype(idx)}")
        return get_key(obj, idx)
    if isinstance(obj, list):
        if isinstance(idx, bool) or not isinstance(idx, int):
            raise type_error(f"list index must be an integer, got {wtype(idx)}")
        if idx < 0 or idx >= len(obj):
            raise index_error(f"list index out of range: {idx}")
        return obj[idx]
    raise type_error(f"cannot index {wtype(obj)}")


def _num_result(value: Any) -> Any:
    return check_int(value) if isinstance(value, int) else value


def binary(op: str, a: Any, b: Any) -> Any:
    """Binary operators with the implicit conversions of the Workflows data types page."""
    if op == "==":
        return weq(a, b)
    if op == "!=":
        return not weq(a, b)
    if op == "in":
        if isinstance(b, list):
            return any(weq(a, item) for item in b)
        if isinstance(b, dict):
            if not isinstance(a, str):
                raise type_error(f"'in' on a map expects a string key, got {wtype(a)}")
            return a in b
        raise type_error(f"'in' expects a list or map on the right, got {wtype(b)}")
    if op in ("<", "<=", ">", ">="):
        if not ((is_number(a) and is_number(b)) or (isinstance(a, str) and isinstance(b, str))):
            raise type_error(f"cannot compare {wtype(a)} and {wtype(b)} with '{op}'")
        if op == "<":
            return a < b
        if op == "<=":
            return a <= b
        if op == ">":
            return a > b
        return a >= b
    if op == "+":
        if is_number(a) and is_number(b):
            return _num_result(a + b)
        # Data types page: STRING + INTEGER/DOUBLE/BOOL yields STRING (and vice versa).
        if (isinstance(a, str) or isinstance(b, str)) and all(
            isinstance(x, str | bool) or is_number(x) for x in (a, b)
        ):
            return to_display_string(a) + to_display_string(b)
        raise type_error(f"unsupported operand types for '+': {wtype(a)} and {wtype(b)}")
    if not (is_number(a) and is_number(b)):
        raise type_error(f"unsupported operand types for '{op}': {wtype(a)} and {wtype(b)}")
    if op == "-":
        return _num_result(a - b)
    if op == "*":
        return _num_result(a * b)
    if op == "/":
        if b == 0:
            raise error("ZeroDivisionError", "division by zero")
        return float(a) / float(b)
    if op == "//":
        if b == 0:
            raise error("ZeroDivisionError", "integer division by zero")
        return _num_result(a // b) if isinstance(a, int) and isinstance(b, int) else float(a // b)
    if op == "%":
        if b == 0:
            raise error("ZeroDivisionError", "modulo by zero")
        return _num_result(a % b) if isinstance(a, int) and isinstance(b, int) else float(a % b)
    raise type_error(f"unknown operator {op}")


def json_safe(value: Any, error: Callable[[str], WorkflowError] = type_error) -> Any:
    """Check a value can leave the workflow as JSON (bytes cannot, per the data types page); ``error``
    makes the failure (json.encode's is a ValueError)."""
    if isinstance(value, bytes | bytearray):
        raise error("bytes cannot be JSON-encoded")
    if isinstance(value, FunctionRef):
        raise error("a function cannot be JSON-encoded")
    if isinstance(value, dict):
        return {k: json_safe(v, error) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v, error) for v in value]
    return value


def dumps(value: Any) -> str:
    return json.dumps(json_safe(value), separators=(",", ":"), ensure_ascii=False)


__all__ = [
    "Callable",
    "Context",
    "Expr",
    "ExpressionSyntaxError",
    "FunctionRef",
    "WorkflowError",
    "compile_value",
    "dumps",
    "evaluate",
    "evaluate_value",
    "parse_expression",
    "weq",
    "wtype",
]
