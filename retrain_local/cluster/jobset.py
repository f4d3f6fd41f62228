"""The JobSet controller's part (jobset.x-k8s.io/v1alpha2), with the scheduler's: once enough Ready nodes
match a JobSet's pod template (nodeSelector, tolerations, GPUs), one Pod per replicated-job replica x
parallelism, bound to a node and run by the kubelet.  It writes the JobSet's status through its status
subresource as the JobSet controller does (``replicatedJobsStatus``, ``restarts``, ``Completed``/``Failed``
conditions, ``terminalState``), applies ``successPolicy``, ``failurePolicy.maxRestarts`` (recreate all
pods) and ``ttlSecondsAfterFinished``, and kills and deletes everything of a deleted JobSet."""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain_local.cluster.faults import Faults
from retrain_local.cluster.kubelet import FUSE_SYNC_S, Kubelet, Pod, Rendezvous
from retrain_local.cluster.nodes import GPU, NODEPOOL_LABEL, NodePool
from retrain_local.cluster.status import is_true, set_condition
from retrain_local.processes import free_port

log = logging.getLogger(__name__)

JS_GROUP, JS_VERSION, JS_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


@dataclass
class JobSetRun:
    """What the controller holds of one JobSet (by uid) and its current attempt's pods."""

    uid: str
    name: str
    port: int
    attempt: int = 0
    pods: dict[str, Pod] = field(default_factory=dict)
    started: float = 0.0
    last_status: Any = None
    finished: bool = False


