"""The retrain workflow's failure paths, through the whole local stack: whatever step fails, the run
ends with a reason, no JobSet, no ProvisioningRequest and zero GPU nodes."""

from __future__ import annotations

import getpass
import json
import re
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import requests
from stack_support import (
    assert_released,
    drop_lines,
    finish,
    new_dataset,
    replace_under_its_name,
    run_with,
    unique_lines,
    wait_for_run,
    wait_for_status,
)

from retrain.adapters.events import read_events
from retrain.adapters.ledger import FirestoreLedger
from retrain.adapters.workflows import WorkflowsExecutions
from retrain.caller import forwarded_id_token
from retrain.cancel import request_cancel
from retrain.contracts import RunEventType
from retrain.domain.errors import Rejected
from retrain.domain.runs import EVAL_SET, FailureKind
from retrain_local.cluster import Faults
from retrain_local.iam import Binding, Kind, Resource
from retrain_local.landing import drop
from retrain_local.stack import LocalStack
from retrain_ops.cli import format_run, operator_identity

pytestmark = [pytest.mark.e2e, pytest.mark.emulators, pytest.mark.envtest]


def test_tokenization_without_tokens_fails_before_any_capacity(stack: LocalStack, tmp_path: Path) -> None:
    run = run_with(
        stack, tmp_path, Faults(), lines=["{not json", json.dumps({"text": ""}), json.dumps({"x": 1})]
    )
    assert_released(stack, run)
    assert run.reason == "tokenization produced no tokens" and run.quarantined == 3
    assert run.failure == FailureKind.TOKENIZE_FAILED
    assert run.quarantine_reasons == {"empty_text": 1, "invalid_json": 1, "missing_key": 1}
    assert "by reason       empty_text 1, invalid_json 1, missing_key 1" in format_run(run)  # `status`
    assert run.gpu_node_seconds == 0


def test_dws_failure(stack: LocalStack, tmp_path: Path) -> None:
    """Capacity refused after tokenizing: the run ends failed with the reason and zero nodes, and a
    subscriber of the run events topic (``retrain events``, what the demo prints) is told its whole life
    and its failure's kind (this was tests/test_e2e.py's failed demo, which booted a stack of its own)."""
    since = datetime.now(UTC)
    run = run_with(stack, tmp_path, Faults(provisioning="fail"))
    assert_released(stack, run)
    assert run.reason and "DWS did not provide capacity (Failed)" in run.reason
    assert run.failure == FailureKind.CAPACITY_ERROR
    assert run.tokens > 0 and run.gpu_node_seconds == 0
    told = []
    deadline = time.monotonic() + 60
    for event in read_events(
        stack.settings.events_topic, since, True, stopped=lambda: time.monotonic() > deadline
    ):
        if event.run_id == run.run_id:
            told.append(event)
        if told and told[-1].type == RunEventType.FAILED:  # published just after the run is recorded
            break
    assert [str(e.type) for e in told] == ["queued", "tokenizing", "provisioning", "releasing", "failed"]
    assert told[-1].failure == FailureKind.CAPACITY_ERROR and told[-1].reason == run.reason, told[-1]


def test_dws_never_provisions(stack: LocalStack, tmp_path: Path) -> None:
    """A request left Accepted for good (its node pool removed under it: kubernetes/autoscaler#9490): the
    run asks again every provision_reask_s (3 s here), then gives up at its provision timeout."""
    run = run_with(stack, tmp_path, Faults(provisioning="never"))
    assert_released(stack, run)
    assert run.reason and run.reason.startswith("DWS did not provision 1 node(s) within 8 s (")
    assert run.failure == FailureKind.CAPACITY_TIMEOUT
    asked = re.search(r"\((\d+) request\(s\)\)$", run.reason)
    assert asked and int(asked.group(1)) >= 2, run.reason  # asked again at least once


def test_a_request_left_accepted_is_asked_again_and_served(stack: LocalStack, tmp_path: Path) -> None:
    """kubernetes-sigs/kueue#3245: a request Accepted but never provisioned, while a new one is served at
    once. Without asking again the run would time out at 8 s; it trains."""
    run = run_with(stack, tmp_path, Faults(provisioning="stuck_once"))
    assert_released(stack, run, "succeeded")
    assert run.checkpoint


