"""The steps that hold other steps, as Workflows runs them: ``for`` (a fresh scope per iteration),
``parallel`` (branches or iterations on a thread pool, shared variables, UnhandledBranchError) and
``try`` with ``retry`` and ``except``.  Each takes the execution it runs in."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .errors import (
    ExecutionCancelled,
    ResourceLimitExceeded,
    WorkflowError,
    key_error,
    type_error,
    value_error,
)
from .expressions import FunctionRef, is_number, wtype
from .scopes import Break, Continue, End, Return, Scope
from .stdlib import POLICIES, RetryPolicy
from .syntax import ForSpec, RetrySpec, Step, Target

if TYPE_CHECKING:
    from .engine import _Execution

log = logging.getLogger("cloudworkflows.engine")


def loop_items(ex: _Execution, spec: ForSpec, scope: Scope, depth: int) -> list[tuple[int, Any]]:
    if spec.in_ is not None:
        items = ex.ev(spec.in_, scope, depth)
        if isinstance(items, dict):
            raise type_error("for: 'in' expects a list (use keys() to iterate over a map)")
        if not isinstance(items, list):
            raise type_error(f"for: 'in' expects a list, got {wtype(items)}")
        return list(enumerate(items))
    bounds = ex.ev(spec.range_, scope, depth)
    if not (isinstance(bounds, list) and len(bounds) == 2 and all(is_number(b) for b in bounds)):
        raise type_error("for: range must be a list of two numbers")
    start, end = bounds
    out: list[tuple[int, Any]] = []
    value = start
    while value <= end:
        out.append((len(out), value))
        value = value + 1
    return out


def bind_loop(ex: _Execution, spec: ForSpec, scope: Scope, index: int, value: Any) -> None:
    if spec.value:
        ex.store(scope, spec.value, copy.deepcopy(value))
    if spec.index:
        ex.store(scope, spec.index, index)


def run_for(ex: _Execution, spec: ForSpec, scope: Scope, depth: int, routine: str) -> None:
    for index, value in loop_items(ex, spec, scope, depth):
        with ex.scope(scope) as it_scope:
            bind_loop(ex, spec, it_scope, index, value)
            try:
                ex.run_block(spec.steps, it_scope, depth, routine)
            except Break:
                break
            except Continue:
                continue


# -- parallel --------------------------------------------------------------------------


def run_parallel(ex: _Execution, step: Step, scope: Scope, depth: int, routine: str) -> None:
    spec = step.parallel
    assert spec is not None
    shared = set(spec.shared)
    for name in shared:
        if scope.find(name) is None:
            raise key_error(f"shared variable '{name}' is not defined before the parallel step")
    limit = ex.ev(spec.concurrency_limit, scope, depth) if spec.concurrency_limit is not None else None
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise value_error("concurrency_limit must be a positive integer")

    tasks: list[tuple[str, Callable[[], None]]] = []
    if spec.branches is not None:
        for branch in spec.branches:

            def run_branch(steps: list[Step] = branch.steps) -> None:
                with ex.scope(scope, shared) as branch_scope:
                    ex.run_block(steps, branch_scope, depth, routine)

            tasks.append((branch.name, run_branch))
    else:
        assert spec.for_ is not None
        loop = spec.for_
        for index, value in loop_items(ex, loop, scope, depth):

            def run_iteration(index: int = index, value: Any = value) -> None:
                with ex.scope(scope, shared) as it_scope:
                    bind_loop(ex, loop, it_scope, index, value)
                    ex.run_block(loop.steps, it_scope, depth, routine)

            tasks.append((str(index), run_iteration))
    if not tasks:
        return

    failures: list[dict[str, Any]] = []
    fatal: list[BaseException] = []

    def guarded(branch_id: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except (Break, Continue, Return, End):
            return  # ends this branch/iteration only
        except ResourceLimitExceeded as exc:  # fails the execution at once, not as a branch's error
            with ex.lock:
                fatal.append(exc)
            ex.cancel.set()  # the siblings stop at their next step, sleep or callback wait
        except WorkflowError as exc:
            with ex.lock:
                failures.append({"id": branch_id, "error": exc.value})
        except BaseException as exc:  # cancellation or a bug: stop everything
            with ex.lock:
                fatal.append(exc)

    workers = min(len(tasks), limit or len(tasks))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"wf-{step.name}") as pool:
        for branch_id, fn in tasks:
            pool.submit(guarded, branch_id, fn)
    if fatal:
        limits = [f for f in fatal if isinstance(f, ResourceLimitExceeded)]
        cancelled = [f for f in fatal if isinstance(f, ExecutionCancelled)]
        raise limits[0] if limits else cancelled[0] if cancelled else fatal[0]
    if failures:
        failures.sort(key=lambda f: [t[0] for t in tasks].index(f["id"]))
        raise WorkflowError(
            {
                "message": "UnhandledBranchError: one or more branches or iterations encountered an "
                "unhandled runtime error",
                "tags": ["UnhandledBranchError"],
                "branches": failures,
                "truncated": False,
            }
        )


# -- try / retry / except --------------------------------------------------------------


def retry_plan(
    ex: _Execution, spec: RetrySpec, scope: Scope, depth: int
) -> tuple[Any, int, float, float, float]:
    if spec.policy is not None:
        policy = ex.ev(spec.policy, scope, depth)
        if isinstance(policy, RetryPolicy):
            return (
                FunctionRef(policy.predicate),
                policy.max_retries,
                policy.initial_delay,
                policy.max_delay,
                policy.multiplier,
            )
        raise type_error(f"retry: expected a retry policy such as http.default_retry, got {wtype(policy)}")
    predicate = ex.ev(spec.predicate, scope, depth)
    if not isinstance(predicate, FunctionRef):
        raise type_error(f"retry predicate must be a function, got {wtype(predicate)}")
    max_retries = ex.ev(spec.max_retries, scope, depth)
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise value_error("max_retries must be a non-negative integer")
    default = POLICIES["http.default_retry"]
    nums = []
    for value, fallback in (
        (spec.initial_delay, default.initial_delay),
        (spec.max_delay, default.max_delay),
        (spec.multiplier, default.multiplier),
    ):
        v = fallback if value is None else ex.ev(value, scope, depth)
        if not is_number(v) or v < 0:
            raise value_error("backoff values must be non-negative numbers")
        nums.append(float(v))
    return predicate, max_retries, nums[0], nums[1], nums[2]


def run_try(ex: _Execution, step: Step, scope: Scope, depth: int, routine: str) -> None:
    retries = 0
    delay: float | None = None
    plan: tuple[Any, int, float, float, float] | None = None
    while True:
        try:
            ex.run_block(step.try_ or [], scope, depth, routine)
            return
        except ResourceLimitExceeded:
            raise
        except WorkflowError as exc:
            if step.retry is not None:
                if plan is None:
                    plan = retry_plan(ex, step.retry, scope, depth)
                predicate, max_retries, initial, max_delay, multiplier = plan
                if retries < max_retries:
                    should = ex.call_ref(predicate, [copy.deepcopy(exc.value)], depth)
                    if not isinstance(should, bool):
                        raise type_error(
                            f"retry predicate must return a boolean, got {wtype(should)}"
                        ) from None
                    if should:
                        delay = initial if delay is None else delay * multiplier
                        delay = min(delay, max_delay)
                        log.debug(
                            "%s: retrying step %s in %.3fs (retry %d of %d)",
                            ex.execution_name,
                            step.name,
                            delay,
                            retries + 1,
                            max_retries,
                        )
                        ex.sleep(delay)
                        retries += 1
                        continue
            if step.except_ is None:
                raise
            if step.except_.as_:
                ex.assign(scope, Target(step.except_.as_, step.except_.as_, []), exc.value, depth)
            ex.run_block(step.except_.steps, scope, depth, routine)
            return
