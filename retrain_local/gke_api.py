"""The GKE API (container.googleapis.com v1) for the local stack: ``projects.locations.clusters.get``,
the one method retrain calls (``retrain.adapters.cluster``), over HTTP as the client's REST transport
speaks it; beside it the two project reads of ``retrain doctor`` (Service Usage ``services.list``,
Compute Engine ``regions.get``), in their REST shapes.

The cluster it describes is the one ``infra/platform/gke.tf`` declares: its name, its node pools with
their autoscaling bounds (``google_container_node_pool.*``), and a control plane that is the local
envtest kube-apiserver, given as the IP endpoint with its CA. The DNS endpoint is off locally: Google
serves it with a publicly trusted certificate, which a loopback apiserver cannot have. Responses are
the client library's own ``container_v1.Cluster`` messages written as JSON, so their shape is the
library's.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from retrain_local.http import LoopbackServer
from retrain_ops.deployment import Deployment


def declared_cluster(deployment: Deployment, endpoint: str, ca_pem: str) -> Any:
    """``container_v1.Cluster`` for the deployment's cluster, its control plane at ``endpoint``: its node
    pools with their bounds, queued provisioning and flex-start as infra/platform declares them, and the
    version it asks for (``kubernetes_version``; the control plane underneath is envtest's kube-apiserver)."""
    from google.cloud import container_v1

    platform = deployment.platform
    pools = []
    for body in platform.resources("google_container_node_pool").values():
        (scaling,) = body.get("autoscaling") or [{}]
        limits = {k: int(platform.evaluate(v)) for k, v in scaling.items() if k.endswith("node_count")}
        (queued,) = body.get("queued_provisioning") or [{}]
        (node,) = body.get("node_config") or [{}]
        pools.append(
            container_v1.NodePool(
                name=platform.evaluate(body["name"]),
                autoscaling=container_v1.NodePoolAutoscaling(enabled=bool(limits), **limits),
                queued_provisioning=container_v1.NodePool.QueuedProvisioning(
                    enabled=bool(platform.evaluate(queued.get("enabled", False)))
                ),
                config=container_v1.NodeConfig(
                    flex_start=bool(platform.evaluate(node.get("flex_start", False)))
                ),
                status=container_v1.NodePool.Status.RUNNING,
            )
        )
    return container_v1.Cluster(
        current_master_version=f"{platform.var('kubernetes_version')}.0-gke.0",
        name=str(platform.output("cluster_name")),
        location=str(platform.var("region")),
        endpoint=endpoint,
        master_auth=container_v1.MasterAuth(
            cluster_ca_certificate=base64.b64encode(ca_pem.encode()).decode()
        ),
        control_plane_endpoints_config=container_v1.ControlPlaneEndpointsConfig(
            dns_endpoint_config=container_v1.ControlPlaneEndpointsConfig.DNSEndpointConfig(
                allow_external_traffic=False
            )
        ),
        node_pools=pools,
        status=container_v1.Cluster.Status.RUNNING,
    )


class GkeApiServer:
    """Serves ``GET /v1/projects/{project}/locations/{location}/clusters/{cluster}`` for one cluster."""

    def __init__(
        self,
        project: str,
        cluster: Any,
        services: list[str] | None = None,
        quotas: dict[str, float] | None = None,
        authorize: Callable[[str | None, str], str | None] | None = None,
    ) -> None:
        self.authorize = authorize
        """(the caller's bearer token, the permission) -> None, or why it is refused (403); None: any
        caller may read."""
        self.project = project
        self.name = f"projects/{project}/locations/{cluster.location}/clusters/{cluster.name}"
        self.cluster = cluster
        self.services = services or []
        self.quotas = quotas or {}
        self._server: LoopbackServer | None = None

    @classmethod
    def for_control_plane(
        cls,
        deployment: Deployment,
        server: str,
        ca_file: str,
        authorize: Callable[[str | None, str], str | None] | None = None,
    ) -> GkeApiServer:
        """The deployment's cluster with the local control plane at ``server`` (``https://host:port``); the
        project has the APIs the bootstrap enables, and GPU quota for exactly the DWS pool's nodes."""
        from retrain_ops.doctor import MACHINE_GPUS, PREEMPTIBLE_GPU_QUOTA

        endpoint = server.removeprefix("https://")
        cluster = declared_cluster(deployment, endpoint, Path(ca_file).read_text())
        p = deployment.platform
        machine = str(p.output("gpu_machine_type"))
        gpu = next((g for prefix, g in MACHINE_GPUS.items() if machine.startswith(prefix)), "")
        gpus = float(p.output("gpu_max_nodes")) * float(p.output("gpus_per_node"))
        quotas = {PREEMPTIBLE_GPU_QUOTA[gpu]: gpus} if gpu in PREEMPTIBLE_GPU_QUOTA else {}
        return cls(deployment.project, cluster, deployment.enabled_services(), quotas, authorize)

    @property
    def base_url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_port}"

    def start(self) -> GkeApiServer:
        from google.cloud import container_v1

        name, body = self.name, container_v1.Cluster.to_json(self.cluster).encode()
        # Service Usage services.list and Compute Engine regions.get, the doctor's reads, in their shapes.
        number = "0"  # the project's number stands in the services' names, as in Service Usage's answers
        services = {
            "services": [
                {"name": f"projects/{number}/services/{s}", "config": {"name": s}, "state": "ENABLED"}
                for s in self.services
            ]
        }
        region = f"/compute/v1/projects/{self.project}/regions/{self.cluster.location}"
        quotas = {
            "name": self.cluster.location,
            "quotas": [{"metric": m, "limit": limit, "usage": 0.0} for m, limit in self.quotas.items()],
        }
        # each read with the permission Google checks for it
        answers = {
            f"/v1/{name}": (body, "container.clusters.get"),
            f"/v1/projects/{self.project}/services": (
                json.dumps(services).encode(),
                "serviceusage.services.list",
            ),
            region: (json.dumps(quotas).encode(), "compute.regions.get"),
        }
        authorize = self.authorize

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path in answers:
                    payload, permission = answers[path]
                    token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip() or None
                    refusal = authorize(token, permission) if authorize else None
                    if refusal is not None:
                        error = {"code": 403, "message": refusal, "status": "PERMISSION_DENIED"}
                        self._answer(403, json.dumps({"error": error}).encode())
                        return
                    self._answer(200, payload)
                else:
                    # Google's JSON error shape (the REST transport maps it to NotFound).
                    requested = path.removeprefix("/v1/")
                    error = {"code": 404, "message": f"Not found: {requested}.", "status": "NOT_FOUND"}
                    self._answer(404, json.dumps({"error": error}).encode())

            def _answer(self, code: int, payload: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = LoopbackServer(Handler)
        threading.Thread(target=self._server.serve_forever, name="gke-api", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
