"""The retrain workflow's failure paths, through the whole local stack: whatever step fails, the run
ends with a reason, no JobSet, no ProvisioningRequest and zero GPU nodes."""

from __future__ import annotations

import dataclasses
import getpass
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from retrain.adapters.ledger import FirestoreLedger
from retrain.adapters.workflows import WorkflowsExecutions
from retrain.cli import follow, request_cancel
from retrain.deployment import local_settings
from retrain.domain.runs import Run
from retrain.local import emulators
from retrain.local.cluster_twin import Faults
from retrain.local.envtest import envtest_unavailable_reason
from retrain.local.landing import drop
from retrain.local.stack import LocalStack

pytestmark = [pytest.mark.slow, pytest.mark.emulators, pytest.mark.envtest]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    for reason in (emulators.java_emulators_unavailable_reason(), envtest_unavailable_reason()):
        if reason:
            pytest.skip(reason)
    settings = dataclasses.replace(
        local_settings({}),  # what the local stack runs on: infra/'s values (retrain.deployment)
        gpus_per_node=1,  # one stand-in rank per node: these runs are about failures, not training
        steps_per_run=4,
        provision_timeout_s=8,
        provision_delay_s=0.5,
        state_dir=str(tmp_path_factory.mktemp("stack")),
    )
    with LocalStack(settings, fresh=True) as s:
        yield s


def run_with(stack: LocalStack, tmp_path: Path, faults: Faults, lines: list[str] | None = None) -> Run:
    stack.twin.faults = faults
    data = tmp_path / f"{uuid.uuid4().hex}.jsonl"
    lines = lines or [
        json.dumps({"text": f"document {i} of a unique batch {uuid.uuid4()}"}) for i in range(5)
    ]
    data.write_text("\n".join(lines) + "\n")
    dataset = f"d{uuid.uuid4().hex[:8]}"
    s = stack.settings
    drop(s, stack.endpoints.ingest_function, [data], dataset=dataset)
    ledger = FirestoreLedger(s.project)
    (run,) = [r for r in ledger.list_runs() if r.dataset == dataset]
    return follow(ledger, run.run_id, 300, WorkflowsExecutions(s.project, s.region, s.workflow))


def assert_released(stack: LocalStack, run: Run) -> None:
    assert run.status == "failed", run
    assert run.nodes_at_end == 0 and stack.twin.node_names() == []
    custom = client.CustomObjectsApi(stack.kube_api)
    for group, version, plural in (
        ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
        ("autoscaling.x-k8s.io", "v1", "provisioningrequests"),
    ):
        items = custom.list_namespaced_custom_object(group, version, "default", plural)["items"]
        assert [i["metadata"]["name"] for i in items] == [], plural


def test_tokenization_without_tokens_fails_before_any_capacity(stack: LocalStack, tmp_path: Path) -> None:
    run = run_with(
        stack, tmp_path, Faults(), lines=["{not json", json.dumps({"text": ""}), json.dumps({"x": 1})]
    )
    assert_released(stack, run)
    assert run.reason == "tokenization produced no tokens" and run.quarantined == 3
    assert run.gpu_node_seconds == 0


def test_dws_failure(stack: LocalStack, tmp_path: Path) -> None:
    run = run_with(stack, tmp_path, Faults(provisioning="fail"))
    assert_released(stack, run)
    assert run.reason and "DWS did not provide capacity (Failed)" in run.reason


def test_dws_never_provisions(stack: LocalStack, tmp_path: Path) -> None:
    run = run_with(stack, tmp_path, Faults(provisioning="never"))
    assert_released(stack, run)
    assert run.reason == "DWS did not provision 1 node(s) within 8 s"


def test_training_fails_after_its_restarts(stack: LocalStack, tmp_path: Path) -> None:
    run = run_with(stack, tmp_path, Faults(crash_pods_always=True))
    assert_released(stack, run)
    assert run.reason and run.reason.startswith("training failed")
    assert run.gpu_node_seconds > 0 and run.tokens > 0


def test_success_on_the_same_stack(stack: LocalStack, tmp_path: Path) -> None:
    run = run_with(stack, tmp_path, Faults())
    assert run.status == "succeeded" and run.nodes_at_end == 0 and run.reason is None


def test_cancel_while_waiting_for_capacity(stack: LocalStack, tmp_path: Path) -> None:
    stack.twin.faults = Faults(provisioning="never")
    s = stack.settings
    ledger = FirestoreLedger(s.project)
    executions = WorkflowsExecutions(s.project, s.region, s.workflow)
    data = tmp_path / "cancel.jsonl"
    data.write_text(json.dumps({"text": f"a run to cancel {uuid.uuid4()}"}) + "\n")
    drop(s, stack.endpoints.ingest_function, [data], dataset="cancelme")
    (run,) = [r for r in ledger.list_runs() if r.dataset == "cancelme"]
    deadline = time.monotonic() + 60
    while (current := ledger.get_run(run.run_id)) is None or current.status != "provisioning":
        assert time.monotonic() < deadline, current
        time.sleep(0.2)
    request_cancel(ledger, executions, run.run_id, "operator said stop")
    ended = follow(ledger, run.run_id, 120, executions)
    assert ended.status == "cancelled"
    assert ended.reason == f"cancelled by {getpass.getuser()} (local): operator said stop"  # who asked
    assert ended.nodes_at_end == 0 and stack.twin.node_names() == []
    with pytest.raises(RuntimeError, match="already ended"):
        request_cancel(ledger, executions, run.run_id, "again")
