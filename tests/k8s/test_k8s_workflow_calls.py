"""The workflow's Kubernetes helpers (workflows/retrain.yaml's kube_create and kube_delete) in retrain's
interpreter, against the real API server through the gke.request binding: a create retried after a lost
response finds its object (409 AlreadyExists) and counts as created; a delete of what is gone is fine; a
delete leaves what is not the run's, and deletes what is only at the uid it read."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from cloudworkflows import ConnectorRegistry, WorkflowError, load_workflow
from retrain_local.connectors import KubeEndpoint, gke_request_binding
from retrain_local.envtest import ControlPlane

pytestmark = pytest.mark.envtest
WORKFLOW = Path(__file__).resolve().parents[2] / "workflows" / "retrain.yaml"


def podtemplate(name: str, run_id: str | None = None) -> dict[str, Any]:
    """A PodTemplate to create and delete through the workflow's helpers, carrying ``run_id`` as a run's
    objects do (the ``retrain.dev/run-id`` annotation)."""
    metadata: dict[str, Any] = {"name": name}
    if run_id is not None:
        metadata["annotations"] = {"retrain.dev/run-id": run_id}
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": metadata,
        "template": {"spec": {"containers": [{"name": "c", "image": "busybox"}]}},
    }


def test_create_twice_and_delete_twice(control_plane: ControlPlane, namespace: str) -> None:
    source = yaml.safe_load(WORKFLOW.read_text())
    path = f"/api/v1/namespaces/{namespace}/podtemplates"
    body = podtemplate("twice", run_id="r-twice")
    source["main"] = {
        "params": ["run"],
        "steps": [
            {"init": {"assign": [{"refused": None}, {"other": '${map.merge(run, {"run_id": "r-other"})}'}]}},
            {
                "first": {
                    "call": "kube_create",
                    "args": {"run": "${run}", "path": path, "body": body},
                    "result": "a",
                }
            },
            {
                "again": {
                    "call": "kube_create",
                    "args": {"run": "${run}", "path": path, "body": body},
                    "result": "b",
                }
            },
            {  # another run's create meets this run's object: never adopted
                "foreign": {
                    "try": {"call": "kube_create", "args": {"run": "${other}", "path": path, "body": body}},
                    "except": {"as": "e", "steps": [{"keep": {"assign": [{"refused": "${e.message}"}]}}]},
                }
            },
            {  # another run's release meets this run's object: left in place
                "foreign_drop": {
                    "call": "kube_delete",
                    "args": {"run": "${other}", "path": path + "/twice"},
                    "result": "kept",
                }
            },
            {
                "still_there": {
                    "call": "kube",
                    "args": {"run": "${run}", "method": "GET", "path": path + "/twice"},
                    "result": "found",
                }
            },
            {
                "drop": {
                    "call": "kube_delete",
                    "args": {"run": "${run}", "path": path + "/twice"},
                    "result": "c",
                }
            },
            {
                "gone": {
                    "call": "kube_delete",
                    "args": {"run": "${run}", "path": path + "/twice"},
                    "result": "d",
                }
            },
            {
                "done": {
                    "return": [
                        "${a}",
                        "${b}",
                        "${kept}",
                        "${found.body.metadata.name}",
                        "${found.body.metadata.uid}",
                        "${c}",
                        "${d}",
                        "${refused}",
                    ]
                }
            },
        ],
    }
    registry = ConnectorRegistry()
    registry.register(
        "gke.request", gke_request_binding(KubeEndpoint.from_kubeconfig(control_plane.kubeconfig))
    )
    run = {"project": "p", "region": "r", "cluster": "c", "run_id": "r-twice"}
    result = load_workflow(yaml.safe_dump(source)).run(run, connectors=registry)
    created, adopted, uid = result[0], result[1], result[4]
    # the object's uid, for the caller to tell it from one created later under its name; a retried create
    # after a lost response adopts this run's own object, and answers its uid too
    assert created == adopted == uid and uid
    assert result[2:4] + result[5:] == [
        "not this run's",  # another run's delete leaves it
        "twice",
        "deleted",
        "absent",
        "PodTemplate twice exists and is not this run's (its run id: r-twice): not adopted",
    ]


def test_the_workflows_calls_go_as_its_account_which_rbac_decides(
    control_plane: ControlPlane, api: Any, namespace: str
) -> None:
    """As on GKE, the connector's calls are the workflow's account's: allowed in its namespace once
    k8s/workflow.yaml's RBAC is applied there, refused (403) anywhere else."""
    import dataclasses

    from retrain_local.envtest import apply_documents, ensure_service_account
    from retrain_ops.deployment import Deployment
    from retrain_ops.manifests import render

    values = dataclasses.replace(Deployment().manifest_values(), namespace=namespace)
    apply_documents(api, list(yaml.safe_load_all(render(values)["workflow.yaml"])))
    elsewhere = f"{namespace}-other"
    ensure_service_account(api, elsewhere)
    source = yaml.safe_load(WORKFLOW.read_text())
    body = podtemplate("mine")

    def create_in(ns: str) -> Any:
        steps = [
            {
                "make": {
                    "call": "kube_create",
                    "args": {"run": "${run}", "path": f"/api/v1/namespaces/{ns}/podtemplates", "body": body},
                    "result": "r",
                }
            },
            {"done": {"return": "${r}"}},
        ]
        source["main"] = {"params": ["run"], "steps": steps}
        registry = ConnectorRegistry()
        kube = KubeEndpoint.from_kubeconfig(control_plane.kubeconfig)
        registry.register("gke.request", gke_request_binding(kube, as_user=values.workflow_user))
        return load_workflow(yaml.safe_dump(source)).run(
            {"project": "p", "region": "r", "cluster": "c"}, connectors=registry
        )

    made = create_in(namespace)
    assert isinstance(made, str) and len(made) == 36  # the uid Kubernetes gave it
    with pytest.raises(WorkflowError) as refused:
        create_in(elsewhere)
    assert refused.value.value["code"] == 403 and "forbidden" in str(refused.value).lower()


