"""Loading and validating Workflows definitions (YAML or JSON) into a typed step tree.

Everything that Cloud Workflows rejects at deployment time is rejected here, with the step name
and the source line, so a broken ``workflows/retrain.yaml`` fails before it runs rather than
halfway through a retraining run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import WorkflowSyntaxError
from .expressions import (
    Attr,
    Call,
    Expr,
    ExpressionSyntaxError,
    Index,
    Node,
    Var,
    children,
    compile_value,
    dotted_name,
    expressions_in,
    parse_expression,
    walk,
)
from .stdlib import FUNCTIONS, OBJECTS, POLICIES

# --------------------------------------------------------------------------- line-tracking YAML


#: Call names that are Workflows connectors (the Google API connectors and the Kubernetes API one).
CONNECTOR_NAMESPACES = ("googleapis.", "gke.")


class LDict(dict[Any, Any]):
    """A mapping that remembers where it (and each key) was in the source."""

    line: int = 0
    key_lines: dict[Any, int]


class LList(list[Any]):
    line: int = 0


class WorkflowsYaml(yaml.SafeLoader):
    """YAML with the core schema of YAML 1.2 (yaml.org/spec/1.2.2, 10.3.2 "Tag Resolution"), not PyYAML's
    1.1: Workflows' booleans are "true/false, True/False, TRUE/FALSE" only
    (cloud.google.com/workflows/docs/reference/syntax/datatypes), exactly 1.2's, so ``yes``, ``on`` and
    ``off`` stay strings, ``010`` is ten and ``1e3`` a double."""


#: Each tag's pattern and the first characters a plain scalar of it can start with ("" for the empty null).
_CORE_SCHEMA = {
    "tag:yaml.org,2002:null": (r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    "tag:yaml.org,2002:bool": (r"true|True|TRUE|false|False|FALSE", list("tTfF")),
    "tag:yaml.org,2002:int": (r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", list("-+0123456789")),
    "tag:yaml.org,2002:float": (
        r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
        list("-+0123456789."),
    ),
}
# Only the core schema's tags and the merge key: PyYAML's 1.1 timestamps (2024-05-08 would be a date,
# which is no Workflows value) and "=" are plain strings in YAML 1.2.
WorkflowsYaml.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag == "tag:yaml.org,2002:merge"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, (_pattern, _first) in _CORE_SCHEMA.items():
    WorkflowsYaml.add_implicit_resolver(_tag, re.compile(f"^(?:{_pattern})$"), _first)


def _core_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text)


WorkflowsYaml.add_constructor("tag:yaml.org,2002:int", _core_int)


def _convert(node: yaml.Node, loader: yaml.SafeLoader) -> Any:
    if isinstance(node, yaml.MappingNode):
        out = LDict()
        out.line = node.start_mark.line + 1
        out.key_lines = {}
        loader.flatten_mapping(node)
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise WorkflowSyntaxError("mapping keys must be scalars", line=key_node.start_mark.line + 1)
            # A map's keys are strings, as in the JSON form of every definition: ``1: one`` is the key "1".
            key = key_node.value
            if key in out:
                raise WorkflowSyntaxError(f"duplicate key {key!r}", line=key_node.start_mark.line + 1)
            out.key_lines[key] = key_node.start_mark.line + 1
            out[key] = _convert(value_node, loader)
        return out
    if isinstance(node, yaml.SequenceNode):
        seq = LList(_convert(child, loader) for child in node.value)
        seq.line = node.start_mark.line + 1
        return seq
    return loader.construct_object(node, deep=True)


def parse_source(text: str) -> Any:
    """YAML (a superset of JSON) with line numbers; plain JSON as a fallback for odd JSON."""
    loader = WorkflowsYaml(text)
    try:
        root = loader.get_single_node()
        if root is None:
            raise WorkflowSyntaxError("empty workflow definition")
        return _convert(root, loader)
    except yaml.YAMLError as exc:
        try:
            return json.loads(text)
        except ValueError:
            mark = getattr(exc, "problem_mark", None)
            raise WorkflowSyntaxError(
                f"invalid YAML: {exc}", line=None if mark is None else mark.line + 1
            ) from None
    finally:
        loader.dispose()


def _line(obj: Any, key: Any = None, default: int = 0) -> int:
    if isinstance(obj, LDict) and key is not None and key in obj.key_lines:
        return obj.key_lines[key]
    return int(getattr(obj, "line", default) or default)


# --------------------------------------------------------------------------- model


@dataclass
class Target:
    """An assignment target such as ``a``, ``a.b``, ``a["k"]`` or ``xs[0]``."""

    text: str
    root: str
    path: list[Any]  # str for .name, Node for [expr]


@dataclass
class RetrySpec:
    line: int
    policy: Expr | None = None
    predicate: Any = None
    max_retries: Any = None
    initial_delay: Any = None
    max_delay: Any = None
    multiplier: Any = None


@dataclass
class ExceptSpec:
    as_: str | None
    steps: list[Step]


@dataclass
class ForSpec:
    line: int
    value: str
    index: str | None
    in_: Any
    range_: Any
    steps: list[Step]


@dataclass
class Branch:
    name: str
    line: int
    steps: list[Step]


@dataclass
class ParallelSpec:
    shared: list[str]
    concurrency_limit: Any
    exception_policy: str
    branches: list[Branch] | None
    for_: ForSpec | None


@dataclass
class Condition:
    line: int
    condition: Any
    next: str | None = None
    steps: list[Step] | None = None
    inline: Step | None = None


@dataclass
class Step:
    name: str
    line: int
    kind: str
    next: str | None = None
    assign: list[tuple[Target, Any]] = field(default_factory=list)
    call: str | None = None
    args: dict[str, Any] | None = None
    result: str | None = None
    switch: list[Condition] | None = None
    steps: list[Step] | None = None
    for_: ForSpec | None = None
    parallel: ParallelSpec | None = None
    try_: list[Step] | None = None
    retry: RetrySpec | None = None
    except_: ExceptSpec | None = None
    value: Any = None  # raise / return value
    inline: bool = False  # the single step of an inline try body or switch condition


@dataclass
class Param:
    name: str
    has_default: bool = False
    default: Any = None


@dataclass
class Subworkflow:
    name: str
    line: int
    params: list[Param]
    steps: list[Step]


@dataclass
class Definition:
    subworkflows: dict[str, Subworkflow]

    @property
    def main(self) -> Subworkflow:
        return self.subworkflows["main"]


# --------------------------------------------------------------------------- parsing

_PRIMARY = ("assign", "call", "switch", "steps", "for", "parallel", "try", "raise", "return")
_ALLOWED: dict[str, set[str]] = {
    "assign": {"assign", "next"},
    "call": {"call", "args", "result", "next"},
    "switch": {"switch", "next"},
    "steps": {"steps", "next"},
    "for": {"for", "next"},
    "parallel": {"parallel", "next"},
    "try": {"try", "retry", "except", "next"},
    "raise": {"raise"},
    "return": {"return"},
    "next": {"next"},
}
BLOCKING_IN_EXPRESSIONS = "blocking"

# Limits Google enforces when a workflow is deployed. "Each switch block can include a maximum of 50
# conditions" (cloud.google.com/workflows/docs/reference/syntax/conditions); the others are the bounds of
# Google's own JSON schema of the language (GoogleCloudPlatform/workflows-samples,
# jsonschema/workflows.json at 127ed78: assign maxItems 50, branches maxItems 10, subworkflow params
# maxItems 10; its branches minItems 2 is not enforced here: no Google page says a one-branch parallel
# step is refused).
#: The quotas page (cloud.google.com/workflows/quotas, "System limits", in its French rendering): source
#: code of at most 128 KB, parallel steps nested at most 2 deep.
MAX_SOURCE_BYTES = 128 * 1024
MAX_PARALLEL_DEPTH = 2
MAX_ASSIGNMENTS = 50
MAX_CONDITIONS = 50
MAX_BRANCHES = 10
MAX_PARAMS = 10
#: "There is a limit to the expression length" (cloud.google.com/workflows/docs/reference/syntax/
#: expressions, linking the quotas page's resource limits, whose table these tools could not read past its
#: quotas). The number is that table's as third-party copies give it: 400 characters
#: (lemonberrylabs/gcw-emulator docs/src/reference/limits.md at fcfc511, beside the 128 KB source, 512 KB
#: memory and 256 KB string rows Google's own pages confirm). Counted between ``${`` and ``}``.
MAX_EXPRESSION_LENGTH = 400


class _Builder:
    def __init__(self, subworkflow_names: set[str]) -> None:
        self.subworkflow_names = subworkflow_names
        self.current_sub = ""

    def fail(self, message: str, step: str | None, line: int | None) -> WorkflowSyntaxError:
        return WorkflowSyntaxError(message, step=step, line=line)

    def compile(self, value: Any, step: str, line: int) -> Any:
        try:
            compiled = compile_value(value)
        except ExpressionSyntaxError as exc:
            raise self.fail(f"invalid expression: {exc}", step, line) from None
        for expr in expressions_in(compiled):
            self.check_expression(expr, step, line)
        return compiled

    def check_expression(self, expr: Expr, step: str, line: int) -> None:
        length = len(expr.source) - len("${}")
        if length > MAX_EXPRESSION_LENGTH:
            raise self.fail(
                f"expression is {length} characters long; the limit is {MAX_EXPRESSION_LENGTH}",
                step,
                line,
            )
        for node in walk(expr.node):
            if isinstance(node, Call):
                fn = FUNCTIONS.get(node.name)
                if fn is not None:
                    if fn.blocking:
                        raise self.fail(
                            f"blocking function {node.name}() is only allowed in a call step",
                            step,
                            line,
                        )
                    continue
                if node.name in self.subworkflow_names:
                    continue
                raise self.fail(f"unknown function {node.name}() in {expr.source}", step, line)

    def steps(self, raw: Any, where: str, line: int) -> list[Step]:
        if not isinstance(raw, list) or not raw:
            raise self.fail("expected a non-empty list of steps", where, line)
        out = []
        for item in raw:
            item_line = _line(item, default=line)
            if not isinstance(item, dict) or len(item) != 1:
                raise self.fail(
                    "each step must be a map with exactly one key (the step name)", where, item_line
                )
            ((name, body),) = item.items()
            out.append(self.step(str(name), body, _line(item, name, item_line)))
        return out

    def step(self, name: str, body: Any, line: int) -> Step:
        if not isinstance(body, dict):
            raise self.fail("step body must be a map", name, line)
        primaries = [k for k in _PRIMARY if k in body]
        if len(primaries) > 1:
            raise self.fail(f"a step cannot combine {' and '.join(primaries)}", name, line)
        kind = primaries[0] if primaries else ("next" if "next" in body else "")
        if not kind:
            keys = ", ".join(map(str, body)) or "nothing"
            raise self.fail(f"unknown step shape (keys: {keys})", name, line)
        unknown = [str(k) for k in body if k not in _ALLOWED[kind]]
        if unknown:
            raise self.fail(
                f"unknown key(s) {', '.join(unknown)} in a {kind} step", name, _line(body, unknown[0], line)
            )
        step = Step(name=name, line=line, kind=kind)
        if "next" in body:
            nxt = body["next"]
            if not isinstance(nxt, str):
                raise self.fail("next must be a step name, end, break or continue", name, line)
            step.next = nxt
        getattr(self, f"_k_{kind}")(step, body)
        return step

    # -- kinds ------------------------------------------------------------------------------

    def _k_next(self, step: Step, body: dict[str, Any]) -> None:
        return None

    def _k_assign(self, step: Step, body: dict[str, Any]) -> None:
        items = body["assign"]
        if not isinstance(items, list) or not items:
            raise self.fail("assign expects a non-empty list of single-key maps", step.name, step.line)
        if len(items) > MAX_ASSIGNMENTS:
            raise self.fail(
                f"an assign step holds at most {MAX_ASSIGNMENTS} assignments, this one {len(items)}",
                step.name,
                step.line,
            )
        for item in items:
            if not isinstance(item, dict) or len(item) != 1:
                raise self.fail(
                    "each assignment must be a single-key map", step.name, _line(item, default=step.line)
                )
            ((target, value),) = item.items()
            line = _line(item, target, step.line)
            step.assign.append(
                (self.target(str(target), step.name, line), self.compile(value, step.name, line))
            )

    def target(self, text: str, step: str, line: int) -> Target:
        try:
            node = parse_expression(text)
        except ExpressionSyntaxError as exc:
            raise self.fail(f"invalid assignment target {text!r}: {exc}", step, line) from None
        path: list[Any] = []
        while True:
            if isinstance(node, Var):
                path.reverse()
                return Target(text=text, root=node.name, path=path)
            if isinstance(node, Attr):
                path.append(node.name)
                node = node.obj
            elif isinstance(node, Index):
                path.append(node.index)
                for sub in walk(node.index):
                    if isinstance(sub, Call):
                        self.check_expression(Expr(text, sub), step, line)
                node = node.obj
            else:
                raise self.fail(f"invalid assignment target {text!r}", step, line)

    def _k_call(self, step: Step, body: dict[str, Any]) -> None:
        name = body["call"]
        if not isinstance(name, str):
            raise self.fail("call expects a function name", step.name, step.line)
        step.call = name
        args = body.get("args")
        if args is not None and not isinstance(args, dict):
            raise self.fail("args must be a map", step.name, _line(body, "args", step.line))
        step.args = None if args is None else self.compile(args, step.name, _line(body, "args", step.line))
        if "result" in body:
            if not isinstance(body["result"], str):
                raise self.fail("result must be a variable name", step.name, step.line)
            step.result = self.target(body["result"], step.name, step.line).text
        fn = FUNCTIONS.get(name)
        arg_names = set(step.args or {})
        if fn is not None:
            unknown = arg_names - set(fn.params) - set(fn.extra_args)
            if unknown:
                raise self.fail(
                    f"unknown argument(s) {', '.join(sorted(unknown))} for {name}", step.name, step.line
                )
            missing = [p for p in fn.params[: fn.required] if p not in arg_names]
            if missing:
                raise self.fail(f"missing argument(s) {', '.join(missing)} for {name}", step.name, step.line)
        elif name in self.subworkflow_names:
            pass  # checked once every subworkflow is known
        elif name.startswith(CONNECTOR_NAMESPACES):
            pass  # connector: resolved against the ConnectorRegistry at run time
        elif name in POLICIES:
            raise self.fail(f"{name} is not callable", step.name, step.line)
        else:
            raise self.fail(f"unknown function {name}", step.name, step.line)

    def _k_switch(self, step: Step, body: dict[str, Any]) -> None:
        conds = body["switch"]
        if not isinstance(conds, list) or not conds:
            raise self.fail("switch expects a non-empty list of conditions", step.name, step.line)
        if len(conds) > MAX_CONDITIONS:
            raise self.fail(
                f"a switch step holds at most {MAX_CONDITIONS} conditions, this one {len(conds)}",
                step.name,
                step.line,
            )
        step.switch = []
        for raw in conds:
            line = _line(raw, default=step.line)
            if not isinstance(raw, dict) or "condition" not in raw:
                raise self.fail("each switch entry needs a condition", step.name, line)
            cond = Condition(line=line, condition=self.compile(raw["condition"], step.name, line))
            rest = {k: v for k, v in raw.items() if k != "condition"}
            if isinstance(rest.get("next"), str) and set(rest) == {"next"}:
                cond.next = rest["next"]
            elif "steps" in rest and set(rest) <= {"steps", "next"}:
                cond.steps = self.steps(rest["steps"], step.name, line)
                cond.next = rest.get("next")
            elif any(k in rest for k in ("assign", "call", "raise", "return")):
                inline = LDict(rest)
                inline.line = line
                inline.key_lines = getattr(raw, "key_lines", {})
                cond.inline = self.step(step.name, inline, line)
                cond.inline.inline = True
                cond.next, cond.inline.next = cond.inline.next, None
            elif not rest:
                raise self.fail("switch condition needs next, steps or an inline step", step.name, line)
            else:
                keys = ", ".join(map(str, rest))
                raise self.fail(f"unknown key(s) {keys} in a switch condition", step.name, line)
            step.switch.append(cond)

    def _k_steps(self, step: Step, body: dict[str, Any]) -> None:
        step.steps = self.steps(body["steps"], step.name, step.line)

    def for_spec(self, raw: Any, step: str, line: int) -> ForSpec:
        if not isinstance(raw, dict):
            raise self.fail("for expects a map", step, line)
        unknown = [str(k) for k in raw if k not in ("value", "index", "in", "range", "steps")]
        if unknown:
            raise self.fail(f"unknown key(s) {', '.join(unknown)} in for", step, line)
        if "value" not in raw and "index" not in raw:
            raise self.fail("for needs value (and/or index)", step, line)
        if ("in" in raw) == ("range" in raw):
            raise self.fail("for needs exactly one of in or range", step, line)
        if "range" in raw and "index" in raw:
            raise self.fail("index cannot be used with range", step, line)
        if "steps" not in raw:
            raise self.fail("for needs steps", step, line)
        rng = raw.get("range")
        if rng is not None and not (isinstance(rng, list) and len(rng) == 2) and not isinstance(rng, str):
            raise self.fail("range must be a list of two numbers [start, end]", step, line)
        return ForSpec(
            line=line,
            value=str(raw["value"]) if "value" in raw else "",
            index=str(raw["index"]) if "index" in raw else None,
            in_=self.compile(raw["in"], step, line) if "in" in raw else None,
            range_=self.compile(rng, step, line) if rng is not None else None,
            steps=self.steps(raw["steps"], step, line),
        )

    def _k_for(self, step: Step, body: dict[str, Any]) -> None:
        step.for_ = self.for_spec(body["for"], step.name, _line(body, "for", step.line))

    def _k_parallel(self, step: Step, body: dict[str, Any]) -> None:
        raw = body["parallel"]
        line = _line(body, "parallel", step.line)
        if not isinstance(raw, dict):
            raise self.fail("parallel expects a map", step.name, line)
        unknown = [
            str(k)
            for k in raw
            if k not in ("shared", "concurrency_limit", "exception_policy", "branches", "for")
        ]
        if unknown:
            raise self.fail(f"unknown key(s) {', '.join(unknown)} in parallel", step.name, line)
        if ("branches" in raw) == ("for" in raw):
            raise self.fail("parallel needs exactly one of branches or for", step.name, line)
        shared = raw.get("shared", [])
        if not isinstance(shared, list) or not all(isinstance(s, str) for s in shared):
            raise self.fail("shared must be a list of variable names", step.name, line)
        policy = raw.get("exception_policy", "continueAll")
        if policy != "continueAll":
            raise self.fail(f"unsupported exception_policy {policy!r} (only continueAll)", step.name, line)
        branches = None
        if "branches" in raw:
            items = raw["branches"]
            if not isinstance(items, list) or not items:
                raise self.fail("branches must be a non-empty list", step.name, line)
            if len(items) > MAX_BRANCHES:
                raise self.fail(
                    f"a parallel step has at most {MAX_BRANCHES} branches, this one {len(items)}",
                    step.name,
                    line,
                )
            branches = []
            for item in items:
                bline = _line(item, default=line)
                if not isinstance(item, dict) or len(item) != 1:
                    raise self.fail("each branch must be a single-key map", step.name, bline)
                ((bname, bbody),) = item.items()
                if not isinstance(bbody, dict) or set(bbody) != {"steps"}:
                    raise self.fail("a branch must contain only steps", str(bname), bline)
                branches.append(Branch(str(bname), bline, self.steps(bbody["steps"], str(bname), bline)))
        step.parallel = ParallelSpec(
            shared=list(shared),
            concurrency_limit=self.compile(raw.get("concurrency_limit"), step.name, line),
            exception_policy=policy,
            branches=branches,
            for_=self.for_spec(raw["for"], step.name, line) if "for" in raw else None,
        )

    def _k_try(self, step: Step, body: dict[str, Any]) -> None:
        raw = body["try"]
        line = _line(body, "try", step.line)
        if isinstance(raw, dict) and set(raw) == {"steps"}:
            step.try_ = self.steps(raw["steps"], step.name, line)
        elif isinstance(raw, dict):
            step.try_ = [self.step(step.name, raw, line)]
            step.try_[0].inline = True
        else:
            raise self.fail("try expects steps or a single step", step.name, line)
        if "retry" not in body and "except" not in body:
            raise self.fail("try needs retry and/or except", step.name, line)
        if "retry" in body:
            step.retry = self.retry(body["retry"], step.name, _line(body, "retry", line))
        if "except" in body:
            exc = body["except"]
            eline = _line(body, "except", line)
            if not isinstance(exc, dict) or "steps" not in exc or not set(exc) <= {"as", "steps"}:
                raise self.fail("except expects {as, steps}", step.name, eline)
            as_ = exc.get("as")
            if as_ is not None and not isinstance(as_, str):
                raise self.fail("except.as must be a variable name", step.name, eline)
            step.except_ = ExceptSpec(as_, self.steps(exc["steps"], step.name, eline))

    def retry(self, raw: Any, step: str, line: int) -> RetrySpec:
        spec = RetrySpec(line=line)
        if isinstance(raw, str):
            compiled = self.compile(raw, step, line)
            if not isinstance(compiled, Expr):
                raise self.fail(
                    "retry policy must be an expression such as ${http.default_retry}", step, line
                )
            spec.policy = compiled
            return spec
        if not isinstance(raw, dict):
            raise self.fail("retry expects a policy expression or a map", step, line)
        unknown = [str(k) for k in raw if k not in ("predicate", "max_retries", "backoff")]
        if unknown:
            raise self.fail(f"unknown key(s) {', '.join(unknown)} in retry", step, line)
        if "predicate" not in raw or "max_retries" not in raw:
            raise self.fail("a custom retry needs predicate and max_retries", step, line)
        spec.predicate = self.compile(raw["predicate"], step, line)
        spec.max_retries = self.compile(raw["max_retries"], step, line)
        backoff = raw.get("backoff")
        if backoff is not None:
            if not isinstance(backoff, dict):
                raise self.fail("backoff must be a map", step, line)
            bad = [str(k) for k in backoff if k not in ("initial_delay", "max_delay", "multiplier")]
            if bad:
                raise self.fail(f"unknown key(s) {', '.join(bad)} in backoff", step, line)
            spec.initial_delay = self.compile(backoff.get("initial_delay"), step, line)
            spec.max_delay = self.compile(backoff.get("max_delay"), step, line)
            spec.multiplier = self.compile(backoff.get("multiplier"), step, line)
        return spec

    def _k_raise(self, step: Step, body: dict[str, Any]) -> None:
        step.value = self.compile(body["raise"], step.name, step.line)

    def _k_return(self, step: Step, body: dict[str, Any]) -> None:
        step.value = self.compile(body["return"], step.name, step.line)


# --------------------------------------------------------------------------- whole-definition checks


def _child_blocks(step: Step) -> list[tuple[list[Step], bool]]:
    """Nested step lists of a step; the flag marks a jump boundary (for body, parallel branch)."""
    out: list[tuple[list[Step], bool]] = []
    if step.steps:
        out.append((step.steps, False))
    for cond in step.switch or []:
        if cond.steps:
            out.append((cond.steps, False))
        if cond.inline:
            out.append(([cond.inline], False))
    if step.for_:
        out.append((step.for_.steps, True))
    if step.parallel:
        for br in step.parallel.branches or []:
            out.append((br.steps, True))
        if step.parallel.for_:
            out.append((step.parallel.for_.steps, True))
    if step.try_:
        out.append((step.try_, False))
    if step.except_:
        out.append((step.except_.steps, False))
    return out


def _check_jumps(steps: list[Step], visible: set[str], in_loop: bool, names: dict[str, int]) -> None:
    here = visible | {s.name for s in steps}
    for step in steps:
        if not step.inline and step.name in names:
            raise WorkflowSyntaxError(
                f"duplicate step name (first at line {names[step.name]})", step.name, step.line
            )
        if not step.inline:
            names[step.name] = step.line
        targets = [step.next] + [c.next for c in step.switch or []]
        for target in targets:
            if target is None or target == "end":
                continue
            if target in ("break", "continue"):
                if not in_loop:
                    raise WorkflowSyntaxError(f"next: {target} outside a for loop", step.name, step.line)
                continue
            if target not in here:
                raise WorkflowSyntaxError(f"next: {target!r} is not a reachable step", step.name, step.line)
        for block, boundary in _child_blocks(step):
            is_loop = step.for_ is not None and block is step.for_.steps
            is_loop = is_loop or (
                step.parallel is not None
                and step.parallel.for_ is not None
                and block is step.parallel.for_.steps
            )
            if boundary:
                _check_jumps(block, set(), is_loop or False, names)
            else:
                _check_jumps(block, here, in_loop, names)


def _branch_writes(steps: list[Step]) -> set[str]:
    """Roots written inside a parallel branch, excluding loop-local for variables."""
    out: set[str] = set()
    for step in steps:
        out.update(t.root for t, _ in step.assign)
        if step.result:
            out.add(step.result.split(".")[0].split("[")[0])
        for block, _ in _child_blocks(step):
            out.update(_branch_writes(block))
    return out


def _check_parallel(sub: Subworkflow, steps: list[Step], outer: set[str]) -> None:
    for step in steps:
        if step.parallel is not None:
            par = step.parallel
            parent_vars = outer | _scope_names(sub.steps, skip=step)
            parent_vars |= _scope_names(steps, skip=step)
            for name in par.shared:
                if name not in parent_vars:
                    raise WorkflowSyntaxError(
                        f"shared variable {name!r} must be declared before the parallel step",
                        step.name,
                        step.line,
                    )
            blocks = [(b.name, b.steps, b.line) for b in par.branches or []]
            loop_vars: set[str] = set()
            if par.for_:
                blocks.append((step.name, par.for_.steps, par.for_.line))
                loop_vars = {n for n in (par.for_.value, par.for_.index) if n}
            for bname, bsteps, bline in blocks:
                writes = _branch_writes(bsteps) - loop_vars
                bad = sorted((writes & parent_vars) - set(par.shared))
                if bad:
                    raise WorkflowSyntaxError(
                        f"variable(s) {', '.join(bad)} defined in the parent scope must be listed in shared "
                        "to be assigned in a parallel branch",
                        bname,
                        bline,
                    )
                _check_parallel(sub, bsteps, outer | parent_vars | loop_vars | _scope_names(bsteps))
            continue
        if step.for_:
            loop_vars = {n for n in (step.for_.value, step.for_.index) if n}
            _check_parallel(sub, step.for_.steps, outer | loop_vars | _scope_names(step.for_.steps))
        for block, boundary in _child_blocks(step):
            if _is_except_block(step, block):
                _check_parallel(sub, block, outer | _except_as(step))
            elif not boundary:
                _check_parallel(sub, block, outer)


def _check_parallel_depth(steps: list[Step], depth: int) -> None:
    for step in steps:
        inner = depth + 1 if step.parallel else depth
        if inner > MAX_PARALLEL_DEPTH:
            raise WorkflowSyntaxError(
                f"parallel steps nest at most {MAX_PARALLEL_DEPTH} deep, this one {inner}",
                step.name,
                step.line,
            )
        for block, _ in _child_blocks(step):
            _check_parallel_depth(block, inner)


def _check_calls(defn: Definition, steps: list[Step]) -> None:
    for step in steps:
        if step.call and step.call in defn.subworkflows:
            target = defn.subworkflows[step.call]
            given = set(step.args or {})
            known = {p.name for p in target.params}
            unknown = given - known
            if unknown:
                raise WorkflowSyntaxError(
                    f"unknown argument(s) {', '.join(sorted(unknown))} for subworkflow {step.call}",
                    step.name,
                    step.line,
                )
            missing = [p.name for p in target.params if not p.has_default and p.name not in given]
            if missing:
                raise WorkflowSyntaxError(
                    f"missing argument(s) {', '.join(missing)} for subworkflow {step.call}",
                    step.name,
                    step.line,
                )
        for block, _ in _child_blocks(step):
            _check_calls(defn, block)


# --------------------------------------------------------------------------- symbols and scopes
#
# Google checks every symbol when a workflow is deployed: "symbol 'varC' is neither a variable nor a
# sub-workflow name" (cloud.google.com/workflows/docs/troubleshooting, "Deployment errors"). A variable
# exists in the scope that creates it (an assign step, a call's result, a parameter); "a variable created
# inside a for loop belongs to the local scope of that loop ... accessing it outside of the loop will raise
# an error when deploying the workflow. This local scoping also applies to any variable created inside an
# except block" (cloud.google.com/workflows/docs/reference/syntax/variables, "Variable scope"), and a
# parallel branch's new variables are its own (only ``shared`` ones are the parent's).


def _is_except_block(step: Step, block: list[Step]) -> bool:
    """``block`` is ``step``'s except block: a scope of its own, with its ``as`` variable."""
    return step.except_ is not None and block is step.except_.steps


