"""Connector calls checked against Google's API definitions (the discovery documents that
google-api-python-client ships): every googleapis.* call of workflows/retrain.yaml binds to its method,
and a call the API would refuse fails with the name of what is wrong, backend or not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cloudworkflows import ConnectorRegistry, WorkflowError, load_workflow
from cloudworkflows.discovery import ConnectorCallError, check_call

REPO = Path(__file__).resolve().parents[2]
#: The connector calls workflows/retrain.yaml makes (the walk below must find exactly these).
USED = {
    "googleapis.pubsub.v1.projects.topics.publish",
    "googleapis.dataflow.v1b3.projects.locations.flexTemplates.launch",
    "googleapis.dataflow.v1b3.projects.locations.jobs.get",
    "googleapis.dataflow.v1b3.projects.locations.jobs.update",
    "googleapis.storage.v1.objects.get",
    "googleapis.firestore.v1.projects.databases.documents.patch",
}


def connector_steps(node: Any) -> list[tuple[str, dict[str, Any]]]:
    """Every ``call: googleapis.*`` in a workflow's YAML, with its literal args (expressions as text)."""
    out = []
    if isinstance(node, dict):
        call = node.get("call")
        if isinstance(call, str) and call.startswith("googleapis."):
            out.append((call, dict(node.get("args") or {})))
        for value in node.values():
            out += connector_steps(value)
    elif isinstance(node, list):
        for value in node:
            out += connector_steps(value)
    return out


CALLS = connector_steps(yaml.safe_load((REPO / "workflows" / "retrain.yaml").read_text()))


def test_the_walk_finds_every_connector_the_workflow_uses() -> None:
    assert {call for call, _ in CALLS} == USED


@pytest.mark.parametrize(("call", "args"), CALLS, ids=[c.split(".", 3)[-1] for c, _ in CALLS])
def test_each_call_of_the_workflow_binds_to_its_method(call: str, args: dict[str, Any]) -> None:
    check_call(call, args)  # expressions stand for their values: names and literal bodies are checked


@pytest.mark.parametrize(
    ("call", "args", "named"),
    [
        # each API the workflow uses, one mistake each, named in the refusal
        ("googleapis.storage.v1.objects.get", {"bucket": "b", "objekt": "o"}, "unknown parameter 'objekt'"),
        ("googleapis.storage.v1.objects.get", {"object": "o"}, "missing required parameter(s) bucket"),
        (
            "googleapis.pubsub.v1.projects.topics.publish",
            {"topic": "projects/p/topics/t", "body": {"messages": [{"datum": "eA=="}]}},
            "unknown field body.messages[0].datum",
        ),
        (
            "googleapis.dataflow.v1b3.projects.locations.flexTemplates.launch",
            {"projectId": "p", "location": "l", "body": {"launchParameter": {"enviroment": {}}}},
            "unknown field body.launchParameter.enviroment",
        ),
        (
            "googleapis.dataflow.v1b3.projects.locations.jobs.get",
            {"projectId": "p", "location": "l", "job_id": "j"},
            "unknown parameter 'job_id'",
        ),
        (
            "googleapis.dataflow.v1b3.projects.locations.jobs.update",
            {"projectId": "p", "location": "l", "jobId": "j", "body": {"requested_state": "X"}},
            "unknown field body.requested_state",
        ),
        (
            "googleapis.firestore.v1.projects.databases.documents.patch",
            {"name": "projects/p/databases/d/documents/c/x", "currentDocument": {"exist": True}},
            "unknown parameter currentDocument.exist (the method takes currentDocument.exists",
        ),
        ("googleapis.storage.v1.objects.fetch", {"bucket": "b"}, "no method 'fetch'"),
        ("googleapis.storage.v9.objects.get", {"bucket": "b"}, "Google has no API storage v9"),
        (
            "googleapis.dataflow.v1b3.projects.locations.jobs.get",
            {"projectId": "p", "location": "l", "jobId": "j", "body": {}},
            "no request body",
        ),
    ],
)
def test_a_call_the_api_would_refuse_is_refused_by_name(call: str, args: dict[str, Any], named: str) -> None:
    with pytest.raises(ConnectorCallError) as e:
        check_call(call, args)
    assert named in str(e.value)


def test_maps_and_the_apis_standard_parameters_bind() -> None:
    # a map field (Dataflow's parameters: additionalProperties) takes any key; alt is the API's own
    check_call(
        "googleapis.dataflow.v1b3.projects.locations.flexTemplates.launch",
        {"projectId": "p", "location": "l", "body": {"launchParameter": {"parameters": {"anything": "x"}}}},
    )
    check_call("googleapis.storage.v1.objects.get", {"bucket": "b", "object": "o", "alt": "media"})


BAD_WORKFLOW = """\
main:
  steps:
    - read:
        call: googleapis.storage.v1.objects.get
        args:
          bucket: b
          objekt: a.txt
        result: r
    - done:
        return: ${r}
"""


def test_the_interpreter_answers_a_bad_call_with_400_before_the_backend_sees_it() -> None:
    seen: list[dict[str, Any]] = []
    registry = ConnectorRegistry()
    registry.register("googleapis.storage.v1.objects.get", lambda args, _: seen.append(args))
    with pytest.raises(WorkflowError) as e:
        load_workflow(BAD_WORKFLOW).run(connectors=registry)
    assert e.value.value["code"] == 400 and e.value.value["tags"] == ["HttpError"]
    assert "unknown parameter 'objekt'" in e.value.value["message"] and seen == []


@pytest.mark.integration
def test_retrain_workflows_run_names_the_misspelled_parameter(tmp_path: Path) -> None:
    """No backend is bound under `retrain workflows run`: the call still fails on its name."""
    source = tmp_path / "bad.yaml"
    source.write_text(BAD_WORKFLOW)
    r = subprocess.run(
        [sys.executable, "-m", "retrain_ops.cli", "workflows", "run", str(source), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert r.returncode == 1
    answer = json.loads(r.stdout)
    assert answer["state"] == "FAILED" and "unknown parameter 'objekt'" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (
            {"cluster_id": "c", "method": "GET", "path": "/api", "quer": {}},
            "TypeError: gke.request: unknown argument(s) quer",
        ),
        ({"cluster_id": "c", "path": "/api"}, "TypeError: gke.request: missing argument(s) method"),
        (
            {"cluster_id": "c", "method": "GET", "path": "/api", "timeout": 3600},
            "ValueError: gke.request: timeout 3600",
        ),
        (
            {"cluster_id": "c", "method": "GET", "path": "/api", "body": None, "query": None},
            "TypeError: gke.request: body, query is null",
        ),
    ],
)
def test_gke_request_takes_its_documented_arguments(args: dict[str, Any], refusal: str) -> None:
    """connectors/gke/request: cluster_id, path, method, project, location, timeout (at most 1800),
    body, headers, query; checked before the cluster is asked."""
    seen: list[dict[str, Any]] = []
    registry = ConnectorRegistry()
    registry.register("gke.request", lambda a, _: seen.append(a))
    source = "- r:\n    call: gke.request\n    args: " + json.dumps(args) + "\n"
    with pytest.raises(WorkflowError) as e:
        load_workflow(source).run(connectors=registry)
    tag, message = e.value.value["tags"][0], e.value.value["message"]
    assert f"{tag}: {message}".startswith(refusal) and seen == []
    ok = {"cluster_id": "c", "method": "GET", "path": "/api", "query": {"a": "b"}, "timeout": 1800}
    load_workflow("- r:\n    call: gke.request\n    args: " + json.dumps(ok) + "\n").run(connectors=registry)
    assert seen == [ok]
