"""The GKE node pool the DWS provisioner grows and the autoscaler shrinks: Node objects in the API server,
labelled and tainted as GKE labels an A3 queued-provisioning pool's nodes, which request each node is
for, which nodes a pod has run on, and what the nodes cost (node-seconds, the pool's bill)."""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from typing import Any

from retrain_local.cluster.status import timestamp

log = logging.getLogger(__name__)

GPU = "nvidia.com/gpu"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
OWNER_ANNOTATION = "retrain.dev/provisioning-request"
TWIN_LABEL = "retrain.dev/cluster-twin"
ACCELERATORS = {
    "a3-highgpu": "nvidia-h100-80gb",
    "a3-megagpu": "nvidia-h100-mega-80gb",
    "a3-ultragpu": "nvidia-h200-141gb",
    "a2-highgpu": "nvidia-tesla-a100",
    "a2-ultragpu": "nvidia-a100-80gb",
    "g2-standard": "nvidia-l4",
}


class NodePool:
    def __init__(
        self, core: Any, *, namespace: str, name: str, machine_type: str, gpus_per_node: int
    ) -> None:
        self.core = core
        self.namespace = namespace
        self.name = name
        self.machine_type = machine_type
        self.gpus_per_node = gpus_per_node
        self.id = secrets.token_hex(3)
        self.min_nodes, self.max_nodes = 0, 1000
        self.created: dict[str, float] = {}  # node -> when it came up (monotonic)
        self.owner: dict[str, str] = {}  # node -> the uid of the ProvisioningRequest it is for
        self.ever: set[str] = set()
        self.consumed: set[str] = set()  # nodes a pod has run on
        self._seconds_done = 0.0

    def names(self) -> list[str]:
        return sorted(self.created)

    def node_seconds(self) -> float:
        """Accumulated lifetime of every node the pool has had."""
        t = time.monotonic()
        return self._seconds_done + sum(t - c for c in self.created.values())

    def lost(self, node: str) -> bool:
        """The pool had this node and it is gone (deleted, preempted)."""
        return node in self.ever and node not in self.created

    def owned_by(self, request_uid: str) -> set[str]:
        return {n for n, uid in self.owner.items() if uid == request_uid}

    def accelerator(self) -> str:
        for prefix, acc in ACCELERATORS.items():
            if self.machine_type.startswith(prefix):
                return acc
        return "nvidia-h100-80gb"

    def create(self, request_uid: str, request_name: str) -> str:
        name = f"gke-twin-{self.name}-{self.id}-{secrets.token_hex(2)}"[:63]
        gpus = str(self.gpus_per_node)
        resources = {"cpu": "208", "memory": "1872Gi", "pods": "110", "ephemeral-storage": "350Gi", GPU: gpus}
        body: dict[str, Any] = {
            "metadata": {
                "name": name,
                "labels": {
                    NODEPOOL_LABEL: self.name,
                    "cloud.google.com/gke-queued": "true",
                    "cloud.google.com/gke-flex-start": "true",  # the pool is flex-start (infra/platform)
                    "cloud.google.com/gke-accelerator": self.accelerator(),
                    "cloud.google.com/machine-family": self.machine_type.split("-")[0],
                    "node.kubernetes.io/instance-type": self.machine_type,
                    "beta.kubernetes.io/instance-type": self.machine_type,
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    TWIN_LABEL: self.id,
                },
                "annotations": {OWNER_ANNOTATION: f"{self.namespace}/{request_name}"},
            },
            "spec": {"taints": [{"key": GPU, "value": "present", "effect": "NoSchedule"}]},
        }
        self.core.create_node(body)
        status = {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": timestamp(),
                    "lastTransitionTime": timestamp(),
                }
            ],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": name},
            ],
        }
        self.core.patch_node_status(name, {"status": status}, _content_type="application/merge-patch+json")
        # The TaintNodesByCondition admission adds node.kubernetes.io/not-ready on create; the node
        # lifecycle controller (absent here) lifts it once the node is Ready: do its part.
        self.core.patch_node(
            name, {"spec": {"taints": body["spec"]["taints"]}}, _content_type="application/merge-patch+json"
        )
        self.created[name] = time.monotonic()
        self.ever.add(name)
        self.owner[name] = request_uid
        log.info("twin: node %s up for %s", name, request_name)
        return name

    def delete(self, name: str) -> None:
        from kubernetes.client import ApiException

        with contextlib.suppress(ApiException):
            self.core.delete_node(name, grace_period_seconds=0)
        created = self.created.pop(name, None)
        if created is not None:
            self._seconds_done += time.monotonic() - created
        self.owner.pop(name, None)
