"""``retrain reap`` against the real API server (envtest) and the real Firestore emulator."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from retrain import config
from retrain.domain.runs import Run, RunStatus
from retrain.k8s import reaper
from retrain.k8s.render import (
    jobset_name,
    provisioning_request_name,
    render_jobset,
    render_provisioning_request,
    render_run_account,
    run_account_name,
)
from retrain.trainers import Command
from retrain_local.envtest import ControlPlane
from retrain_local.gke_api import GkeApiServer
from retrain_ops import reap
from retrain_ops.deployment import Deployment

pytestmark = [pytest.mark.envtest, pytest.mark.emulators]

PR = ("autoscaling.x-k8s.io", "v1", "provisioningrequests")
JS = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
HOUR = 3600.0


@pytest.fixture()
def ledger(firestore_host: str, project: str) -> Any:
    from retrain.adapters.ledger import FirestoreLedger

    return FirestoreLedger(project)


class Cluster:
    def __init__(self, api: Any, namespace: str) -> None:
        from kubernetes import client

        self.api, self.ns, self.pool = api, namespace, f"pool-{namespace}"
        self.core: Any = client.CoreV1Api(api)
        self.objects: Any = client.CustomObjectsApi(api)
        self.nodes: list[str] = []

    def create_run_objects(self, run_id: str) -> None:
        """What the workflow creates for a run: PodTemplate + ProvisioningRequest, then the JobSet."""
        tmpl, pr = render_provisioning_request(run_id, nodes=1, namespace=self.ns, node_pool=self.pool)
        self.core.create_namespaced_pod_template(self.ns, tmpl)
        self.objects.create_namespaced_custom_object(*PR[:2], self.ns, PR[2], pr)
        js = render_jobset(
            run_id,
            nodes=1,
            image="local",
            command=Command(["true"], []),
            namespace=self.ns,
            node_pool=self.pool,
            provisioning_request=pr["metadata"]["name"],
        )
        self.objects.create_namespaced_custom_object(*JS[:2], self.ns, JS[2], js)
        self.core.create_namespaced_service_account(self.ns, render_run_account(run_id, self.ns))

    def inventory(self) -> set[tuple[str, str]]:
        """(kind, name) of every JobSet, ProvisioningRequest and PodTemplate of the namespace."""
        out = {("JobSet", o["metadata"]["name"]) for o in self._items(JS)}
        out |= {("ProvisioningRequest", o["metadata"]["name"]) for o in self._items(PR)}
        templates = self.core.list_namespaced_pod_template(self.ns).items
        out |= {("PodTemplate", t.metadata.name) for t in templates}
        accounts = self.core.list_namespaced_service_account(self.ns).items
        return out | {("ServiceAccount", a.metadata.name) for a in accounts if a.metadata.name != "default"}

    def _items(self, gvp: tuple[str, str, str]) -> list[dict[str, Any]]:
        return list(self.objects.list_namespaced_custom_object(*gvp[:2], self.ns, gvp[2])["items"])

    def add_node(self, name: str) -> None:
        """A GPU node of the pool, as GKE (or the cluster twin) would have created it."""
        self.core.create_node(
            {
                "metadata": {
                    "name": name,
                    "labels": {
                        "cloud.google.com/gke-nodepool": self.pool,
                        "node.kubernetes.io/instance-type": "a3-highgpu-8g",
                    },
                }
            }
        )
        self.nodes.append(name)
        self.core.patch_node_status(
            name,
            {
                "status": {
                    "capacity": {"nvidia.com/gpu": "8"},
                    "allocatable": {"nvidia.com/gpu": "8"},
                    "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                }
            },
            _content_type="application/merge-patch+json",
        )

    def delete_nodes(self) -> None:
        from kubernetes.client import ApiException

        for name in self.nodes:
            try:
                self.core.delete_node(name, grace_period_seconds=0)
            except ApiException as e:
                if e.status != 404:
                    raise
        self.nodes.clear()


@pytest.fixture()
def cluster(api: Any, namespace: str) -> Iterator[Cluster]:
    c = Cluster(api, namespace)
    try:
        yield c
    finally:
        c.delete_nodes()  # nodes are cluster-wide: leave none to the next test


def record(ledger: Any, run_id: str, status: RunStatus, age_s: float = 60.0, queued_s: float = 0.0) -> None:
    """A run record whose work began ``age_s`` ago, after ``queued_s`` queued behind another run."""

    def ago(seconds: float) -> str:
        return (datetime.now(UTC) - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    run = Run(
        run_id=run_id,
        dataset="d",
        trigger="manual",
        status=status,
        created_at=ago(age_s + queued_s),
        tokenizing_at=ago(age_s),
    )
    ledger.db.collection("runs").document(run_id).set(run.to_dict())


def names(run_id: str) -> set[tuple[str, str]]:
    pr = provisioning_request_name(run_id)
    return {
        ("JobSet", jobset_name(run_id)),
        ("ProvisioningRequest", pr),
        ("PodTemplate", pr),
        ("ServiceAccount", run_account_name(run_id)),  # the identity its folder grant names
    }


def test_reaps_orphaned_terminal_and_stale_runs_keeps_live_ones(cluster: Cluster, ledger: Any) -> None:
    live = {
        "live-train": RunStatus.TRAINING,
        "live-prov": RunStatus.PROVISIONING,
        "queued-long": RunStatus.TRAINING,
    }
    terminal = {
        "done-ok": RunStatus.SUCCEEDED,
        "done-fail": RunStatus.FAILED,
        "done-cxl": RunStatus.CANCELLED,
    }
    for run_id, status in {**live, **terminal}.items():
        record(ledger, run_id, status)
    # queued a day behind another run, then an hour into its work: live (its age is its work's)
    record(ledger, "queued-long", RunStatus.TRAINING, age_s=HOUR, queued_s=30 * HOUR)
    record(ledger, "stuck-run", RunStatus.TRAINING, age_s=30 * HOUR)  # older than the max age
    runs = [*live, *terminal, "stuck-run", "ghost-run"]  # ghost-run: objects without any record
    for run_id in runs:
        cluster.create_run_objects(run_id)
    # Something else's objects in the namespace (no run id) are never touched.
    cluster.core.create_namespaced_pod_template(
        cluster.ns,
        {
            "metadata": {"name": "not-retrain"},
            "template": {"spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.9"}]}},
        },
    )
    everything = cluster.inventory()
    assert everything == {("PodTemplate", "not-retrain")}.union(*(names(r) for r in runs))
    kw: dict[str, Any] = {"namespace": cluster.ns, "node_pool": cluster.pool, "max_age_s": 24 * HOUR}

    dry = reaper.reap(cluster.api, ledger, dry_run=True, **kw)
    assert cluster.inventory() == everything  # a dry run deletes nothing
    doomed = set().union(*(names(r) for r in [*terminal, "stuck-run", "ghost-run"]))
    assert {(d.kind, d.name) for d in dry.deleted} == doomed
    assert {(k.kind, k.name) for k in dry.kept} == set().union(*(names(r) for r in live))
    assert (
        dry.live_runs == ["live-prov", "live-train", "queued-long"] and not dry.errors and dry.exit_code == 0
    )

    report = reaper.reap(cluster.api, ledger, dry_run=False, **kw)
    assert cluster.inventory() == everything - doomed
    why = {(d.kind, d.run_id): d.why for d in report.deleted}
    assert {d.run_id for d in report.deleted} == {*terminal, "stuck-run", "ghost-run"}
    assert why[("JobSet", "ghost-run")] == "no run record in the ledger"
    assert why[("PodTemplate", "ghost-run")] == "no run record in the ledger"
    assert why[("ProvisioningRequest", "done-ok")] == "run succeeded"
    assert why[("JobSet", "done-fail")] == "run failed" and why[("JobSet", "done-cxl")] == "run cancelled"
    assert why[("JobSet", "stuck-run")].startswith("run training for 30h00m, past the max age of 24h00m")
    # Deleted in the order that frees nodes first: JobSets, then requests, then their templates.
    kinds = [d.kind for d in report.deleted]
    assert kinds == sorted(
        kinds, key=["JobSet", "ProvisioningRequest", "PodTemplate", "ServiceAccount"].index
    )
    assert {k.why for k in report.kept} == {"run training (live)", "run provisioning (live)"}
    assert report.nodes_up == [] and report.exit_code == 0

    again = reaper.reap(cluster.api, ledger, dry_run=False, **kw)  # idempotent
    assert again.deleted == [] and {(k.kind, k.name) for k in again.kept} == set().union(
        *(names(r) for r in live)
    )
    # Once the live runs end, the next pass takes their objects too.
    record(ledger, "live-train", RunStatus.SUCCEEDED)
    record(ledger, "live-prov", RunStatus.FAILED)
    record(ledger, "queued-long", RunStatus.SUCCEEDED)
    reaper.reap(cluster.api, ledger, dry_run=False, **kw)
    assert cluster.inventory() == {("PodTemplate", "not-retrain")}


def test_an_unreadable_ledger_deletes_nothing(cluster: Cluster) -> None:
    class Down:
        def get_run(self, run_id: str) -> Run | None:
            raise RuntimeError("ledger unavailable")

    cluster.create_run_objects("any-run")
    before = cluster.inventory()
    with pytest.raises(RuntimeError, match="ledger unavailable"):
        reaper.reap(cluster.api, Down(), namespace=cluster.ns, node_pool=cluster.pool, max_age_s=HOUR)
    assert cluster.inventory() == before


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = reap.main(["--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_main_reports_nodes_up_and_exits_3_without_a_live_run(
    cluster: Cluster,
    ledger: Any,
    project: str,
    gke_api: GkeApiServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``retrain reap`` finds the cluster through the GKE API (as against a deployment) and reports the
    pool's autoscaling bounds with it."""
    monkeypatch.setenv("RETRAIN_PROJECT", project)
    monkeypatch.setenv("RETRAIN_NAMESPACE", cluster.ns)
    monkeypatch.setenv("RETRAIN_NODE_POOL", cluster.pool)

    code, out = run_main(capsys)
    assert code == 0 and out["nodes_up"] == [] and out["deleted"] == [] and not out["idle_nodes"]
    assert out["max_age_s"] == reaper.default_max_age_s(config.load())

    # A live run holds two nodes: reported, but no alarm.
    record(ledger, "busy-run", RunStatus.TRAINING)
    cluster.create_run_objects("busy-run")
    cluster.add_node(f"gke-{cluster.pool}-a")
    cluster.add_node(f"gke-{cluster.pool}-b")
    code, out = run_main(capsys)
    assert code == 0 and out["live_runs"] == ["busy-run"] and not out["idle_nodes"]
    assert sorted(n["name"] for n in out["nodes_up"]) == sorted(cluster.nodes)
    for n in out["nodes_up"]:
        assert 0 <= n["up_s"] < 600 and n["gpus"] == 8 and n["ready"]
        assert n["instance_type"] == "a3-highgpu-8g" and n["created_at"]

    # The run ends but the nodes stay up: the reaper releases the objects and raises the alarm (3).
    record(ledger, "busy-run", RunStatus.SUCCEEDED)
    code, out = run_main(capsys, "--dry-run")
    assert (
        code == 3 and out["dry_run"] and len(out["deleted"]) == len(names("busy-run")) and out["idle_nodes"]
    )
    assert cluster.inventory() == names("busy-run")
    assert reap.main([]) == 3
    text = capsys.readouterr().out
    assert f"deleted JobSet {jobset_name('busy-run')} (run busy-run): run succeeded" in text
    assert f"ALERT: 2 GPU node(s) of pool {cluster.pool} up with no live run" in text
    assert f"node gke-{cluster.pool}-a up " in text and "(a3-highgpu-8g, 8 GPUs)" in text
    assert cluster.inventory() == set()

    # Scaled to zero: exit 0 again.
    cluster.delete_nodes()
    code, out = run_main(capsys, "--max-age-hours", "1")
    assert code == 0 and out["nodes_up"] == [] and out["max_age_s"] == HOUR
    assert out["node_pool_size"] is None  # this test's pool is not one of the cluster's

    # The deployment's GPU pool: its bounds as the GKE API reports them (infra/platform's gpu_dws pool).
    gpu_max = Deployment().platform.var("gpu_max_nodes")
    code, out = run_main(capsys, "--node-pool", "a3-dws", "--dry-run")
    assert out["node_pool_size"] == {"min_nodes": 0, "max_nodes": gpu_max, "per_zone": False}
    reap.main(["--node-pool", "a3-dws", "--dry-run"])
    assert f"node pool a3-dws scales 0..{gpu_max} nodes\n" in capsys.readouterr().out


