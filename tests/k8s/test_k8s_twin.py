"""The cluster twin against the real API server: DWS provisioning, JobSet runs, failure policy."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from retrain.k8s.render import render_jobset, render_provisioning_request
from retrain.trainers import Command
from retrain_local.cluster import ClusterTwin, Faults

from .waiting import wait_for

pytestmark = pytest.mark.envtest

PR = ("autoscaling.x-k8s.io", "v1", "provisioningrequests")
JS = ("jobset.x-k8s.io", "v1alpha2", "jobsets")


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


class Cluster:
    def __init__(self, api: Any, namespace: str, pool: str) -> None:
        from kubernetes import client

        self.api, self.ns, self.pool = api, namespace, pool
        self.core = client.CoreV1Api(api)
        self.objects = client.CustomObjectsApi(api)

    def create_pr(self, run_id: str, nodes: int) -> str:
        tmpl, pr = render_provisioning_request(run_id, nodes=nodes, namespace=self.ns, node_pool=self.pool)
        self.core.create_namespaced_pod_template(self.ns, tmpl)
        self.objects.create_namespaced_custom_object(*PR[:2], self.ns, PR[2], pr)
        return str(pr["metadata"]["name"])

    def pr(self, name: str) -> dict[str, Any]:
        return dict(self.objects.get_namespaced_custom_object(*PR[:2], self.ns, PR[2], name))

    def delete_pr(self, name: str) -> None:
        self.objects.delete_namespaced_custom_object(*PR[:2], self.ns, PR[2], name)

    def create_jobset(self, run_id: str, nodes: int, code: str, **kw: Any) -> str:
        js = render_jobset(
            run_id,
            nodes=nodes,
            image="local",
            command=Command(["python", "-c", code], []),
            namespace=self.ns,
            node_pool=self.pool,
            **kw,
        )
        self.objects.create_namespaced_custom_object(*JS[:2], self.ns, JS[2], js)
        return str(js["metadata"]["name"])

    def jobset(self, name: str) -> dict[str, Any]:
        return dict(self.objects.get_namespaced_custom_object(*JS[:2], self.ns, JS[2], name))

    def terminal(self, name: str) -> str | None:
        return (self.jobset(name).get("status") or {}).get("terminalState")

    def pool_nodes(self) -> list[Any]:
        return list(self.core.list_node(label_selector=f"cloud.google.com/gke-nodepool={self.pool}").items)


@pytest.fixture()
def cluster(api: Any, namespace: str) -> Cluster:
    return Cluster(api, namespace, f"pool-{namespace}")


def make_twin(cluster: Cluster, tmp_path: Path, **kw: Any) -> ClusterTwin:
    kw.setdefault("provision_delay_s", 0.3)
    return ClusterTwin(
        cluster.api,
        namespace=cluster.ns,
        node_pool=cluster.pool,
        workdir=tmp_path / "twin",
        poll_s=0.1,
        **kw,
    )


RANK_CODE = (
    "import os, pathlib; "
    "pathlib.Path('out.txt').write_text(','.join(os.environ[k] for k in "
    "('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'NODE_RANK', 'RETRAIN_RUN_ID', 'EXTRA')))"
)


def test_provision_run_and_release(cluster: Cluster, tmp_path: Path) -> None:
    twin = make_twin(cluster, tmp_path, pod_env={"EXTRA": "x"})
    with twin:
        pr = cluster.create_pr("ok-1", nodes=2)
        got = wait_for(
            lambda: (
                conditions(cluster.pr(pr)).get("Provisioned", {}).get("status") == "True" and cluster.pr(pr)
            )
        )
        conds = conditions(got)
        assert conds["Accepted"]["status"] == "True" and conds["Provisioned"]["reason"]
        nodes = cluster.pool_nodes()
        assert len(nodes) == 2 and sorted(n.metadata.name for n in nodes) == twin.node_names()
        node = nodes[0]
        assert node.metadata.labels["cloud.google.com/gke-queued"] == "true"
        assert node.metadata.labels["node.kubernetes.io/instance-type"] == "a3-highgpu-8g"
        assert node.metadata.labels["cloud.google.com/gke-accelerator"] == "nvidia-h100-80gb"
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert [(t.key, t.value, t.effect) for t in node.spec.taints] == [
            ("nvidia.com/gpu", "present", "NoSchedule")
        ]
        assert node.metadata.annotations["retrain.dev/provisioning-request"] == f"{cluster.ns}/{pr}"

        js = cluster.create_jobset("ok-1", 2, RANK_CODE)
        assert wait_for(lambda: cluster.terminal(js)) == "Completed"
        obj = cluster.jobset(js)
        c = conditions(obj)["Completed"]
        assert (c["status"], c["reason"]) == ("True", "AllJobsCompleted")
        assert obj["status"]["restarts"] == 0
        assert obj["status"]["replicatedJobsStatus"] == [
            {"name": "trainer", "active": 0, "ready": 0, "succeeded": 1, "failed": 0, "suspended": 0}
        ]
        outs = sorted(p.read_text() for p in (tmp_path / "twin").rglob("out.txt"))
        assert outs == ["0,2,127.0.0.1,0,ok-1,x", "1,2,127.0.0.1,1,ok-1,x"]
        pods = cluster.core.list_namespaced_pod(cluster.ns).items
        assert len(pods) == 2 and {p.status.phase for p in pods} == {"Succeeded"}
        assert {p.spec.node_name for p in pods} == set(twin.node_names())

        cluster.delete_pr(pr)
        wait_for(lambda: not cluster.pool_nodes() and not twin.node_names())
        assert twin.node_seconds() > 0
    assert not twin.errors


def test_dws_never_provisions(cluster: Cluster, tmp_path: Path) -> None:
    with make_twin(cluster, tmp_path, faults=Faults(provisioning="never"), provision_delay_s=0.1):
        pr = cluster.create_pr("never-1", nodes=1)
        wait_for(lambda: "Accepted" in conditions(cluster.pr(pr)))
        time.sleep(1.0)
        conds = conditions(cluster.pr(pr))
        assert conds["Provisioned"]["status"] == "False" and "Failed" not in conds
        assert cluster.pool_nodes() == []


def test_dws_fails(cluster: Cluster, tmp_path: Path) -> None:
    with make_twin(cluster, tmp_path, faults=Faults(provisioning="fail")) as twin:
        pr = cluster.create_pr("fail-1", nodes=1)
        got = wait_for(lambda: "Failed" in conditions(cluster.pr(pr)) and cluster.pr(pr))
        assert conditions(got)["Failed"]["status"] == "True" and conditions(got)["Failed"]["reason"]
        assert twin.node_names() == []


def test_request_beyond_autoscaling_max_fails(cluster: Cluster, tmp_path: Path) -> None:
    with make_twin(cluster, tmp_path) as twin:
        twin.set_autoscaling(0, 1)
        pr = cluster.create_pr("big-1", nodes=2)
        got = wait_for(lambda: "Failed" in conditions(cluster.pr(pr)) and cluster.pr(pr))
        assert conditions(got)["Failed"]["reason"] == "MaxNodesExceeded"
        assert twin.node_names() == []


def test_crash_once_restarts_then_completes(cluster: Cluster, tmp_path: Path) -> None:
    with make_twin(cluster, tmp_path, faults=Faults(crash_pod_once=True)) as twin:
        cluster.create_pr("crash-1", nodes=1)
        wait_for(twin.node_names)
        js = cluster.create_jobset("crash-1", 1, "import time; time.sleep(0.2)")
        assert wait_for(lambda: cluster.terminal(js)) == "Completed"
        assert cluster.jobset(js)["status"]["restarts"] == 1
        pods = cluster.core.list_namespaced_pod(cluster.ns).items
        assert [p.metadata.labels["jobset.sigs.k8s.io/restart-attempt"] for p in pods] == ["1"]
    assert not twin.errors


def test_max_restarts_exhausted_fails(cluster: Cluster, tmp_path: Path) -> None:
    with make_twin(cluster, tmp_path) as twin:
        cluster.create_pr("bad-1", nodes=1)
        wait_for(twin.node_names)
        js = cluster.create_jobset("bad-1", 1, "raise SystemExit(3)", max_restarts=1)
        assert wait_for(lambda: cluster.terminal(js)) == "Failed"
        obj = cluster.jobset(js)
        c = conditions(obj)["Failed"]
        assert c["reason"] == "ReachedMaxRestarts" and "first failed job" in c["message"]
        assert obj["status"]["restarts"] == 1


def test_preempted_node_is_replaced_and_run_restarts(cluster: Cluster, tmp_path: Path) -> None:
    with make_twin(cluster, tmp_path, faults=Faults(preempt_node_after_s=0.3)) as twin:
        cluster.create_pr("pre-1", nodes=2)
        wait_for(lambda: len(twin.node_names()) == 2)
        first = set(twin.node_names())
        js = cluster.create_jobset("pre-1", 2, "import time; time.sleep(1.0)")
        assert wait_for(lambda: cluster.terminal(js)) == "Completed"
        assert cluster.jobset(js)["status"]["restarts"] == 1
        assert len(twin.node_names()) == 2 and set(twin.node_names()) != first


def test_deleting_jobset_kills_and_deletes_pods(cluster: Cluster, tmp_path: Path) -> None:
    with make_twin(cluster, tmp_path) as twin:
        cluster.create_pr("del-1", nodes=1)
        wait_for(twin.node_names)
        js = cluster.create_jobset("del-1", 1, "import time; time.sleep(60)")
        wait_for(lambda: cluster.core.list_namespaced_pod(cluster.ns).items)
        cluster.objects.delete_namespaced_custom_object(*JS[:2], cluster.ns, JS[2], js)
        wait_for(lambda: not cluster.core.list_namespaced_pod(cluster.ns).items)
        wait_for(lambda: not any(p.result is None for p in twin.pods()))


def test_a_pod_whose_service_account_does_not_exist_is_never_created(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The API server's ServiceAccount admission refuses a pod of an account that does not exist (the
    run's own account not created, or named otherwise than its JobSet says), as on GKE: no pod, nothing
    of the command runs, and the JobSet waits (the run's training deadline ends it)."""
    with make_twin(cluster, tmp_path) as twin:
        cluster.create_pr("nosa-1", nodes=1)
        wait_for(twin.node_names)
        js = cluster.create_jobset("nosa-1", 1, RANK_CODE, service_account="retrain-nosa-1")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert cluster.core.list_namespaced_pod(cluster.ns).items == []
            time.sleep(0.5)
        assert cluster.terminal(js) is None and not list((tmp_path / "twin").rglob("out.txt"))
        refused = [str(e) for e in twin.errors]
        assert refused and 'serviceaccount \\"retrain-nosa-1\\" not found' in refused[0], refused[:1]


