"""Tokenizer, precedence parser and evaluator of ``${...}`` expressions."""

from __future__ import annotations

from typing import Any

import pytest

from cloudworkflows.errors import WorkflowError
from cloudworkflows.expressions import (
    Binary,
    Call,
    ExpressionSyntaxError,
    FunctionRef,
    Unary,
    evaluate,
    parse_expression,
    tokenize,
)
from cloudworkflows.stdlib import FUNCTIONS, resolve_object


class Ctx:
    def __init__(self, **variables: Any) -> None:
        self.variables = variables

    def lookup(self, name: str) -> tuple[bool, Any]:
        return (name in self.variables, self.variables.get(name))

    def call_function(self, name: str, args: list[Any]) -> Any:
        return FUNCTIONS[name].invoke(self, args)  # type: ignore[arg-type]

    def function_ref(self, name: str) -> Any:
        return resolve_object(name)


def ev(src: str, **variables: Any) -> Any:
    return evaluate(parse_expression(src), Ctx(**variables))


def test_tokenizer_strings_and_numbers() -> None:
    toks = tokenize(r'"a\"b\n\u0041" 12 3.5 1e3 x.y // != and')
    assert [t.value for t in toks[:-1]] == ['a"b\nA', 12, 3.5, 1000.0, "x", ".", "y", "//", "!=", "and"]
    assert isinstance(toks[1].value, int) and isinstance(toks[2].value, float)


@pytest.mark.parametrize(
    ("src", "expected"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("10 - 4 - 3", 3),
        ("2 * 3 % 4", 2),
        ("-2 * 3", -6),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 / 2", 3.5),
        ("1 < 2 == true", True),
        ("not false and true", True),
        ("true or false and false", True),
        ("'single' + \"double\"", "singledouble"),
        ("[1, 2, [3]][2][0]", 3),
        ('{"a": {"b": 5}}.a.b', 5),
        ('{"a": 1}["a"]', 1),
        ("1 == 1.0", True),
        ("true == 1", False),
        ('"b" > "a"', True),
        ("3 in [1, 2, 3]", True),
        ("null == null", True),
        ('len(keys({"a": 1}))', 1),
        ("TRUE and True", True),
    ],
)
def test_evaluation(src: str, expected: Any) -> None:
    result = ev(src)
    assert result == expected
    assert type(result) is type(expected)


def test_precedence_tree() -> None:
    node = parse_expression("a or b and not c == d")
    assert isinstance(node, Binary) and node.op == "or"
    assert isinstance(node.right, Binary) and node.right.op == "and"
    # Per the documented order of operations, `not` binds tighter than `==`.
    eq = node.right.right
    assert isinstance(eq, Binary) and eq.op == "==" and isinstance(eq.left, Unary)


def test_dotted_function_call() -> None:
    node = parse_expression('text.to_upper("x")')
    assert isinstance(node, Call) and node.name == "text.to_upper"
    assert ev('text.to_upper("x")') == "X"


def test_variables_and_function_refs() -> None:
    assert ev("x.items[1]", x={"items": [1, 2]}) == 2
    assert ev("http.default_retry_predicate") == FunctionRef("http.default_retry_predicate")
    # A variable shadows a namespace of the same name.
    assert ev("text.a", text={"a": 1}) == 1


@pytest.mark.parametrize(
    ("src", "tag"),
    [
        ("1 / 0", "ZeroDivisionError"),
        ("1 // 0", "ZeroDivisionError"),
        ("5 % 0", "ZeroDivisionError"),
        ("[1, 2] + 1", "TypeError"),
        ("true + 1", "TypeError"),
        ('1 < "a"', "TypeError"),
        ("1 and true", "TypeError"),
        ("not 1", "TypeError"),
        ('{"a": 1}.b', "KeyError"),
        ("[1][1]", "IndexError"),
        ("undefined_var", "KeyError"),
        ("9223372036854775807 + 1", "ValueError"),
        ('int("x")', "ValueError"),
        ("1 in 2", "TypeError"),
    ],
)
def test_errors(src: str, tag: str) -> None:
    with pytest.raises(WorkflowError) as info:
        ev(src)
    assert tag in info.value.value["tags"]
    assert info.value.value["message"]


@pytest.mark.parametrize("src", ["1 +", "(1", "a.", "f(1,", "'open", "1 2", "{1}", "#", ""])
def test_syntax_errors(src: str) -> None:
    with pytest.raises(ExpressionSyntaxError):
        parse_expression(src)


def test_string_plus_number_follows_conversion_table() -> None:
    assert ev('"n=" + 1') == "n=1"
    assert ev('1.5 + "x"') == "1.5x"
    assert ev('"b=" + false') == "b=false"