def test_an_object_replaced_between_the_read_and_the_delete_is_not_deleted(
    control_plane: ControlPlane, namespace: str
) -> None:
    """kube_delete reads the object, then deletes it with the uid it read as a precondition: when another
    object took the name in between (here made by the connector just before it sends the DELETE), the
    DELETE is refused (409) and the newcomer stays."""
    source = yaml.safe_load(WORKFLOW.read_text())
    path = f"/api/v1/namespaces/{namespace}/podtemplates"
    body = podtemplate("swapped", run_id="r-swap")
    gke = gke_request_binding(KubeEndpoint.from_kubeconfig(control_plane.kubeconfig))
    uids: list[str] = []

    def swap_before_delete(args: dict[str, Any], context: dict[str, Any]) -> Any:
        if args["method"] == "DELETE":
            gke({"method": "DELETE", "path": args["path"]}, context)
            uids.append(
                gke({"method": "POST", "path": path, "body": body}, context)["body"]["metadata"]["uid"]
            )
        return gke(args, context)

    registry = ConnectorRegistry()
    registry.register("gke.request", swap_before_delete)
    source["main"] = {
        "params": ["run"],
        "steps": [
            {"make": {"call": "kube_create", "args": {"run": "${run}", "path": path, "body": body}}},
            {
                "drop": {
                    "call": "kube_delete",
                    "args": {"run": "${run}", "path": path + "/swapped"},
                    "result": "r",
                }
            },
            {"done": {"return": "${r}"}},
        ],
    }
    run = {"project": "p", "region": "r", "cluster": "c", "run_id": "r-swap"}
    assert load_workflow(yaml.safe_dump(source)).run(run, connectors=registry) == "absent"
    kept = gke({"method": "GET", "path": path + "/swapped"}, {})
    assert [kept["body"]["metadata"]["uid"]] == uids


