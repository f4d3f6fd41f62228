"""k8s/ manifests and rendered objects are accepted by the real API server, unpruned; notifier RBAC."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from retrain.config import Settings
from retrain.k8s.render import render_jobset, render_provisioning_request

pytestmark = pytest.mark.envtest

REPO = Path(__file__).resolve().parents[2]
RBAC_SETTLE_S = 10.0  # how long a fresh grant may take to reach the authorizer's caches
CR_PLURALS = {
    "Network": "networks",
    "GKENetworkParamSet": "gkenetworkparamsets",
    "JobSet": "jobsets",
    "ProvisioningRequest": "provisioningrequests",
}


def subset(want: Any, got: Any, path: str = "") -> list[str]:
    """Where ``want`` is not contained in ``got`` (the server may add defaults, never drop fields)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{path}: not an object"]
        return [
            e
            for k, v in want.items()
            for e in (subset(v, got[k], f"{path}.{k}") if k in got else [f"{path}.{k}: pruned"])
        ]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: list differs"]
        return [
            e for i, (a, b) in enumerate(zip(want, got, strict=True)) for e in subset(a, b, f"{path}[{i}]")
        ]
    return [] if want == got or str(want) == str(got) else [f"{path}: {want!r} != {got!r}"]


def create(api: Any, obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    """Create any object of the manifests through the Python client; return what the server stored."""
    from kubernetes import client

    obj = dict(obj, metadata=dict(obj["metadata"]))
    kind = obj["kind"]
    if kind in CR_PLURALS:
        group, version = obj["apiVersion"].split("/")
        objects = client.CustomObjectsApi(api)
        if "namespace" in obj["metadata"] or kind in ("JobSet", "ProvisioningRequest"):
            obj["metadata"]["namespace"] = namespace
            return dict(
                objects.create_namespaced_custom_object(group, version, namespace, CR_PLURALS[kind], obj)
            )
        return dict(objects.create_cluster_custom_object(group, version, CR_PLURALS[kind], obj))
    obj["metadata"]["namespace"] = namespace
    if kind == "ServiceAccount":
        out = client.CoreV1Api(api).create_namespaced_service_account(namespace, obj)
    elif kind == "PodTemplate":
        out = client.CoreV1Api(api).create_namespaced_pod_template(namespace, obj)
    elif kind == "Role":
        out = client.RbacAuthorizationV1Api(api).create_namespaced_role(namespace, obj)
    elif kind == "RoleBinding":
        for s in obj.get("subjects", []):
            if s["kind"] == "ServiceAccount":
                s["namespace"] = namespace
        out = client.RbacAuthorizationV1Api(api).create_namespaced_role_binding(namespace, obj)
    elif kind == "Deployment":
        out = client.AppsV1Api(api).create_namespaced_deployment(namespace, obj)
    else:
        raise AssertionError(f"unexpected kind {kind}")
    return dict(api.sanitize_for_serialization(out))


def rendered(name: str, namespace: str) -> list[dict[str, Any]]:
    """k8s/NAME rendered as retrain deploy renders it, for the test's namespace."""
    import dataclasses

    from retrain_ops.deployment import Deployment
    from retrain_ops.manifests import render

    values = dataclasses.replace(Deployment().manifest_values(), namespace=namespace)
    return list(yaml.safe_load_all(render(values)[name]))


def allowed(
    api: Any,
    user: str,
    groups: list[str],
    namespace: str | None,
    verb: str,
    resource: str,
    group: str,
    sub: str = "",
    wait_for_yes: bool = True,
) -> bool:
    """The API server's own answer (SubjectAccessReview): may ``user`` do this?

    RBAC's authorizer answers from informer caches of roles and bindings, so a grant created a
    moment ago can still read as a no (CI met it: a ClusterRoleBinding not yet seen).  A yes is
    therefore waited for, up to RBAC_SETTLE_S; a test asks its noes (``wait_for_yes=False``) after
    its yeses, when the caches hold every object it created.
    """
    from kubernetes import client

    attributes = {"verb": verb, "group": group, "resource": resource, "subresource": sub}
    if namespace:
        attributes["namespace"] = namespace
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {"user": user, "groups": groups, "resourceAttributes": attributes},
    }
    deadline = time.monotonic() + (RBAC_SETTLE_S if wait_for_yes else 0)
    while True:
        answer = client.AuthorizationV1Api(api).create_subject_access_review(review).status.allowed
        if answer or time.monotonic() >= deadline:
            return bool(answer)
        time.sleep(0.1)


