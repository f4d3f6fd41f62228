"""``retrain doctor``'s checks (retrain_ops.doctor): what a new DWS project lacks is named with its fix.
The project reads go over REST as Google serves them (Service Usage services.list, Compute Engine
regions.get), replayed here by a loopback server in those shapes."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests
from google.cloud import container_v1

from retrain import config
from retrain_ops.doctor import RestProjectApis, Verdict, examine

SETTINGS = dataclasses.replace(config.load({}), project="acme", region="us-east5", nodes=2, gpus_per_node=8)
DIGEST = "sha256:" + "cd" * 32
TEMPLATE = json.dumps({"image": f"us-east5-docker.pkg.dev/acme/retrain_tokenize/@{DIGEST}"}).encode()


@pytest.fixture
def google() -> Iterator[dict[str, Any]]:
    """A loopback stand-in of the two Google reads, answering in their v1 JSON shapes."""
    answers: dict[str, Any] = {
        "services": ["compute.googleapis.com", "container.googleapis.com"],
        "quotas": [{"metric": "PREEMPTIBLE_NVIDIA_H100_GPUS", "limit": 0.0, "usage": 0.0}],
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/v1/projects/acme/services":
                services = [
                    {"name": f"projects/123/services/{s}", "config": {"name": s}, "state": "ENABLED"}
                    for s in answers["services"]
                ]
                body: Any = {"services": services}
            elif path == "/compute/v1/projects/acme/regions/us-east5":
                body = {"kind": "compute#region", "name": "us-east5", "quotas": answers["quotas"]}
            else:
                self.send_response(404)
                self.end_headers()
                return
            payload = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    answers["apis"] = RestProjectApis(requests.Session(), base, base)
    yield answers
    server.shutdown()
    server.server_close()


def cluster(version: str = "1.35.8-gke.1225000", flex_start: bool = True, pool: str = "a3-dws") -> Any:
    return container_v1.Cluster(
        current_master_version=version,
        node_pools=[
            container_v1.NodePool(
                name=pool,
                autoscaling=container_v1.NodePoolAutoscaling(enabled=True, total_max_node_count=4),
                queued_provisioning=container_v1.NodePool.QueuedProvisioning(enabled=True),
                config=container_v1.NodeConfig(flex_start=flex_start),
            )
        ],
    )


def verdicts(findings: list[Any]) -> dict[str, Verdict]:
    return {f.check: f.verdict for f in findings}


def test_a_new_project_is_told_what_it_lacks_before_anything_is_spent(google: dict[str, Any]) -> None:
    """No preemptible H100 quota (a new project's), an API off, an old GKE, no flex-start pool, a
    template naming its image by tag: each is a failure with its fix."""
    required = ["compute.googleapis.com", "container.googleapis.com", "dataflow.googleapis.com"]
    tagged = json.dumps({"image": "us-east5-docker.pkg.dev/acme/retrain_tokenize/:latest"}).encode()
    findings = examine(
        SETTINGS, google["apis"], cluster("1.31.9-gke.100", flex_start=False), lambda _: tagged, required
    )
    assert verdicts(findings) == {
        "apis": Verdict.FAIL,
        "gpu-quota": Verdict.FAIL,
        "active-resize-requests": Verdict.UNKNOWN,
        "gke-version": Verdict.FAIL,
        "dws-pool": Verdict.FAIL,
        "template": Verdict.FAIL,
    }
    by = {f.check: f for f in findings}
    assert "dataflow.googleapis.com" in by["apis"].detail and "gcloud services enable" in by["apis"].fix
    assert by["gpu-quota"].detail == "PREEMPTIBLE_NVIDIA_H100_GPUS in us-east5: 0 free of 0, a run needs 16"
    assert "preemptible quota" in by["gpu-quota"].fix
    assert "not flex-start" in by["dws-pool"].detail and "not by digest" in by["template"].detail


def test_a_ready_project_passes(google: dict[str, Any]) -> None:
    google["quotas"] = [{"metric": "PREEMPTIBLE_NVIDIA_H100_GPUS", "limit": 32.0, "usage": 8.0}]
    findings = examine(SETTINGS, google["apis"], cluster(), lambda _: TEMPLATE, google["services"])
    assert {f.verdict for f in findings if f.check != "active-resize-requests"} == {Verdict.PASS}


def test_a_pool_removed_from_under_the_cluster_is_named(google: dict[str, Any]) -> None:
    google["quotas"] = [{"metric": "PREEMPTIBLE_NVIDIA_H100_GPUS", "limit": 32.0, "usage": 0.0}]
    findings = examine(SETTINGS, google["apis"], cluster(pool="other"), lambda _: TEMPLATE, [])
    (pool,) = [f for f in findings if f.check == "dws-pool"]
    assert pool.verdict == Verdict.FAIL and "autoscaler#9490" in pool.detail
