"""The local cluster twin: plays GKE's DWS provisioner, the JobSet controller and the kubelet against a real
API server (see :mod:`retrain.local.envtest`), so runs and tests exercise the real objects and statuses.

- DWS provisioner: for each ProvisioningRequest (autoscaling.x-k8s.io/v1) of the twin's namespace and node
  pool, sets ``Accepted``; after ``provision_delay_s`` creates ``podSets[0].count`` Node objects labelled
  like a GKE A3 queued-provisioning pool (GPU capacity, ``nvidia.com/gpu=present:NoSchedule`` taint,
  annotated with the owning request) and sets ``Provisioned=True``; a request beyond the pool's
  autoscaling maximum, or with ``Faults(provisioning="fail")``, gets ``Failed=True``; ``"never"`` leaves it
  pending.  A deleted request's nodes go once they have been unneeded for ``scale_down_delay_s`` (the
  cluster autoscaler's scale-down delay); a lost (preempted) node is replaced after the provisioning delay.
- JobSet controller + kubelet: for each JobSet (jobset.x-k8s.io/v1alpha2), once enough Ready nodes match
  the pod template's nodeSelector and tolerations, creates one Pod per replicated-job replica x
  parallelism (bound to a node) and runs each container's ``command + args`` as a local process (in its
  own process group) from the container's local image (:mod:`retrain.local.images`): container paths
  are translated to host paths, Cloud Storage FUSE volumes are host folders written back to the bucket
  (:mod:`retrain.local.gcsfuse`), and torchrun's rendezvous variables point at 127.0.0.1.  It writes Pod
  and JobSet status through the status subresources as the JobSet controller does
  (``replicatedJobsStatus``, ``restarts``, ``Completed``/``Failed`` conditions, ``terminalState``),
  applies ``failurePolicy.maxRestarts`` (recreate all pods) and ``ttlSecondsAfterFinished``, and
  kills/deletes everything of a deleted JobSet.

The twin reconciles level-triggered: it lists the objects every ``poll_s`` (a controller's resync, with a
short period) instead of holding watches, which keeps it simple and robust to restarts of either side.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.api_core.exceptions import Forbidden

from retrain.adapters.credentials import LOCAL_TOKEN_VAR
from retrain.local import processes
from retrain.local.gcsfuse import DRIVER as GCSFUSE_DRIVER
from retrain.local.gcsfuse import FuseMount, named_paths
from retrain.local.images import LocalImage, local_images, translate
from retrain.local.processes import free_port

log = logging.getLogger(__name__)

PR_GROUP, PR_VERSION, PR_PLURAL = "autoscaling.x-k8s.io", "v1", "provisioningrequests"
JS_GROUP, JS_VERSION, JS_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
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
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
#: What a pod's process takes from the twin's own environment (a container starts from its image's).
HOST_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "USER")
#: How often a running pod's Cloud Storage FUSE writes reach the bucket (and at the pod's end).
FUSE_SYNC_S = 2.0


PROVISIONING_FAULTS = ("ok", "fail", "never", "stuck_once")


@dataclass
class Faults:
    provisioning: str = "ok"
    """ok; fail (Failed=True); never (Accepted, never provisioned: a pool gone from under it,
    kubernetes/autoscaler#9490); stuck_once (a run's first request stays Accepted, a new one with its name
    is provisioned: kubernetes-sigs/kueue#3245)."""
    crash_pod_once: bool = False
    crash_pods_always: bool = False  # every attempt's rank 0 dies: the JobSet exhausts maxRestarts
    preempt_node_after_s: float | None = None
    hold_training_s: float = 0.0  # pods that exited 0 count as running until this long after their start
    revoke_capacity_after_s: float | None = None
    """DWS takes a provisioned request's capacity back this long after provisioning (CapacityRevoked)."""
    unschedulable: bool = False
    """Pods never land on the provisioned nodes: the booking expires (BookingExpired) after the window."""

    def __post_init__(self) -> None:
        if self.provisioning not in PROVISIONING_FAULTS:
            raise ValueError(
                f"Faults.provisioning must be one of {PROVISIONING_FAULTS}, not {self.provisioning!r}"
            )


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


#: Set in every process of a pod (its name): what stands in for the pod's cgroup when the node goes.
POD_MARK = "RETRAIN_TWIN_POD"


def _marked(pod_name: str) -> list[int]:
    """Every live process carrying ``pod_name``'s mark in its environment: the pod's containers and all
    they started, also those in sessions of their own (torchrun's workers) or left behind by a parent
    that exited.  Read from /proc (``environ``: the environment a process started with, inherited)."""
    mark = f"{POD_MARK}={pod_name}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except (OSError, ValueError):
            continue
    return found


def _condition(
    old: list[dict[str, Any]], ctype: str, status: str, reason: str, message: str
) -> list[dict[str, Any]]:
    """``old`` with condition ``ctype`` set (lastTransitionTime kept when the status is unchanged)."""
    out, found = [], False
    for c in old:
        if c.get("type") == ctype:
            found = True
            ltt = c.get("lastTransitionTime") if c.get("status") == status else _now()
            c = {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": ltt or _now(),
            }
        out.append(c)
    if not found:
        out.append(
            {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": _now(),
            }
        )
    return out


def _is_true(conds: list[dict[str, Any]], ctype: str) -> bool:
    return any(c.get("type") == ctype and c.get("status") == "True" for c in conds)


@dataclass
class _PR:
    uid: str
    name: str
    count: int
    seen: float
    provisioned: bool = False
    nodes: set[str] = field(default_factory=set)
    short_since: float | None = None
    provisioned_at: float = 0.0
    stuck: bool = False
    ended: bool = False
    """Its capacity was taken back (CapacityRevoked) or its booking expired (BookingExpired)."""


@dataclass
class _Pod:
    name: str
    rjob: str
    job_index: int
    index: int  # completion index within the Job
    rank: int
    node: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Any] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    forced_failure: str | None = None
    result: str | None = None  # "Succeeded" | "Failed"
    reason: str = ""
    fuse: dict[str, FuseMount] = field(default_factory=dict)  # mountPath -> its Cloud Storage FUSE
    synced_at: float = 0.0
    started_at: float = field(default_factory=time.monotonic)