def test_the_control_plane_serves_the_clusters_groups_and_not_kueue(api: Any, namespace: str) -> None:
    """The custom groups served are the deployed cluster's (envtest.CLUSTER_GROUPS), from the CRDs of
    ../shared/crds; Kueue's, which the deployment does not install, are not served: a LocalQueue is
    refused with a 404 as on a GKE cluster without Kueue."""
    from kubernetes import client

    from retrain_local.envtest import CLUSTER_GROUPS

    served = {g.name for g in client.ApisApi(api).get_api_versions().groups}
    assert {g for g in served if g.endswith((".x-k8s.io", ".gke.io"))} == CLUSTER_GROUPS
    queue = {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "LocalQueue", "metadata": {"name": "q"}}
    with pytest.raises(client.ApiException) as refused:
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            "kueue.x-k8s.io", "v1beta1", namespace, "localqueues", {**queue, "spec": {"clusterQueue": "c"}}
        )
    assert refused.value.status == 404


def test_tcpx_network_objects_accepted(api: Any, namespace: str) -> None:
    """GPUDirect-TCPX's Network and GKENetworkParamSet objects, created on the API server serving GKE's
    own multi-networking CRDs: nothing pruned."""
    for doc in rendered("tcpx.yaml", namespace):
        stored = create(api, doc, namespace)
        assert subset(doc["spec"], stored["spec"]) == [], doc["kind"]


def test_notifier_manifests_accepted_and_least_privilege(api: Any, namespace: str) -> None:
    docs = rendered("notifier.yaml", namespace)
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "Deployment"]
    ksa = docs[0]["metadata"]["name"]
    for doc in docs:
        stored = create(api, doc, namespace)
        if doc["kind"] == "Deployment":
            c = stored["spec"]["template"]["spec"]["containers"][0]
            assert c["command"] == ["retrain-notify"]
            assert stored["spec"]["template"]["spec"]["serviceAccountName"] == ksa
    user = f"system:serviceaccount:{namespace}:{ksa}"
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"]

    def may(verb: str, resource: str, group: str = "jobset.x-k8s.io", sub: str = "") -> bool:
        return allowed(api, user, groups, namespace, verb, resource, group, sub)

    def refused(verb: str, resource: str, group: str = "jobset.x-k8s.io", sub: str = "") -> bool:
        return not allowed(api, user, groups, namespace, verb, resource, group, sub, wait_for_yes=False)

    for verb in ("get", "list", "watch", "patch"):
        assert may(verb, "jobsets"), verb
    assert refused("delete", "jobsets")
    assert refused("create", "jobsets")
    assert refused("update", "jobsets", sub="status")
    assert refused("list", "secrets", group="")
    assert refused("create", "pods", group="")


def test_reaper_rbac_allows_its_work_and_nothing_more(api: Any, namespace: str) -> None:
    """The functions' Google account, as GKE names it to RBAC, may delete training objects of the
    namespace and list nodes: what retrain.k8s.reaper does, and nothing else."""
    from kubernetes import client

    docs = rendered("reaper.yaml", namespace)
    for doc in docs:
        if doc["kind"] in ("Role", "RoleBinding"):
            create(api, doc, namespace)
        elif doc["kind"] == "ClusterRole":
            client.RbacAuthorizationV1Api(api).create_cluster_role(doc)
        else:
            client.RbacAuthorizationV1Api(api).create_cluster_role_binding(doc)
    user = docs[1]["subjects"][0]["name"]
    assert user.endswith(".iam.gserviceaccount.com")

    def may(verb: str, resource: str, group: str, ns: str | None = namespace) -> bool:
        return allowed(api, user, ["system:authenticated"], ns, verb, resource, group)

    def refused(verb: str, resource: str, group: str, ns: str | None = namespace) -> bool:
        return not allowed(api, user, ["system:authenticated"], ns, verb, resource, group, wait_for_yes=False)

    for verb in ("list", "delete"):
        assert may(verb, "jobsets", "jobset.x-k8s.io")
        assert may(verb, "provisioningrequests", "autoscaling.x-k8s.io")
        assert may(verb, "podtemplates", "")
        assert may(verb, "serviceaccounts", "")  # a lost run's identity
    assert refused("create", "serviceaccounts", "")
    assert may("list", "nodes", "", ns=None)
    assert refused("delete", "nodes", "", ns=None)
    assert refused("create", "jobsets", "jobset.x-k8s.io")
    assert refused("list", "secrets", "")
    assert refused("delete", "jobsets", "jobset.x-k8s.io", ns="kube-system")