class JobSetController:
    def __init__(
        self,
        objects: Any,
        core: Any,
        pool: NodePool,
        kubelet: Kubelet,
        *,
        faults: Faults,
        workdir: Path,
        errors: list[str],
    ) -> None:
        self.objects, self.core, self.pool, self.kubelet = objects, core, pool, kubelet
        self.faults = faults
        self.workdir = workdir
        self.errors = errors
        self.runs: dict[str, JobSetRun] = {}
        self._preempted_once = False

    @property
    def namespace(self) -> str:
        return self.pool.namespace

    def pods(self) -> list[Pod]:
        """The pods of every JobSet's current attempt."""
        return [p for r in self.runs.values() for p in r.pods.values()]

    def busy_nodes(self) -> set[str]:
        return {p.node for p in self.pods() if p.result is None}

    def reconcile(self) -> int:
        """One pass over the JobSets; how many there are."""
        listing = self.objects.list_namespaced_custom_object(JS_GROUP, JS_VERSION, self.namespace, JS_PLURAL)
        items = listing.get("items", [])
        nodes = {n.metadata.name: n for n in self.core.list_node().items} if items else {}
        live = set()
        for js in items:
            live.add(js["metadata"]["uid"])
            try:
                self._reconcile_jobset(js, nodes)
            except Exception as e:
                log.exception("twin: jobset %s", js["metadata"]["name"])
                self.errors.append(f"{js['metadata']['name']}: {type(e).__name__}: {e}")
        for uid in [u for u in self.runs if u not in live]:
            self.teardown(self.runs.pop(uid), delete_pods=True)
        return len(live)

    def stop(self) -> None:
        for run in list(self.runs.values()):
            self.teardown(run, delete_pods=True)
        self.runs.clear()

    def _reconcile_jobset(self, js: dict[str, Any], nodes: dict[str, Any]) -> None:
        meta, spec = js["metadata"], js.get("spec") or {}
        status = js.get("status") or {}
        uid, name = meta["uid"], meta["name"]
        conds = list(status.get("conditions") or [])
        run = self.runs.get(uid)
        if status.get("terminalState") or is_true(conds, "Completed") or is_true(conds, "Failed"):
            if run and not run.finished:
                self.teardown(run, delete_pods=False)
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
        if pools - {None, self.pool.name}:
            return  # another node pool's (another twin's) JobSet
        if run is None:
            run = self.runs[uid] = JobSetRun(uid, name, free_port(), attempt=int(status.get("restarts") or 0))
        if not run.pods:
            self._try_start(js, run, nodes)
            self._write_status(js, run, conds)
            return
        self._observe(run, nodes)
        failed = [p for p in run.pods.values() if p.result == "Failed"]
        if failed:
            self._handle_failure(js, run, conds, failed[0])
        elif self._success(spec, run):
            self._complete(js, run, conds)
        else:
            self._write_status(js, run, conds)

    def _observe(self, run: JobSetRun, nodes: dict[str, Any]) -> None:
        """A running attempt: its pods' processes and lost nodes."""
        self._maybe_preempt(run, time.monotonic())
        for pod in run.pods.values():
            if pod.result is not None:
                continue
            if pod.node not in nodes or self.pool.lost(pod.node):
                self.kubelet.kill(pod)
                self.kubelet.finish(pod, "Failed", "NodeLost", f"node {pod.node} was deleted (preempted)")
                continue
            self.kubelet.sync(pod, every_s=FUSE_SYNC_S)
            codes = [p.poll() for p in pod.procs]
            if any(c is not None and c != 0 for c in codes) or pod.forced_failure:
                self.kubelet.kill(pod)
                msg = pod.forced_failure or f"container exited with code {next(c for c in codes if c)}"
                self.kubelet.finish(pod, "Failed", "Error", msg)
            elif all(c == 0 for c in codes):
                if time.monotonic() - pod.started_at < self.faults.hold_training_s:
                    continue  # fault injection: training that takes longer than it does here
                self.kubelet.finish(pod, "Succeeded", "Completed", "")

    def _complete(self, js: dict[str, Any], run: JobSetRun, conds: list[dict[str, Any]]) -> None:
        for pod in run.pods.values():
            if pod.result is None:
                self.kubelet.kill(pod)
                self.kubelet.finish(pod, "Succeeded", "Completed", "success policy met")
        conds = set_condition(conds, "Completed", "True", "AllJobsCompleted", "jobset completed successfully")
        run.finished = True
        self._write_status(js, run, conds, terminal="Completed")
        self.kubelet.close_logs(list(run.pods.values()))
        log.info("twin: jobset %s completed", run.name)

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
                self.objects.delete_namespaced_custom_object(
                    JS_GROUP, JS_VERSION, self.namespace, JS_PLURAL, js["metadata"]["name"]
                )

    def _maybe_preempt(self, run: JobSetRun, now: float) -> None:
        after = self.faults.preempt_node_after_s
        if after is None or self._preempted_once or now - run.started < after:
            return
        running = [p for p in run.pods.values() if p.result is None and p.node in self.pool.created]
        if running:
            self._preempted_once = True
            victim = running[-1].node
            log.info("twin: preempting node %s", victim)
            self.pool.delete(victim)

    def _try_start(self, js: dict[str, Any], run: JobSetRun, nodes: dict[str, Any]) -> None:
        if self.faults.unschedulable:
            return  # no node fits its pods: they stay pending
        wanted: list[tuple[str, int, int, dict[str, Any]]] = []
        for rj in js["spec"].get("replicatedJobs") or []:
            jspec = rj["template"].get("spec") or {}
            parallelism = int(jspec.get("parallelism") or 1)
            completions = int(jspec.get("completions") or parallelism)
            for j in range(int(rj.get("replicas", 1))):
                for p in range(min(parallelism, completions)):
                    wanted.append((rj["name"], j, p, jspec["template"]))
        chosen = place([tmpl for *_, tmpl in wanted], nodes, self.busy_nodes())
        if chosen is None:
            return  # not enough capacity yet: wait
        meet = Rendezvous(port=run.port, world=len(wanted))
        attempt_dir = self.workdir / run.name / f"attempt-{run.attempt}"
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        for rank, ((rjob, j, p, tmpl), node) in enumerate(zip(wanted, chosen, strict=True)):
            pod = Pod(f"{run.name}-{rjob}-{j}-{p}-{secrets.token_hex(3)[:5]}", rjob, j, p, rank, node)
            obj = pod_object(js, run, pod, tmpl)
            self.core.create_namespaced_pod(self.namespace, obj)
            run.pods[pod.name] = pod
            self.pool.consumed.add(node)
            self.kubelet.run(pod, obj, meet, attempt_dir)
        run.started = time.monotonic()
        log.info("twin: jobset %s attempt %d started %d pods", run.name, run.attempt, len(wanted))

    @staticmethod
    def _success(spec: dict[str, Any], run: JobSetRun) -> bool:
        policy = spec.get("successPolicy") or {}
        targets = policy.get("targetReplicatedJobs") or [
            rj["name"] for rj in spec.get("replicatedJobs") or []
        ]
        jobs: dict[tuple[str, int], list[Pod]] = {}
        for p in run.pods.values():
            if p.rjob in targets:
                jobs.setdefault((p.rjob, p.job_index), []).append(p)
        done = [all(p.result == "Succeeded" for p in ps) for ps in jobs.values()]
        if not done:
            return False
        return any(done) if policy.get("operator") == "Any" else all(done)

    def _handle_failure(
        self, js: dict[str, Any], run: JobSetRun, conds: list[dict[str, Any]], first: Pod
    ) -> None:
        for pod in run.pods.values():
            if pod.result is None:
                self.kubelet.kill(pod)
                self.kubelet.finish(pod, "Failed", "Terminated", "restarting the jobset")
        failed_job = f"{run.name}-{first.rjob}-{first.job_index}"
        policy = (js.get("spec") or {}).get("failurePolicy")
        if policy is None or run.attempt >= int(policy.get("maxRestarts") or 0):
            if policy is None:
                reason, base = "FailedJobs", "jobset failed due to one or more job failures"
            else:
                reason, base = "ReachedMaxRestarts", "jobset failed due to reaching max number of restarts"
            message = f"{base} (first failed job: {failed_job})"
            conds = set_condition(conds, "Failed", "True", reason, message)
            run.finished = True
            self._write_status(js, run, conds, terminal="Failed")
            self.kubelet.close_logs(list(run.pods.values()))
            log.info("twin: jobset %s failed: %s", run.name, message)
            return
        # Recreate all: delete this attempt's pods, count the restart, wait for capacity again.
        log.info("twin: jobset %s restarting after %s failed (%s)", run.name, first.name, first.reason)
        self.teardown(run, delete_pods=True)
        run.attempt += 1
        run.pods = {}
        self._write_status(js, run, conds)

    def teardown(self, run: JobSetRun, *, delete_pods: bool) -> None:
        from kubernetes.client import ApiException

        for pod in run.pods.values():
            self.kubelet.kill(pod)
            if pod.result is None:
                self.kubelet.sync(pod)
            if delete_pods:
                with contextlib.suppress(ApiException):
                    self.core.delete_namespaced_pod(pod.name, self.namespace, grace_period_seconds=0)
        self.kubelet.close_logs(list(run.pods.values()))

    def _write_status(
        self, js: dict[str, Any], run: JobSetRun, conds: list[dict[str, Any]], terminal: str | None = None
    ) -> None:
        rjs = []
        for rj in js["spec"].get("replicatedJobs") or []:
            counts = {"active": 0, "ready": 0, "succeeded": 0, "failed": 0, "suspended": 0}
            jobs: dict[int, list[Pod]] = {}
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
        self.objects.patch_namespaced_custom_object_status(
            JS_GROUP,
            JS_VERSION,
            self.namespace,
            JS_PLURAL,
            run.name,
            {"status": status},
            _content_type="application/merge-patch+json",
        )
        run.last_status = key


def pod_object(js: dict[str, Any], run: JobSetRun, pod: Pod, tmpl: dict[str, Any]) -> dict[str, Any]:
    """The Pod the JobSet's Job makes of ``tmpl`` for ``pod``: labels and annotations as the JobSet and Job
    controllers set them, bound to its node."""
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
            "namespace": js["metadata"]["namespace"],
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


def place(templates: list[dict[str, Any]], nodes: dict[str, Any], busy: set[str]) -> list[str] | None:
    """The scheduler's part: a node for each pod template, in order (one pod per node: a GPU node is one
    rank), or None while the Ready, untainted-for-it, matching nodes with its GPUs are too few."""
    chosen: list[str] = []
    for tmpl in templates:
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
            if node.spec.unschedulable or not _tolerates(node.spec.taints, pspec.get("tolerations") or []):
                continue
            ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
            alloc = int((node.status.allocatable or {}).get(GPU, "0") or 0) if node.status else 0
            if ready and alloc >= need_gpu:
                free.append(n)
        if not free:
            return None
        chosen.append(free[0])
    return chosen


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
