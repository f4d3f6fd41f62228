"""The local stack refuses what Google would refuse: one grant removed from a copy of infra/ (or one verb
from a Role in a copy of k8s/) fails the run at the exact call, the missing permission named in the
run's reason or the stack's IAM log; and a grant beyond need shows up as unused.

Each case swaps the running stack's policy for the copy's (``Guard.policy``, read from the copy by the
same reader as infra/), or applies the copy's Role, and puts the deployment back after."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from stack_support import (
    assert_released,
    drop_lines,
    finish,
    infra_copy,
    new_dataset,
    remove_resource,
    unique_lines,
    wait_for_run,
)

from retrain import config
from retrain.adapters.ledger import FirestoreLedger
from retrain_local.iam import Decision
from retrain_local.identities import Deployed
from retrain_local.stack import LocalStack
from retrain_ops.manifests import K8S_DIR, documents
from retrain_tokenize import pipeline

pytestmark = [pytest.mark.e2e, pytest.mark.emulators, pytest.mark.envtest]

FUNCTIONS = "serviceAccount:retrain-functions@retrain-local.iam.gserviceaccount.com"
NOTIFIER = "serviceAccount:retrain-notifier@retrain-local.iam.gserviceaccount.com"


@contextlib.contextmanager
def deployed_from(stack: LocalStack, infra: Path) -> Iterator[None]:
    """The stack's IAM as the copy ``infra`` declares it, for the block."""
    assert stack.deployment is not None
    copy = dataclasses.replace(stack.deployment, infra=infra)
    policy, kept = Deployed.read(copy).policy, stack.guard.policy
    assert len(policy.bindings) < len(kept.bindings) or policy.bindings != kept.bindings
    stack.guard.policy = policy
    try:
        yield
    finally:
        stack.guard.policy = kept


def refusals(stack: LocalStack, member: str, since: int) -> list[Decision]:
    return [
        d
        for d in stack.guard.refused()[since:]
        if d.member == member or (member.endswith("/") and d.member.startswith(member))
    ]


def wait_for_refusal(
    stack: LocalStack, member: str, permission: str, since: int, timeout_s: float = 60
) -> Decision:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [d for d in refusals(stack, member, since) if d.permission == permission]
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"{member} was not refused {permission}: {refusals(stack, member, since)}")


# --- a grant removed: the run fails where Google would fail it -------------------------------------

OLD_RUNS_GRANT = """resource "google_storage_bucket_iam_member" "functions_runs" {
  bucket = google_storage_bucket.artifacts.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.functions.email}"
  condition {
    title      = "run-folders"
    expression = "resource.name.startsWith(\\"projects/_/buckets/${local.old_runs_prefix}\\")"
  }
}
locals {
  old_runs_prefix = "${google_storage_bucket.artifacts.name}/objects/runs/"
}"""


WORKFLOW = "serviceAccount:retrain-workflow@retrain-local.iam.gserviceaccount.com"
DATAFLOW = "serviceAccount:retrain-dataflow@retrain-local.iam.gserviceaccount.com"
#: Every run's pods: each run's own service account's principal begins so (a member ending in "/" matches
#: any principal it begins).
RUN_PODS = (
    "principal://iam.googleapis.com/projects/000000000000/locations/global/workloadIdentityPools/"
    f"retrain-local.svc.id.goog/subject/ns/{config.Settings().namespace}/sa/"
)


@dataclasses.dataclass(frozen=True)
class Removed:
    """One grant taken out of a copy of infra/, and where its absence must show."""

    label: str
    stage_file: str
    rtype: str
    name: str
    refused: tuple[str, str]
    """(member, permission) the stack's IAM log must show refused."""
    in_reason: str | None = None
    """What the run's reason must name (None: a pod's failure, which the JobSet's reason does not carry)."""
    replace_with: str = ""
    object_bytes: int = 0
    """The dropped object's least size: a shard over ``INLINE_SHARD_BYTES`` is the one whose ids go
    through temporary parts under shards/ (a small one's travel in the pipeline's elements)."""

    def lines(self) -> list[str]:
        """The dropped object's lines: unique, and together over ``object_bytes``."""
        lines = unique_lines()
        while sum(len(line) + 1 for line in lines) <= self.object_bytes:
            lines += [json.dumps({"text": " ".join(f"w{j % 997}" for j in range(2000))}), *unique_lines(1)]
        return lines