def _except_as(step: Step) -> set[str]:
    """The error variable ``step``'s except block names (visible in that block only)."""
    return {step.except_.as_} if step.except_ and step.except_.as_ else set()


def _scope_names(steps: list[Step], skip: Step | None = None) -> set[str]:
    """Variables a scope creates (assign roots, call results): its own steps' and those of the blocks that
    are not scopes of their own (nested ``steps``, ``switch`` blocks, ``try`` bodies); for bodies,
    parallel branches and except blocks (with their ``as`` variable) are. ``skip``: a step left out."""
    out: set[str] = set()
    for step in steps:
        if step is skip:
            continue
        out.update(t.root for t, _ in step.assign)
        if step.result:
            out.add(step.result.split(".")[0].split("[")[0])
        for block, boundary in _child_blocks(step):
            if not boundary and not _is_except_block(step, block):
                out.update(_scope_names(block, skip))
    return out


def _own_values(step: Step) -> list[Any]:
    """Every value of a step evaluated in the step's own scope (not those of its nested blocks)."""
    values: list[Any] = []
    for target, value in step.assign:
        values.append(value)
        values.extend(Expr(target.text, n) for n in target.path if isinstance(n, Node))
    if step.result and "[" in step.result:
        values.extend(
            Expr(step.result, n.index) for n in walk(parse_expression(step.result)) if isinstance(n, Index)
        )
    values.append(step.args)
    values.extend(c.condition for c in step.switch or [])
    loops = [step.for_, step.parallel.for_ if step.parallel else None]
    values.extend(v for loop in loops if loop for v in (loop.in_, loop.range_))
    if step.parallel:
        values.append(step.parallel.concurrency_limit)
    if step.retry:
        r = step.retry
        values.extend([r.policy, r.predicate, r.max_retries, r.initial_delay, r.max_delay, r.multiplier])
    if step.kind in ("raise", "return"):
        values.append(step.value)
    return values