def test_capacity_revoked_in_training_ends_the_run_truthfully(stack: LocalStack, tmp_path: Path) -> None:
    run = run_with(stack, tmp_path, Faults(revoke_capacity_after_s=2, hold_training_s=60))
    assert_released(stack, run)
    assert run.reason and run.reason.startswith("DWS took the capacity back (CapacityRevoked)"), run.reason
    assert run.failure == FailureKind.CAPACITY_ERROR
    assert run.content_returned


def test_a_booking_whose_pods_never_start_expires_and_ends_the_run(stack: LocalStack, tmp_path: Path) -> None:
    """GKE gives the pods 10 minutes (10 s here) to consume provisioned nodes, then takes them back."""
    run = run_with(stack, tmp_path, Faults(unschedulable=True))
    assert_released(stack, run)
    assert run.reason and run.reason.startswith("DWS took the capacity back (BookingExpired)"), run.reason
    assert run.failure == FailureKind.CAPACITY_ERROR


def test_training_fails_after_its_restarts(stack: LocalStack, tmp_path: Path) -> None:
    run = run_with(stack, tmp_path, Faults(crash_pods_always=True))
    assert_released(stack, run)
    assert run.reason and run.reason.startswith("training failed")
    assert run.failure == FailureKind.TRAINING_FAILED
    assert run.gpu_node_seconds > 0 and run.tokens > 0


def test_a_jobset_of_the_runs_name_that_is_not_its_own_is_never_adopted(
    stack: LocalStack, tmp_path: Path
) -> None:
    """A create that meets 409 adopts what is there only when it is this run's (a retried create after a
    lost response): one of the run's name carrying another run id (left behind, or planted to have its
    completion taken as ours) ends the run with the reason, and every GPU goes back."""
    from kubernetes import client

    from retrain.k8s.render import jobset_name, render_jobset
    from retrain.trainers import Command

    stack.twin.faults = Faults(provisioning="never")  # held in provisioning until the JobSet is planted
    stack.paused_jobs.add("reaper")  # which deletes what no live run owns: the planted JobSet too
    try:
        run = drop_lines(
            stack, tmp_path / "planted.jsonl", [json.dumps({"text": str(uuid.uuid4())})], "planted"
        )
        wait_for_status(stack, run, "provisioning", 60)
        ns = stack.settings.namespace
        planted = render_jobset(
            "someone-else", nodes=1, image="local", command=Command(["true"], []), namespace=ns
        )
        planted["metadata"]["name"] = jobset_name(run.run_id)
        planted["spec"]["suspend"] = True
        objects = client.CustomObjectsApi(stack.kube_api)
        jobsets = ("jobset.x-k8s.io", "v1alpha2", ns, "jobsets")
        objects.create_namespaced_custom_object(*jobsets, planted)
        stack.twin.faults = Faults()  # the next request is served
        ended = finish(stack, run, 120)
        # the release deleted only what was the run's: the planted JobSet is left ...
        kept = objects.get_namespaced_custom_object(*jobsets, jobset_name(run.run_id))
        assert kept["metadata"]["annotations"]["retrain.dev/run-id"] == "someone-else", kept["metadata"]
    finally:
        stack.paused_jobs.discard("reaper")
    # ... to the reaper, which deletes what no live run owns (it ticks every 15 s here)
    deadline = time.monotonic() + 90
    while [j["metadata"]["name"] for j in objects.list_namespaced_custom_object(*jobsets)["items"]]:
        assert time.monotonic() < deadline, "the reaper left the planted JobSet"
        time.sleep(1)
    assert_released(stack, ended)
    refusal = f"JobSet {jobset_name(run.run_id)} exists and is not this run's (its run id: someone-else)"
    assert ended.reason and f"{refusal}: not adopted" in ended.reason, ended.reason
    assert ended.failure == FailureKind.STEP_FAILED