REMOVED = [
    # the grant of the first round: an object-name condition never grants listing the bucket, so the
    # results step (run_step, as the functions' account) cannot list runs/RUN/
    Removed(
        "run_step lists runs/ (the old conditioned grant)",
        "platform/iam.tf",
        "google_storage_managed_folder_iam_member",
        "functions_runs",
        (FUNCTIONS, "storage.objects.list"),
        "storage.objects.list",
        OLD_RUNS_GRANT,
    ),
    # the workflow launches the tokenize job as the Dataflow account only if it may act as it
    Removed(
        "workflow acts as the Dataflow account",
        "platform/iam.tf",
        "google_service_account_iam_member",
        "workflow_acts_as_dataflow",
        (WORKFLOW, "iam.serviceAccounts.actAs"),
        "Permission 'iam.serviceAccounts.actAs' denied on resource 'retrain-dataflow@",
    ),
    # the tokenize job (as the Dataflow account) deletes a large shard's parts under shards/ once written
    # (roles/dataflow.worker alone would let it create objects anywhere, but never delete one)
    Removed(
        "Dataflow job cleans up shards/",
        "platform/iam.tf",
        "google_storage_managed_folder_iam_member",
        "dataflow_shards_admin",
        (DATAFLOW, "storage.objects.delete"),
        object_bytes=pipeline.INLINE_SHARD_BYTES,
    ),
    # a run's pods (their own service account's principal) read the shards, the tokenizer and the
    # champion through their namespace's principal set: without it the FUSE mount lists nothing
    Removed(
        "trainer pods read through their namespace",
        "platform/iam.tf",
        "google_storage_bucket_iam_member",
        "training_artifacts_viewer",
        (RUN_PODS, "storage.objects.list"),
    ),
    # the workflow gives each run its own write grant (the managed folder runs/RUN/ and its policy):
    # without the role it may not, and the run fails before it tokenizes anything
    Removed(
        "workflow grants the run its folder",
        "platform/iam.tf",
        "google_storage_bucket_iam_member",
        "workflow_run_folders",
        (WORKFLOW, "storage.managedFolders.create"),
        "storage.managedFolders.create",
    ),
]


@pytest.mark.parametrize("removed", REMOVED, ids=[r.label for r in REMOVED])
def test_a_missing_grant_fails_the_run_at_the_call_that_needs_it(
    stack: LocalStack, tmp_path: Path, removed: Removed
) -> None:
    infra = infra_copy(tmp_path / "repo")
    remove_resource(infra, removed.stage_file, removed.rtype, removed.name, removed.replace_with)
    since = len(stack.guard.refused())
    with deployed_from(stack, infra):
        run = finish(stack, drop_lines(stack, tmp_path / "a.jsonl", removed.lines(), new_dataset()))
    assert_released(stack, run)
    wait_for_refusal(stack, *removed.refused, since, timeout_s=1)
    if removed.in_reason:
        assert run.reason and removed.in_reason in run.reason, run.reason


def test_the_functions_without_the_ledger_take_no_event_until_granted(
    stack: LocalStack, tmp_path: Path
) -> None:
    """on_object_finalized, refused Firestore, answers Eventarc with an error; Eventarc delivers again,
    and once the grant is back the object is recorded and the run starts."""
    infra = infra_copy(tmp_path / "repo")
    remove_resource(infra, "platform/iam.tf", "google_project_iam_member", "functions_datastore_user")
    dataset, since = new_dataset(), len(stack.guard.refused())
    with deployed_from(stack, infra):
        path = tmp_path / "a.jsonl"
        path.write_text("\n".join(unique_lines()) + "\n")
        from retrain_local.landing import drop

        dropped = drop(stack.settings, stack.endpoints.ingest_function, [path], dataset=dataset)
        assert dropped.queued == 2  # the object's event and the seal's: neither taken
        refused = wait_for_refusal(stack, FUNCTIONS, "datastore.entities.get", since)
        assert refused.resource.name == stack.settings.project
        assert [r for r in FirestoreLedger(stack.settings.project).list_runs() if r.dataset == dataset] == []
    run = finish(stack, wait_for_run(stack, dataset, timeout_s=120))  # Eventarc's redelivery, granted now
    assert run.status == "succeeded", run


