"""One real control plane (etcd + kube-apiserver, CRDs loaded) for tests/k8s, stopped after its last test
(``tests/conftest.py`` runs the package's tests on one worker: ``SHARED_PACKAGES``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from retrain_local.envtest import ControlPlane, envtest_unavailable_reason

_counter = itertools.count()


@pytest.fixture(scope="package")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    reason = envtest_unavailable_reason()
    if reason is not None:
        pytest.skip(f"envtest unavailable: {reason}")
    cp = ControlPlane(tmp_path_factory.mktemp("envtest") / "cp")
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture()
def api(control_plane: ControlPlane) -> Iterator[Any]:
    client = control_plane.api_client()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture()
def namespace(api: Any) -> str:
    """A fresh namespace (with its default ServiceAccount) per test."""
    from retrain_local.envtest import ensure_service_account

    ns = f"t{next(_counter)}"
    ensure_service_account(api, ns)
    return ns


@pytest.fixture()
def gke_api(control_plane: ControlPlane, project: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The GKE API describing infra/'s cluster in ``project`` with this control plane as its endpoint;
    the process's clients find the cluster through it (RETRAIN_CONTAINER_ENDPOINT), as the stack's do."""
    from retrain.adapters.cluster import CONTAINER_ENDPOINT_VAR
    from retrain.adapters.credentials import LOCAL_TOKEN_VAR
    from retrain_local.connectors import KubeEndpoint
    from retrain_local.gke_api import GkeApiServer
    from retrain_ops.deployment import Deployment

    kube = KubeEndpoint.from_kubeconfig(control_plane.kubeconfig)
    server = GkeApiServer.for_control_plane(Deployment(project=project), kube.server, kube.ca_file).start()
    monkeypatch.setenv(CONTAINER_ENDPOINT_VAR, server.base_url)
    monkeypatch.setenv(LOCAL_TOKEN_VAR, kube.token)  # no GKE front: the control plane's own
    try:
        yield server
    finally:
        server.stop()
