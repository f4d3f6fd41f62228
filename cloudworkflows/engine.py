"""Executes a validated workflow definition with Cloud Workflows semantics.

One :class:`_Execution` per run holds the environment, the cancel flag and the connectors;
steps run on the calling thread, parallel branches on a thread pool (:mod:`.constructs`). Control flow
(``next``, ``return``, ``break``) travels as exceptions of its own (:mod:`.scopes`), so it can never be
caught by ``except``.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from . import constructs
from .callbacks import CallbackHub
from .clock import Clock, RealClock
from .discovery import ConnectorCallError, check_call, check_gke_request
from .errors import (
    ExecutionCancelled,
    ResourceLimitExceeded,
    WorkflowError,
    WorkflowSyntaxError,
    error,
    http_error,
    index_error,
    key_error,
    type_error,
    value_error,
)
from .expressions import (
    Call,
    Expr,
    FunctionRef,
    evaluate,
    evaluate_value,
    expressions_in,
    get_index,
    get_key,
    json_safe,
    walk,
    wtype,
)
from .scopes import Break, Continue, End, Jump, Return, Scope, in_parallel
from .stdlib import FUNCTIONS, resolve_object
from .syntax import Definition, Step, Subworkflow, Target, load_source

log = logging.getLogger("cloudworkflows.engine")

# System limits from Google's quotas page (cloud.google.com/workflows/quotas, "System limits"; read in its
# French rendering): "Profondeur maximale de la pile d'appel ... 20" (subworkflows calling subworkflows,
# or standard-library functions calling others) and at most 100,000 steps per execution.
MAX_CALL_DEPTH = 20
MAX_STEPS = 100_000
# Memory: "The maximum amount of memory that you can use applies to the cumulative size of all variables
# defined in a single execution" (cloud.google.com/workflows/docs/reference/syntax/variables, "Memory
# usage", which gives the sizes memory_of counts).  The quotas page's row ("Data size ... 512 KB", the
# cumulative maximum size of variables, arguments and events) is read through two quotes of it, the
# Japanese page quoted at qiita.com/tetutetu214/items/7fe89b86ee0238f284f5 and the English one in a
# 2024 post; Google's pages name MemoryLimitExceededError for it (docs/best-practice, "Store only what you
# need"; docs/troubleshooting, "Resource limits").  Strings: "unicode <= 256 KB length" (the syntax cheat
# sheet); the data types page links a string's "maximum length" to the quotas page's resource limits.
MAX_VARIABLE_MEMORY = 512 * 1024
MAX_STRING_BYTES = 256 * 1024
DEFAULT_LOCATION = "local"

ConnectorFn = Callable[[dict[str, Any], dict[str, Any]], Any]


class ChildExecutions(Protocol):
    """Executions of other workflows, for ``experimental.executions``: the executions service."""

    def run_children(
        self, parent: str, arguments: Sequence[Any], timeout: float, check_cancel: Callable[[], None]
    ) -> list[Any]:
        """Start one execution of ``parent`` (``projects/P/locations/L/workflows/W``) per argument, wait
        for all of them and return their results in the arguments' order; ExecutionError if any did not
        succeed, TimeoutError after ``timeout`` s; ``check_cancel`` raises when the caller is cancelled."""
        ...


class ConnectorRegistry:
    """Local stand-ins for ``googleapis.*`` connectors, keyed by their full call name, and the
    credentials of the identity the executions run as."""

    def __init__(self, token: str | None = None) -> None:
        self._fns: dict[str, ConnectorFn] = {}
        self.token = token
        """The local stand-in of the workflow service account's token, which ``http.*`` calls with an
        ``auth`` argument present as a bearer token, as Workflows adds an OIDC or OAuth2 token of that
        account (cloud.google.com/workflows/docs/authenticate-from-workflow); None: no identity."""
        self.origins: dict[str, str] = {}
        """A Google API's origin (``https://storage.googleapis.com``) -> the local endpoint that serves
        it: ``http.*`` calls to that API go there, path and query unchanged, as a DNS override would."""

    def register(self, name: str, fn: ConnectorFn) -> None:
        self._fns[name] = fn

    def get(self, name: str) -> ConnectorFn | None:
        return self._fns.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def names(self) -> list[str]:
        return sorted(self._fns)

    def route(self, url: str) -> str:
        """``url``, sent to the local endpoint of its API when one serves it (:attr:`origins`)."""
        for origin, local in self.origins.items():
            if url == origin or url.startswith(origin + "/"):
                return local.rstrip("/") + url[len(origin) :]
        return url


def _parse_execution_name(name: str) -> dict[str, str]:
    parts = name.strip("/").split("/")
    out: dict[str, str] = {}
    for i in range(0, len(parts) - 1, 2):
        out[parts[i]] = parts[i + 1]
    return out


def builtin_env(execution_name: str, revision: str) -> dict[str, str]:
    """The documented built-in variables, derived from the execution's resource name."""
    parts = _parse_execution_name(execution_name)
    env = {
        "GOOGLE_CLOUD_PROJECT_ID": parts.get("projects", ""),
        "GOOGLE_CLOUD_LOCATION": parts.get("locations", DEFAULT_LOCATION),
        "GOOGLE_CLOUD_WORKFLOW_ID": parts.get("workflows", ""),
        "GOOGLE_CLOUD_WORKFLOW_EXECUTION_ID": parts.get("executions", ""),
        "GOOGLE_CLOUD_WORKFLOW_REVISION_ID": revision,
    }
    return {k: v for k, v in env.items() if v}