def _reads(node: Node) -> Iterator[str]:
    """Each variable read of an expression, as its whole dotted chain (``a.b.c``) when it is one."""
    chain = dotted_name(node)
    if chain is not None:
        yield chain
        return
    for child in children(node):
        yield from _reads(child)


def _unknown_symbol(expr: Expr, visible: set[str], subworkflows: dict[str, Subworkflow]) -> str | None:
    """The first name ``expr`` reads that is no visible variable, sub-workflow or standard-library
    object used as a value (``http.default_retry``), else None."""
    for chain in _reads(expr.node):
        root = chain.split(".", 1)[0]
        if root in visible or root in subworkflows:
            continue
        if chain in FUNCTIONS or chain in POLICIES or chain in OBJECTS:
            continue
        return root
    return None


def _loops(step: Step) -> list[ForSpec]:
    return [loop for loop in (step.for_, step.parallel.for_ if step.parallel else None) if loop]


def _check_symbols(defn: Definition, steps: list[Step], visible: set[str]) -> None:
    for step in steps:
        for expr in (e for value in _own_values(step) for e in expressions_in(value)):
            unknown = _unknown_symbol(expr, visible, defn.subworkflows)
            if unknown is not None:
                raise WorkflowSyntaxError(
                    f"symbol '{unknown}' is neither a variable nor a sub-workflow name", step.name, step.line
                )
        loop_vars = {n for loop in _loops(step) for n in (loop.value, loop.index) if n}
        for block, boundary in _child_blocks(step):
            inner = visible
            if boundary:  # a for body (with its loop variables) or a parallel branch
                inner = visible | _scope_names(block)
                if any(block is loop.steps for loop in _loops(step)):
                    inner |= loop_vars
            elif _is_except_block(step, block):
                inner = visible | _except_as(step) | _scope_names(block)
            _check_symbols(defn, block, inner)