def test_the_scheduler_reaper_job_reaps_through_the_function_side_adapter(
    cluster: Cluster, ledger: Any, project: str, gke_api: GkeApiServer
) -> None:
    """The tick infra/ declares for the "reaper" job, handled by Ingest as the function handles it,
    reaches the cluster through GkeCluster (found with the GKE API, as in the cloud)."""
    import dataclasses

    from retrain.adapters.cluster import GkeCluster
    from retrain.ingest import Action, Ingest

    record(ledger, "live-run", RunStatus.TRAINING)
    cluster.create_run_objects("live-run")
    cluster.create_run_objects("gone-run")  # no record: its execution crashed before writing one
    settings = dataclasses.replace(
        config.load({}), project=project, namespace=cluster.ns, node_pool=cluster.pool
    )
    ingest = Ingest(settings, ledger, None, None, cluster=GkeCluster(settings))  # type: ignore[arg-type]
    (reaper_job,) = [j for j in Deployment().scheduler_jobs() if j.name == "reaper"]
    (outcome,) = ingest.on_scheduler_tick(json.loads(reaper_job.data))
    assert outcome.action == Action.REAPED
    assert cluster.inventory() == names("live-run")
    assert "retrain-gone-run" in outcome.detail


def test_main_with_a_kubeconfig_reaches_that_cluster_without_the_gke_api(
    cluster: Cluster,
    ledger: Any,
    project: str,
    control_plane: ControlPlane,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``retrain reap --kubeconfig F``: no GKE API is asked (none is reachable here), the cluster F names is
    reaped, and the report has no pool bounds to show."""
    monkeypatch.delenv("RETRAIN_CONTAINER_ENDPOINT", raising=False)
    monkeypatch.setenv("RETRAIN_PROJECT", project)
    monkeypatch.setenv("RETRAIN_NAMESPACE", cluster.ns)
    monkeypatch.setenv("RETRAIN_NODE_POOL", cluster.pool)
    record(ledger, "ended-run", RunStatus.FAILED)
    cluster.create_run_objects("ended-run")
    code, out = run_main(capsys, "--kubeconfig", str(control_plane.kubeconfig))
    assert code == 0 and out["node_pool_size"] is None
    assert sorted(d["name"] for d in out["deleted"]) == sorted(name for _, name in names("ended-run"))
    assert cluster.inventory() == set()
