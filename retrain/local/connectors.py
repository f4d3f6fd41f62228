"""The workflow's connectors, bound to the local backends.

Each binding receives the connector's documented arguments and answers in the documented shape, so
workflows/retrain.yaml runs unchanged: Firestore and GCS calls go to their emulators through the same
REST/JSON APIs, ``gke.request`` goes to the real kube-apiserver, node-pool sizing goes to the cluster
twin, and a Dataflow flex-template launch runs the same Beam pipeline on the FnApiRunner.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import requests
import yaml
from google.api_core.exceptions import NotFound

from retrain.adapters import objects
from retrain.local import processes
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


# --- Dataflow: flex-template launches run the Beam pipeline locally --------------------------------


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """A job and the workers it started (its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass
class LocalDataflow:
    """Runs each launched tokenize job as a subprocess (FnApiRunner) and reports Dataflow job states."""

    log_dir: Path
    env: Mapping[str, str]
    jobs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def launch(self, args: Args, _: Args) -> Any:
        launch = args["body"]["launchParameter"]
        params = launch.get("parameters", {})
        for required in ("manifest", "shard_root", "report"):
            if required not in params:
                raise WorkflowError(http_error(400, f"launchParameter.parameters.{required} is required"))
        # Not Dataflow's rule but the deployment's: workers never run as the default compute account on
        # the default network, so a launch that leaves these out is refused here as a bug.
        environment = launch.get("environment") or {}
        for required in ("serviceAccountEmail", "subnetwork", "tempLocation"):
            if not environment.get(required):
                raise WorkflowError(http_error(400, f"launchParameter.environment.{required} is required"))
        job_id = f"{launch.get('jobName', 'job')}-{uuid.uuid4().hex[:8]}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{job_id}.log", "wb")  # noqa: SIM115 - handed to the child
        argv = [
            sys.executable,
            "-m",
            "retrain.tokenize",
            "--manifest",
            params["manifest"],
            "--shard-root",
            params["shard_root"],
            "--report",
            params["report"],
        ]
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}, start_new_session=True
        )
        log.close()
        processes.record(proc.pid, f"dataflow {job_id}")
        with self.lock:
            self.jobs[job_id] = proc
        return {
            "job": {
                "id": job_id,
                "name": launch.get("jobName"),
                "projectId": args.get("projectId"),
                "location": args.get("location"),
                "currentState": "JOB_STATE_PENDING",
            }
        }

    def _job(self, args: Args) -> subprocess.Popen[bytes]:
        job_id = args["jobId"]
        with self.lock:
            proc = self.jobs.get(job_id)
        if proc is None:
            raise WorkflowError(http_error(404, f"job {job_id} not found"))
        return proc

    def get(self, args: Args, _: Args) -> Any:
        job_id = args["jobId"]
        code = self._job(args).poll()
        if job_id in self.cancelled:
            state = "JOB_STATE_CANCELLED"
        elif code is None:
            state = "JOB_STATE_RUNNING"
        else:
            state = "JOB_STATE_DONE" if code == 0 else "JOB_STATE_FAILED"
        return {"id": job_id, "currentState": state}

    def update(self, args: Args, _: Args) -> Any:
        """jobs.update: ``requestedState`` JOB_STATE_CANCELLED stops a running job (Dataflow's cancel)."""
        requested = (args.get("body") or {}).get("requestedState")
        if requested != "JOB_STATE_CANCELLED":
            raise WorkflowError(http_error(400, f"requestedState {requested!r} is not supported locally"))
        proc = self._job(args)
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
            self.cancelled.add(args["jobId"])
        return self.get(args, {})

    def stop(self) -> None:
        with self.lock:
            for proc in self.jobs.values():
                if proc.poll() is None:
                    _kill_group(proc)
                    proc.wait()


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
