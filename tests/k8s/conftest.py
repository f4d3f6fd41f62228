"""One real control plane (etcd + kube-apiserver, CRDs loaded) per test session for tests/k8s."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from retrain.local.envtest import ControlPlane, envtest_unavailable_reason

_counter = itertools.count()


@pytest.fixture(scope="session")
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
    from retrain.local.envtest import ensure_service_account

    ns = f"t{next(_counter)}"
    ensure_service_account(api, ns)
    return ns
