"""Engine behaviour that needs Python-side instrumentation: retries, connectors, parallel, HTTP."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from cloudworkflows import (
    ConnectorRegistry,
    ExecutionCancelled,
    WorkflowError,
    WorkflowSyntaxError,
    http_error,
    load_workflow,
)
from cloudworkflows import engine as engine_mod

LAUNCH = "googleapis.dataflow.v1b3.projects.locations.flexTemplates.launch"


class Flaky:
    """A connector that fails ``failures`` times, then succeeds; records every attempt."""

    def __init__(self, failures: int, code: int = 503) -> None:
        self.failures = failures
        self.code = code
        self.calls: list[tuple[dict[str, Any], dict[str, Any], float]] = []

    def __call__(self, args: dict[str, Any], params: dict[str, Any]) -> Any:
        self.calls.append((args, params, time.monotonic()))
        if len(self.calls) <= self.failures:
            raise WorkflowError(http_error(self.code, "unavailable", body={"attempt": len(self.calls)}))
        return {"job": {"id": "job-1"}, "attempt": len(self.calls)}


RETRY_WF = """\
main:
  steps:
    - launch:
        try:
          call: googleapis.dataflow.v1b3.projects.locations.flexTemplates.launch
          args:
            projectId: p
            location: l
            body:
              launchParameter: {jobName: j}
            connector_params:
              timeout: 60
          result: r
        retry:
          predicate: ${http.default_retry_predicate}
          max_retries: MAX
          backoff:
            initial_delay: 0.02
            max_delay: 0.05
            multiplier: 2
    - done:
        return: ${r}
"""


def registry(fn: Any) -> ConnectorRegistry:
    reg = ConnectorRegistry()
    reg.register(LAUNCH, fn)
    return reg


@pytest.mark.parametrize(
    ("max_retries", "failures", "attempts", "ok"),
    [(2, 2, 3, True), (2, 3, 3, False), (0, 1, 1, False), (3, 0, 1, True)],
)
def test_retry_attempt_count(max_retries: int, failures: int, attempts: int, ok: bool) -> None:
    wf = load_workflow(RETRY_WF.replace("MAX", str(max_retries)))
    flaky = Flaky(failures)
    if ok:
        assert wf.run(connectors=registry(flaky))["attempt"] == attempts
    else:
        with pytest.raises(WorkflowError) as info:
            wf.run(connectors=registry(flaky))
        assert info.value.value["code"] == 503
        assert info.value.value["body"] == {"attempt": attempts}
        assert info.value.step == "launch"  # type: ignore[attr-defined]
    assert len(flaky.calls) == attempts
    args, params, _ = flaky.calls[0]
    assert args == {"projectId": "p", "location": "l", "body": {"launchParameter": {"jobName": "j"}}}
    assert params == {"timeout": 60}


def test_backoff_delays_grow_and_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    requested: list[float] = []
    real_sleep = engine_mod._Execution.sleep

    def spy(self: Any, seconds: float) -> None:
        requested.append(seconds)
        real_sleep(self, seconds)

    monkeypatch.setattr(engine_mod._Execution, "sleep", spy)
    flaky = Flaky(3)
    wf = load_workflow(RETRY_WF.replace("MAX", "4"))
    assert wf.run(connectors=registry(flaky))["attempt"] == 4
    assert requested == pytest.approx([0.02, 0.04, 0.05])
    gaps = [b[2] - a[2] for a, b in zip(flaky.calls, flaky.calls[1:], strict=False)]
    for gap, want in zip(gaps, [0.02, 0.04, 0.05], strict=True):
        assert gap >= want * 0.9


def test_non_retryable_code_is_not_retried() -> None:
    flaky = Flaky(1, code=404)
    with pytest.raises(WorkflowError) as info:
        load_workflow(RETRY_WF.replace("MAX", "5")).run(connectors=registry(flaky))
    assert info.value.value["code"] == 404 and len(flaky.calls) == 1


def test_default_retry_policy_values(monkeypatch: pytest.MonkeyPatch) -> None:
    requested: list[float] = []
    monkeypatch.setattr(engine_mod._Execution, "sleep", lambda self, s: requested.append(s))
    src = (
        RETRY_WF.split("        retry:")[0]
        + "        retry: ${http.default_retry}\n    - done:\n        return: 1\n"
    )
    flaky = Flaky(100, code=429)
    with pytest.raises(WorkflowError):
        load_workflow(src).run(connectors=registry(flaky))
    assert len(flaky.calls) == 6  # max_retries 5
    assert requested == pytest.approx([1, 1.25, 1.5625, 1.953125, 2.44140625])


def test_default_retry_non_idempotent_skips_502(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_mod._Execution, "sleep", lambda self, s: None)
    src = (
        RETRY_WF.split("        retry:")[0] + "        retry: ${http.default_retry_non_idempotent}\n"
        "    - done:\n        return: 1\n"
    )
    for code, attempts in ((502, 1), (503, 6)):
        flaky = Flaky(100, code=code)
        with pytest.raises(WorkflowError):
            load_workflow(src).run(connectors=registry(flaky))
        assert len(flaky.calls) == attempts


def test_connector_error_caught_by_except() -> None:
    def not_found(args: dict[str, Any], params: dict[str, Any]) -> Any:
        raise WorkflowError(http_error(404, "not found", body={"error": "gone"}))

    wf = load_workflow(
        """\