def workflow_calls() -> set[tuple[str, str, str, bool]]:
    """(verb, API group, resource, namespaced) of every Kubernetes call workflows/retrain.yaml makes
    (its steps calling kube, kube_create, kube_delete or kube_get_own), read from the file.  A
    kube_create also reads the object it meets on 409 (to adopt it only when it is the run's): a get of
    what it creates."""
    methods = {"kube_create": "POST", "kube_delete": "DELETE", "kube_get_own": "GET"}
    found = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            helpers = ("kube", "kube_create", "kube_delete", "kube_get_own")
            if node.get("call") in helpers and "path" in node.get("args", {}):
                args = node["args"]
                method = methods.get(node["call"]) or args["method"]
                path = str(args["path"])
                if path in ("${path}", '${path + "/" + body.metadata.name}'):  # helpers passing theirs on
                    return
                api_path = r'"?/(?:apis/([a-z0-9.-]+)/v[0-9a-z]+|api/v1)/(?:namespaces/"[^"]*"/)?([a-z]+)'
                m = re.search(api_path, path)
                assert m is not None, f"an unreadable path in workflows/retrain.yaml: {path}"
                group, resource = m.group(1) or "", m.group(2)
                named = path.rstrip("}").rstrip().endswith(("name", "_name"))
                verb = {"POST": "create", "DELETE": "delete"}.get(method, "get" if named else "list")
                found.add((verb, group, resource, "namespaces/" in path))
                if node["call"] == "kube_create":
                    found.add(("get", group, resource, "namespaces/" in path))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(yaml.safe_load((REPO / "workflows" / "retrain.yaml").read_text()))
    return found


def test_workflow_rbac_allows_its_connector_calls_and_nothing_more(api: Any, namespace: str) -> None:
    """The workflow's Google account, as GKE names it to RBAC, may make every gke.request call
    workflows/retrain.yaml makes, in its namespace, and nothing else: IAM gives it only
    container.clusters.get/.connect, so this RBAC is all it may do in the cluster."""
    from retrain_local.envtest import apply_documents

    docs = rendered("workflow.yaml", namespace)
    apply_documents(api, docs)
    user = docs[1]["subjects"][0]["name"]
    assert user.startswith("retrain-workflow@") and user.endswith(".iam.gserviceaccount.com")

    def may(verb: str, resource: str, group: str, ns: str | None = namespace) -> bool:
        return allowed(api, user, ["system:authenticated"], ns, verb, resource, group)

    def refused(verb: str, resource: str, group: str, ns: str | None = namespace) -> bool:
        return not allowed(api, user, ["system:authenticated"], ns, verb, resource, group, wait_for_yes=False)

    calls = workflow_calls()
    assert calls == {
        ("create", "", "podtemplates", True),
        ("get", "", "podtemplates", True),
        ("delete", "", "podtemplates", True),
        ("create", "", "serviceaccounts", True),  # the run's own identity (open_run_folder)
        ("get", "", "serviceaccounts", True),
        ("delete", "", "serviceaccounts", True),
        ("create", "autoscaling.x-k8s.io", "provisioningrequests", True),
        ("get", "autoscaling.x-k8s.io", "provisioningrequests", True),
        ("delete", "autoscaling.x-k8s.io", "provisioningrequests", True),
        ("create", "jobset.x-k8s.io", "jobsets", True),
        ("get", "jobset.x-k8s.io", "jobsets", True),
        ("delete", "jobset.x-k8s.io", "jobsets", True),
        ("list", "", "nodes", False),
    }
    for verb, group, resource, namespaced in calls:
        assert may(verb, resource, group, namespace if namespaced else None), (verb, resource)
    granted = {
        (verb, group, rule_resource)
        for doc in docs
        if doc["kind"] in ("Role", "ClusterRole")
        for rule in doc["rules"]
        for group in rule["apiGroups"]
        for rule_resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {(v, g, r) for v, g, r, _ in calls}
    assert refused("create", "jobsets", "jobset.x-k8s.io", ns="kube-system")  # its namespace only
    assert refused("update", "jobsets", "jobset.x-k8s.io")
    assert refused("list", "jobsets", "jobset.x-k8s.io")
    assert refused("create", "pods", "")
    assert refused("list", "secrets", "")
    assert refused("delete", "nodes", "", ns=None)


@pytest.mark.parametrize("tcpx", [False, True])
def test_rendered_jobset_accepted_unpruned(api: Any, namespace: str, tcpx: bool) -> None:
    from retrain.k8s.render import GcsMounts, example_plan
    from retrain.trainers.nemo import NEMO_24_12

    mounts = GcsMounts()
    js = render_jobset(
        f"accept-{int(tcpx)}",
        nodes=2,
        image="nvcr.io/nvidia/nemo:24.12",
        command=NEMO_24_12.render(example_plan(), mounts.path),
        mounts=mounts,
        namespace=namespace,
        tcpx_image=Settings().tcpx_image if tcpx else None,
        callback_url="https://cb.example/x",
    )
    stored = create(api, js, namespace)
    assert subset(js["spec"], stored["spec"]) == []
    assert subset(js["metadata"]["labels"], stored["metadata"]["labels"]) == []


def test_rendered_provisioning_request_accepted_unpruned(api: Any, namespace: str) -> None:
    tmpl, pr = render_provisioning_request("accept-pr", nodes=2, namespace=namespace, max_run_duration_s=3600)
    stored_tmpl = create(api, tmpl, namespace)
    assert stored_tmpl["template"]["spec"]["nodeSelector"] == tmpl["template"]["spec"]["nodeSelector"]
    stored = create(api, pr, namespace)
    assert subset(pr["spec"], stored["spec"]) == []