def test_the_notifier_without_its_topic_publishes_nothing_until_granted(
    stack: LocalStack, tmp_path: Path
) -> None:
    """The notifier (a pod, as the notifier account through Workload Identity) is refused its topic: the
    completion waits, and is published once the grant is back."""
    infra = infra_copy(tmp_path / "repo")
    remove_resource(infra, "platform/iam.tf", "google_pubsub_topic_iam_member", "notifier_publisher")
    since = len(stack.guard.refused())
    with deployed_from(stack, infra):
        run = drop_lines(stack, tmp_path / "a.jsonl", unique_lines(), new_dataset())
        refused = wait_for_refusal(stack, NOTIFIER, "pubsub.topics.publish", since, timeout_s=180)
        assert refused.resource.name == stack.settings.jobset_topic
        assert FirestoreLedger(stack.settings.project).get_run(run.run_id).status.terminal is False  # type: ignore[union-attr]
    assert finish(stack, run).status == "succeeded"


# --- a verb removed from a Role: RBAC refuses the workflow's call -----------------------------------


def test_a_verb_missing_from_the_workflow_role_fails_the_run_with_rbac_s_refusal(
    stack: LocalStack, tmp_path: Path
) -> None:
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, k8s)
    role = (k8s / "workflow.yaml").read_text()
    rule = "resources: [jobsets]\n  verbs: [create, get, delete]"
    mutated = role.replace(rule, "resources: [jobsets]\n  verbs: [get, delete]")
    assert mutated != role, "k8s/workflow.yaml's jobsets rule changed: update this test"
    (k8s / "workflow.yaml").write_text(mutated)
    assert stack.deployment is not None
    values = stack.deployment.manifest_values()

    def apply_role(k8s_dir: Path) -> None:  # as `kubectl apply` replaces it
        (role,) = [
            d
            for d in documents(values, k8s_dir)
            if d["kind"] == "Role" and d["metadata"]["name"] == "retrain-workflow"
        ]
        rbac = client.RbacAuthorizationV1Api(stack.kube_api)
        rbac.replace_namespaced_role(role["metadata"]["name"], role["metadata"]["namespace"], role)  # type: ignore[arg-type]

    apply_role(k8s)
    try:
        run = finish(stack, drop_lines(stack, tmp_path / "a.jsonl", unique_lines(), new_dataset()))
    finally:
        apply_role(K8S_DIR)
    assert_released(stack, run)
    assert run.reason and 'cannot create resource "jobsets"' in run.reason, run.reason


# --- least privilege, measured ------------------------------------------------------------------


def test_a_grant_beyond_need_is_reported_unused(stack: LocalStack, tmp_path: Path) -> None:
    infra = infra_copy(tmp_path / "repo")
    extra = """
resource "google_storage_bucket_iam_member" "workflow_landing_admin" {
  bucket = google_storage_bucket.landing.name
  role   = "roles/storage.objectAdmin"
  member = "serviceAccount:${google_service_account.workflow.email}"
}
"""
    (infra / "platform" / "iam.tf").write_text((infra / "platform" / "iam.tf").read_text() + extra)
    with deployed_from(stack, infra):
        run = finish(stack, drop_lines(stack, tmp_path / "a.jsonl", unique_lines(), new_dataset()))
        report = stack.guard.least_privilege()
    assert run.status == "succeeded", run
    workflow = report["serviceAccount:retrain-workflow@retrain-local.iam.gserviceaccount.com"]
    unused = [g["binding"] for g in workflow["unused"]]
    assert unused == ["infra/platform: google_storage_bucket_iam_member.workflow_landing_admin"], workflow
    # and what it did use, each through the grant meant for it
    assert workflow["used"]["iam.serviceAccounts.actAs"] == [
        "infra/platform: google_service_account_iam_member.workflow_acts_as_dataflow"
    ]
    assert workflow["used"]["container.clusters.connect"] == [
        "infra/platform: google_project_iam_member.workflow_cluster_connect"
    ]