- t:
    try:
      call: googleapis.dataflow.v1b3.projects.locations.flexTemplates.launch
      args: {projectId: p, location: l}
      result: r
    except:
      as: e
      steps:
        - r:
            return: ${[e.code, e.body.error, e.message, "HttpError" in e.tags]}
"""
    )
    assert wf.run(connectors=registry(not_found)) == [404, "gone", "not found", True]


def test_unregistered_connector_fails_loudly() -> None:
    wf = load_workflow(
        "- a:\n    call: googleapis.run.v1.namespaces.jobs.create\n    args: {parent: namespaces/p}\n"
    )
    with pytest.raises(WorkflowSyntaxError) as info:
        wf.run()
    assert info.value.step == "a" and info.value.line == 1


def test_parallel_branches_run_concurrently() -> None:
    wf = load_workflow(
        """\
- init:
    assign:
      - out: {}
- p:
    parallel:
      shared: [out]
      branches:
        - one:
            steps:
              - s1:
                  call: sys.sleep
                  args: {seconds: 0.2}
              - w1:
                  assign:
                    - out.one: 1
        - two:
            steps:
              - s2:
                  call: sys.sleep
                  args: {seconds: 0.2}
              - w2:
                  assign:
                    - out.two: 2
- done:
    return: ${out}
"""
    )
    start = time.monotonic()
    assert wf.run() == {"one": 1, "two": 2}
    assert time.monotonic() - start < 0.35


def test_parallel_concurrency_limit_serialises() -> None:
    src = """\
- init:
    assign:
      - n: 0
- p:
    parallel:
      shared: [n]
      concurrency_limit: LIMIT
      for:
        value: v
        in: [1, 2, 3]
        steps:
          - s:
              call: sys.sleep
              args: {seconds: 0.1}
          - c:
              assign:
                - n: ${n + v}
- done:
    return: ${n}
"""
    start = time.monotonic()
    assert load_workflow(src.replace("LIMIT", "1")).run() == 6
    assert time.monotonic() - start >= 0.29
    start = time.monotonic()
    assert load_workflow(src.replace("LIMIT", "3")).run() == 6
    assert time.monotonic() - start < 0.25


def test_parallel_unhandled_errors_reported_per_branch() -> None:
    wf = load_workflow(
        """\
- p:
    parallel:
      for:
        value: num
        range: [0, 5]
        steps:
          - checkEven:
              switch:
                - condition: ${num % 2 != 0}
                  raise: "how odd!"
"""
    )
    with pytest.raises(WorkflowError) as info:
        wf.run()
    err = info.value.value
    assert err["tags"] == ["UnhandledBranchError"]
    assert [b["id"] for b in err["branches"]] == ["1", "3", "5"]
    assert all(b["error"] == "how odd!" for b in err["branches"])


def test_parallel_non_shared_write_stays_local_at_runtime() -> None:
    # The loader rejects assignments to known parent variables; a variable the parent creates
    # only *after* the parallel step is local to each branch.
    wf = load_workflow(
        """\