def test_an_idle_twin_lists_less_often_and_a_request_wakes_it(cluster: Cluster, tmp_path: Path) -> None:
    """With nothing to reconcile the twin waits idle_poll_s between lists (an idle stack's polling was
    most of its CPU and its API server's); a ProvisioningRequest is seen within one such wait, and while
    one exists (or its node) the twin waits poll_s."""
    twin = make_twin(cluster, tmp_path, idle_poll_s=0.5)
    waits: list[tuple[float, float]] = []  # (when, how long) the loop waited

    class Recorded(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append((time.monotonic(), float(timeout or 0)))
            return super().wait(timeout)

    twin._stop = Recorded()
    with twin:
        time.sleep(1.2)
        pr = cluster.create_pr("wake-1", nodes=1)
        asked = time.monotonic()
        wait_for(lambda: conditions(cluster.pr(pr)).get("Provisioned", {}).get("status") == "True")
        cluster.delete_pr(pr)
        wait_for(lambda: not twin.node_names())
        time.sleep(0.6)
    before = [t for when, t in waits if when < asked]
    assert before and set(before) == {0.5}, waits
    after = [t for when, t in waits if when > asked]
    assert after.index(0.1) <= 1, waits  # seen by the list after the idle wait under way when it was made
    assert after[-1] == 0.5 and 0.1 in after, waits  # busy while it lived, idle again once its node went
    assert not twin.errors


def test_an_images_own_environment_is_under_what_the_pod_sets(cluster: Cluster, tmp_path: Path) -> None:
    """A local image's ``env`` (a Dockerfile's ``ENV``) reaches its containers, and what the container
    (its spec's ``env``) or the pod sets wins; the stand-in trainers' images set OpenMP's passive wait
    (``retrain_local.images.STANDIN_ENV``)."""
    from retrain_local.images import LocalImage, local_images
    from retrain_ops.deployment import BRIDGE_STANDIN, NEMO_STANDIN

    images = local_images(tmp_path / "images")
    assert images[NEMO_STANDIN].env == images[BRIDGE_STANDIN].env == {"OMP_WAIT_POLICY": "PASSIVE"}
    # RETRAIN_RUN_ID is a value of the container's env (render_jobset), EXTRA the twin's pod environment
    image = LocalImage(env={"IMAGE_ONLY": "i", "EXTRA": "the image's", "RETRAIN_RUN_ID": "the image's"})
    code = (
        "import os, pathlib; pathlib.Path('out.txt').write_text("
        "os.environ['IMAGE_ONLY'] + os.environ['EXTRA'] + ' ' + os.environ['RETRAIN_RUN_ID'])"
    )
    with make_twin(cluster, tmp_path, images={"local": image}, pod_env={"EXTRA": "x"}) as twin:
        cluster.create_pr("image-env-1", nodes=1)
        wait_for(lambda: len(twin.node_names()) == 1)
        js = cluster.create_jobset("image-env-1", 1, code)
        assert wait_for(lambda: cluster.terminal(js)) == "Completed"
    assert [p.read_text() for p in (tmp_path / "twin").rglob("out.txt")] == ["ix image-env-1"]


def test_the_ranks_a_pod_forked_from_the_warm_interpreter_go_with_its_jobset(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The stand-in image's ``torchrun`` forks its ranks from the fork server, outside the pod's process
    group and with the server's /proc environment: deleting the JobSet still kills every rank, by the
    pod's mark, before the twin counts the pod ended."""
    from retrain_local.forkserver import ForkServer
    from retrain_local.images import local_images
    from retrain_ops.deployment import NEMO_STANDIN

    pids = tmp_path / "pids"
    pids.mkdir()
    rank = tmp_path / "rank.py"
    rank.write_text(
        "import os, pathlib, time\n"
        "pathlib.Path(os.environ['PIDS'], str(os.getpid())).write_text(os.environ['RETRAIN_TWIN_POD'])\n"
        "time.sleep(120)\n"
    )
    fs = ForkServer((), tmp_path / "fork.log")
    image = local_images(tmp_path / "images", standin_launcher=True, fork_server=fs.socket_path)[NEMO_STANDIN]
    launch = (
        "import os; os.execvp('torchrun', ['torchrun', '--nnodes=2', '--nproc-per-node=1', "
        f"'--node-rank=' + os.environ['NODE_RANK'], {str(rank)!r}])"
    )
    with make_twin(
        cluster, tmp_path, images={"local": image}, fork_server=fs, pod_env={"PIDS": str(pids)}
    ) as twin:
        cluster.create_pr("fork-1", nodes=2)
        wait_for(lambda: len(twin.node_names()) == 2)
        js = cluster.create_jobset("fork-1", 2, launch)
        ranks = wait_for(lambda: len(list(pids.iterdir())) == 2 and [int(p.name) for p in pids.iterdir()])
        assert fs.proc is not None
        for pid in ranks:  # forked by the server, not started by the pod's launcher
            assert Path(f"/proc/{pid}/status").read_text().split("PPid:")[1].split()[0] == str(fs.proc.pid)
        assert {(pids / str(pid)).read_text() for pid in ranks} == {p.name for p in twin.pods()}
        cluster.objects.delete_namespaced_custom_object(*JS[:2], cluster.ns, JS[2], js)
        wait_for(lambda: not twin.pods())  # torn down (the twin's pass holds its lock till then)
        assert [pid for pid in ranks if Path(f"/proc/{pid}").exists()] == []  # killed and reaped
    assert fs.proc.poll() is not None  # stopped with the twin