@dataclass
class _Run:
    uid: str
    name: str
    port: int
    attempt: int = 0
    pods: dict[str, _Pod] = field(default_factory=dict)
    started: float = 0.0
    last_status: Any = None
    finished: bool = False


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
        images: dict[str, LocalImage] | None = None,
        scale_down_delay_s: float = 0.0,
        booking_window_s: float = 600.0,
        pod_identity: Callable[[str, str], Mapping[str, str]] | None = None,
    ) -> None:
        """``booking_window_s``: how long provisioned nodes wait for their pods before the booking expires
        ("You have 10 minutes to start the Pods to consume provisioned resources", GKE's
        provisioningrequest page).  ``pod_identity``: (namespace, Kubernetes service account) -> the
        environment a pod's processes get to call Google as the account Workload Identity maps it to
        (its ``RETRAIN_LOCAL_ACCESS_TOKEN`` is what its Cloud Storage FUSE mounts present too)."""
        from kubernetes import client

        self.api = api
        self.namespace = namespace
        self.node_pool = node_pool
        self.machine_type = machine_type
        self.gpus_per_node = gpus_per_node
        self.provision_delay_s = provision_delay_s
        self.workdir = Path(workdir)
        self.pod_env = dict(pod_env or {})
        self.pod_identity = pod_identity
        self.images = images if images is not None else local_images(self.workdir)
        self.scale_down_delay_s = scale_down_delay_s
        self.booking_window_s = booking_window_s
        self._stuck_names: set[str] = set()
        self._consumed: set[str] = set()  # nodes a pod has run on
        self._unneeded: dict[str, float] = {}  # node -> since when no ProvisioningRequest holds it
        self.faults = faults or Faults()
        self.poll_s = poll_s
        self.min_nodes, self.max_nodes = 0, 1000
        self._core: Any = client.CoreV1Api(api)
        self._objects: Any = client.CustomObjectsApi(api)
        self._id = secrets.token_hex(3)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prs: dict[str, _PR] = {}
        self._nodes: dict[str, float] = {}  # node -> created (monotonic)
        self._node_owner: dict[str, str] = {}  # node -> PR uid
        self._ever_nodes: set[str] = set()
        self._node_seconds_done = 0.0
        self._runs: dict[str, _Run] = {}
        self._crashed_once = False
        self._preempted_once = False
        self.errors: list[str] = []

    # --- public ----------------------------------------------------------------------------------
    def start(self) -> ClusterTwin:
        from retrain.local.envtest import ensure_service_account

        self.workdir.mkdir(parents=True, exist_ok=True)
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
            for run in list(self._runs.values()):
                self._teardown_run(run, delete_pods=True)
            self._runs.clear()
            for node in list(self._nodes):
                self._delete_node(node)

    def set_autoscaling(self, min_nodes: int, max_nodes: int) -> None:
        """The node pool's autoscaling bounds; requests beyond ``max_nodes`` are not provisioned and idle
        nodes above it are removed."""
        if min_nodes < 0 or max_nodes < min_nodes:
            raise ValueError("need 0 <= min_nodes <= max_nodes")
        with self._lock:
            self.min_nodes, self.max_nodes = min_nodes, max_nodes

    def node_names(self) -> list[str]:
        with self._lock:
            return sorted(self._nodes)

    def node_seconds(self) -> float:
        """Accumulated lifetime of every node the twin created (the bill of a node pool)."""
        now = time.monotonic()
        with self._lock:
            return self._node_seconds_done + sum(now - t for t in self._nodes.values())

    def __enter__(self) -> ClusterTwin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- loop ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    self._reconcile_provisioning()
                    self._reconcile_jobsets()
            except Exception as e:  # keep the twin alive; record for tests and logs
                log.exception("cluster twin reconcile failed")
                self.errors.append(f"{type(e).__name__}: {e}")
                del self.errors[:-50]
            self._stop.wait(self.poll_s)

    # --- DWS provisioner -------------------------------------------------------------------------
    def _pr_status(self, name: str, conditions: list[dict[str, Any]]) -> None:
        self._objects.patch_namespaced_custom_object_status(
            PR_GROUP,
            PR_VERSION,
            self.namespace,
            PR_PLURAL,
            name,
            {"status": {"conditions": conditions}},
            _content_type="application/merge-patch+json",
        )

    def _pr_targets_pool(self, pr: dict[str, Any]) -> bool:
        from kubernetes.client import ApiException

        try:
            ref = pr["spec"]["podSets"][0]["podTemplateRef"]["name"]
            tmpl = self._core.read_namespaced_pod_template(ref, self.namespace)
        except (KeyError, IndexError, ApiException):
            return True
        selector = (tmpl.template.spec.node_selector if tmpl.template and tmpl.template.spec else None) or {}
        return selector.get(NODEPOOL_LABEL, self.node_pool) == self.node_pool

    def _reconcile_provisioning(self) -> None:
        listing = self._objects.list_namespaced_custom_object(PR_GROUP, PR_VERSION, self.namespace, PR_PLURAL)
        now = time.monotonic()
        live = set()
        for pr in listing.get("items", []):
            meta, spec = pr["metadata"], pr.get("spec") or {}
            uid, name = meta["uid"], meta["name"]
            live.add(uid)
            conds = list((pr.get("status") or {}).get("conditions") or [])
            state = self._prs.get(uid)
            if state is None:
                if _is_true(conds, "Failed") or not self._pr_targets_pool(pr):
                    continue
                count = int(spec["podSets"][0]["count"])
                state = self._prs[uid] = _PR(uid, name, count, now)
                if self.faults.provisioning == "stuck_once" and name not in self._stuck_names:
                    self._stuck_names.add(name)
                    state.stuck = True
                conds = _condition(
                    conds,
                    "Accepted",
                    "True",
                    "Accepted",
                    "ProvisioningRequest is accepted by queued provisioning",
                )
                conds = _condition(
                    conds,
                    "Provisioned",
                    "False",
                    "CapacityNotYetAvailable",
                    f"waiting for {count} {self.machine_type} nodes in pool {self.node_pool}",
                )
                self._pr_status(name, conds)
                continue
            if _is_true(conds, "Failed"):
                continue
            if state.ended:
                continue
            if not state.provisioned:
                waiting = self.faults.provisioning == "never" or state.stuck
                if waiting or now - state.seen < self.provision_delay_s:
                    continue
                others = len([n for n in self._nodes if self._node_owner.get(n) != uid])
                failure = None
                if state.count + others > self.max_nodes:
                    failure = (
                        "MaxNodesExceeded",
                        f"{state.count} nodes requested but node pool {self.node_pool} autoscaling allows "
                        f"at most {self.max_nodes} ({others} in use)",
                    )
                elif self.faults.provisioning == "fail":
                    failure = (
                        "ResourcePoolExhausted",
                        f"GCE out of resources: not enough {self.machine_type} capacity for {state.count} "
                        "nodes in the zone",
                    )
                if failure:
                    conds = _condition(conds, "Provisioned", "False", failure[0], failure[1])
                    conds = _condition(conds, "Failed", "True", failure[0], failure[1])
                    self._pr_status(name, conds)
                    continue
                for _ in range(state.count):
                    self._create_node(state)
                state.provisioned, state.provisioned_at = True, now
                conds = _condition(
                    conds,
                    "Provisioned",
                    "True",
                    "Provisioned",
                    f"Provisioning Request was successfully provisioned: {state.count} nodes",
                )
                self._pr_status(name, conds)
                continue
            ended = self._capacity_ended(state, now)
            if ended is not None:
                state.ended = True
                conds = _condition(conds, ended[0], "True", ended[0], ended[1])
                self._pr_status(name, conds)
                for node in sorted(state.nodes):
                    self._delete_node(node)
                continue
            # Provisioned: replace lost (preempted) nodes after the provisioning delay, within max.
            state.nodes &= set(self._nodes)
            if len(state.nodes) < state.count:
                if state.short_since is None:
                    state.short_since = now
                elif now - state.short_since >= self.provision_delay_s:
                    while len(state.nodes) < state.count and len(self._nodes) < self.max_nodes:
                        self._create_node(state)
                    state.short_since = None
        for uid in [u for u in self._prs if u not in live]:
            for node in sorted(self._prs[uid].nodes):
                self._unneeded.setdefault(node, now)  # the autoscaler removes it after its delay
            del self._prs[uid]
        for node, since in list(self._unneeded.items()):
            if now - since >= self.scale_down_delay_s or node not in self._nodes:
                self._unneeded.pop(node)
                self._delete_node(node)
        # Scale down idle nodes above the autoscaling max.
        if len(self._nodes) > self.max_nodes:
            busy = {p.node for r in self._runs.values() for p in r.pods.values() if p.result is None}
            for node in sorted(self._nodes):
                if len(self._nodes) <= self.max_nodes:
                    break
                if node not in busy:
                    self._delete_node(node)

    def _capacity_ended(self, state: _PR, now: float) -> tuple[str, str] | None:
        """(condition, message) when DWS ends a provisioned request's capacity: revoked by a fault, or its
        booking expired with no pod started on its nodes within the booking window."""
        revoke = self.faults.revoke_capacity_after_s
        if revoke is not None and now - state.provisioned_at >= revoke:
            return "CapacityRevoked", f"the capacity of {state.count} {self.machine_type} node(s) was revoked"
        if now - state.provisioned_at >= self.booking_window_s and not state.nodes & self._consumed:
            return (
                "BookingExpired",
                f"no Pod consumed the {state.count} provisioned node(s) within the booking",
            )
        return None

    def _accelerator(self) -> str:
        for prefix, acc in ACCELERATORS.items():
            if self.machine_type.startswith(prefix):
                return acc
        return "nvidia-h100-80gb"

    def _create_node(self, pr: _PR) -> str:
        name = f"gke-twin-{self.node_pool}-{self._id}-{secrets.token_hex(2)}"[:63]
        gpus = str(self.gpus_per_node)
        resources = {"cpu": "208", "memory": "1872Gi", "pods": "110", "ephemeral-storage": "350Gi", GPU: gpus}
        body: dict[str, Any] = {
            "metadata": {
                "name": name,
                "labels": {
                    NODEPOOL_LABEL: self.node_pool,
                    "cloud.google.com/gke-queued": "true",
                    "cloud.google.com/gke-flex-start": "true",  # the pool is flex-start (infra/platform)
                    "cloud.google.com/gke-accelerator": self._accelerator(),
                    "cloud.google.com/machine-family": self.machine_type.split("-")[0],
                    "node.kubernetes.io/instance-type": self.machine_type,
                    "beta.kubernetes.io/instance-type": self.machine_type,
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    TWIN_LABEL: self._id,
                },
                "annotations": {OWNER_ANNOTATION: f"{self.namespace}/{pr.name}"},
            },
            "spec": {"taints": [{"key": GPU, "value": "present", "effect": "NoSchedule"}]},
        }
        self._core.create_node(body)
        status = {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": _now(),
                    "lastTransitionTime": _now(),
                }
            ],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": name},
            ],
        }
        self._core.patch_node_status(name, {"status": status}, _content_type="application/merge-patch+json")
        # The TaintNodesByCondition admission adds node.kubernetes.io/not-ready on create; the node
        # lifecycle controller (absent here) lifts it once the node is Ready: do its part.
        self._core.patch_node(
            name, {"spec": {"taints": body["spec"]["taints"]}}, _content_type="application/merge-patch+json"
        )
        self._nodes[name] = time.monotonic()
        self._ever_nodes.add(name)
        self._node_owner[name] = pr.uid
        pr.nodes.add(name)
        log.info("twin: node %s up for %s", name, pr.name)
        return name

    def _delete_node(self, name: str) -> None:
        from kubernetes.client import ApiException

        self._unneeded.pop(name, None)
        with contextlib.suppress(ApiException):
            self._core.delete_node(name, grace_period_seconds=0)
        created = self._nodes.pop(name, None)
        if created is not None:
            self._node_seconds_done += time.monotonic() - created
        owner = self._node_owner.pop(name, None)
        if owner and owner in self._prs:
            self._prs[owner].nodes.discard(name)

    # --- JobSet controller + kubelet -------------------------------------------------------------
    def _reconcile_jobsets(self) -> None:
        listing = self._objects.list_namespaced_custom_object(JS_GROUP, JS_VERSION, self.namespace, JS_PLURAL)
        nodes = {n.metadata.name: n for n in self._core.list_node().items}
        live = set()
        for js in listing.get("items", []):
            live.add(js["metadata"]["uid"])
            try:
                self._reconcile_jobset(js, nodes)
            except Exception as e:
                log.exception("twin: jobset %s", js["metadata"]["name"])
                self.errors.append(f"{js['metadata']['name']}: {type(e).__name__}: {e}")
        for uid in [u for u in self._runs if u not in live]:
            self._teardown_run(self._runs.pop(uid), delete_pods=True)

    def _reconcile_jobset(self, js: dict[str, Any], nodes: dict[str, Any]) -> None:
        meta, spec = js["metadata"], js.get("spec") or {}
        status = js.get("status") or {}
        uid, name = meta["uid"], meta["name"]
        conds = list(status.get("conditions") or [])
        run = self._runs.get(uid)
        if status.get("terminalState") or _is_true(conds, "Completed") or _is_true(conds, "Failed"):
            if run and not run.finished:
                self._teardown_run(run, delete_pods=False)
                run.finished = True
            self._maybe_ttl(js, conds)
            return
        if spec.get("suspend") or spec.get("managedBy") not in (None, "jobset.sigs.k8s.io/jobset-controller"):
            return
        pools = {
            ((rj["template"]["spec"]["template"].get("spec") or {}).get("nodeSelector") or {}).get(
                NODEPOOL_LABEL
            )
            for rj in spec.get("replicatedJobs") or []
        }
        if pools - {None, self.node_pool}:
            return  # another node pool's (another twin's) JobSet
        if run is None:
            run = self._runs[uid] = _Run(uid, name, free_port(), attempt=int(status.get("restarts") or 0))
        if not run.pods:
            self._try_start(js, run, nodes)
            self._write_jobset_status(js, run, conds)
            return
        # Running: observe processes and lost nodes.
        now = time.monotonic()
        self._maybe_preempt(run, now)
        for pod in run.pods.values():
            if pod.result is not None:
                continue
            if pod.node not in nodes or (pod.node in self._ever_nodes and pod.node not in self._nodes):
                self._kill(pod)
                self._finish_pod(pod, "Failed", "NodeLost", f"node {pod.node} was deleted (preempted)")
                continue
            self._sync(pod, every_s=FUSE_SYNC_S)
            codes = [p.poll() for p in pod.procs]
            if any(c is not None and c != 0 for c in codes) or pod.forced_failure:
                self._kill(pod)
                msg = pod.forced_failure or f"container exited with code {next(c for c in codes if c)}"
                self._finish_pod(pod, "Failed", "Error", msg)
            elif all(c == 0 for c in codes):
                if time.monotonic() - pod.started_at < self.faults.hold_training_s:
                    continue  # fault injection: training that takes longer than it does here
                self._finish_pod(pod, "Succeeded", "Completed", "")
        failed = [p for p in run.pods.values() if p.result == "Failed"]
        if failed:
            self._handle_failure(js, run, conds, failed[0])
            return
        if self._success(spec, run):
            for pod in run.pods.values():
                if pod.result is None:
                    self._kill(pod)
                    self._finish_pod(pod, "Succeeded", "Completed", "success policy met")
            conds = _condition(
                conds, "Completed", "True", "AllJobsCompleted", "jobset completed successfully"
            )
            run.finished = True
            self._write_jobset_status(js, run, conds, terminal="Completed")
            self._close_logs(run)
            log.info("twin: jobset %s completed", name)
            return
        self._write_jobset_status(js, run, conds)

    def _maybe_ttl(self, js: dict[str, Any], conds: list[dict[str, Any]]) -> None:
        ttl = (js.get("spec") or {}).get("ttlSecondsAfterFinished")
        if ttl is None:
            return
        times = [c.get("lastTransitionTime") for c in conds if c.get("type") in ("Completed", "Failed")]
        if not times or not times[0]:
            return
        finished = dt.datetime.strptime(times[0], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
        if dt.datetime.now(dt.UTC) >= finished + dt.timedelta(seconds=int(ttl)):
            from kubernetes.client import ApiException

            with contextlib.suppress(ApiException):
                self._objects.delete_namespaced_custom_object(
                    JS_GROUP, JS_VERSION, self.namespace, JS_PLURAL, js["metadata"]["name"]
                )

    def _maybe_preempt(self, run: _Run, now: float) -> None:
        after = self.faults.preempt_node_after_s
        if after is None or self._preempted_once or now - run.started < after:
            return
        running = [p for p in run.pods.values() if p.result is None and p.node in self._nodes]
        if running:
            self._preempted_once = True
            victim = running[-1].node
            log.info("twin: preempting node %s", victim)
            self._delete_node(victim)

    @staticmethod
    def _tolerates(taints: list[Any], tolerations: list[dict[str, Any]]) -> bool:
        for t in taints or []:
            if t.effect not in ("NoSchedule", "NoExecute"):
                continue
            ok = False
            for tol in tolerations:
                if tol.get("effect") and tol["effect"] != t.effect:
                    continue
                if tol.get("operator") == "Exists":
                    ok = not tol.get("key") or tol["key"] == t.key
                else:
                    ok = tol.get("key") == t.key and (tol.get("value") or "") == (t.value or "")
                if ok:
                    break
            if not ok:
                return False
        return True

    def _try_start(self, js: dict[str, Any], run: _Run, nodes: dict[str, Any]) -> None:
        if self.faults.unschedulable:
            return  # no node fits its pods: they stay pending
        spec = js["spec"]
        wanted: list[tuple[str, int, int, dict[str, Any]]] = []
        for rj in spec.get("replicatedJobs") or []:
            jspec = rj["template"].get("spec") or {}
            parallelism = int(jspec.get("parallelism") or 1)
            completions = int(jspec.get("completions") or parallelism)
            for j in range(int(rj.get("replicas", 1))):
                for p in range(min(parallelism, completions)):
                    wanted.append((rj["name"], j, p, jspec["template"]))
        busy = {p.node for r in self._runs.values() for p in r.pods.values() if p.result is None}
        free: list[str] = []
        chosen: list[str] = []
        for _rjob, _j, _p, tmpl in wanted:
            pspec = tmpl.get("spec") or {}
            selector = pspec.get("nodeSelector") or {}
            need_gpu = 0
            for c in pspec.get("containers") or []:
                res = c.get("resources") or {}
                need_gpu += int((res.get("limits") or res.get("requests") or {}).get(GPU, 0))
            free = []
            for n, node in sorted(nodes.items()):
                if n in busy or n in chosen:
                    continue
                labels = node.metadata.labels or {}
                if any(labels.get(k) != v for k, v in selector.items()):
                    continue
                if node.spec.unschedulable or not self._tolerates(
                    node.spec.taints, pspec.get("tolerations") or []
                ):
                    continue
                ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
                alloc = int((node.status.allocatable or {}).get(GPU, "0") or 0) if node.status else 0
                if ready and alloc >= need_gpu:
                    free.append(n)
            if not free:
                return  # not enough capacity yet: wait
            chosen.append(free[0])
        world = len(wanted)
        attempt_dir = self.workdir / run.name / f"attempt-{run.attempt}"
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        for rank, ((rjob, j, p, tmpl), node) in enumerate(zip(wanted, chosen, strict=True)):
            pod = _Pod(f"{run.name}-{rjob}-{j}-{p}-{secrets.token_hex(3)[:5]}", rjob, j, p, rank, node)
            obj = self._pod_object(js, run, pod, tmpl)
            self._core.create_namespaced_pod(self.namespace, obj)
            run.pods[pod.name] = pod
            self._consumed.add(node)
            self._spawn(run, pod, obj, world, attempt_dir)
        run.started = time.monotonic()
        log.info("twin: jobset %s attempt %d started %d pods", run.name, run.attempt, world)

    def _pod_object(self, js: dict[str, Any], run: _Run, pod: _Pod, tmpl: dict[str, Any]) -> dict[str, Any]:
        name = run.name
        tmeta = tmpl.get("metadata") or {}
        labels = dict(tmeta.get("labels") or {})
        labels.update(
            {
                "jobset.sigs.k8s.io/jobset-name": name,
                "jobset.sigs.k8s.io/replicatedjob-name": pod.rjob,
                "jobset.sigs.k8s.io/job-index": str(pod.job_index),
                "jobset.sigs.k8s.io/restart-attempt": str(run.attempt),
                "jobset.sigs.k8s.io/jobset-uid": run.uid,
                COMPLETION_INDEX: str(pod.index),
                "job-name": f"{name}-{pod.rjob}-{pod.job_index}",
            }
        )
        annotations = dict(tmeta.get("annotations") or {})
        annotations.update(
            {
                COMPLETION_INDEX: str(pod.index),
                "jobset.sigs.k8s.io/jobset-name": name,
                "jobset.sigs.k8s.io/replicatedjob-name": pod.rjob,
                "jobset.sigs.k8s.io/job-index": str(pod.job_index),
                "jobset.sigs.k8s.io/restart-attempt": str(run.attempt),
            }
        )
        spec = copy.deepcopy(tmpl.get("spec") or {})
        spec["nodeName"] = pod.node
        spec["hostname"] = f"{name}-{pod.rjob}-{pod.job_index}-{pod.index}"
        spec["subdomain"] = ((js["spec"].get("network") or {}).get("subdomain")) or name
        spec["automountServiceAccountToken"] = False
        spec.setdefault("restartPolicy", "Never")
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod.name,
                "namespace": self.namespace,
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [
                    {
                        "apiVersion": f"{JS_GROUP}/{JS_VERSION}",
                        "kind": "JobSet",
                        "name": name,
                        "uid": run.uid,
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": spec,
        }

    @staticmethod
    def _field_ref(obj: dict[str, Any], path: str) -> str:
        meta = obj["metadata"]
        m = re.fullmatch(r"metadata\.(annotations|labels)\['(.+)'\]", path)
        if m:
            return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        return {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "spec.nodeName": obj["spec"].get("nodeName", ""),
            "status.podIP": "127.0.0.1",
            "status.hostIP": "127.0.0.1",
        }.get(path, "")

    def _spawn(self, run: _Run, pod: _Pod, obj: dict[str, Any], world: int, attempt_dir: Path) -> None:
        cwd = attempt_dir / pod.name
        cwd.mkdir(parents=True, exist_ok=True)
        logf = open(self.workdir / "logs" / f"{pod.name}.log", "ab")  # noqa: SIM115 - closed when the run ends
        pod.logs.append(logf)
        volumes = {v["name"]: v for v in obj["spec"].get("volumes") or []}
        ksa = str(obj["spec"].get("serviceAccountName") or "default")
        identity = dict(self.pod_identity(obj["metadata"]["namespace"], ksa)) if self.pod_identity else {}
        for c in obj["spec"].get("containers") or []:
            pod.containers.append(c["name"])
            image = self.images.get(str(c.get("image", "")))
            if image is None:
                pod.forced_failure = (
                    f"ErrImagePull: container {c['name']}: image {c.get('image')!r} has no local stand-in "
                    f"(the local images are {sorted(self.images)})"
                )
                continue
            raw = list(c.get("command") or []) + list(c.get("args") or [])
            if not raw:
                pod.forced_failure = (
                    f"container {c['name']} has no command (image entrypoints are not run locally)"
                )
                continue
            named = [*raw, *(str(e.get("value", "")) for e in c.get("env") or [])]
            paths = dict(image.files)
            for vm in c.get("volumeMounts") or []:
                volume, mount_path = volumes.get(vm["name"]) or {}, vm["mountPath"]
                csi = volume.get("csi") or {}
                if csi.get("driver") == GCSFUSE_DRIVER:
                    read_only = bool(vm.get("readOnly") or csi.get("readOnly"))
                    host = cwd / "root" / mount_path.lstrip("/")
                    bucket = csi["volumeAttributes"]["bucketName"]
                    fuse = pod.fuse.setdefault(
                        mount_path, FuseMount(bucket, host, read_only, identity.get(LOCAL_TOKEN_VAR))
                    )
                    try:
                        fuse.fetch(named_paths(mount_path, named))
                    except Forbidden as refused:  # the gcsfuse sidecar fails the mount, so the pod
                        pod.forced_failure = f"MountVolume.SetUp failed for volume {vm['name']!r}: {refused}"
                        continue
                    paths[mount_path] = str(host)
                elif "emptyDir" in volume:
                    host = cwd / "volumes" / vm["name"]
                    host.mkdir(parents=True, exist_ok=True)
                    paths[mount_path] = str(host)
            if pod.forced_failure:  # a mount failed: the container never starts
                continue
            env = {k: v for k, v in os.environ.items() if k in HOST_ENV}
            for e in c.get("env") or []:
                if "value" in e:
                    env[e["name"]] = translate(str(e["value"]), paths)
                elif (e.get("valueFrom") or {}).get("fieldRef"):
                    env[e["name"]] = self._field_ref(obj, e["valueFrom"]["fieldRef"]["fieldPath"])
            env.update(self.pod_env)
            env.update(identity)
            env[POD_MARK] = pod.name
            env.update(
                {
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(run.port),
                    "WORLD_SIZE": str(world),
                    "RANK": str(pod.rank),
                    "NODE_RANK": str(pod.rank),
                    "LOCAL_RANK": "0",
                    "LOCAL_WORLD_SIZE": "1",
                    "JOB_COMPLETION_INDEX": str(pod.index),
                    "HOSTNAME": obj["spec"]["hostname"],
                }
            )
            argv = [translate(self._expand(a, env), paths) for a in raw]
            env["PATH"] = os.pathsep.join([*image.path, env.get("PATH", "")])
            if argv[0] in ("python", "python3"):
                argv[0] = sys.executable
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=cwd,
                    env=env,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as e:
                pod.forced_failure = f"container {c['name']}: {e}"
                continue
            processes.record(proc.pid, f"pod {pod.name}/{c['name']}")
            pod.procs.append(proc)
        crash_now = self.faults.crash_pods_always or (self.faults.crash_pod_once and not self._crashed_once)
        if crash_now and pod.rank == 0 and pod.procs:
            self._crashed_once = True
            self._kill(pod)
            pod.forced_failure = "container killed (fault injection)"
        self._pod_status(pod, "Running")

    @staticmethod
    def _expand(arg: str, env: dict[str, str]) -> str:
        # Kubernetes' $(VAR) expansion in command/args; $$(VAR) escapes.
        return re.sub(
            r"\$\$\(|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
            lambda m: "$(" if m.group(0) == "$$(" else env.get(m.group(1), m.group(0)),
            arg,
        )

    def _kill(self, pod: _Pod) -> None:
        """Every process of the pod, as a node that goes takes them all: each container's process group,
        and every process carrying the pod's mark (torchrun starts its workers in sessions of their own,
        which outlive a killed launcher: a preempted attempt trained on to the end)."""
        for proc in pod.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for pid in _marked(
            pod.name
        ):  # what left the containers' sessions (torchrun's workers have their own)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def _pod_status(self, pod: _Pod, phase: str, reason: str = "", message: str = "") -> None:
        from kubernetes.client import ApiException

        ts = _now()
        containers = pod.containers or ["main"]
        if phase == "Running":
            state: dict[str, Any] = {"running": {"startedAt": ts}}
        else:
            code = 0 if phase == "Succeeded" else next((p.returncode for p in pod.procs if p.returncode), 1)
            state = {
                "terminated": {
                    "exitCode": int(code) if code is not None else 137,
                    "reason": reason or phase,
                    "message": message,
                    "finishedAt": ts,
                    "startedAt": ts,
                }
            }
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": "127.0.0.1",
            "podIP": "127.0.0.1",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if phase == "Running" else "False",
                    "lastTransitionTime": ts,
                }
            ],
            "containerStatuses": [
                {
                    "name": n,
                    "ready": phase == "Running",
                    "restartCount": 0,
                    "image": "local",
                    "imageID": "",
                    "state": state,
                }
                for n in containers
            ],
        }
        if phase == "Running":
            status["startTime"] = ts
        if reason:
            status["reason"], status["message"] = reason, message
        try:
            self._core.patch_namespaced_pod_status(
                pod.name, self.namespace, {"status": status}, _content_type="application/merge-patch+json"
            )
        except ApiException as e:
            if e.status != 404:
                raise

    def _finish_pod(self, pod: _Pod, result: str, reason: str, message: str) -> None:
        refused = self._sync(pod)  # what the container wrote through its FUSE mounts is in the bucket
        if refused and result == "Succeeded":  # a file closed under a refused write fails its writer
            result, reason, message = "Failed", "Error", f"gcsfuse: {refused}"
        pod.result, pod.reason = result, message or reason
        self._pod_status(pod, result, reason, message)

    def _sync(self, pod: _Pod, every_s: float = 0.0) -> str | None:
        """Write the pod's FUSE mounts back; a write Cloud Storage refused, if any."""
        now = time.monotonic()
        if now - pod.synced_at < every_s:
            return None
        pod.synced_at = now
        refused = None
        for fuse in pod.fuse.values():
            try:
                fuse.sync()
            except Forbidden as e:
                refused = refused or str(e)
                log.warning("twin: gcsfuse %s of %s: %s", fuse.bucket, pod.name, e)
            except Exception as e:  # the emulator going away must not stop the twin
                log.warning("twin: gcsfuse %s of %s: %s", fuse.bucket, pod.name, e)
        return refused

    def _success(self, spec: dict[str, Any], run: _Run) -> bool:
        policy = spec.get("successPolicy") or {}
        targets = policy.get("targetReplicatedJobs") or [
            rj["name"] for rj in spec.get("replicatedJobs") or []
        ]
        jobs: dict[tuple[str, int], list[_Pod]] = {}
        for p in run.pods.values():
            if p.rjob in targets:
                jobs.setdefault((p.rjob, p.job_index), []).append(p)
        done = [all(p.result == "Succeeded" for p in ps) for ps in jobs.values()]
        if not done:
            return False
        return any(done) if policy.get("operator") == "Any" else all(done)

    def _handle_failure(
        self, js: dict[str, Any], run: _Run, conds: list[dict[str, Any]], first: _Pod
    ) -> None:
        for pod in run.pods.values():
            if pod.result is None:
                self._kill(pod)
                self._finish_pod(pod, "Failed", "Terminated", "restarting the jobset")
        failed_job = f"{run.name}-{first.rjob}-{first.job_index}"
        policy = (js.get("spec") or {}).get("failurePolicy")
        restarts = run.attempt
        if policy is None or restarts >= int(policy.get("maxRestarts") or 0):
            if policy is None:
                reason, base = "FailedJobs", "jobset failed due to one or more job failures"
            else:
                reason, base = "ReachedMaxRestarts", "jobset failed due to reaching max number of restarts"
            message = f"{base} (first failed job: {failed_job})"
            conds = _condition(conds, "Failed", "True", reason, message)
            run.finished = True
            self._write_jobset_status(js, run, conds, terminal="Failed")
            self._close_logs(run)
            log.info("twin: jobset %s failed: %s", run.name, message)
            return
        # Recreate all: delete this attempt's pods, count the restart, wait for capacity again.
        log.info("twin: jobset %s restarting after %s failed (%s)", run.name, first.name, first.reason)
        self._teardown_run(run, delete_pods=True)
        run.attempt += 1
        run.pods = {}
        self._write_jobset_status(js, run, conds)

    def _teardown_run(self, run: _Run, *, delete_pods: bool) -> None:
        from kubernetes.client import ApiException

        for pod in run.pods.values():
            self._kill(pod)
            if pod.result is None:
                self._sync(pod)
            if delete_pods:
                with contextlib.suppress(ApiException):
                    self._core.delete_namespaced_pod(pod.name, self.namespace, grace_period_seconds=0)
        self._close_logs(run)

    @staticmethod
    def _close_logs(run: _Run) -> None:
        for pod in run.pods.values():
            for f in pod.logs:
                with contextlib.suppress(OSError):
                    f.close()

    def _write_jobset_status(
        self, js: dict[str, Any], run: _Run, conds: list[dict[str, Any]], terminal: str | None = None
    ) -> None:
        rjs = []
        for rj in js["spec"].get("replicatedJobs") or []:
            counts = {"active": 0, "ready": 0, "succeeded": 0, "failed": 0, "suspended": 0}
            jobs: dict[int, list[_Pod]] = {}
            for p in run.pods.values():
                if p.rjob == rj["name"]:
                    jobs.setdefault(p.job_index, []).append(p)
            for pods in jobs.values():
                if any(p.result == "Failed" for p in pods):
                    counts["failed"] += 1
                elif all(p.result == "Succeeded" for p in pods):
                    counts["succeeded"] += 1
                else:
                    counts["active"] += 1
                    if all(p.result is None for p in pods):
                        counts["ready"] += 1
            rjs.append({"name": rj["name"], **counts})
        status: dict[str, Any] = {
            "replicatedJobsStatus": rjs,
            "restarts": run.attempt,
            "restartsCountTowardsMax": run.attempt,
            "conditions": conds,
        }
        if terminal:
            status["terminalState"] = terminal
        key = repr(status)
        if key == run.last_status:
            return
        self._objects.patch_namespaced_custom_object_status(
            JS_GROUP,
            JS_VERSION,
            self.namespace,
            JS_PLURAL,
            run.name,
            {"status": status},
            _content_type="application/merge-patch+json",
        )
        run.last_status = key