# --------------------------------------------------------------------------- evaluation context


class _Ctx:
    def __init__(self, ex: _Execution, scope: Scope, depth: int) -> None:
        self.ex = ex
        self.scope = scope
        self.depth = depth

    def lookup(self, name: str) -> tuple[bool, Any]:
        owner = self.scope.find(name)
        if owner is None:
            return False, None
        return True, owner.vars[name]

    def call_function(self, name: str, args: list[Any]) -> Any:
        fn = FUNCTIONS.get(name)
        if fn is not None:
            return fn.invoke(self.ex, args)
        sub = self.ex.definition.subworkflows.get(name)
        if sub is not None:
            if len(args) > len(sub.params):
                raise type_error(f"{name}() takes at most {len(sub.params)} arguments")
            return self.ex.call_subworkflow(
                sub, dict(zip([p.name for p in sub.params], args, strict=False)), self.depth
            )
        raise type_error(f"unknown function {name}()")

    def function_ref(self, name: str) -> Any:
        if name in self.ex.definition.subworkflows:
            return FunctionRef(name)
        return resolve_object(name)


# --------------------------------------------------------------------------- execution


def memory_of(value: Any) -> int:
    """A value's size as the variables page counts it: 8 bytes for an integer, double or boolean; 8
    bytes + each element for a string (its UTF-8 bytes), bytes or a list; 8 bytes + each key + each
    value for a map, recursively.  Null is not in the table; it is counted as a scalar.  Raises
    ResourceLimitError for a string over MAX_STRING_BYTES."""
    if isinstance(value, str):
        size = len(value.encode())
        if size > MAX_STRING_BYTES:
            raise ResourceLimitExceeded(
                f"string of {size} bytes exceeds the {MAX_STRING_BYTES // 1024} KB limit"
            )
        return 8 + size
    if isinstance(value, bytes | bytearray):
        return 8 + len(value)
    if isinstance(value, list):
        return 8 + sum(memory_of(v) for v in value)
    if isinstance(value, dict):
        return 8 + sum(memory_of(k) + memory_of(v) for k, v in value.items())
    return 8


