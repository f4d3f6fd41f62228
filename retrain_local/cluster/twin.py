"""The cluster twin: GKE's data plane for a real API server (:mod:`retrain_local.envtest`), as three
controllers over one node pool (:mod:`.nodes`): the DWS provisioner with the autoscaler (:mod:`.dws`) and
the JobSet controller with the scheduler (:mod:`.jobset`), reconciled in turn on one loop, and the kubelet
(:mod:`.kubelet`), which runs the pods the JobSet controller binds.

It reconciles level-triggered: it lists the objects every ``poll_s`` (a controller's resync, with a short
period) instead of holding watches, which keeps it simple and robust to restarts of either side.  With
nothing to reconcile (no ProvisioningRequest, no JobSet, no node) it lists every ``idle_poll_s``: an idle
stack's polling was most of its CPU (and of its API server's), and a run's first object waits at most that
long to be seen."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from retrain_local.cluster.dws import DwsProvisioner
from retrain_local.cluster.faults import Faults
from retrain_local.cluster.jobset import JobSetController
from retrain_local.cluster.kubelet import Kubelet, Pod
from retrain_local.cluster.nodes import NodePool
from retrain_local.forkserver import ForkServer
from retrain_local.images import LocalImage, local_images

log = logging.getLogger(__name__)


class ClusterTwin:
    def __init__(
        self,
        api: Any,
        *,
        namespace: str = "default",
        node_pool: str = "a3-dws",
        machine_type: str = "a3-highgpu-8g",
        gpus_per_node: int = 8,
        provision_delay_s: float = 2.0,
        workdir: Path,
        pod_env: dict[str, str] | None = None,
        faults: Faults | None = None,
        poll_s: float = 0.2,
        idle_poll_s: float = 1.0,
        images: dict[str, LocalImage] | None = None,
        scale_down_delay_s: float = 0.0,
        booking_window_s: float = 600.0,
        pod_identity: Callable[[str, str], Mapping[str, str]] | None = None,
        fork_server: ForkServer | None = None,
    ) -> None:
        """``booking_window_s``: how long provisioned nodes wait for their pods before the booking expires
        ("You have 10 minutes to start the Pods to consume provisioned resources", GKE's
        provisioningrequest page).  ``pod_identity``: (namespace, Kubernetes service account) -> the
        environment a pod's processes get to call Google as the account Workload Identity maps it to
        (its ``RETRAIN_LOCAL_ACCESS_TOKEN`` is what its Cloud Storage FUSE mounts present too)."""
        from kubernetes import client

        self.api = api
        self.namespace = namespace
        self.workdir = Path(workdir)
        self.poll_s, self.idle_poll_s = poll_s, idle_poll_s
        self.errors: list[str] = []
        core: Any = client.CoreV1Api(api)
        objects: Any = client.CustomObjectsApi(api)
        self.pool = NodePool(
            core, namespace=namespace, name=node_pool, machine_type=machine_type, gpus_per_node=gpus_per_node
        )
        faults = faults or Faults()
        self.kubelet = Kubelet(
            core,
            namespace=namespace,
            workdir=self.workdir,
            images=images if images is not None else local_images(self.workdir),
            pod_env=dict(pod_env or {}),
            pod_identity=pod_identity,
            faults=faults,
            fork_server=fork_server,
        )
        self.fork_server = fork_server
        self.jobsets = JobSetController(
            objects, core, self.pool, self.kubelet, faults=faults, workdir=self.workdir, errors=self.errors
        )
        self.dws = DwsProvisioner(
            objects,
            core,
            self.pool,
            faults=faults,
            busy=self.jobsets.busy_nodes,
            provision_delay_s=provision_delay_s,
            scale_down_delay_s=scale_down_delay_s,
            booking_window_s=booking_window_s,
        )
        self._faults = faults
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def faults(self) -> Faults:
        return self._faults

    @faults.setter
    def faults(self, faults: Faults) -> None:
        """The faults from now on, in all three controllers."""
        with self._lock:
            self._faults = self.dws.faults = self.jobsets.faults = self.kubelet.faults = faults

    def start(self) -> ClusterTwin:
        from retrain_local.envtest import ensure_service_account

        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.fork_server:
            self.fork_server.start()
        ensure_service_account(self.api, self.namespace)
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="cluster-twin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(30)
            self._thread = None
        with self._lock:
            self.jobsets.stop()
            for node in self.pool.names():
                self.pool.delete(node)
        if self.fork_server:
            self.fork_server.stop()

    def set_autoscaling(self, min_nodes: int, max_nodes: int) -> None:
        """The node pool's autoscaling bounds; requests beyond ``max_nodes`` are not provisioned and idle
        nodes above it are removed."""
        if min_nodes < 0 or max_nodes < min_nodes:
            raise ValueError("need 0 <= min_nodes <= max_nodes")
        with self._lock:
            self.pool.min_nodes, self.pool.max_nodes = min_nodes, max_nodes

    def node_names(self) -> list[str]:
        with self._lock:
            return self.pool.names()

    def node_seconds(self) -> float:
        """Accumulated lifetime of every node the twin created (the bill of a node pool)."""
        with self._lock:
            return self.pool.node_seconds()

    def pods(self) -> list[Pod]:
        """The pods of every JobSet's current attempt."""
        with self._lock:
            return self.jobsets.pods()

    def __enter__(self) -> ClusterTwin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = True
            try:
                with self._lock:
                    busy = bool(self.dws.reconcile() + self.jobsets.reconcile() or self.pool.names())
            except Exception as e:  # keep the twin alive; record for tests and logs
                log.exception("cluster twin reconcile failed")
                self.errors.append(f"{type(e).__name__}: {e}")
                del self.errors[:-50]
            self._stop.wait(self.poll_s if busy else self.idle_poll_s)