- p:
    parallel:
      branches:
        - a:
            steps:
              - s:
                  assign:
                    - tmp: 1
        - b:
            steps:
              - s2:
                  assign:
                    - tmp: 2
- done:
    return: ${default(map.get({}, "x"), "no tmp leaked")}
"""
    )
    assert wf.run() == "no tmp leaked"


def run_in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, box


def test_cancel_during_sleep_is_not_catchable() -> None:
    wf = load_workflow(
        """\
- t:
    try:
      steps:
        - nap:
            call: sys.sleep
            args: {seconds: 30}
    except:
      steps:
        - caught:
            return: "caught"
- after:
    return: "finished"
"""
    )
    cancel = threading.Event()
    thread, box = run_in_thread(lambda: wf.run(cancel=cancel))
    time.sleep(0.1)
    start = time.monotonic()
    cancel.set()
    thread.join(timeout=2)
    assert not thread.is_alive()
    assert time.monotonic() - start < 0.5
    assert isinstance(box.get("error"), ExecutionCancelled), box


def test_cancel_during_parallel_branches() -> None:
    wf = load_workflow(
        "- p:\n    parallel:\n      for:\n        value: v\n        in: [1, 2]\n        steps:\n"
        "          - nap:\n              call: sys.sleep\n              args: {seconds: 30}\n"
    )
    cancel = threading.Event()
    thread, box = run_in_thread(lambda: wf.run(cancel=cancel))
    time.sleep(0.1)
    cancel.set()
    thread.join(timeout=2)
    assert isinstance(box.get("error"), ExecutionCancelled)


def test_http_get_post_and_errors(http_stub: Any) -> None:
    http_stub.replies = [
        (200, {"hello": "world"}, {}),
        (201, {"created": True}, {"X-Id": "7"}),
        (404, {"error": "missing"}, {}),
        (200, b"plain text", {"Content-Type": "text/plain"}),
    ]
    wf = load_workflow(
        f"""\
- g:
    call: http.get
    args:
      url: {http_stub.url}/a
      query: {{q: "1"}}
      auth: {{type: OIDC}}
    result: g
- p:
    call: http.post
    args:
      url: {http_stub.url}/b
      body: {{x: 1}}
      headers: {{Authorization: Bearer t}}
    result: p
- declare:  # a variable the except block creates would be its own (refused when read after it)
    assign:
      - err: null
- m:
    try:
      call: http.get
      args:
        url: {http_stub.url}/missing
    except:
      as: e
      steps:
        - keep:
            assign:
              - err: ${{e}}
- t:
    call: http.request
    args:
      method: GET
      url: {http_stub.url}/text
    result: t
- done:
    return:
      g: ${{g.body.hello}}
      code: ${{p.code}}
      xid: ${{p.headers["X-Id"]}}
      err: ${{[err.code, err.body.error, err.tags]}}
      text: ${{t.body}}
