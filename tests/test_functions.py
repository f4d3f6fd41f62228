"""The ingest Cloud Function served by the real functions-framework, with the real Firestore emulator
and retrain's executions service: CloudEvents in, one workflow execution per sealed snapshot out."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import requests
from stack_support import stored_plan

from cloudworkflows import ConnectorRegistry, ExecutionsServer, load_workflow
from retrain.adapters import objects
from retrain.adapters.ledger import FirestoreLedger
from retrain_local.landing import finalized_event

if TYPE_CHECKING:
    from conftest import ServedFunction

pytestmark = pytest.mark.emulators

ECHO = """
main:
  params: [args]
  steps:
    - done:
        return: ${args.run_id}
"""


@pytest.fixture(scope="module")
def executions() -> Iterator[ExecutionsServer]:
    workflow = load_workflow(ECHO)
    with ExecutionsServer(lambda _: workflow, ConnectorRegistry(), {}) as server:
        yield server


@pytest.fixture(scope="module")
def function(serve_function: Callable[..., ServedFunction], executions: ExecutionsServer) -> ServedFunction:
    """on_object_finalized, its executions echoing their run id (so they succeed at once)."""
    return serve_function(
        "on_object_finalized",
        RETRAIN_LANDING_BUCKET="land",
        RETRAIN_WORKFLOWS_ENDPOINT=executions.base_url,
        RETRAIN_WORKFLOWS_GRPC_ENDPOINT=executions.grpc_target,
    )


def resource(name: str, generation: int = 1, md5: str | None = None) -> dict[str, Any]:
    return {
        "kind": "storage#object",
        "bucket": "land",
        "name": name,
        "generation": str(generation),
        "metageneration": "1",
        "size": "100",
        "md5Hash": md5 or f"md5-{name}",
        "updated": "2026-11-21T00:00:00.000Z",
        "contentType": "text/plain",
    }


def post(url: str, res: dict[str, Any], **header_overrides: str) -> requests.Response:
    headers, body = finalized_event(res)
    headers.update(header_overrides)
    return requests.post(url, headers=headers, data=body, timeout=60)


def test_events_become_one_execution_per_sealed_snapshot(
    function: ServedFunction, executions: ExecutionsServer
) -> None:
    function_url, project = function.url, function.project
    ds = f"d{uuid.uuid4().hex[:6]}"
    names = [f"incoming/{ds}/part-{i}.jsonl" for i in range(3)]
    for name in names:
        assert post(function_url, resource(name)).status_code == 200
    assert post(function_url, resource(names[0])).status_code == 200  # redelivery
    assert post(function_url, resource(f"incoming/{ds}/_SUCCESS")).status_code == 200

    runs = [r for r in FirestoreLedger(project).list_runs() if r.dataset == ds]
    assert len(runs) == 1 and runs[0].objects == 3 and runs[0].trigger == "gcs-marker"
    execution = executions.wait(runs[0].execution, timeout=30)
    assert execution["state"] == "SUCCEEDED"
    assert json.loads(execution["result"]) == runs[0].run_id
    # the argument names the run and the start claim; the plan is the ledger's (the begin step reads it)
    argument = json.loads(execution["argument"])
    assert set(argument) == {"run_id", "claim"} and argument["run_id"] == runs[0].run_id
    plan = stored_plan(FirestoreLedger(project), runs[0].run_id)
    assert plan is not None and plan["objects"] == 3
    assert plan["training"]["run_id"] == plan["run_id"] == runs[0].run_id
    manifest = json.loads(objects.read_bytes(f"gs://{function.artifacts}/{plan['manifest_object']}"))
    assert [o["uri"] for o in manifest["objects"]] == [f"gs://land/{n}" for n in names]
    assert [o["generation"] for o in manifest["objects"]] == [1, 1, 1]  # the versions that arrived

    # the same data again, under new generations: acknowledged, but no second run
    for name in names:
        post(function_url, resource(name, generation=2, md5=f"md5-{name}"))
    post(function_url, resource(f"incoming/{ds}/_SUCCESS", generation=2))
    assert len([r for r in FirestoreLedger(project).list_runs() if r.dataset == ds]) == 1


@pytest.mark.parametrize(
    ("res", "headers"),
    [
        (resource("incoming/../../etc/passwd"), {}),
        # (the header carries a sanitised subject: HTTP itself forbids control characters there)
        (resource("incoming/a\x01b"), {"ce-subject": "objects/incoming/ab"}),
        (
            {**resource("incoming/x"), "bucket": "someone-elses"},
            {"ce-source": "//storage.googleapis.com/projects/_/buckets/someone-elses"},
        ),
        (resource("incoming/x"), {"ce-source": "//storage.googleapis.com/projects/_/buckets/spoofed"}),
        ({"bucket": "land"}, {}),
    ],
)
def test_bad_events_are_acknowledged_and_do_nothing(
    function: ServedFunction, res: dict[str, Any], headers: dict[str, str]
) -> None:
    ledger = FirestoreLedger(function.project)
    before = ledger.pending()
    if "name" not in res:
        h, _ = finalized_event(resource("incoming/x"))
        resp = requests.post(function.url, headers=h, data=json.dumps(res), timeout=30)
    else:
        resp = post(function.url, res, **headers)
    assert resp.status_code == 200  # acknowledged: no redelivery loop
    assert ledger.pending() == before  # no arrival recorded
    assert "rejected event" in function.log.read_text().splitlines()[-1]


def test_not_a_cloudevent_is_a_client_error(function: ServedFunction) -> None:
    resp = requests.post(function.url, data=b"hello", headers={"content-type": "text/plain"}, timeout=30)
    assert 400 <= resp.status_code < 500
