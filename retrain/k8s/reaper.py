"""``retrain reap``: scale to zero guaranteed, not hoped for.

The workflow always releases what it provisioned, but a crash of the workflow service, a deleted
execution or a person's ``kubectl apply`` can still leave a JobSet or a ProvisioningRequest behind, and
with it GPU nodes billed by the hour.  The reaper, run on a schedule (Cloud Scheduler -> a Job in the
cluster, or by hand), deletes every JobSet, ProvisioningRequest, PodTemplate and run service account
(the Kubernetes identity a run's write grant names) of the namespace that carries a retrain run id
(label/annotation ``retrain.dev/run-id``, see :mod:`retrain.k8s.render`) and
belongs to no live run:

- the run has no record in the ledger (``runs/{run_id}``), or
- its record is terminal (succeeded / failed / cancelled), or
- the run's work began longer than ``max_age_s`` ago (stuck: no run works that long; the default is the
  provisioning and training timeouts plus two hours; the time it waited queued behind another run does
  not count).

Objects of a live run (a record still pending / tokenizing / provisioning / training and younger than
the max age) are never touched; a ledger that cannot be read stops the reaper before it deletes anything.
It then reports the GPU nodes of the node pool (``cloud.google.com/gke-nodepool=<pool>``) still up and
for how long.  ``main`` exits 3 when such nodes are up while no live run owns any object (nothing should
be holding them: a Scheduler job alerts on it), 1 when an object could not be deleted, else 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from retrain.domain.runs import Run, parse_iso
from retrain.k8s.render import (
    GPU,
    JOBSET_API,
    NODEPOOL_LABEL,
    PROVREQ_API,
    RUN_ID_ANNOTATION,
    RUN_ID_LABEL,
)
from retrain.ports import NodeUp, Reaped, ReapReport, RunLookup

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

JOBSET, PROVREQ, PODTEMPLATE, ACCOUNT = "JobSet", "ProvisioningRequest", "PodTemplate", "ServiceAccount"
_CUSTOM = {
    JOBSET: (*JOBSET_API.split("/"), "jobsets"),
    PROVREQ: (*PROVREQ_API.split("/"), "provisioningrequests"),
}
#: What uses the nodes first, the request's template last, the run's identity once nothing runs as it.
_ORDER = (JOBSET, PROVREQ, PODTEMPLATE, ACCOUNT)


def default_max_age_s(settings: Any) -> float:
    """No run outlives its provisioning and training timeouts; two hours more cover tokenizing."""
    return float(settings.provision_timeout_s + settings.train_timeout_s + 2 * 3600)


def _parse_time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return parse_iso(str(value)) if value else None


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class _Obj:
    kind: str
    name: str
    run_id: str
    created: datetime | None


def _meta(obj: Any) -> tuple[str, dict[str, str], dict[str, str], datetime | None]:
    """(name, labels, annotations, creationTimestamp) of a dict (custom object) or a client model."""
    if isinstance(obj, dict):
        m = obj.get("metadata") or {}
        return (
            str(m.get("name")),
            dict(m.get("labels") or {}),
            dict(m.get("annotations") or {}),
            _parse_time(m.get("creationTimestamp")),
        )
    m = obj.metadata
    return m.name, dict(m.labels or {}), dict(m.annotations or {}), _parse_time(m.creation_timestamp)


def _list_objects(api: Any, namespace: str) -> list[_Obj]:
    """Every JobSet, ProvisioningRequest, PodTemplate and ServiceAccount of ``namespace`` carrying a run
    id."""
    from kubernetes import client

    custom: Any = client.CustomObjectsApi(api)
    core: Any = client.CoreV1Api(api)
    raw: dict[str, list[Any]] = {}
    for kind, (group, version, plural) in _CUSTOM.items():
        try:
            raw[kind] = list(custom.list_namespaced_custom_object(group, version, namespace, plural)["items"])
        except client.ApiException as e:
            if e.status != 404:  # 404: the CRD is not installed, so there is nothing of that kind
                raise
            raw[kind] = []
    raw[PODTEMPLATE] = list(core.list_namespaced_pod_template(namespace).items)
    raw[ACCOUNT] = list(core.list_namespaced_service_account(namespace).items)

    out: list[_Obj] = []
    by_name: dict[str, str] = {}  # PR / JobSet name -> full run id (annotations carry it unabridged)
    for kind in _ORDER:
        for obj in raw[kind]:
            name, labels, annotations, created = _meta(obj)
            run_id = annotations.get(RUN_ID_ANNOTATION)
            if kind == PODTEMPLATE and not run_id:
                # A PodTemplate carries only the label, which may be an abridged run id: take the full
                # id from its ProvisioningRequest (same name) or JobSet (the request's name less -dws).
                run_id = by_name.get(name) or by_name.get(name.removesuffix("-dws"))
            run_id = run_id or labels.get(RUN_ID_LABEL)
            if not run_id:
                continue  # not retrain's
            if kind != PODTEMPLATE:
                by_name[name] = run_id
            out.append(_Obj(kind, name, run_id, created))
    return out


def _verdict(
    run: Run | None, obj_created: datetime | None, now: datetime, max_age_s: float
) -> tuple[bool, str]:
    """(live, why) of a run from its ledger record."""
    if run is None:
        return False, "no run record in the ledger"
    status = str(run.status)
    if run.status.terminal:
        return False, f"run {status}"
    # Age counts from when the run's execution began work (tokenizing, or the first stage it recorded),
    # never from the record's creation: a run queued a day behind another is not a day into its work.
    began = run.tokenizing_at or run.provisioning_at or run.training_at
    born = _parse_time(began) or obj_created
    if born is not None:
        age = (now - born).total_seconds()
        if age > max_age_s:
            return False, f"run {status} for {_duration(age)}, past the max age of {_duration(max_age_s)}"
    return True, f"run {status} (live)"


def _delete(api: Any, namespace: str, obj: _Obj) -> None:
    from kubernetes import client

    core: Any = client.CoreV1Api(api)
    custom: Any = client.CustomObjectsApi(api)
    try:
        if obj.kind == PODTEMPLATE:
            core.delete_namespaced_pod_template(obj.name, namespace)
        elif obj.kind == ACCOUNT:
            core.delete_namespaced_service_account(obj.name, namespace)
        else:
            group, version, plural = _CUSTOM[obj.kind]
            custom.delete_namespaced_custom_object(
                group, version, namespace, plural, obj.name, propagation_policy="Background"
            )
    except client.ApiException as e:
        if e.status != 404:  # gone already: what we wanted
            raise


def nodes_up(api: Any, node_pool: str, now: datetime | None = None) -> list[NodeUp]:
    """The nodes of ``node_pool`` that exist, oldest first, with how long each has been up."""
    from kubernetes import client

    now = now or datetime.now(UTC)
    core: Any = client.CoreV1Api(api)
    out = []
    for n in core.list_node(label_selector=f"{NODEPOOL_LABEL}={node_pool}").items:
        created = _parse_time(n.metadata.creation_timestamp)
        status = n.status
        alloc = (status.allocatable if status else None) or {}
        conds = (status.conditions if status else None) or []
        try:
            gpus = int(alloc.get(GPU, 0) or 0)
        except ValueError:
            gpus = 0
        out.append(
            NodeUp(
                name=n.metadata.name,
                up_s=round((now - created).total_seconds(), 1) if created else 0.0,
                created_at=created.isoformat() if created else "",
                instance_type=(n.metadata.labels or {}).get("node.kubernetes.io/instance-type"),
                gpus=gpus,
                ready=any(c.type == "Ready" and c.status == "True" for c in conds),
            )
        )
    return sorted(out, key=lambda x: -x.up_s)


def reap(
    api: ApiClient,
    ledger: RunLookup,
    *,
    namespace: str,
    node_pool: str,
    max_age_s: float,
    dry_run: bool = False,
) -> ReapReport:
    """Delete the JobSets, ProvisioningRequests and PodTemplates of ``namespace`` that belong to no live
    run (``dry_run``: only report them), then report the nodes of ``node_pool`` still up.

    Every run id is looked up before anything is deleted, so a ledger error deletes nothing."""
    report = ReapReport(namespace=namespace, node_pool=node_pool, max_age_s=max_age_s, dry_run=dry_run)
    now = datetime.now(UTC)
    objs = _list_objects(api, namespace)
    records: dict[str, Run | None] = {}
    for run_id in sorted({o.run_id for o in objs}):
        records[run_id] = ledger.get_run(run_id)
    doomed: list[tuple[_Obj, str]] = []
    for obj in sorted(objs, key=lambda o: (_ORDER.index(o.kind), o.name)):
        live, why = _verdict(records[obj.run_id], obj.created, now, max_age_s)
        if live:
            report.kept.append(Reaped(obj.kind, obj.name, obj.run_id, why))
        else:
            doomed.append((obj, why))
    from kubernetes import client

    for obj, why in doomed:
        if not dry_run:
            try:
                _delete(api, namespace, obj)
            except client.ApiException as e:
                report.errors.append(f"{obj.kind} {obj.name}: {e.status} {e.reason}")
                continue
        report.deleted.append(Reaped(obj.kind, obj.name, obj.run_id, why))
    report.nodes_up = nodes_up(api, node_pool, now)
    return report


def render_text(report: ReapReport) -> Iterable[str]:
    verb = "would delete" if report.dry_run else "deleted"
    yield (
        f"reap: namespace {report.namespace}, node pool {report.node_pool}, "
        f"max run age {_duration(report.max_age_s)}{' (dry run)' if report.dry_run else ''}"
    )
    for r in report.deleted:
        yield f"{verb} {r.kind} {r.name} (run {r.run_id}): {r.why}"
    for r in report.kept:
        yield f"kept {r.kind} {r.name} (run {r.run_id}): {r.why}"
    for e in report.errors:
        yield f"error: could not delete {e}"
    for n in report.nodes_up:
        yield (
            f"node {n.name} up {_duration(n.up_s)} ({n.instance_type or 'unknown type'}, {n.gpus} GPUs"
            f"{'' if n.ready else ', not ready'})"
        )
    if report.node_pool_size:
        size = report.node_pool_size
        yield (
            f"node pool {report.node_pool} scales {size['min_nodes']}..{size['max_nodes']} nodes"
            f"{' per zone' if size['per_zone'] else ''}"
        )
    if report.idle_nodes:
        yield (f"ALERT: {len(report.nodes_up)} GPU node(s) of pool {report.node_pool} up with no live run")
    elif not report.nodes_up:
        yield f"node pool {report.node_pool}: no nodes up"
