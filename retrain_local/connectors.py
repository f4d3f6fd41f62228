"""The workflow's connectors, bound to the local backends.

Each binding receives the connector's documented arguments and answers in the documented shape, so
workflows/retrain.yaml runs unchanged: Firestore and GCS calls go to their emulators through the same
REST/JSON APIs, ``gke.request`` goes to the real kube-apiserver, node-pool sizing goes to the cluster
twin, and a Dataflow flex-template launch goes through the launcher's contract (``retrain_local.dataflow``).

Every call is made as the workflow's service account (a :class:`retrain_local.identities.Caller`): a
connector Google would refuse for want of a permission raises the connector's ``HttpError`` 403, its
body the API's ``PERMISSION_DENIED`` naming the permission and the resource.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import requests
import yaml
from google.api_core.exceptions import NotFound

from cloudworkflows import ConnectorRegistry, WorkflowError, http_error
from cloudworkflows.stdlib import send
from retrain.adapters import credentials, objects
from retrain_local.dataflow import LocalDataflow
from retrain_local.iam import Kind, Resource
from retrain_local.identities import Caller
from retrain_local.identities import connector_require as require

Args = dict[str, Any]


def _project_of(name: str) -> Resource:
    """The project of a resource name ``projects/P/...`` (Firestore and Dataflow check there)."""
    return Resource(Kind.PROJECT, name.split("/")[1])


# --- Firestore (REST API of the emulator) ----------------------------------------------------------


def firestore_bindings(
    emulator_host: str, caller: Caller | None = None
) -> dict[str, Callable[[Args, Args], Any]]:
    base = f"http://{emulator_host}/v1/"
    headers = {"Authorization": "Bearer owner"}

    def patch(args: Args, _: Args) -> Any:
        # "patch: datastore.entities.update" (cloud.google.com/firestore/docs/security/iam)
        require(caller, "datastore.entities.update", _project_of(args["name"]))
        params: list[tuple[str, str]] = []
        for path in (args.get("updateMask") or {}).get("fieldPaths", []):
            params.append(("updateMask.fieldPaths", f"`{path}`" if not path.isidentifier() else path))
        for key, value in (args.get("currentDocument") or {}).items():
            params.append(
                (f"currentDocument.{key}", json.dumps(value) if isinstance(value, bool) else str(value))
            )
        url = base + args["name"]
        return send("PATCH", url, params=params, json=args.get("body") or {}, headers=headers, timeout=30)[
            "body"
        ]

    def get(args: Args, _: Args) -> Any:
        require(caller, "datastore.entities.get", _project_of(args["name"]))
        return send("GET", base + args["name"], headers=headers, timeout=30)["body"]

    return {
        "googleapis.firestore.v1.projects.databases.documents.patch": patch,
        "googleapis.firestore.v1.projects.databases.documents.get": get,
    }


# --- Pub/Sub (REST API of the emulator: the connector's request, unchanged) ------------------------


def pubsub_publish_binding(emulator_host: str, caller: Caller | None = None) -> Callable[[Args, Args], Any]:
    def publish(args: Args, _: Args) -> Any:
        require(caller, "pubsub.topics.publish", Resource(Kind.TOPIC, str(args["topic"]).rsplit("/", 1)[-1]))
        url = f"http://{emulator_host}/v1/{args['topic']}:publish"
        return send("POST", url, json=args.get("body") or {}, timeout=30)["body"]

    return publish


# --- Cloud Storage (JSON API of the emulator, through the client library) --------------------------


def _object_uri(args: Args, key: str) -> str:
    name = unquote(str(args[key]))
    return f"gs://{args['bucket']}/{name}"


def storage_get_binding(caller: Caller | None = None) -> Callable[[Args, Args], Any]:
    """objects.get, through the storage front as the caller."""

    def get(args: Args, _: Args) -> Any:
        with credentials.acting_as(caller.token if caller else None):
            try:
                return storage_get(args, {})
            except Exception as e:
                if getattr(e, "code", None) == 403:  # the front's refusal, as the connector raises it
                    raise WorkflowError(http_error(403, str(e))) from None
                raise

    return get


def storage_get(args: Args, _: Args) -> Any:
    """objects.get; with alt=media the connector returns the content (decoded when it is JSON)."""
    uri = _object_uri(args, "object")
    try:
        if args.get("alt") == "media":
            data = objects.read_bytes(uri)
            try:
                return json.loads(data)
            except ValueError:
                return data.decode("utf-8", "replace")
        info = objects.stat(uri)
    except (FileNotFoundError, NotFound):
        raise WorkflowError(http_error(404, f"No such object: {uri}")) from None
    return {
        "bucket": args["bucket"],
        "name": unquote(str(args["object"])),
        "size": str(info.size),
        "generation": str(info.generation),
    }


# --- GKE: the Kubernetes API of the envtest control plane, node pools of the twin ------------------


@dataclass
class KubeEndpoint:
    server: str
    token: str
    ca_file: str

    @classmethod
    def from_kubeconfig(cls, path: Path) -> KubeEndpoint:
        cfg = yaml.safe_load(path.read_text())
        cluster = cfg["clusters"][0]["cluster"]
        return cls(cluster["server"], cfg["users"][0]["user"]["token"], cluster["certificate-authority"])


def gke_request_binding(
    kube: KubeEndpoint, as_user: str | None = None, caller: Caller | None = None
) -> Callable[[Args, Args], Any]:
    """``gke.request`` against the local API server with ``kube.token``: in the stack, the workflow's
    own token at the cluster's front (``retrain_local.kube_front``), which maps it to the workflow's
    account as GKE does; with ``as_user``, made as that user by Kubernetes impersonation
    (``Impersonate-User``), for tests of a bare control plane.  Either way RBAC decides.

    The connector finds the cluster by its id and reaches its control plane "even if the cluster is
    private" (cloud.google.com/workflows/docs/reference/connectors/gke/Overview): through its DNS-based
    endpoint, which authorizes the caller by ``container.clusters.connect``, after the cluster's lookup
    (``container.clusters.get``)."""
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {kube.token}"
    if as_user is not None:
        session.headers["Impersonate-User"] = as_user

    def request(args: Args, _: Args) -> Any:
        if caller is not None:
            project = Resource(Kind.PROJECT, str(args.get("project") or caller.guard.deployed.project))
            require(caller, "container.clusters.get", project)
            require(caller, "container.clusters.connect", project)
        path = str(args["path"])
        if not path.startswith("/") or ".." in path:
            raise WorkflowError({"message": f"invalid path {path!r}", "tags": ["ValueError"]})
        return send(
            str(args.get("method", "GET")),
            kube.server + path,
            session,
            params=args.get("query"),
            json=args.get("body"),
            timeout=float(args.get("timeout", 60)),
            verify=kube.ca_file,  # explicit: REQUESTS_CA_BUNDLE would otherwise win over session.verify
        )

    return request


def local_registry(
    *,
    firestore_host: str,
    pubsub_host: str,
    kube: KubeEndpoint,
    dataflow: LocalDataflow,
    caller: Caller,
) -> ConnectorRegistry:
    """Every connector workflows/retrain.yaml calls, bound to the local stack, each made as ``caller``
    (the workflow's service account): ``kube`` is the cluster's front with the caller's token, and
    ``http.*`` calls with ``auth`` present the caller's token too (the OIDC or OAuth2 token Workflows
    adds)."""
    registry = ConnectorRegistry(token=caller.token)
    for name, fn in firestore_bindings(firestore_host, caller).items():
        registry.register(name, fn)
    registry.register("googleapis.storage.v1.objects.get", storage_get_binding(caller))
    registry.register(
        "googleapis.pubsub.v1.projects.topics.publish", pubsub_publish_binding(pubsub_host, caller)
    )
    registry.register("googleapis.dataflow.v1b3.projects.locations.flexTemplates.launch", dataflow.launch)
    registry.register("googleapis.dataflow.v1b3.projects.locations.jobs.get", dataflow.get)
    registry.register("googleapis.dataflow.v1b3.projects.locations.jobs.update", dataflow.update)
    registry.register("gke.request", gke_request_binding(kube, caller=caller))
    return registry
