"""The GKE cluster: found through Google's GKE API client, then reached through its Kubernetes API.

``google.cloud.container_v1.ClusterManagerClient.get_cluster`` says where the control plane is and how
to trust it (:func:`access_of`) and how far its node pools may scale. The Kubernetes API is then called
with the caller's Google access token, as ``gcloud container clusters get-credentials`` and Terraform's
kubernetes provider in ``infra/app/versions.tf`` do: through the IAM-authenticated DNS endpoint when the
platform enabled it (a publicly trusted certificate), through the IP endpoint and the cluster's CA
otherwise. IAM (``container.clusters.get`` and ``.connect``) and Kubernetes RBAC (``k8s/reaper.yaml``)
decide what the caller may do.

Cloud and local stack differ only by endpoint: ``RETRAIN_CONTAINER_ENDPOINT`` points the client's REST
transport at the local stack's GKE API (``retrain_local.gke_api``), and the
caller's local identity (``retrain.adapters.credentials``) stands in for its Google access token, checked
by the local GKE API and the cluster's front as GKE checks the real one.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from retrain.adapters import credentials
from retrain.config import Settings
from retrain.ports import RunLookup

if TYPE_CHECKING:
    from retrain.k8s.reaper import ReapReport

CONTAINER_ENDPOINT_VAR = "RETRAIN_CONTAINER_ENDPOINT"
"""The GKE API's endpoint when it is not Google's (the local stack's): ``http://127.0.0.1:PORT``."""


@dataclass(frozen=True)
class NodePoolSize:
    """A node pool's autoscaling bounds, as the GKE API reports them."""

    min_nodes: int
    """Fewest nodes the autoscaler keeps."""
    max_nodes: int
    """Most nodes the autoscaler creates."""
    per_zone: bool
    """The bounds hold per zone of the pool (``minNodeCount``/``maxNodeCount``) rather than for the
    whole pool (``totalMinNodeCount``/``totalMaxNodeCount``)."""

    def to_dict(self) -> dict[str, Any]:
        return {"min_nodes": self.min_nodes, "max_nodes": self.max_nodes, "per_zone": self.per_zone}


@dataclass(frozen=True)
class ClusterAccess:
    """Where a cluster's Kubernetes API is and how to trust it, from the GKE API's ``Cluster``."""

    host: str
    """``https://`` address of the control plane."""
    ca_pem: str | None
    """The cluster's CA certificate (PEM) for the IP endpoint; None for the DNS endpoint, whose
    certificate is publicly trusted."""
    node_pools: dict[str, NodePoolSize] = field(default_factory=dict)
    """Autoscaling bounds of each node pool that has autoscaling."""


def pool_size(pool: Any) -> NodePoolSize | None:
    """A ``container_v1.NodePool``'s autoscaling bounds: the whole pool's (``totalMin/MaxNodeCount``, with
    a location policy) when set, else per zone; None without autoscaling."""
    a = pool.autoscaling
    if not a.enabled:
        return None
    total = a.total_max_node_count > 0
    return NodePoolSize(
        min_nodes=a.total_min_node_count if total else a.min_node_count,
        max_nodes=a.total_max_node_count if total else a.max_node_count,
        per_zone=not total,
    )


def access_of(cluster: Any) -> ClusterAccess:
    """The DNS endpoint when it allows external traffic, else the IP endpoint with ``masterAuth``'s CA
    (the same rule as ``infra/app/versions.tf``'s ``k8s_host``/``k8s_ca``)."""
    import base64

    dns = cluster.control_plane_endpoints_config.dns_endpoint_config
    pools = {pool.name: size for pool in cluster.node_pools if (size := pool_size(pool)) is not None}
    if dns.endpoint and dns.allow_external_traffic:
        return ClusterAccess(f"https://{dns.endpoint}", None, pools)
    if not cluster.endpoint:
        raise RuntimeError(
            f"cluster {cluster.name} has no control-plane endpoint yet ({cluster.status.name})"
        )
    ca = base64.b64decode(cluster.master_auth.cluster_ca_certificate).decode()
    return ClusterAccess(f"https://{cluster.endpoint}", ca, pools)


def cluster_manager() -> Any:
    """Google's ``ClusterManagerClient``: its own endpoint and Application Default Credentials, or (with
    ``RETRAIN_CONTAINER_ENDPOINT``) the local stack's GKE API over the REST transport."""
    from google.cloud import container_v1

    endpoint = os.environ.get(CONTAINER_ENDPOINT_VAR)
    if endpoint:
        from google.api_core.client_options import ClientOptions
        from google.oauth2.credentials import Credentials

        return container_v1.ClusterManagerClient(
            transport="rest",
            credentials=Credentials(_access_token()),
            client_options=ClientOptions(api_endpoint=endpoint),
        )
    return container_v1.ClusterManagerClient()  # pragma: no cover - needs Google credentials


_CA_FILES: dict[str, str] = {}


def _ca_file(pem: str) -> str:
    """The kubernetes client reads its CA from a file: one private file per certificate and process
    (``mkstemp``: a file another user placed in the temp folder is never trusted)."""
    if pem not in _CA_FILES:
        fd, path = tempfile.mkstemp(prefix="retrain-cluster-ca-", suffix=".pem")
        with os.fdopen(fd, "w") as f:
            f.write(pem)
        atexit.register(os.unlink, path)
        _CA_FILES[pem] = path
    return _CA_FILES[pem]


def _access_token() -> str:
    if os.environ.get(CONTAINER_ENDPOINT_VAR):  # the local stack's: never sent to a cluster Google named
        token = credentials.local_token()
        if not token:
            raise RuntimeError(f"{CONTAINER_ENDPOINT_VAR} is set, yet no local identity was given")
        return token
    import google.auth  # pragma: no cover - needs Google credentials
    import google.auth.transport.requests

    creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    creds.refresh(google.auth.transport.requests.Request())
    return str(creds.token)


class GkeCluster:
    """:class:`retrain.ports.Cluster` over the Kubernetes API (``retrain.k8s.reaper`` does the work)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @property
    def name(self) -> str:
        """The cluster's resource name in the GKE API."""
        s = self.settings
        return f"projects/{s.project}/locations/{s.region}/clusters/{s.cluster}"

    def describe(self) -> ClusterAccess:
        """The cluster's endpoint, CA and node pool bounds (``projects.locations.clusters.get``)."""
        from google.api_core.exceptions import NotFound

        client = cluster_manager()
        try:
            return access_of(client.get_cluster(name=self.name))
        except NotFound:
            raise RuntimeError(
                f"GKE has no cluster {self.name} (settings RETRAIN_PROJECT, RETRAIN_REGION, RETRAIN_CLUSTER)"
            ) from None
        finally:
            client.transport.close()

    def api_client(self, access: ClusterAccess | None = None) -> Any:
        """A ``kubernetes.client.ApiClient`` for the cluster, with the caller's bearer token."""
        from kubernetes import client

        access = access or self.describe()
        configuration = client.Configuration()
        configuration.host = access.host
        if access.ca_pem is not None:
            configuration.ssl_ca_cert = _ca_file(access.ca_pem)
        configuration.api_key = {"authorization": f"Bearer {_access_token()}"}
        return client.ApiClient(configuration)

    def reap(self, runs: RunLookup) -> ReapReport:
        from retrain.k8s.reaper import default_max_age_s

        return self.reap_report(runs, max_age_s=default_max_age_s(self.settings))

    def reap_report(
        self, runs: RunLookup, *, max_age_s: float, dry_run: bool = False, kubeconfig: str | None = None
    ) -> ReapReport:
        """``retrain.k8s.reaper.reap`` on this cluster, with the node pool's bounds in the report; with
        ``kubeconfig``, the cluster that file names instead (no GKE API, so no bounds)."""
        from retrain.k8s.reaper import reap

        access = None
        if kubeconfig:
            from kubernetes import config

            api = config.new_client_from_config(config_file=kubeconfig)
        else:
            access = self.describe()
            api = self.api_client(access)
        try:
            report = reap(
                api,
                runs,
                namespace=self.settings.namespace,
                node_pool=self.settings.node_pool,
                max_age_s=max_age_s,
                dry_run=dry_run,
            )
        finally:
            api.close()
        pool = access.node_pools.get(self.settings.node_pool) if access else None
        report.node_pool_size = pool.to_dict() if pool else None
        return report

    def confirm_completion(self, namespace: str, name: str, uid: str, run_id: str, state: str) -> str | None:
        from kubernetes import client
        from kubernetes.client import ApiException

        from retrain.k8s.notifier import terminal_state
        from retrain.k8s.render import JOBSET_API, RUN_ID_LABEL, label_value

        group, version = JOBSET_API.split("/")
        api = self.api_client()
        objects: Any = client.CustomObjectsApi(api)
        try:
            jobset: dict[str, Any] = objects.get_namespaced_custom_object(
                group, version, namespace, "jobsets", name
            )
        except ApiException as e:
            if e.status == 404:
                return f"JobSet {name} does not exist"
            raise
        finally:
            api.close()
        meta = jobset.get("metadata") or {}
        if meta.get("uid") != uid or (meta.get("labels") or {}).get(RUN_ID_LABEL) != label_value(run_id):
            return f"JobSet {name} is not run {run_id}'s (its label or uid differ)"
        terminal = terminal_state(jobset)
        if terminal is None or terminal[0] != state:
            return f"JobSet {name} is {terminal[0] if terminal else 'not finished'}, not {state}"
        return None