"""
    )
    assert wf.run() == {
        "g": "world",
        "code": 201,
        "xid": "7",
        "err": [404, "missing", ["HttpError"]],
        "text": "plain text",
    }
    first, second = http_stub.requests[:2]
    assert first["method"] == "GET" and first["path"] == "/a?q=1"
    assert second["method"] == "POST" and second["body"] == b'{"x":1}'
    assert second["headers"]["Authorization"] == "Bearer t"


def test_http_connection_refused() -> None:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    wf = load_workflow(
        f"- g:\n    try:\n      call: http.get\n      args:\n        url: http://127.0.0.1:{port}/\n"
        f"    except:\n      as: e\n      steps:\n        - r:\n            return: ${{e.tags}}\n"
    )
    assert "ConnectionFailedError" in wf.run()


def test_sys_get_env_user_and_builtin() -> None:
    wf = load_workflow('- a:\n    return: ${[sys.get_env("GOOGLE_CLOUD_PROJECT_ID"), sys.get_env("MODE")]}\n')
    assert wf.run(env={"GOOGLE_CLOUD_PROJECT_ID": "p", "MODE": "local"}) == ["p", "local"]


def test_uncaught_error_str_and_context() -> None:
    wf = load_workflow(
        "main:\n  steps:\n    - a:\n        raise:\n          message: boom\n          tags: [X]\n"
    )
    with pytest.raises(WorkflowError) as info:
        wf.run()
    assert str(info.value) == '{"message": "boom", "tags": ["X"]}'
    assert engine_mod.error_context(info.value) == 'in step "a", routine "main", line: 3'


def test_returning_bytes_is_a_type_error() -> None:
    with pytest.raises(WorkflowError) as info:
        load_workflow('- a:\n    return: ${text.encode("x")}\n').run()
    assert "TypeError" in info.value.value["tags"]


def test_sys_log_and_uuid(caplog: pytest.LogCaptureFixture) -> None:
    wf = load_workflow(
        "- l:\n    call: sys.log\n    args:\n      text: hello log\n      severity: WARNING\n"
        "- u:\n    return: ${len(uuid.generate())}\n"
    )
    with caplog.at_level("DEBUG"):
        assert wf.run() == 36
    assert any("hello log" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    assert any("step l" in r.getMessage() for r in caplog.records)


def test_parallel_shared_read_modify_write_is_atomic() -> None:
    wf = load_workflow(
        """\
- init:
    assign:
      - total: 0
      - seen: []
- p:
    parallel:
      shared: [total, seen]
      concurrency_limit: 8
      for:
        value: v
        range: [1, 200]
        steps:
          - add:
              assign:
                - total: ${total + v}
                - seen: ${list.concat(seen, v)}
- done:
    return: [ "${total}", "${len(seen)}" ]
"""
    )
    assert wf.run() == [20100, 200]


STEP_LIMIT_WF = """\
main:
  steps:
    - guarded:
        try:
          steps:
            - spin:
                for:
                  value: i
                  range: [1, 1000]
                  steps:
                    - tick:
                        assign:
                          - x: ${i}
        retry:
          predicate: ${always}
          max_retries: 3
        except:
          as: e
          steps:
            - caught:
                return: "caught"
    - unreachable:
        return: "no limit"
always:
  params: [e]
  steps:
    - yes:
        return: true
"""


def test_the_step_limit_fails_the_execution_past_try_retry_and_except(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ResourceLimitError raised by the runtime "cannot be caught and causes immediate execution failure"
    (error tags table, cloud.google.com/workflows/docs/access-execution-results): neither the retry
    predicate nor the except block sees it.  The limit is lowered so the test stays fast."""
    monkeypatch.setattr(engine_mod, "MAX_STEPS", 50)
    with pytest.raises(WorkflowError) as failed:
        load_workflow(STEP_LIMIT_WF).run()
    assert failed.value.tags == ["ResourceLimitError"] and "more than 50 steps" in str(failed.value)


def test_the_memory_limit_counts_the_callers_frames_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory counts the variables of every live scope: a subworkflow's own string under the limit
    exceeds it together with its caller's (MemoryLimitExceededError, catchable like any error), and
    the same string fits once the caller's frame has returned."""
    monkeypatch.setattr(engine_mod, "MAX_VARIABLE_MEMORY", 1000)
    wf = load_workflow(
        """\
main:
  steps:
    - hold:
        assign:
          - tags: null
          - a: "A_STRING"
    - inner:
        try:
          call: keep
          result: kept
        except:
          as: e
          steps:
            - why:
                assign:
                  - a: null
                  - tags: ${e.tags}
    - again:
        call: keep
        result: kept
    - done:
        return: ${[tags, kept]}
keep:
  steps:
    - hold:
        assign:
          - b: "B_STRING"
    - give:
        return: ${len(b)}
""".replace("A_STRING", "y" * 600).replace("B_STRING", "z" * 600)
    )
    assert wf.run() == [["MemoryLimitExceededError"], 600]