@pytest.mark.parametrize("stage", ["provisioning", "training"])
def test_a_capacity_request_made_again_by_someone_else_is_not_the_runs(
    stack: LocalStack, tmp_path: Path, stage: str
) -> None:
    """The provisioning wait, and the training wait's look at the capacity under its JobSet, read the
    run's ProvisioningRequest by name and confirm it by the uid its create answered: one deleted and
    made again under the name, label and all, is not the request this run asked with, and neither its
    Provisioned nor its conditions are this run's capacity; the run fails saying so."""
    from retrain.k8s.render import provisioning_request_name

    # provisioning: the run's request stays Accepted; training: the JobSet trains on for a while
    stack.twin.faults = (
        Faults(provisioning="never") if stage == "provisioning" else Faults(hold_training_s=120)
    )
    lines = [json.dumps({"text": f"a run whose request is replaced {uuid.uuid4()}"})]
    # a dataset of its own: the other stage's run, in a dataset of the same name, would be taken for it
    run = drop_lines(stack, tmp_path / "replaced.jsonl", lines, new_dataset())
    wait_for_status(stack, run, stage, 90)
    name = provisioning_request_name(run.run_id)
    group = ("autoscaling.x-k8s.io", "v1", stack.settings.namespace, "provisioningrequests")
    replace_under_its_name(stack, group, name)
    ended = finish(stack, run, 120)
    assert_released(stack, ended)
    assert ended.failure == FailureKind.CAPACITY_ERROR, ended
    assert ended.reason and f"capacity request {name} is no longer the one this run made" in ended.reason


def test_a_dataset_s_second_run_is_judged_on_its_held_out_eval_set(stack: LocalStack, tmp_path: Path) -> None:
    """The eval gate always has held-out data: a dataset's first run carves its eval set out of its own
    objects (never trained on), validates on it and becomes the champion with that loss; the next run
    is compared with the champion on that same eval set, not on data of its own choosing."""
    stack.twin.faults = Faults()
    dataset = new_dataset()
    books = []
    for i in range(4):  # retrain.plan.HOLD_OUT_MIN_OBJECTS: one of them is held out
        books.append(tmp_path / f"book{i}.jsonl")
        books[-1].write_text("\n".join(unique_lines(12)) + "\n")
    drop(stack.settings, stack.endpoints.ingest_function, books, dataset=dataset)
    first = finish(stack, wait_for_run(stack, dataset))
    assert first.status == "succeeded" and first.eval_set and first.eval is not None, first
    assert first.eval.promoted and first.eval.val_loss is not None and first.eval.val_loss > 0, first.eval
    second = finish(stack, drop_lines(stack, tmp_path / "more.jsonl", unique_lines(12), dataset, after=first))
    assert second.status == "succeeded" and second.base_checkpoint == first.checkpoint, second
    assert second.eval_set == first.eval_set and second.eval is not None, second
    assert second.eval.compared_on == EVAL_SET, second.eval
    assert second.eval.champion_run == first.run_id and second.eval.champion_val_loss is not None
    assert second.eval.val_loss is not None and second.eval.val_loss > 0, second.eval


def test_success_on_the_same_stack(stack: LocalStack, tmp_path: Path) -> None:
    run = run_with(stack, tmp_path, Faults())
    assert run.status == "succeeded" and run.nodes_at_end == 0 and run.reason is None and run.failure is None


def test_cancel_while_waiting_for_capacity(stack: LocalStack, tmp_path: Path) -> None:
    stack.twin.faults = Faults(provisioning="never")
    s = stack.settings
    ledger = FirestoreLedger(s.project)
    executions = WorkflowsExecutions(s.project, s.region, s.workflow)
    lines = [json.dumps({"text": f"a run to cancel {uuid.uuid4()}"})]
    run = drop_lines(stack, tmp_path / "cancel.jsonl", lines, "cancelme")
    wait_for_status(stack, run, "provisioning", 60)
    request_cancel(ledger, executions, run.run_id, "operator said stop", requested_by=operator_identity())
    ended = finish(stack, run, 120)
    assert_released(stack, ended, "cancelled")
    assert ended.reason == f"cancelled by {getpass.getuser()} (local): operator said stop"  # who asked
    assert ended.failure == FailureKind.CANCELLED
    with pytest.raises(Rejected, match="already ended"):
        request_cancel(ledger, executions, run.run_id, "again", requested_by=operator_identity())


