"""The local executions service over real HTTP: executions, callbacks and cancellation."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from cloudworkflows import CallbackHub, ConnectorRegistry, ExecutionsServer, WorkflowError, load_workflow
from retrain.ports import ExecutionState, ExecutionStatus

#: The workflow tells the world its callback URL the way a real one would: a Pub/Sub message.
NOTIFY = "googleapis.pubsub.v1.projects.topics.publish"

CALLBACK_WF = """\
main:
  params: [args]
  steps:
    - create:
        call: events.create_callback_endpoint
        args:
          http_callback_method: POST
        result: cb
    - tell:
        call: googleapis.pubsub.v1.projects.topics.publish
        args:
          topic: projects/p/topics/callbacks
          body:
            messages:
              - attributes:
                  url: ${cb.url}
    - wait:
        try:
          call: events.await_callback
          args:
            callback: ${cb}
            timeout: ${args.timeout}
          result: req
        except:
          as: e
          steps:
            - timed_out:
                return: ${"timeout:" + e.tags[0]}
    - done:
        return:
          body: ${req.http_request.body}
          method: ${req.http_request.method}
          type: ${req.type}
          job: ${args.job}
"""

SLEEP_WF = "- nap:\n    call: sys.sleep\n    args:\n      seconds: 30\n- done:\n    return: 1\n"
FAIL_WF = "main:\n  steps:\n    - a:\n        raise:\n          message: nope\n          tags: [ValueError]\n"


class Harness:
    def __init__(self) -> None:
        self.urls: list[str] = []
        self.on_notify: Any = None
        self.workflows = {
            "retrain": load_workflow(CALLBACK_WF),
            "sleepy": load_workflow(SLEEP_WF),
            "failing": load_workflow(FAIL_WF),
        }
        reg = ConnectorRegistry()
        reg.register(NOTIFY, self.notify)
        self.server = ExecutionsServer(self.workflows.__getitem__, reg, {"GOOGLE_CLOUD_PROJECT_ID": "p"})

    def notify(self, args: dict[str, Any], params: dict[str, Any]) -> Any:
        url = args["body"]["messages"][0]["attributes"]["url"]
        self.urls.append(url)
        if self.on_notify is not None:
            self.on_notify(url)
        return None

    def wait_for_url(self, timeout: float = 2.0) -> str:
        deadline = time.monotonic() + timeout
        while not self.urls:
            assert time.monotonic() < deadline, "workflow never created its callback"
            time.sleep(0.01)
        return self.urls[-1]


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    h.server.start()
    yield h
    h.server.stop()


def create(h: Harness, workflow: str, argument: Any) -> dict[str, Any]:
    resp = requests.post(
        f"{h.server.base_url}/v1/projects/p/locations/l/workflows/{workflow}/executions",
        json={"argument": json.dumps(argument)},
        timeout=5,
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def get(h: Harness, name: str) -> dict[str, Any]:
    resp = requests.get(f"{h.server.base_url}/v1/{name}", timeout=5)
    assert resp.status_code == 200
    return dict(resp.json())


def poll(h: Harness, name: str, timeout: float = 3.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        ex = get(h, name)
        if ex["state"] != "ACTIVE" or time.monotonic() > deadline:
            return ex
        time.sleep(0.02)


def test_callback_round_trip_over_http(harness: Harness) -> None:
    ex = create(harness, "retrain", {"job": "j1", "timeout": 5})
    assert ex["state"] == "ACTIVE"
    assert ex["name"].startswith("projects/p/locations/l/workflows/retrain/executions/")
    assert json.loads(ex["argument"]) == {"job": "j1", "timeout": 5}
    assert ex["workflowRevisionId"] and ex["startTime"]
    url = harness.wait_for_url()
    assert url.startswith(f"{harness.server.base_url}/v1/{ex['name']}/callbacks/")
    # wrong method -> 404, right method -> 200
    assert requests.get(url, timeout=5).status_code == 404
    resp = requests.post(url, json={"status": "SUCCEEDED", "metrics": {"loss": 1.5}}, timeout=5)
    assert resp.status_code == 200
    done = poll(harness, ex["name"])
    assert done["state"] == "SUCCEEDED", done
    assert json.loads(done["result"]) == {
        "body": {"status": "SUCCEEDED", "metrics": {"loss": 1.5}},
        "method": "POST",
        "type": "HTTP",
        "job": "j1",
    }
    assert done["endTime"] >= done["startTime"]
    # after the execution ends its endpoint is gone
    assert requests.post(url, json={}, timeout=5).status_code == 404


def test_callback_delivered_before_await_is_queued(harness: Harness) -> None:
    harness.on_notify = lambda url: requests.post(url, json={"early": True}, timeout=5)
    ex = create(harness, "retrain", {"job": "j2", "timeout": 5})
    done = poll(harness, ex["name"])
    assert done["state"] == "SUCCEEDED"
    assert json.loads(done["result"])["body"] == {"early": True}


def test_await_callback_timeout_is_a_timeout_error(harness: Harness) -> None:
    ex = create(harness, "retrain", {"job": "j3", "timeout": 0.1})
    done = poll(harness, ex["name"])
    assert json.loads(done["result"]) == "timeout:TimeoutError"


def test_unknown_callback_is_404(harness: Harness) -> None:
    url = f"{harness.server.base_url}/v1/projects/p/locations/l/workflows/w/executions/x/callbacks/nope"
    assert requests.post(url, json={}, timeout=5).status_code == 404


def test_cancel_during_await_callback(harness: Harness) -> None:
    ex = create(harness, "retrain", {"job": "j4", "timeout": 60})
    harness.wait_for_url()
    start = time.monotonic()
    resp = requests.post(f"{harness.server.base_url}/v1/{ex['name']}:cancel", json={}, timeout=5)
    assert resp.status_code == 200 and resp.json()["state"] == "CANCELLED"
    rec = harness.server.wait(ex["name"], timeout=2)
    assert rec["state"] == "CANCELLED"
    assert time.monotonic() - start < 1.0


def test_cancel_during_sleep_python_api(harness: Harness) -> None:
    name = harness.server.start_execution(harness.workflows["sleepy"], None)
    time.sleep(0.05)
    harness.server.cancel(name)
    assert harness.server.wait(name, timeout=1)["state"] == "CANCELLED"


def test_a_cancelled_caller_of_experimental_executions_cancels_its_children(harness: Harness) -> None:
    harness.workflows["mapper"] = load_workflow(
        "- m:\n    call: experimental.executions.map\n    args:\n      workflow_id: sleepy\n"
        "      arguments: [1, 2]\n"
    )
    parent = harness.server.start_execution("mapper", None)
    children_of = "projects/p/locations/local/workflows/sleepy"
    deadline = time.monotonic() + 5
    while len(harness.server.list(children_of)) < 2:
        assert time.monotonic() < deadline, "the map started no executions"
        time.sleep(0.02)
    assert {c["state"] for c in harness.server.list(children_of)} == {"ACTIVE"}
    harness.server.cancel(parent)
    assert harness.server.wait(parent, timeout=2)["state"] == "CANCELLED"
    for child in harness.server.list(children_of):
        assert harness.server.wait(child["name"], timeout=2)["state"] == "CANCELLED"


def test_failed_execution_error_payload(harness: Harness) -> None:
    name = harness.server.start_execution("failing", {})
    rec = harness.server.wait(name, timeout=2)
    assert rec["state"] == "FAILED"
    assert json.loads(rec["error"]["payload"]) == {"message": "nope", "tags": ["ValueError"]}
    assert "a" in rec["error"]["context"] and "line: 3" in rec["error"]["context"]
    assert "result" not in rec


def test_list_and_unknown(harness: Harness) -> None:
    name = harness.server.start_execution("failing", {})
    harness.server.wait(name, timeout=2)
    listed = requests.get(
        f"{harness.server.base_url}/v1/projects/p/locations/local/workflows/failing/executions", timeout=5
    ).json()
    assert [e["name"] for e in listed["executions"]] == [name]
    missing = requests.get(
        f"{harness.server.base_url}/v1/projects/p/locations/l/workflows/w/executions/none", timeout=5
    )
    assert missing.status_code == 404
    bad = requests.post(
        f"{harness.server.base_url}/v1/projects/p/locations/l/workflows/retrain/executions",
        json={"argument": "{not json"},
        timeout=5,
    )
    assert bad.status_code == 400


def test_argument_over_32kb_is_rejected_as_the_api_does(harness: Harness) -> None:
    url = f"{harness.server.base_url}/v1/projects/p/locations/l/workflows/sleepy/executions"
    fits = json.dumps({"pad": "x" * (32 * 1024 - 20)})
    assert len(fits) <= 32 * 1024
    assert requests.post(url, json={"argument": fits}, timeout=5).status_code == 200
    too_big = json.dumps({"pad": "x" * (32 * 1024)})
    resp = requests.post(url, json={"argument": too_big}, timeout=5)
    assert resp.status_code == 400 and "32KB" in resp.json()["error"]["message"]


def test_adapter_client_against_server(harness: Harness) -> None:
    from retrain.adapters.workflows import WorkflowsExecutions

    # Google's ExecutionsClient over gRPC for create/get, the REST side for callbacks
    client = WorkflowsExecutions(
        "p", "l", "retrain", endpoint=harness.server.base_url, grpc_endpoint=harness.server.grpc_target
    )
    name = client.start({"job": "j5", "timeout": 5})
    url = harness.wait_for_url()
    assert client.is_callback_url(url)
    assert client.send_callback(url, {"status": "DONE"}) == 200
    deadline = time.monotonic() + 3
    while client.get(name).state == ExecutionState.ACTIVE and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.get(name) == ExecutionStatus(ExecutionState.SUCCEEDED)
    assert json.loads(harness.server.get(name)["result"])["body"] == {"status": "DONE"}
    # the client's own errors: NOT_FOUND is a lost execution, INVALID_ARGUMENT the API's 32 KB limit
    from google.api_core.exceptions import InvalidArgument

    from retrain.domain.errors import ExecutionLost

    with pytest.raises(ExecutionLost):
        client.get("projects/p/locations/l/workflows/retrain/executions/none")
    with pytest.raises(InvalidArgument, match="32KB"):
        client.start({"job": "x" * 40_000})
    held = client.start({"job": "j6", "timeout": 30})
    client.cancel(held)
    assert client.get(held) == ExecutionStatus(ExecutionState.CANCELLED)


def test_hub_directly_and_run_with_hub() -> None:
    hub = CallbackHub("http://127.0.0.1:9")
    wf = load_workflow(
        "- c:\n    call: events.create_callback_endpoint\n    result: cb\n"
        "- w:\n    call: events.await_callback\n    args:\n      callback: ${cb}\n      timeout: 2\n"
        "    result: r\n- d:\n    return: ${r.http_request}\n"
    )
    name = "projects/p/locations/l/workflows/w/executions/e1"
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(r=wf.run(hub=hub, execution_name=name)))
    thread.start()
    deadline = time.monotonic() + 2
    while not hub.endpoints(name):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    path = hub.endpoints(name)[0].removeprefix("http://127.0.0.1:9")
    assert not hub.deliver(path, "PUT", {}, b"x")
    assert hub.deliver(path + "?a=1", "POST", {"Content-Type": "text/plain"}, b"hello")
    thread.join(timeout=2)
    assert box["r"] == {
        "body": "hello",
        "headers": {"Content-Type": "text/plain"},
        "method": "POST",
        "query": {"a": ["1"]},
        "url": path,
    }


def test_callbacks_without_hub_fail() -> None:
    wf = load_workflow("- c:\n    call: events.create_callback_endpoint\n    result: cb\n")
    with pytest.raises(WorkflowError):
        wf.run()


def test_callback_urls_with_the_project_id_or_its_number_are_ours() -> None:
    """Google may name an execution (and so its callbacks) by project number: both shapes are ours; another
    project's, another workflow's, another host's or a path escaping the execution are not."""
    from retrain.adapters.workflows import CLOUD_ENDPOINT, WorkflowsExecutions

    client = WorkflowsExecutions(
        "my-proj", "us-central1", "retrain", CLOUD_ENDPOINT, project_number="123456789012"
    )
    tail = "locations/us-central1/workflows/retrain/executions/e1/callbacks/c1_abc"
    assert client.is_callback_url(f"{CLOUD_ENDPOINT}/v1/projects/my-proj/{tail}")
    assert client.is_callback_url(f"{CLOUD_ENDPOINT}/v1/projects/123456789012/{tail}")
    for url in (
        f"{CLOUD_ENDPOINT}/v1/projects/other-proj/{tail}",
        f"{CLOUD_ENDPOINT}/v1/projects/999999999999/{tail}",
        f"{CLOUD_ENDPOINT}/v1/projects/my-proj/{tail.replace('/retrain/', '/other/')}",
        f"https://evil.example.com/v1/projects/my-proj/{tail}",
        f"{CLOUD_ENDPOINT}/v1/projects/my-proj/locations/us-central1/workflows/retrain/executions/../../x/callbacks/c",
    ):
        assert not client.is_callback_url(url), url
    without_number = WorkflowsExecutions("my-proj", "us-central1", "retrain", CLOUD_ENDPOINT)
    assert not without_number.is_callback_url(f"{CLOUD_ENDPOINT}/v1/projects/123456789012/{tail}")