def test_each_execution_s_peak_memory_is_kept_for_who_measures_how_far_it_stayed_from_the_limit() -> None:
    """The peak counts every live frame at once (600 + 600 here), not what is left at the end."""
    wf = load_workflow(
        """\
main:
  steps:
    - hold:
        assign:
          - a: "A_STRING"
    - inner:
        call: keep
        result: kept
    - drop:
        assign:
          - a: null
    - done:
        return: ${kept}
keep:
  steps:
    - hold:
        assign:
          - b: "B_STRING"
    - give:
        return: ${len(b)}
""".replace("A_STRING", "y" * 600).replace("B_STRING", "z" * 600)
    )
    assert wf.run(execution_name="projects/p/locations/l/workflows/w/executions/e1") == 600
    assert 1200 <= wf.peak_memory["projects/p/locations/l/workflows/w/executions/e1"] < 1400


def test_a_write_over_the_memory_limit_is_undone_so_the_except_block_can_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The write that would exceed the limit raises and leaves the variable as it was: the except block
    binds its error and reads the old value."""
    monkeypatch.setattr(engine_mod, "MAX_VARIABLE_MEMORY", 1000)
    wf = load_workflow(
        """\
main:
  steps:
    - init:
        assign:
          - kept: "small"
          - box: {"a": 1}
    - too_big:
        try:
          assign:
            - kept: "BIG"
        except:
          as: e
          steps:
            - report:
                return: ${[e.tags, kept]}
""".replace("BIG", "x" * 990)
    )
    assert wf.run() == [["MemoryLimitExceededError"], "small"]


def test_a_resource_limit_in_one_branch_stops_its_siblings(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "Immediate execution failure": a branch over the string limit ends the execution while its
    sibling still sleeps, and the caller's cancel stays unset."""
    monkeypatch.setattr(engine_mod, "MAX_STRING_BYTES", 10)
    wf = load_workflow(
        """\
main:
  steps:
    - both:
        parallel:
          branches:
            - long:
                steps:
                  - wait:
                      call: sys.sleep
                      args: {seconds: 60}
            - over:
                steps:
                  - grow:
                      assign:
                        - s: "0123456789abc"
"""
    )
    cancel = threading.Event()
    started = time.monotonic()
    with pytest.raises(WorkflowError) as failed:
        wf.run(cancel=cancel)
    assert failed.value.tags == ["ResourceLimitError"]
    assert time.monotonic() - started < 30 and not cancel.is_set()


def test_parallel_iterations_binding_subworkflow_arguments_count_memory_safely() -> None:
    """Every iteration binds its value and its subworkflow's arguments while the others write: each
    write is counted under the execution's lock (no dictionary changes under a reader)."""
    wf = load_workflow(
        """\
main:
  steps:
    - init:
        assign:
          - total: 0
    - fan:
        parallel:
          shared: [total]
          for:
            value: i
            range: [1, 40]
            steps:
              - call_it:
                  call: size
                  args: {a: [1, 2, 3], b: [4, 5, 6], c: [7, 8, 9]}
                  result: n
              - add:
                  assign:
                    - total: ${total + n}
    - done:
        return: ${total}
size:
  params: [a, b, c]
  steps:
    - count:
        return: ${len(a) + len(b) + len(c)}
"""
    )
    for _ in range(5):
        assert wf.run() == 40 * 9


@pytest.mark.parametrize(
    "call",
    [
        "call: sys.sleep\n    args:\n      seconds: 31536001",
        "call: sys.sleep\n    args:\n      seconds: -1",
        "call: sys.sleep_until\n    args:\n      time: ${time.format(sys.now() + 2 * 31536000)}",
    ],
)
def test_sleeps_past_a_year_or_backwards_are_value_errors(call: str) -> None:
    """sys.sleep: "Maximum is 31536000 (one year)"; sys.sleep_until: "The latest allowed time is one year
    from now" (cloud.google.com/workflows/docs/reference/stdlib/sys/sleep, .../sys/sleep_until)."""
    started = time.monotonic()
    with pytest.raises(WorkflowError) as raised:
        load_workflow(f"- nap:\n    {call}\n").run()
    assert raised.value.value["tags"] == ["ValueError"]
    assert time.monotonic() - started < 5