def test_an_operator_who_may_only_invoke_run_http_cancels_a_run_in_their_own_name(
    stack: LocalStack, tmp_path: Path
) -> None:
    """The least operator: ``run.invoker`` on ``run_http`` (infra's ``var.run_http_invokers``), nothing
    else. Their cancel is recorded under the name Cloud Run verified, never one the body claims, and
    the run stops and releases every GPU; the ledger and the run's callback stay out of their reach."""
    oncall = "user:oncall@retrain_local"
    service = stack.guard.deployed.functions["run_http"].service
    invoker = Binding(
        oncall, "roles/run.invoker", Resource(Kind.SERVICE, service), None, "test: var.run_http_invokers"
    )
    stack.guard.policy.bindings = [*stack.guard.policy.bindings, invoker]
    url, headers = stack.endpoints.manual_function, {"Authorization": f"Bearer {stack.guard.token(oncall)}"}
    try:
        stack.twin.faults = Faults(provisioning="never")
        lines = [json.dumps({"text": f"a run the on-call stops {uuid.uuid4()}"})]
        run = drop_lines(stack, tmp_path / "oncall.jsonl", lines, "oncall")
        wait_for_status(stack, run, "provisioning", 60)
        assert requests.post(url, json={"cancel": run.run_id}, timeout=30).status_code == 403  # no token
        assert requests.post(url, json={"cancel": "../runs"}, headers=headers, timeout=30).status_code == 400
        body = {"cancel": run.run_id, "reason": "paged: bad data", "requested_by": "the-ceo"}
        # Cloud Run checks X-Serverless-Authorization when it is there and hands Authorization on as sent:
        # an ID token the caller wrote there themselves names nobody
        claims = {"iss": "https://accounts.google.com", "email": "ceo@retrain_local", "email_verified": True}
        checked = {
            "X-Serverless-Authorization": headers["Authorization"],
            "Authorization": f"Bearer {forwarded_id_token({**claims, 'exp': time.time() + 600})}",
        }
        answer = requests.post(url, json=body, headers=checked, timeout=120)
        assert answer.status_code == 200, answer.text
        assert (
            answer.json()["outcome"] == "requested"
            and answer.json()["requested_by"] == "oncall@retrain_local"
        )
        ended = finish(stack, run, 120)
        assert_released(stack, ended, "cancelled")
        assert ended.reason == "cancelled by oncall@retrain_local: paged: bad data", ended.reason
        assert ended.failure == FailureKind.CANCELLED
        again = requests.post(url, json=body, headers=headers, timeout=60)
        assert again.status_code == 409 and "already ended" in again.json()["error"]
        project = Resource(Kind.PROJECT, stack.settings.project)
        for permission in (
            "datastore.entities.update",
            "workflows.callbacks.send",
            "workflows.executions.create",
        ):
            assert not stack.guard.check(oncall, permission, project).allowed, permission
    finally:
        stack.guard.policy.bindings = [b for b in stack.guard.policy.bindings if b is not invoker]


def test_the_doctor_checks_the_local_stack_as_it_would_a_project(stack: LocalStack) -> None:
    """The same checks through the stack's GKE API front: the bootstrap's APIs, GPU quota for the DWS
    pool, the version infra/platform asks for, the flex-start pool, the template spec by digest."""
    from retrain.adapters import objects
    from retrain.adapters.cluster import GkeCluster, cluster_manager
    from retrain_ops.deployment import Deployment
    from retrain_ops.doctor import RestProjectApis, Verdict, examine

    s = stack.settings
    found = examine(
        s,
        RestProjectApis.from_environment(),
        cluster_manager().get_cluster(name=GkeCluster(s).name),
        objects.read_bytes,
        Deployment(project=s.project).enabled_services(),
    )
    assert {f.check: f.verdict for f in found} == {
        "apis": Verdict.PASS,
        "gpu-quota": Verdict.PASS,
        "active-resize-requests": Verdict.UNKNOWN,
        "gke-version": Verdict.PASS,
        "dws-pool": Verdict.PASS,
        "template": Verdict.PASS,
    }, found