class _Stop(threading.Event):
    """What ends an execution's steps early: its caller's cancel (``caller``), or this event's own flag,
    set when a parallel branch hits a resource limit ("immediate execution failure") so its siblings
    stop at their next step, sleep or callback wait instead of running on."""

    def __init__(self, caller: threading.Event) -> None:
        super().__init__()
        self.caller = caller

    def is_set(self) -> bool:
        return self.caller.is_set() or super().is_set()

    def wait(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = 0.05 if end is None else min(0.05, end - time.monotonic())
            if left <= 0:
                return False
            self.caller.wait(left)
        return True


class _Execution:
    """State of one running execution; also the stdlib's Runtime."""

    def __init__(
        self,
        workflow: Workflow,
        connectors: ConnectorRegistry,
        env: Mapping[str, str],
        hub: CallbackHub | None,
        execution_name: str,
        cancel: threading.Event,
        executions: ChildExecutions | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.workflow = workflow
        self.definition = workflow.definition
        self.connectors = connectors
        self.env = env
        self.hub = hub
        self.executions = executions
        self.execution_name = execution_name
        self.cancel = _Stop(cancel)
        self.clock: Clock = clock or RealClock()
        self.lock = threading.RLock()
        self.steps_run = 0
        self.memory = 0  # memory_of every variable of every live scope (frames, iterations, branches)
        self.peak_memory = 0  # the most self.memory has been

    @contextmanager
    def scope(self, parent: Scope | None = None, shared: set[str] | None = None) -> Iterator[Scope]:
        """A new variable scope, whose variables count in the execution's memory until its frame,
        iteration or branch ends."""
        made = Scope(parent, shared)
        try:
            yield made
        finally:
            with self.lock:
                self.memory -= sum(made.sizes.values())

    def store(
        self,
        scope: Scope,
        name: str,
        value: Any,
        container: dict[Any, Any] | list[Any] | None = None,
        slot: Any = None,
    ) -> None:
        """``scope.vars[name] = value``, or ``container[slot] = value`` for a container inside that
        variable, counted: the variable's size is recounted, and a write that would take the
        execution's variables over MAX_VARIABLE_MEMORY is undone and raises MemoryLimitExceededError
        (a string over MAX_STRING_BYTES: ResourceLimitError).  Every write to a variable comes here."""
        with self.lock:
            target: Any = scope.vars if container is None else container
            slot = name if container is None else slot
            had = isinstance(target, list) or slot in target
            old = target[slot] if had else None
            target[slot] = value
            try:
                size = memory_of(scope.vars[name])
                if self.memory + size - scope.sizes.get(name, 0) > MAX_VARIABLE_MEMORY:
                    raise error(
                        "MemoryLimitExceededError",
                        f"variables would use {self.memory + size - scope.sizes.get(name, 0)} bytes, "
                        f"over the limit of {MAX_VARIABLE_MEMORY}",
                    )
            except WorkflowError:
                if had:
                    target[slot] = old
                else:
                    del target[slot]
                raise
            self.memory += size - scope.sizes.get(name, 0)
            self.peak_memory = max(self.peak_memory, self.memory)
            scope.sizes[name] = size

    # -- Runtime interface for stdlib ------------------------------------------------------

    def sleep(self, seconds: float) -> None:
        if self.clock.sleep(seconds, self.cancel):
            raise ExecutionCancelled()

    def now(self) -> float:
        return self.clock.now()

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise ExecutionCancelled()

    # -- helpers ---------------------------------------------------------------------------

    def ev(self, value: Any, scope: Scope, depth: int) -> Any:
        return evaluate_value(value, _Ctx(self, scope, depth))

    def call_subworkflow(self, sub: Subworkflow, args: dict[str, Any], depth: int) -> Any:
        if depth + 1 > MAX_CALL_DEPTH:
            raise error("RecursionError", f"maximum call depth {MAX_CALL_DEPTH} exceeded calling {sub.name}")
        with self.scope() as scope:
            unknown = set(args) - {p.name for p in sub.params}
            if unknown:
                names = ", ".join(sorted(unknown))
                raise type_error(f"unknown argument(s) {names} for subworkflow {sub.name}")
            for param in sub.params:
                if param.name in args:
                    self.store(scope, param.name, copy.deepcopy(args[param.name]))
                elif param.has_default:
                    self.store(scope, param.name, self.ev(param.default, scope, depth + 1))
                else:
                    raise type_error(f"missing argument '{param.name}' for subworkflow {sub.name}")
            try:
                self.run_block(sub.steps, scope, depth + 1, sub.name)
            except Return as ret:
                return ret.value
            except End:
                return None
            return None

    # -- blocks and steps ------------------------------------------------------------------

    def run_block(self, steps: list[Step], scope: Scope, depth: int, routine: str) -> None:
        names = {s.name: i for i, s in enumerate(steps) if not s.inline}
        i = 0
        while i < len(steps):
            step = steps[i]
            try:
                target = self.run_step(step, scope, depth, routine)
            except Jump as jump:
                if jump.target in names:
                    i = names[jump.target]
                    continue
                raise
            if target is None:
                i += 1
            elif target == "end":
                raise End()
            elif target == "break":
                raise Break()
            elif target == "continue":
                raise Continue()
            elif target in names:
                i = names[target]
            else:
                raise Jump(target)

    def run_step(self, step: Step, scope: Scope, depth: int, routine: str) -> str | None:
        self.check_cancel()
        with self.lock:
            self.steps_run += 1
            if self.steps_run > MAX_STEPS:
                raise ResourceLimitExceeded(f"more than {MAX_STEPS} steps executed")
        log.debug(
            "%s: step %s (%s, line %d) in %s", self.execution_name, step.name, step.kind, step.line, routine
        )
        self.workflow.steps_taken.add((routine, step.name, step.line))
        try:
            return self._dispatch(step, scope, depth, routine)
        except WorkflowError as exc:
            if getattr(exc, "step", None) is None:
                exc.step = step.name  # type: ignore[attr-defined]
                exc.line = step.line  # type: ignore[attr-defined]
                exc.routine = routine  # type: ignore[attr-defined]
            raise

    def _dispatch(self, step: Step, scope: Scope, depth: int, routine: str) -> str | None:
        kind = step.kind
        if kind == "assign":
            parallel = in_parallel(scope)
            for target, value in step.assign:
                if parallel and not self._calls_subworkflow(value):
                    # Read-modify-write of a shared variable (``total: ${total + v}``) is atomic.
                    with self.lock:
                        self.assign(scope, target, self.ev(value, scope, depth), depth)
                else:
                    self.assign(scope, target, self.ev(value, scope, depth), depth)
            return step.next
        if kind == "call":
            args = self.ev(step.args, scope, depth) if step.args is not None else {}
            result = self.call(step, args, scope, depth)
            if step.result:
                self.assign(scope, self.workflow.result_target(step), result, depth)
            return step.next
        if kind == "switch":
            for cond in step.switch or []:
                ok = self.ev(cond.condition, scope, depth)
                if not isinstance(ok, bool):
                    raise type_error(f"switch condition must be a boolean, got {wtype(ok)}")
                if not ok:
                    continue
                if cond.inline is not None:
                    self.workflow.steps_taken.add((routine, cond.inline.name, cond.inline.line))
                    inner = self._dispatch(cond.inline, scope, depth, routine)
                    return cond.next if cond.next is not None else inner
                if cond.steps is not None:
                    self.run_block(cond.steps, scope, depth, routine)
                return cond.next
            return step.next
        if kind == "steps":
            self.run_block(step.steps or [], scope, depth, routine)
            return step.next
        if kind == "for":
            assert step.for_ is not None
            constructs.run_for(self, step.for_, scope, depth, routine)
            return step.next
        if kind == "parallel":
            constructs.run_parallel(self, step, scope, depth, routine)
            return step.next
        if kind == "try":
            constructs.run_try(self, step, scope, depth, routine)
            return step.next
        if kind == "raise":
            raise WorkflowError(self.ev(step.value, scope, depth))
        if kind == "return":
            raise Return(self.ev(step.value, scope, depth))
        return step.next

    def _calls_subworkflow(self, value: Any) -> bool:
        for expr in expressions_in(value):
            for node in walk(expr.node):
                if isinstance(node, Call) and node.name in self.definition.subworkflows:
                    return True
        return False

    # -- assignment ------------------------------------------------------------------------

    def assign(self, scope: Scope, target: Target, value: Any, depth: int) -> None:
        keys = [k if isinstance(k, str) else evaluate(k, _Ctx(self, scope, depth)) for k in target.path]
        with self.lock:
            owner = scope.find(target.root)
            if owner is not None:
                s: Scope | None = scope
                while s is not None and s is not owner:
                    if s.shared is not None and target.root not in s.shared:
                        # Not shared: the branch gets its own copy (the loader rejects the
                        # obvious cases as deployment errors, like Workflows does).
                        if keys:
                            self.store(scope, target.root, copy.deepcopy(owner.vars[target.root]))
                        owner = scope
                        break
                    s = s.parent
            if not keys:
                self.store(owner or scope, target.root, copy.deepcopy(value))
                return
            if owner is None:
                raise key_error(f"variable '{target.root}' is not defined")
            container = owner.vars[target.root]
            for key in keys[:-1]:
                container = get_index(container, key)
            last = keys[-1]
            if isinstance(container, dict):
                if not isinstance(last, str):
                    raise type_error(f"map keys must be strings, got {wtype(last)}")
            elif isinstance(container, list):
                if isinstance(last, bool) or not isinstance(last, int):
                    raise type_error(f"list index must be an integer, got {wtype(last)}")
                if last < 0 or last >= len(container):
                    raise index_error(f"list index out of range: {last}")
            else:
                raise type_error(f"cannot assign into {wtype(container)} ({target.text})")
            self.store(owner, target.root, copy.deepcopy(value), container, last)

    # -- calls -----------------------------------------------------------------------------

    def call(self, step: Step, args: dict[str, Any], scope: Scope, depth: int) -> Any:
        name = step.call or ""
        fn = FUNCTIONS.get(name)
        if fn is not None:
            return fn.invoke(self, kwargs=args)
        sub = self.definition.subworkflows.get(name)
        if sub is not None:
            return self.call_subworkflow(sub, args, depth)
        if name.startswith("googleapis."):
            try:  # Google's API answers a call it cannot bind with 400, backend or not
                check_call(name, args)
            except ConnectorCallError as e:
                raise WorkflowError(http_error(400, f"Invalid request: {e}")) from None
        elif name == "gke.request" and (problem := check_gke_request(args)) is not None:
            tag, message = problem
            raise (value_error if tag == "ValueError" else type_error)(message)
        connector = self.connectors.get(name)
        if connector is not None:
            params = args.get("connector_params") or {}
            plain = {k: v for k, v in args.items() if k != "connector_params"}
            self.check_cancel()
            return connector(plain, dict(params))
        raise WorkflowSyntaxError(f"unknown function or unregistered connector {name}", step.name, step.line)

    def call_ref(self, ref: Any, args: list[Any], depth: int) -> Any:
        if not isinstance(ref, FunctionRef):
            raise type_error(f"expected a function, got {wtype(ref)}")
        return _Ctx(self, Scope(), depth).call_function(ref.name, args)

    # -- loops -----------------------------------------------------------------------------


# --------------------------------------------------------------------------- public API


class Workflow:
    """A loaded, validated workflow definition ready to run."""

    def __init__(self, definition: Definition, source: str = "<string>", name: str | None = None) -> None:
        self.definition = definition
        self.source = source
        self.name = name or (Path(source).stem if source != "<string>" else "workflow")
        self.revision_id = "000001-local"
        self.peak_memory: dict[str, int] = {}
        """Each execution's peak memory of variables (as MAX_VARIABLE_MEMORY counts it): how far a run
        stays from the limit, which no Google API reports."""
        self._result_targets: dict[int, Target] = {}
        self.steps_taken: set[tuple[str, str, int]] = set()
        """Every step any execution of this workflow ran: (routine, step, line).  With :meth:`steps`,
        which steps its tests never take."""

    def steps(self) -> dict[tuple[str, str, int], Step]:
        """Every step of the definition, nested ones included, by (routine, step, line)."""
        out: dict[tuple[str, str, int], Step] = {}

        def visit(routine: str, steps: list[Step] | None) -> None:
            for step in steps or []:
                out[(routine, step.name, step.line)] = step
                visit(routine, step.steps)
                visit(routine, step.try_)
                visit(routine, step.except_.steps if step.except_ else None)
                visit(routine, step.for_.steps if step.for_ else None)
                for condition in step.switch or []:
                    visit(routine, condition.steps)
                    visit(routine, [condition.inline] if condition.inline else None)
                parallel = step.parallel
                if parallel is not None:
                    visit(routine, parallel.for_.steps if parallel.for_ else None)
                    for branch in parallel.branches or []:
                        visit(routine, branch.steps)

        for name, sub in self.definition.subworkflows.items():
            visit(name, sub.steps)
        return out

    def result_target(self, step: Step) -> Target:
        target = self._result_targets.get(id(step))
        if target is None:
            from .syntax import _Builder

            target = _Builder(set()).target(step.result or "", step.name, step.line)
            self._result_targets[id(step)] = target
        return target

    @property
    def subworkflows(self) -> list[str]:
        return list(self.definition.subworkflows)

    def run(
        self,
        args: Any = None,
        *,
        connectors: ConnectorRegistry | None = None,
        env: Mapping[str, str] | None = None,
        hub: CallbackHub | None = None,
        execution_name: str | None = None,
        cancel: threading.Event | None = None,
        executions: ChildExecutions | None = None,
        clock: Clock | None = None,
    ) -> Any:
        """Run to completion; returns the result or raises WorkflowError / ExecutionCancelled.  On
        ``clock`` (by default ``hub``'s, else the wall clock), which must be ``hub``'s too."""
        if hub is not None and clock is not None and clock is not hub.clock:
            raise ValueError("the execution's clock must be its callback hub's: awaits count time on it")
        clock = clock or (hub.clock if hub is not None else None)
        given_env = dict(env or {})
        if execution_name is None:
            project = given_env.get("GOOGLE_CLOUD_PROJECT_ID", "local-project")
            location = given_env.get("GOOGLE_CLOUD_LOCATION", DEFAULT_LOCATION)
            execution_name = (
                f"projects/{project}/locations/{location}/workflows/{self.name}/executions/{uuid.uuid4()}"
            )
        full_env = builtin_env(execution_name, self.revision_id)
        full_env.update(given_env)
        ex = _Execution(
            self,
            connectors or ConnectorRegistry(),
            full_env,
            hub,
            execution_name,
            cancel or threading.Event(),
            executions,
            clock,
        )
        main = self.definition.main
        call_args: dict[str, Any] = {}
        if main.params:
            call_args[main.params[0].name] = args
        log.debug("%s: start", execution_name)
        try:
            result = ex.call_subworkflow(main, call_args, 0)
            out = json_safe(result)
        finally:
            if hub is not None:
                hub.release(execution_name)
            self.peak_memory[execution_name] = ex.peak_memory
        log.debug("%s: finished, peak variable memory %d bytes", execution_name, ex.peak_memory)
        return out


def load_workflow(source: str | Path, name: str | None = None) -> Workflow:
    """Load and validate a workflow from a file path or YAML/JSON text."""
    definition, label = load_source(source)
    return Workflow(definition, label, name)


def error_context(exc: WorkflowError) -> str:
    """Where an uncaught error surfaced, in the spirit of Workflows' error ``context``."""
    step = getattr(exc, "step", None)
    if step is None:
        return "RuntimeError"
    return f'in step "{step}", routine "{getattr(exc, "routine", "main")}", line: {getattr(exc, "line", 0)}'


__all__ = [
    "CallbackHub",
    "ConnectorRegistry",
    "ExecutionCancelled",
    "Expr",
    "Workflow",
    "WorkflowError",
    "WorkflowSyntaxError",
    "error_context",
    "get_key",
    "load_workflow",
]
