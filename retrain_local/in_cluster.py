"""What the deployment puts in the cluster, as the local stack plays it: the manifests Terraform applies
(rendered by the same code from infra/'s values), the cluster twin within the node pool's bounds, and
pods' Kubernetes identities."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from retrain import config
from retrain.adapters.cluster import pool_size
from retrain_local.connectors import KubeEndpoint
from retrain_local.gke_api import GkeApiServer
from retrain_local.iam import Kind, Resource
from retrain_local.identities import Caller, Guard
from retrain_local.kube_front import KubeFront
from retrain_local.lifetime import Lifetime
from retrain_ops.deployment import DWS_BOOKING_WINDOW_S, LOCAL_TIME_FACTOR, Deployment, ManifestValues


def control_plane(folder: Path, guard: Guard, lifetime: Lifetime) -> tuple[Any, KubeEndpoint, KubeFront]:
    """kube-apiserver and etcd with the CRDs (envtest), its endpoint as the cluster's admin, and GKE's front
    of it, which checks each caller (both started, and stopped with ``lifetime``)."""
    from retrain_local.envtest import ControlPlane

    plane = ControlPlane(folder)
    plane.start()
    lifetime.on_stop(plane.stop)
    kube = KubeEndpoint.from_kubeconfig(plane.kubeconfig)
    front = KubeFront(kube.server, kube.token, kube.ca_file, guard, plane.run_dir / "pki").start()
    lifetime.on_stop(front.stop)
    return plane, kube, front


def gke_api(deployment: Deployment, endpoint: str, ca_file: str, guard: Guard, project: str) -> GkeApiServer:
    """The GKE API (started) that finds the cluster (retrain.adapters.cluster): ``endpoint`` (GKE's front of
    the API server) as the cluster's, its node pools as infra/platform declares them, each caller checked
    for the permission its request needs on the project."""
    on = Resource(Kind.PROJECT, project)
    return GkeApiServer.for_control_plane(
        deployment,
        endpoint,
        ca_file,
        authorize=lambda token, permission: guard.authorize(token, permission, on),
    ).start()


def apply_manifests(api: Any, deployment: Deployment) -> ManifestValues:
    """The service accounts, the notifier's, the reaper's and the workflow's RBAC, and the settings
    ConfigMap (Terraform writes it from local.retrain_env); GKE's multi-networking objects (GPUDirect-TCPX)
    too.  The values they were rendered from."""
    from retrain_local.envtest import apply_documents
    from retrain_ops.manifests import documents

    values = deployment.manifest_values()
    settings_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": values.settings_config_map, "namespace": values.namespace},
        "data": deployment.env,
    }
    apply_documents(api, [settings_map, *documents(values)])
    return values


def parse_faults(spec: str) -> Any:
    """``provisioning=fail,crash_pod_once=true`` -> the cluster twin's Faults (fields typed from it)."""
    from retrain_local.cluster import Faults

    values: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, _, raw = item.partition("=")
        default = getattr(Faults(), key, KeyError)
        if default is KeyError:
            raise ValueError(f"unknown twin fault {key!r} (in {spec!r})")
        if isinstance(default, bool):
            values[key] = raw.lower() in ("1", "true", "yes")
        elif key.endswith("_s"):
            values[key] = float(raw)
        else:
            values[key] = raw
    return Faults(**values)


def cluster_twin(
    api: Any,
    s: config.Settings,
    gke_api: GkeApiServer,
    *,
    workdir: Path,
    pod_env: dict[str, str],
    pod_identity: Callable[[str, str], dict[str, str]],
    standin_launcher: bool = False,
) -> Any:
    """The cluster twin (not started), its autoscaling within the bounds the GKE API gives the node pool
    (Terraform's google_container_node_pool.gpu_dws).  GKE's own controllers (DWS, the JobSet controller,
    the kubelet) act as the cluster's admin: ``api``."""
    from retrain_local.cluster import ClusterTwin
    from retrain_local.images import local_images
    from retrain_local.torchrun import rank_fork_server

    ranks = rank_fork_server(workdir / "logs" / "fork-server.log") if standin_launcher else None
    twin = ClusterTwin(
        api,
        scale_down_delay_s=s.scale_down_delay_s,
        booking_window_s=DWS_BOOKING_WINDOW_S / LOCAL_TIME_FACTOR,
        namespace=s.namespace,
        node_pool=s.node_pool,
        machine_type=s.machine_type,
        gpus_per_node=s.gpus_per_node,
        provision_delay_s=s.provision_delay_s,
        workdir=workdir,
        pod_env=pod_env,
        faults=parse_faults(s.twin_faults),
        pod_identity=pod_identity,
        images=local_images(
            workdir, standin_launcher=standin_launcher, fork_server=ranks.socket_path if ranks else None
        ),
        fork_server=ranks,
    )
    size = {p.name: pool_size(p) for p in gke_api.cluster.node_pools}.get(s.node_pool)
    if size is None:
        raise RuntimeError(
            f"RETRAIN_NODE_POOL={s.node_pool} is no autoscaled node pool of infra/platform's cluster "
            f"({', '.join(p.name for p in gke_api.cluster.node_pools)})"
        )
    twin.set_autoscaling(size.min_nodes, size.max_nodes)
    return twin


def service_account_annotations(api: Any, namespace: str, ksa: str) -> dict[str, str]:
    """A Kubernetes service account's annotations (Workload Identity's among them); none when it is gone."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        account = client.CoreV1Api(api).read_namespaced_service_account(ksa, namespace)
    except ApiException as e:
        if e.status != 404:
            raise
        return {}
    return dict((account.metadata and account.metadata.annotations) or {})


def service_account_client(api: Any, kube: KubeEndpoint, namespace: str, ksa: str) -> Any:
    """A Kubernetes client that is ``ksa``, with a token the API server issues it (TokenRequest), as a pod's
    projected service account token."""
    from kubernetes import client

    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=2 * 86400)
    )
    answer = client.CoreV1Api(api).create_namespaced_service_account_token(ksa, namespace, request)
    configuration = client.Configuration()
    configuration.host = kube.server
    configuration.ssl_ca_cert = kube.ca_file
    assert answer.status is not None, "TokenRequest answered without a token"
    configuration.api_key = {"authorization": f"Bearer {answer.status.token}"}
    return client.ApiClient(configuration)


def notifier(
    api: Any,
    kube: KubeEndpoint,
    values: ManifestValues,
    s: config.Settings,
    publisher: Any,
    as_member: Caller,
    state_path: Path,
) -> Any:
    """The notifier (started), as its pod runs it: with its Kubernetes service account's own token for the
    API server (when IAM is enforced; else as the admin ``api``), and publishing as the Google account
    Workload Identity maps that account to (``as_member``)."""
    from retrain.k8s.notifier import Notifier

    topic = publisher.topic_path(s.project, s.jobset_topic)

    def publish(data: bytes, attributes: dict[str, str]) -> None:
        as_member.require("pubsub.topics.publish", Resource(Kind.TOPIC, s.jobset_topic))
        publisher.publish(topic, data, **attributes).result(timeout=30)

    own_api = service_account_client(api, kube, values.namespace, values.notifier_ksa) if s.local_iam else api
    started = Notifier(own_api, publish, namespace=s.namespace, state_path=state_path)
    started.start()
    return started


@contextlib.contextmanager
def evicted(pod: Any) -> Iterator[None]:
    """``pod`` (a started in-cluster component: ``stop()``, ``start()``) stopped for the block, and started
    again after it, as a pod evicted and rescheduled: for the fault suite."""
    pod.stop()
    try:
        yield
    finally:
        pod.start()
