"""envtest discovery: a clear reason when the binaries are missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrain.local import envtest


def test_unavailable_reason_names_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path / "nowhere"))
    monkeypatch.setattr(envtest, "SHARED", tmp_path / "shared")
    reason = envtest.envtest_unavailable_reason()
    assert reason is not None and "KUBEBUILDER_ASSETS" in reason and "kube-apiserver" in reason


def test_assets_from_kubebuilder_assets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("kube-apiserver", "etcd"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    assert envtest.assets_dir() == tmp_path
