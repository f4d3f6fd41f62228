"""The GKE API (container.googleapis.com v1) for the local stack: ``projects.locations.clusters.get``,
the one method retrain calls (``retrain.adapters.cluster``), over HTTP as the client's REST transport
speaks it.

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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from retrain.deployment import Deployment


def declared_cluster(deployment: Deployment, endpoint: str, ca_pem: str) -> Any:
    """``container_v1.Cluster`` for the deployment's cluster, its control plane at ``endpoint``."""
    from google.cloud import container_v1

    platform = deployment.platform
    pools = []
    for body in platform.resources("google_container_node_pool").values():
        (scaling,) = body.get("autoscaling") or [{}]
        limits = {k: int(platform.evaluate(v)) for k, v in scaling.items() if k.endswith("node_count")}
        pools.append(
            container_v1.NodePool(
                name=platform.evaluate(body["name"]),
                autoscaling=container_v1.NodePoolAutoscaling(enabled=bool(limits), **limits),
                status=container_v1.NodePool.Status.RUNNING,
            )
        )
    return container_v1.Cluster(
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

    def __init__(self, project: str, cluster: Any) -> None:
        self.name = f"projects/{project}/locations/{cluster.location}/clusters/{cluster.name}"
        self.cluster = cluster
        self._server: ThreadingHTTPServer | None = None

    @classmethod
    def for_control_plane(cls, deployment: Deployment, server: str, ca_file: str) -> GkeApiServer:
        """The deployment's cluster with the local control plane at ``server`` (``https://host:port``)."""
        endpoint = server.removeprefix("https://")
        return cls(deployment.project, declared_cluster(deployment, endpoint, Path(ca_file).read_text()))

    @property
    def base_url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_port}"

    def start(self) -> GkeApiServer:
        from google.cloud import container_v1

        name, body = self.name, container_v1.Cluster.to_json(self.cluster).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == f"/v1/{name}":
                    self._answer(200, body)
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

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, name="gke-api", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