def _params(raw: Any, name: str, line: int) -> list[Param]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise WorkflowSyntaxError("params must be a list", name, line)
    if len(raw) > MAX_PARAMS:
        raise WorkflowSyntaxError(
            f"a subworkflow takes at most {MAX_PARAMS} params, this one {len(raw)}", name, line
        )
    out = []
    for item in raw:
        if isinstance(item, str):
            out.append(Param(item))
        elif isinstance(item, dict) and len(item) == 1:
            ((pname, default),) = item.items()
            out.append(Param(str(pname), True, compile_value(default)))
        else:
            raise WorkflowSyntaxError("each param is a name or a single-key map {name: default}", name, line)
    return out


def build_definition(data: Any) -> Definition:
    """Turn parsed YAML/JSON into a validated :class:`Definition`."""
    raw_subs: dict[str, tuple[Any, Any, int]] = {}
    if isinstance(data, list):
        raw_subs["main"] = (None, data, _line(data, default=1))
    elif isinstance(data, dict):
        if "main" not in data:
            raise WorkflowSyntaxError(
                "a workflow needs a main block (or a plain list of steps)", line=_line(data)
            )
        for name, body in data.items():
            line = _line(data, name, 1)
            if not isinstance(body, dict):
                raise WorkflowSyntaxError(
                    "a subworkflow must be a map with params and steps", str(name), line
                )
            unknown = [str(k) for k in body if k not in ("params", "steps")]
            if unknown:
                raise WorkflowSyntaxError(
                    f"unknown key(s) {', '.join(unknown)} in subworkflow", str(name), line
                )
            if "steps" not in body:
                raise WorkflowSyntaxError("a subworkflow needs steps", str(name), line)
            raw_subs[str(name)] = (body.get("params"), body["steps"], line)
    else:
        raise WorkflowSyntaxError("a workflow is a list of steps or a map of subworkflows")
    builder = _Builder(set(raw_subs))
    subs: dict[str, Subworkflow] = {}
    for name, (params, steps, line) in raw_subs.items():
        builder.current_sub = name
        subs[name] = Subworkflow(name, line, _params(params, name, line), builder.steps(steps, name, line))
    if len(subs["main"].params) > 1:
        raise WorkflowSyntaxError(
            "main accepts at most one parameter (the runtime argument)", "main", subs["main"].line
        )
    defn = Definition(subs)
    for sub in subs.values():
        _check_parallel_depth(sub.steps, 0)
        _check_jumps(sub.steps, set(), False, {})
        _check_calls(defn, sub.steps)
        _check_parallel(sub, sub.steps, {p.name for p in sub.params})
        _check_symbols(defn, sub.steps, {p.name for p in sub.params} | _scope_names(sub.steps))
    return defn


def load_source(source: str | Path) -> tuple[Definition, str]:
    """Read a path or a YAML/JSON text; returns the definition and a label for messages."""
    label = "<string>"
    if isinstance(source, Path):
        text, label = source.read_text(encoding="utf-8"), str(source)
    elif "\n" not in source and len(source) < 4096 and Path(source).is_file():
        text, label = Path(source).read_text(encoding="utf-8"), source
    else:
        text = source
    size = len(text.encode("utf-8"))
    if size > MAX_SOURCE_BYTES:
        raise WorkflowSyntaxError(f"the workflow source is {size} bytes, more than {MAX_SOURCE_BYTES}")
    return build_definition(parse_source(text)), label
