"""Finding the cluster through Google's ``ClusterManagerClient``: what ``access_of`` makes of a ``Cluster``
(the DNS endpoint or the IP endpoint and its CA, node pool bounds), and the local GKE API serving
infra/'s cluster to the real client over its REST transport."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Iterator

import pytest
from google.cloud import container_v1

from retrain import config
from retrain.adapters.cluster import (
    CONTAINER_ENDPOINT_VAR,
    ClusterAccess,
    GkeCluster,
    NodePoolSize,
    access_of,
)
from retrain.adapters.credentials import LOCAL_TOKEN_VAR
from retrain_local.gke_api import GkeApiServer, declared_cluster
from retrain_ops.deployment import Deployment

PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
DNS = container_v1.ControlPlaneEndpointsConfig.DNSEndpointConfig
DNS_NAME = "gke-0123.us-central1.gke.goog"


def cluster(dns_allowed: bool, *pools: container_v1.NodePool) -> container_v1.Cluster:
    return container_v1.Cluster(
        name="retrain",
        endpoint="10.0.0.2",
        master_auth=container_v1.MasterAuth(cluster_ca_certificate=base64.b64encode(PEM.encode()).decode()),
        control_plane_endpoints_config=container_v1.ControlPlaneEndpointsConfig(
            dns_endpoint_config=DNS(
                endpoint="gke-0123.us-central1.gke.goog", allow_external_traffic=dns_allowed
            )
        ),
        node_pools=list(pools),
    )


def test_the_dns_endpoint_is_used_when_it_allows_traffic_with_the_public_trust_store() -> None:
    # infra/app/versions.tf: k8s_host is the DNS endpoint and k8s_ca null when the DNS endpoint is on.
    assert access_of(cluster(True)) == ClusterAccess(f"https://{DNS_NAME}", None, {})


def test_the_ip_endpoint_comes_with_the_clusters_ca() -> None:
    assert access_of(cluster(False)) == ClusterAccess("https://10.0.0.2", PEM, {})


def test_node_pool_bounds_total_or_per_zone_and_pools_without_autoscaling_left_out() -> None:
    auto = container_v1.NodePoolAutoscaling
    got = access_of(
        cluster(
            False,
            container_v1.NodePool(
                name="a3", autoscaling=auto(enabled=True, total_min_node_count=0, total_max_node_count=4)
            ),
            container_v1.NodePool(
                name="cpu", autoscaling=auto(enabled=True, min_node_count=1, max_node_count=3)
            ),
            container_v1.NodePool(name="fixed"),
        )
    )
    assert got.node_pools == {
        "a3": NodePoolSize(0, 4, per_zone=False),
        "cpu": NodePoolSize(1, 3, per_zone=True),
    }


def test_a_cluster_without_an_endpoint_yet_is_refused_by_name() -> None:
    provisioning = container_v1.Cluster(name="retrain", status=container_v1.Cluster.Status.PROVISIONING)
    with pytest.raises(
        RuntimeError, match=r"cluster retrain has no control-plane endpoint yet \(PROVISIONING\)"
    ):
        access_of(provisioning)


@pytest.fixture()
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[GkeApiServer]:
    deployment = Deployment()
    server = GkeApiServer(deployment.project, declared_cluster(deployment, "127.0.0.1:6443", PEM)).start()
    monkeypatch.setenv(CONTAINER_ENDPOINT_VAR, server.base_url)
    monkeypatch.setenv(
        LOCAL_TOKEN_VAR, "ya29.local.any"
    )  # this server checks no caller (tests/test_iam.py does)
    try:
        yield server
    finally:
        server.stop()


def test_the_client_finds_infras_cluster_through_the_local_gke_api(served: GkeApiServer) -> None:
    """The real client (REST transport) reads what infra/platform/gke.tf declares: the cluster's name
    and each node pool's autoscaling block, evaluated from the Terraform."""
    platform = Deployment().platform
    settings = dataclasses.replace(config.load({}), cluster=str(platform.output("cluster_name")))
    got = GkeCluster(settings).describe()
    assert got.host == "https://127.0.0.1:6443" and got.ca_pem == PEM
    assert got.node_pools == {
        str(platform.output("gpu_node_pool")): NodePoolSize(0, platform.var("gpu_max_nodes"), per_zone=False),
        "default": NodePoolSize(
            platform.var("default_pool_min_nodes"), platform.var("default_pool_max_nodes"), per_zone=True
        ),
    }


def test_another_project_or_cluster_name_is_not_found_and_says_which(served: GkeApiServer) -> None:
    settings = dataclasses.replace(config.load({}), project="someone-else")
    with pytest.raises(
        RuntimeError, match="no cluster projects/someone-else/locations/us-central1/clusters/"
    ):
        GkeCluster(settings).describe()