@pytest.mark.emulators
def test_a_run_s_pods_write_only_under_their_own_folder_and_only_while_it_runs(
    control_plane: ControlPlane, api: Any, namespace: str, gcs_host: str
) -> None:
    """workflows/retrain.yaml's open_run_folder and close_run_folder in the interpreter, as the workflow's
    account: its Kubernetes calls against the API server under k8s/workflow.yaml's RBAC, its Cloud
    Storage calls (http.* with OAuth2, to storage.googleapis.com) through the storage front under
    infra/'s IAM.  The run's pods (its own service account's principal) may then write under
    ``runs/RUN/`` and nowhere else, another run's pods not there; after the release, not even there."""
    import dataclasses
    import uuid

    import kubernetes
    from google.api_core.exceptions import Forbidden

    from retrain.adapters import credentials, objects
    from retrain.k8s.render import render_run_account, run_account_name, run_principal
    from retrain_local.envtest import apply_documents
    from retrain_local.identities import OPERATOR, Caller, Deployed, Guard
    from retrain_local.storage_front import STORAGE_API, StorageFront
    from retrain_ops.deployment import Deployment
    from retrain_ops.manifests import render

    deployment = Deployment()
    settings = deployment.settings()
    values = dataclasses.replace(deployment.manifest_values(), namespace=namespace)
    apply_documents(api, list(yaml.safe_load_all(render(values)["workflow.yaml"])))
    deployed = Deployed.read(deployment)
    guard = Guard(deployed)
    client = objects.storage_client()
    if client.lookup_bucket(settings.artifacts_bucket) is None:
        client.create_bucket(settings.artifacts_bucket)
    front = StorageFront(gcs_host, guard).start()

    def run_of(run_id: str) -> dict[str, Any]:
        ksa = run_account_name(run_id)
        return {
            "project": "p",
            "region": "r",
            "cluster": "c",
            "run_id": run_id,
            "namespace": namespace,
            "artifacts_bucket": settings.artifacts_bucket,
            "run_account": render_run_account(run_id, namespace),
            "run_principal": run_principal(settings.project_number, settings.project, namespace, ksa),
            "run_folder": f"runs/{run_id}/",
        }

    def call(sub: str, run: dict[str, Any]) -> Any:
        source = yaml.safe_load(WORKFLOW.read_text())
        source["main"] = {"params": ["run"], "steps": [{"go": {"call": sub, "args": {"run": "${run}"}}}]}
        workflow_as = Caller(guard, deployed.workflow)
        registry = ConnectorRegistry(token=workflow_as.token)
        kube = KubeEndpoint.from_kubeconfig(control_plane.kubeconfig)
        registry.register("gke.request", gke_request_binding(kube, as_user=values.workflow_user))
        registry.origins[STORAGE_API] = front.url
        return load_workflow(yaml.safe_dump(source)).run(run, connectors=registry)

    def write(run: dict[str, Any], name: str) -> None:
        pods = guard.workload_member(namespace, run["run_account"]["metadata"]["name"], {})
        assert pods == run["run_principal"]  # who Google takes the pods for: the principal granted
        with credentials.acting_as(guard.token(pods)):
            objects.write_bytes(f"gs://{settings.artifacts_bucket}/{name}", b"weights")

    tag = uuid.uuid4().hex[:6]
    mine, other = run_of(f"mine-{tag}"), run_of(f"other-{tag}")
    old_host = os.environ["STORAGE_EMULATOR_HOST"]
    os.environ["STORAGE_EMULATOR_HOST"] = front.url
    try:
        call("open_run_folder", mine)
        call("open_run_folder", mine)  # a retried execution finds the account and the folder: the same
        call("open_run_folder", other)
        core = kubernetes.client.CoreV1Api(api)
        account = core.read_namespaced_service_account(run_account_name(mine["run_id"]), namespace)
        assert account.metadata.annotations["retrain.dev/run-id"] == mine["run_id"]
        write(mine, f"runs/{mine['run_id']}/checkpoints/step-10.ckpt")
        for elsewhere in (
            f"runs/{other['run_id']}/tokenize_report.json",
            f"runs/{tag}-champion/x",
            "shards/d/x.bin",
        ):
            with pytest.raises(Forbidden, match=r"storage\.objects\.create"):
                write(mine, elsewhere)
        write(other, f"runs/{other['run_id']}/events.out")
        call("close_run_folder", mine)
        refused = len(guard.refused())
        call("close_run_folder", mine)  # a retried release: nothing left, nothing refused
        assert guard.refused()[refused:] == []
        with pytest.raises(Forbidden, match=r"storage\.objects\.create"):
            write(mine, f"runs/{mine['run_id']}/late.ckpt")
        write(other, f"runs/{other['run_id']}/events.out")  # the other run's grant is its own
        # what the run wrote stays (the folder goes, its objects do not), readable as before
        with credentials.acting_as(guard.token(OPERATOR)):
            written = objects.read_bytes(
                f"gs://{settings.artifacts_bucket}/runs/{mine['run_id']}/checkpoints/step-10.ckpt"
            )
        assert written == b"weights"
        assert [a.metadata.name for a in core.list_namespaced_service_account(namespace).items] == [
            "default",
            run_account_name(other["run_id"]),
        ]
        # the workflow can touch only folders nested in runs/: never runs/ itself (Terraform's policy)
        outside = {**run_of(f"x-{tag}"), "run_folder": "runs/"}
        with pytest.raises(WorkflowError) as denied:
            call("open_run_folder", outside)
        assert denied.value.value["code"] == 403
        assert "storage.managedFolders.create" in json.dumps(denied.value.value["body"])
        call("close_run_folder", outside)  # its release takes the account it made before the refusal
        call("close_run_folder", other)
        assert [a.metadata.name for a in core.list_namespaced_service_account(namespace).items] == ["default"]
    finally:
        os.environ["STORAGE_EMULATOR_HOST"] = old_host
        front.stop()
