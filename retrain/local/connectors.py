"""The workflow's connectors, bound to the local backends.

Each binding receives the connector's documented arguments and answers in the documented shape, so
workflows/retrain.yaml runs unchanged: Firestore and GCS calls go to their emulators through the same
REST/JSON APIs, ``gke.request`` goes to the real kube-apiserver, node-pool sizing goes to the cluster
twin, and a Dataflow flex-template launch goes through the launcher's contract (``retrain.local.dataflow``).
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

from retrain.adapters import objects
from retrain.local.dataflow import LocalDataflow
from retrain.workflows import ConnectorRegistry, WorkflowError, http_error
from retrain.workflows.stdlib import send

Args = dict[str, Any]


# --- Firestore (REST API of the emulator) ----------------------------------------------------------


def firestore_bindings(emulator_host: str) -> dict[str, Callable[[Args, Args], Any]]:
    base = f"http://{emulator_host}/v1/"
    headers = {"Authorization": "Bearer owner"}

    def patch(args: Args, _: Args) -> Any:
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
        return send("GET", base + args["name"], headers=headers, timeout=30)["body"]

    return {
        "googleapis.firestore.v1.projects.databases.documents.patch": patch,
        "googleapis.firestore.v1.projects.databases.documents.get": get,
    }


# --- Pub/Sub (REST API of the emulator: the connector's request, unchanged) ------------------------


def pubsub_publish_binding(emulator_host: str) -> Callable[[Args, Args], Any]:
    def publish(args: Args, _: Args) -> Any:
        url = f"http://{emulator_host}/v1/{args['topic']}:publish"
        return send("POST", url, json=args.get("body") or {}, timeout=30)["body"]

    return publish


# --- Cloud Storage (JSON API of the emulator, through the client library) --------------------------


def _object_uri(args: Args, key: str) -> str:
    name = unquote(str(args[key]))
    return f"gs://{args['bucket']}/{name}"


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


def gke_request_binding(kube: KubeEndpoint, as_user: str | None = None) -> Callable[[Args, Args], Any]:
    """``gke.request`` against the local API server; with ``as_user``, every call is made as that user
    (Kubernetes impersonation, ``Impersonate-User``; the API server adds ``system:authenticated``), so
    that RBAC decides it as GKE decides the workflow's account's calls."""
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {kube.token}"
    if as_user is not None:
        session.headers["Impersonate-User"] = as_user

    def request(args: Args, _: Args) -> Any:
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
    kube_user: str,
    dataflow: LocalDataflow,
) -> ConnectorRegistry:
    """Every connector workflows/retrain.yaml calls, bound to the local stack; its Kubernetes API calls
    are made as ``kube_user`` (the workflow's account, as GKE names it to RBAC)."""
    registry = ConnectorRegistry()
    for name, fn in firestore_bindings(firestore_host).items():
        registry.register(name, fn)
    registry.register("googleapis.storage.v1.objects.get", storage_get)
    registry.register("googleapis.pubsub.v1.projects.topics.publish", pubsub_publish_binding(pubsub_host))
    registry.register("googleapis.dataflow.v1b3.projects.locations.flexTemplates.launch", dataflow.launch)
    registry.register("googleapis.dataflow.v1b3.projects.locations.jobs.get", dataflow.get)
    registry.register("googleapis.dataflow.v1b3.projects.locations.jobs.update", dataflow.update)
    registry.register("gke.request", gke_request_binding(kube, as_user=kube_user))
    return registry
