"""An execution on virtual time (``cloudworkflows.clock``): hours of polls, sleeps and callback waits
run in milliseconds, and what a test schedules happens at the virtual time it names, seen by
``sys.now``, the polls and the callback's ``received_time`` alike."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import pytest

from cloudworkflows import (
    CallbackHub,
    ConnectorRegistry,
    ExecutionCancelled,
    VirtualClock,
    WorkflowError,
    load_workflow,
)

JOBS_GET = "googleapis.dataflow.v1b3.projects.locations.jobs.get"

POLL = """\
main:
  steps:
    - start:
        assign:
          - started: ${sys.now()}
          - give_up_at: ${sys.now() + 21600}
          - polls: 0
    - poll:
        call: googleapis.dataflow.v1b3.projects.locations.jobs.get
        args: {projectId: p, location: l, jobId: j}
        result: job
    - count:
        assign:
          - polls: ${polls + 1}
    - done:
        switch:
          - condition: ${job.currentState == "JOB_STATE_DONE"}
            return: {polls: '${polls}', waited: '${sys.now() - started}'}
          - condition: ${sys.now() > give_up_at}
            raise: {code: 504, message: '${"gave up after " + string(int(sys.now() - started)) + " s"}'}
    - wait:
        call: sys.sleep
        args: {seconds: 60}
        next: poll
"""


class Job:
    """A Dataflow job's state, as jobs.get answers it; each poll's virtual time is kept."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock, self.state, self.polled_at = clock, "JOB_STATE_RUNNING", []

    def get(self, args: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        self.polled_at.append(self.clock.now())
        return {"id": args["jobId"], "currentState": self.state}


def polled(clock: VirtualClock, job: Job) -> Any:
    connectors = ConnectorRegistry()
    connectors.register(JOBS_GET, job.get)
    return load_workflow(POLL).run(connectors=connectors, clock=clock)


def test_hours_of_polls_run_at_once_and_see_the_job_end_when_it_ended() -> None:
    clock = VirtualClock()
    start, job = clock.now(), Job(clock)

    def finish() -> None:
        job.state = "JOB_STATE_DONE"

    clock.at(start + 3 * 3600 + 30, finish)  # between two polls
    assert polled(clock, job) == {"polls": 182, "waited": 3 * 3600 + 60}
    assert job.polled_at == [start + 60 * i for i in range(182)]
    assert clock.now() == start + 3 * 3600 + 60


def test_a_job_that_never_ends_is_given_up_on_at_its_virtual_deadline() -> None:
    clock = VirtualClock()
    start, job = clock.now(), Job(clock)
    with pytest.raises(WorkflowError) as info:
        polled(clock, job)
    assert info.value.value["message"] == "gave up after 21660 s"
    assert len(job.polled_at) == 362 and clock.now() == start + 21660


CALLBACK = """\
main:
  params: [timeout]
  steps:
    - open:
        call: events.create_callback_endpoint
        args: {http_callback_method: POST}
        result: callback
    - start:
        assign:
          - started: ${sys.now()}
    - wait:
        call: events.await_callback
        args: {callback: '${callback}', timeout: '${timeout}'}
        result: got
    - done:
        return:
          body: ${got.http_request.body}
          received_time: ${got.received_time}
          waited: ${sys.now() - started}
"""

EXECUTION = "projects/p/locations/l/workflows/w/executions/e1"


def test_a_callback_delivered_at_a_virtual_time_wakes_its_await_then() -> None:
    clock = VirtualClock()
    hub, start = CallbackHub("http://127.0.0.1:1", clock=clock), clock.now()

    def deliver() -> None:
        (url,) = hub.endpoints(EXECUTION)
        assert hub.deliver(url.removeprefix(hub.base_url), "POST", {}, b'{"state": "Completed"}')

    clock.at(start + 500, deliver)
    result = load_workflow(CALLBACK).run(3600, hub=hub, clock=clock, execution_name=EXECUTION)
    assert result["body"] == {"state": "Completed"} and result["waited"] == 500
    assert result["received_time"] == datetime.fromtimestamp(start + 500, UTC).isoformat(
        timespec="microseconds"
    ).replace("+00:00", "Z")


def test_a_callback_never_delivered_times_out_at_its_virtual_timeout() -> None:
    clock = VirtualClock()
    hub, start = CallbackHub("http://127.0.0.1:1", clock=clock), clock.now()
    with pytest.raises(WorkflowError) as info:
        load_workflow(CALLBACK).run(43200, hub=hub, clock=clock, execution_name=EXECUTION)
    assert info.value.value["tags"] == ["TimeoutError"] and clock.now() == start + 43200


def test_a_cancel_during_a_virtual_sleep_stops_the_execution_at_its_time() -> None:
    clock, cancel = VirtualClock(), threading.Event()
    start = clock.now()
    clock.at(start + 90, cancel.set)
    sleeper = "main:\n  steps:\n    - nap:\n        call: sys.sleep\n        args: {seconds: 3600}\n"
    with pytest.raises(ExecutionCancelled):
        load_workflow(sleeper).run(cancel=cancel, clock=clock)
    assert clock.now() == start + 90


def test_sleep_until_waits_for_the_virtual_time_it_names() -> None:
    clock = VirtualClock()
    until = datetime.fromtimestamp(clock.now() + 7200, UTC).isoformat()
    source = (
        "main:\n  steps:\n    - nap:\n        call: sys.sleep_until\n"
        f"        args: {{time: '{until}'}}\n    - done:\n        return: ${{sys.now()}}\n"
    )
    start = clock.now()
    assert load_workflow(source).run(clock=clock) == start + 7200


def test_actions_run_in_time_order_each_at_its_own_time() -> None:
    clock = VirtualClock(start=0.0)
    seen: list[tuple[str, float]] = []
    clock.at(30, lambda: seen.append(("b", clock.now())))
    clock.at(10, lambda: seen.append(("a", clock.now())))
    clock.at(30, lambda: seen.append(("c", clock.now())))
    clock.advance(20)
    assert seen == [("a", 10)] and clock.now() == 20
    clock.advance(100)
    assert seen == [("a", 10), ("b", 30), ("c", 30)] and clock.now() == 120


def test_an_execution_and_its_hub_keep_one_time() -> None:
    """A callback hub on the wall clock would make a virtual execution's awaits wait in real time."""
    hub = CallbackHub("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="callback hub"):
        load_workflow(CALLBACK).run(60, hub=hub, clock=VirtualClock(), execution_name=EXECUTION)
    clock = VirtualClock()
    on_its_clock = CallbackHub("http://127.0.0.1:1", clock=clock)
    with pytest.raises(WorkflowError):  # its hub's virtual clock by default: times out at once
        load_workflow(CALLBACK).run(3600, hub=on_its_clock, execution_name=EXECUTION)
    assert clock.now() == VirtualClock().now() + 3600


def test_a_virtual_clock_serves_one_thread() -> None:
    clock, cancel = VirtualClock(), threading.Event()
    clock.sleep(10, cancel)
    failed: list[BaseException] = []

    def other() -> None:
        try:
            clock.sleep(10, cancel)
        except RuntimeError as e:
            failed.append(e)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(failed) == 1 and "one thread" in str(failed[0])
