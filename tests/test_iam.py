"""IAM as infra/ grants it, and the local fronts that enforce it (retrain_local.iam, .identities,
.storage_front, .firestore_front): the policy read from the Terraform, Google's rules for where a
permission is checked, and refusals shaped as the real APIs shape them, through the real emulators."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import requests
from google.api_core.exceptions import Forbidden, PermissionDenied

from retrain import config
from retrain.adapters import credentials, objects
from retrain.k8s.render import run_account_name, run_principal
from retrain.ports import ExecutionState
from retrain_local.firestore_front import FirestoreFront
from retrain_local.iam import Kind, Resource, condition_holds, predefined_roles, storage_object
from retrain_local.identities import OPERATOR, Deployed, Guard
from retrain_local.storage_front import StorageFront
from retrain_ops.deployment import Deployment

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
ARTIFACTS = "retrain-local-retrain-artifacts"
LANDING = "retrain-local-retrain-landing"
FUNCTIONS = "serviceAccount:retrain-functions@retrain-local.iam.gserviceaccount.com"
WORKFLOW = "serviceAccount:retrain-workflow@retrain-local.iam.gserviceaccount.com"
DATAFLOW = "serviceAccount:retrain-dataflow@retrain-local.iam.gserviceaccount.com"
NOTIFIER = "serviceAccount:retrain-notifier@retrain-local.iam.gserviceaccount.com"
NAMESPACE = config.Settings().namespace  # infra's k8s_namespace, as its bindings name it


def run_pods(run_id: str) -> str:
    """Who a run's pods are to Google: their own service account's principal."""
    return run_principal("000000000000", "retrain-local", NAMESPACE, run_account_name(run_id))


@pytest.fixture(scope="module")
def deployed() -> Deployed:
    return Deployed.read(Deployment())


@pytest.fixture
def guard(deployed: Deployed) -> Guard:
    return Guard(deployed)


# --- the policy, from infra/ --------------------------------------------------------------------


def test_every_role_infra_grants_is_in_the_vendored_dataset_or_is_infra_s_own(deployed: Deployed) -> None:
    granted = {b.role for b in deployed.policy.bindings}
    # and the roles of grants this project's variables leave out (a BigQuery table's viewer)
    named = {m for tf in INFRA.rglob("*.tf") for m in re.findall(r'"(roles/[\w.]+)"', tf.read_text())}
    assert named >= granted - set(deployed.policy.custom_roles)
    custom = set(deployed.policy.custom_roles)
    unknown = {r for r in granted | named if r not in predefined_roles() and r not in custom}
    assert not unknown, f"roles infra/ grants that retrain_local/iam_roles.json lacks: {sorted(unknown)}"
    data = json.loads((ROOT / "retrain_local/iam_roles.json").read_text())
    assert set(data["roles"]) == named, "the vendored roles are exactly those infra/ names"
    assert data["source"].startswith("https://github.com/iann0036/iam-dataset") and len(data["commit"]) == 40


def test_who_runs_what_is_read_from_the_terraform(deployed: Deployed) -> None:
    assert deployed.functions["run_step"].member == FUNCTIONS
    assert deployed.pushes["jobset-events"].name == "retrain-jobset-events-push"
    assert deployed.functions["run_step"].service == "retrain-run-step"
    assert deployed.functions["on_object_finalized"].trigger_member == (
        "serviceAccount:retrain-events@retrain-local.iam.gserviceaccount.com"
    )
    assert deployed.workflow == WORKFLOW
    assert deployed.policy.custom_roles["projects/retrain-local/roles/retrainClusterConnect"] == {
        "container.clusters.connect",
        "container.clusters.get",
    }


def test_a_condition_on_object_names_never_grants_listing_the_bucket() -> None:
    # "Since the storage.objects.list permission is granted at the bucket level, you cannot use the
    # resource.name condition attribute to restrict object listing access" (cloud.google.com/storage/docs/
    # access-control/iam): the bucket's name does not start with the object prefix.
    condition = f'resource.name.startsWith("projects/_/buckets/{ARTIFACTS}/objects/runs/")'
    assert condition_holds(condition, storage_object(ARTIFACTS, "runs/r1/manifest.json"))
    assert not condition_holds(condition, Resource(Kind.BUCKET, ARTIFACTS))
    assert condition_holds(
        f'resource.type == "storage.googleapis.com/Bucket" || {condition}', Resource(Kind.BUCKET, ARTIFACTS)
    )
    assert not condition_holds(f"!({condition})", storage_object(ARTIFACTS, "runs/x"))
    with pytest.raises(ValueError, match="not in the subset"):
        condition_holds('resource.service == "storage.googleapis.com"', Resource(Kind.BUCKET, ARTIFACTS))


def test_grants_reach_what_google_says_they_reach(guard: Guard) -> None:
    # a managed folder grant: the objects under its path, not the bucket's other objects
    assert guard.check(
        FUNCTIONS, "storage.objects.create", storage_object(ARTIFACTS, "runs/r1/manifest.json")
    ).allowed
    refused = guard.check(FUNCTIONS, "storage.objects.create", storage_object(ARTIFACTS, "shards/d/x.bin"))
    assert not refused.allowed
    assert refused.reason == (
        "retrain-functions@retrain-local.iam.gserviceaccount.com does not have storage.objects.create access "
        f"to projects/_/buckets/{ARTIFACTS}/objects/shards/d/x.bin"
    )
    # a bucket grant: every object of that bucket, no other bucket's
    assert guard.check(FUNCTIONS, "storage.objects.get", storage_object(LANDING, "d/a.txt")).allowed
    assert not guard.check(FUNCTIONS, "storage.objects.delete", storage_object(LANDING, "d/a.txt")).allowed
    # a service account grant: that account only
    acts_as = guard.check(
        WORKFLOW, "iam.serviceAccounts.actAs", Resource(Kind.SERVICE_ACCOUNT, DATAFLOW[15:])
    )
    assert acts_as.allowed and acts_as.by is not None
    assert acts_as.by.address == "infra/platform: google_service_account_iam_member.workflow_acts_as_dataflow"
    assert not guard.check(
        WORKFLOW, "iam.serviceAccounts.actAs", Resource(Kind.SERVICE_ACCOUNT, NOTIFIER[15:])
    ).allowed
    # the operator owns the project
    assert guard.check(OPERATOR, "storage.buckets.delete", Resource(Kind.BUCKET, LANDING)).allowed
    assert [d.permission for d in guard.refused()] == [
        "storage.objects.create",
        "storage.objects.delete",
        "iam.serviceAccounts.actAs",
    ]


def test_workload_identity_maps_a_pod_to_its_google_account_only_with_the_binding(guard: Guard) -> None:
    annotated = {"iam.gke.io/gcp-service-account": NOTIFIER.removeprefix("serviceAccount:")}
    ns = NAMESPACE
    assert guard.workload_member(ns, "jobset-notifier", annotated) == NOTIFIER
    # the same annotation on a KSA the binding does not name, or in another namespace: the pod keeps
    # its own principal ("principal://.../subject/ns/NAMESPACE/sa/KSA")
    pool = "principal://iam.googleapis.com/projects/000000000000/locations/global/workloadIdentityPools"
    assert guard.workload_member(ns, "intruder", annotated) == (
        f"{pool}/retrain-local.svc.id.goog/subject/ns/{ns}/sa/intruder"
    )
    assert guard.workload_member("default", "jobset-notifier", annotated) == (
        f"{pool}/retrain-local.svc.id.goog/subject/ns/default/sa/jobset-notifier"
    )
    assert guard.refused()[-1].permission == "iam.serviceAccounts.getAccessToken"


def test_a_run_s_pods_read_the_artifacts_through_their_namespace_and_write_nowhere(guard: Guard) -> None:
    # "All GKE Pods in a Kubernetes namespace" (principalSet://.../namespace/NAMESPACE): a run's pods
    # read shards, tokenizer files and the champion; a pod of another namespace reads nothing
    pods = run_pods("books-1")
    assert guard.check(pods, "storage.objects.get", storage_object(ARTIFACTS, "shards/d/x.bin")).allowed
    assert guard.check(pods, "storage.objects.list", Resource(Kind.BUCKET, ARTIFACTS)).allowed
    elsewhere = guard.workload_member("default", run_account_name("books-1"), {})
    assert not guard.check(elsewhere, "storage.objects.get", storage_object(ARTIFACTS, "shards/d/x")).allowed
    # the same namespace and account in another project (its number) is nobody this project knows
    stranger = run_principal("111111111111", "retrain-local", NAMESPACE, run_account_name("books-1"))
    assert not guard.check(stranger, "storage.objects.get", storage_object(ARTIFACTS, "shards/d/x")).allowed
    # no grant of infra/ lets them write: their run's own folder grant is the workflow's to set
    for name in ("runs/books-1/ckpt", "runs/other/ckpt", "shards/d/x.bin"):
        assert not guard.check(pods, "storage.objects.create", storage_object(ARTIFACTS, name)).allowed


def test_enforcement_off_refuses_nothing_but_still_logs_what_google_would_refuse(deployed: Deployed) -> None:
    lax = Guard(deployed, enforce=False)
    assert lax.check(FUNCTIONS, "storage.objects.delete", storage_object(LANDING, "d/a.txt")).allowed
    assert [d.permission for d in lax.refused(FUNCTIONS)] == ["storage.objects.delete"]
    assert config.load({"RETRAIN_LOCAL_IAM": "off"}).local_iam is False  # as docs/local-stack.md spells it
    assert config.load({}).local_iam is True
    with pytest.raises(ValueError, match="RETRAIN_LOCAL_IAM"):
        config.load({"RETRAIN_LOCAL_IAM": "maybe"})


# --- Cloud Storage's front ----------------------------------------------------------------------


@pytest.fixture
def storage_front(gcs_host: str, guard: Guard) -> Iterator[StorageFront]:
    client = objects.storage_client()
    for name in (ARTIFACTS, LANDING):
        if client.lookup_bucket(name) is None:
            client.create_bucket(name)
    front = StorageFront(gcs_host, guard).start()
    old = os.environ["STORAGE_EMULATOR_HOST"]
    os.environ["STORAGE_EMULATOR_HOST"] = front.url
    try:
        yield front
    finally:
        os.environ["STORAGE_EMULATOR_HOST"] = old
        front.stop()


@pytest.mark.integration
def test_storage_calls_are_checked_as_the_json_api_checks_them(
    storage_front: StorageFront, guard: Guard
) -> None:
    run = f"gs://{ARTIFACTS}/runs/iam-{os.getpid()}"
    with credentials.acting_as(guard.token(OPERATOR)):
        objects.write_bytes(f"{run}/checkpoint.txt", b"weights")
    with credentials.acting_as(guard.token(NOTIFIER)), pytest.raises(Forbidden) as refused:
        objects.write_bytes(f"gs://{ARTIFACTS}/shards/d/x.bin", b"no")
    assert "storage.objects.create" in str(refused.value) and "shards/d/x.bin" in str(refused.value)
    with credentials.acting_as(guard.token(FUNCTIONS)):
        # the results step's listing: allowed by the grant on the runs/ managed folder
        assert [o.uri for o in objects.list_objects(run + "/")] == [f"{run}/checkpoint.txt"]
        assert objects.read_bytes(f"{run}/checkpoint.txt") == b"weights"
        # overwriting needs storage.objects.delete too: objectUser on runs/ has it
        objects.write_bytes(f"{run}/checkpoint.txt", b"weights v2")
        # the shard cache: read (handover reads the packs' member lists), never written
        list(objects.list_objects(f"gs://{ARTIFACTS}/shards/"))
        with pytest.raises(Forbidden) as written:
            objects.write_bytes(f"gs://{ARTIFACTS}/shards/d/x_pack.json", b"{}")
        with pytest.raises(Forbidden) as listing:
            list(objects.list_objects(f"gs://{ARTIFACTS}/dataflow/"))
    assert "storage.objects.create" in str(written.value)
    assert "storage.objects.list" in str(listing.value)
    # overwriting an object needs storage.objects.delete too ("only required if the request causes an
    # object with the same name to be overwritten"): roles/dataflow.worker, on the project, grants
    # storage.objects.create on every bucket, but no delete
    landed = f"gs://{LANDING}/d/a-{os.getpid()}.txt"
    with credentials.acting_as(guard.token(OPERATOR)):
        objects.write_bytes(landed, b"data")
    with credentials.acting_as(guard.token(DATAFLOW)), pytest.raises(Forbidden) as overwrite:
        objects.write_bytes(landed, b"never")
    assert "does not have storage.objects.delete access" in str(overwrite.value)
    # a token no identity holds is no identity: 401, as Google answers an invalid credential
    forged = requests.get(
        f"{storage_front.url}/storage/v1/b/{ARTIFACTS}/o",
        headers={"Authorization": "Bearer ya29.local.forged"},
    )
    assert forged.status_code == 401 and forged.json()["error"]["errors"][0]["reason"] == "required"


@pytest.mark.integration
def test_the_conditioned_grant_of_old_fails_the_results_listing(
    storage_front: StorageFront, guard: Guard
) -> None:
    """The grant infra/ had before the managed folder: objectUser on the bucket, conditioned on runs/."""
    from retrain_local.iam import Binding

    folder = next(
        b for b in guard.policy.bindings if b.address.endswith("managed_folder_iam_member.functions_runs")
    )
    guard.policy.bindings.remove(folder)
    guard.policy.bindings.append(
        Binding(
            FUNCTIONS,
            "roles/storage.objectUser",
            Resource(Kind.BUCKET, ARTIFACTS),
            f'resource.name.startsWith("projects/_/buckets/{ARTIFACTS}/objects/runs/")',
            "the old conditioned grant",
        )
    )
    run = f"gs://{ARTIFACTS}/runs/old-grant-{os.getpid()}"
    with credentials.acting_as(guard.token(FUNCTIONS)):
        objects.write_bytes(f"{run}/manifest.json", b"{}")  # object-level calls: the condition holds
        with pytest.raises(Forbidden) as refused:
            list(objects.list_objects(run + "/"))
    assert "does not have storage.objects.list access to the Google Cloud Storage bucket" in str(
        refused.value
    )


# --- Firestore's front ---------------------------------------------------------------------------


@pytest.mark.emulators
def test_firestore_calls_are_checked_per_identity_endpoint(firestore_host: str, guard: Guard) -> None:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import firestore  # type: ignore[attr-defined]

    front = FirestoreFront(firestore_host, guard, "retrain-local")
    old = os.environ["FIRESTORE_EMULATOR_HOST"]
    try:
        os.environ["FIRESTORE_EMULATOR_HOST"] = front.endpoint(FUNCTIONS)
        db = firestore.Client(project="retrain-local", credentials=AnonymousCredentials())
        doc = db.collection("iam-test").document(f"d{os.getpid()}")
        doc.set({"n": 1})
        assert doc.get().to_dict() == {"n": 1}
        assert [d.id for d in db.collection("iam-test").stream()] == [doc.id]
        assert {p for (m, p, _) in guard.used if m == FUNCTIONS} == {
            "datastore.entities.create",
            "datastore.entities.update",
            "datastore.entities.get",
            "datastore.entities.list",
        }
        os.environ["FIRESTORE_EMULATOR_HOST"] = front.endpoint(DATAFLOW)  # infra/ grants it no Firestore role
        db = firestore.Client(project="retrain-local", credentials=AnonymousCredentials())
        with pytest.raises(PermissionDenied) as refused:
            db.collection("iam-test").document(doc.id).get()
        assert "Missing or insufficient permissions." in str(refused.value)
        assert (
            "retrain-dataflow@retrain-local.iam.gserviceaccount.com does not have datastore.entities.get"
            in str(refused.value)
        )
    finally:
        os.environ["FIRESTORE_EMULATOR_HOST"] = old
        front.stop()
    assert grpc  # the front relays raw gRPC


# --- the GKE API -----------------------------------------------------------------------------------


def test_the_gke_api_describes_the_cluster_only_to_who_may_get_it(
    guard: Guard, monkeypatch: pytest.MonkeyPatch
) -> None:
    from retrain.adapters.cluster import CONTAINER_ENDPOINT_VAR, GkeCluster
    from retrain_local.gke_api import GkeApiServer, declared_cluster
    from retrain_ops.deployment import local_settings

    project = Resource(Kind.PROJECT, "retrain-local")
    cluster = declared_cluster(Deployment(), "127.0.0.1:1", "-----BEGIN CERTIFICATE-----")

    def authorize(token: str | None, permission: str) -> str | None:
        return guard.authorize(token, permission, project)

    server = GkeApiServer("retrain-local", cluster, authorize=authorize).start()
    monkeypatch.setenv(CONTAINER_ENDPOINT_VAR, server.base_url)
    try:
        with credentials.acting_as(guard.token(FUNCTIONS)):  # the reaper's: infra's custom role
            assert GkeCluster(local_settings({})).describe().host == "https://127.0.0.1:1"
        with credentials.acting_as(guard.token(DATAFLOW)), pytest.raises(Forbidden) as refused:
            GkeCluster(local_settings({})).describe()
    finally:
        server.stop()
    assert "Permission 'container.clusters.get' denied on resource 'retrain-local'" in str(refused.value)
    assert "retrain-dataflow@" in str(refused.value)


# --- the executions service ----------------------------------------------------------------------


def test_the_executions_service_serves_only_who_may_run_the_workflow(
    guard: Guard, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cloudworkflows import ExecutionsServer
    from retrain.adapters.workflows import WorkflowsExecutions

    server = ExecutionsServer.holding()
    server.authorize = lambda token, permission, name: guard.authorize(
        token, permission, Resource(Kind.WORKFLOW, name)
    )
    with server:
        monkeypatch.setenv("RETRAIN_WORKFLOWS_ENDPOINT", server.base_url)
        monkeypatch.setenv("RETRAIN_WORKFLOWS_GRPC_ENDPOINT", server.grpc_target)
        with credentials.acting_as(guard.token(FUNCTIONS)):  # roles/workflows.invoker on the project
            executions = WorkflowsExecutions("retrain-local", "us-central1", "retrain")
            name = executions.start({"run_id": "r"})
            assert executions.get(name).state == ExecutionState.ACTIVE
            executions.cancel(name)
        with credentials.acting_as(guard.token(DATAFLOW)), pytest.raises(PermissionDenied) as refused:
            WorkflowsExecutions("retrain-local", "us-central1", "retrain").start({"run_id": "r"})
    assert "Permission 'workflows.executions.create' denied on resource" in str(refused.value)
    assert "projects/retrain-local/locations/us-central1/workflows/retrain" in str(refused.value)
    assert [p for (m, p, _) in guard.used if m == FUNCTIONS] == [
        "workflows.executions.create",
        "workflows.executions.get",
        "workflows.executions.cancel",
    ]


# --- Cloud Run's invoker check ----------------------------------------------------------------------


def test_a_function_serves_only_its_invokers_eventarc_and_its_push_subscription(
    deployed: Deployed, guard: Guard
) -> None:
    from http.server import BaseHTTPRequestHandler

    from retrain_local.http import LoopbackServer
    from retrain_local.invoker_front import InvokerFront

    class Echo(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    function = LoopbackServer(Echo)
    threading.Thread(target=function.serve_forever, daemon=True).start()
    upstream = f"http://127.0.0.1:{function.server_port}"
    step, ingest = deployed.functions["run_step"], deployed.functions["on_object_finalized"]
    fronts = [
        InvokerFront(upstream, step.service, guard).start(),
        InvokerFront(
            upstream,
            ingest.service,
            guard,
            trigger_member=ingest.trigger_member,
            storage_agent=deployed.storage_agent,
        ).start(),
    ]
    try:
        as_workflow = {"Authorization": f"Bearer {guard.token(WORKFLOW)}"}
        assert requests.post(fronts[0].url, json={}, headers=as_workflow).status_code == 204
        as_dataflow = {"Authorization": f"Bearer {guard.token(DATAFLOW)}"}
        refused = requests.post(fronts[0].url, json={}, headers=as_dataflow)
        assert (
            refused.status_code == 403
            and "does not have run.routes.invoke access to retrain-run-step" in refused.text
        )
        assert requests.post(fronts[0].url, json={}).status_code == 403  # no token, no identity
        assert requests.post(fronts[1].url + "/_eventarc", json={}).status_code == 204
        assert (
            requests.post(fronts[0].url + "/_eventarc", json={}).status_code == 403
        )  # run_step has no trigger
    finally:
        for front in fronts:
            front.stop()
        function.shutdown()
    events = "serviceAccount:retrain-events@retrain-local.iam.gserviceaccount.com"
    assert {(m, p) for (m, p, _) in guard.used if m in (events, deployed.storage_agent)} == {
        (deployed.storage_agent, "pubsub.topics.publish"),
        (events, "eventarc.events.receiveEvent"),
        (events, "run.routes.invoke"),
    }


@pytest.mark.integration
def test_managed_folders_are_held_as_cloud_storage_holds_them(
    storage_front: StorageFront, guard: Guard
) -> None:
    """The front's managed folders (the emulator has none): created once, a policy set whole (a stale
    etag refused), a non-empty folder deleted only with allowNonEmpty (which needs setIamPolicy too),
    its grant gone with it; each call checked against infra/'s IAM."""
    folders = f"{storage_front.url}/storage/v1/b/{ARTIFACTS}/managedFolders"
    name = f"runs/mf-{os.getpid()}/"
    one = f"{folders}/{requests.utils.quote(name, safe='')}"

    def as_(member: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {guard.token(member)}"}

    refused = requests.post(folders, json={"name": name}, headers=as_(NOTIFIER), timeout=30)
    assert refused.status_code == 403 and "storage.managedFolders.create" in refused.text
    # objectUser on runs/ (the functions) may create a folder in it, never set its policy
    assert (
        requests.put(one + "/iam", json={"bindings": []}, headers=as_(FUNCTIONS), timeout=30).status_code
        == 403
    )
    made = requests.post(folders, json={"name": name}, headers=as_(WORKFLOW), timeout=30)
    assert made.status_code == 200 and made.json()["name"] == name
    assert requests.post(folders, json={"name": name}, headers=as_(WORKFLOW), timeout=30).status_code == 409
    # the workflow's role holds create, setIamPolicy and delete, never get or getIamPolicy
    assert requests.get(one + "/iam", headers=as_(WORKFLOW), timeout=30).status_code == 403
    pods = run_pods(f"mf-{os.getpid()}")
    policy = {"bindings": [{"role": "roles/storage.objectAdmin", "members": [pods]}]}
    stale = requests.put(one + "/iam", json={**policy, "etag": "BwX"}, headers=as_(WORKFLOW), timeout=30)
    assert stale.status_code == 412 and "conditionNotMet" in stale.text
    assert requests.put(one + "/iam", json=policy, headers=as_(WORKFLOW), timeout=30).status_code == 200
    read = requests.get(one + "/iam", headers=as_(OPERATOR), timeout=30).json()
    assert read["bindings"] == policy["bindings"] and read["etag"] != "CAE="
    with credentials.acting_as(guard.token(pods)):
        objects.write_bytes(f"gs://{ARTIFACTS}/{name}ckpt", b"w")
    not_empty = requests.delete(one, headers=as_(WORKFLOW), timeout=30)
    assert not_empty.status_code == 409 and "not empty" in not_empty.text
    gone = requests.delete(one, params={"allowNonEmpty": "true"}, headers=as_(WORKFLOW), timeout=30)
    assert gone.status_code == 204
    assert requests.get(one, headers=as_(OPERATOR), timeout=30).status_code == 404
    with credentials.acting_as(guard.token(pods)), pytest.raises(Forbidden):
        objects.write_bytes(f"gs://{ARTIFACTS}/{name}ckpt2", b"w")
    with credentials.acting_as(guard.token(OPERATOR)):
        assert objects.read_bytes(f"gs://{ARTIFACTS}/{name}ckpt") == b"w"  # the folder went, not its objects
