"""envtest discovery: a clear reason when the binaries are missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrain_local import envtest


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


@pytest.mark.unit
def test_ports_taken_between_choice_and_bind_are_chosen_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A free port is free only until someone binds it, and parallel test workers do: a control plane that
    chose its ports chooses again when the apiserver could not bind (seen in a full run on three
    workers); one given its ports, or failing for another reason, fails as it did."""
    plane = envtest.ControlPlane(tmp_path / "cp")
    tried: list[tuple[int, int]] = []

    def start(timeout_s: float) -> envtest.ControlPlane:
        tried.append((plane.apiserver_port, plane.etcd_port))
        if len(tried) == 1:
            raise envtest.EnvtestError("control plane did not start: bind: address already in use")
        return plane

    monkeypatch.setattr(plane, "_start", start)
    assert plane.start() is plane and len(tried) == 2 and tried[0] != tried[1]

    def taken(timeout_s: float) -> envtest.ControlPlane:
        raise envtest.EnvtestError("control plane did not start: bind: address already in use")

    given = envtest.ControlPlane(tmp_path / "given", apiserver_port=1, etcd_port=2)
    monkeypatch.setattr(given, "_start", taken)
    with pytest.raises(envtest.EnvtestError, match="address already in use"):
        given.start()
    other = envtest.ControlPlane(tmp_path / "other")
    calls: list[int] = []

    def broken(timeout_s: float) -> envtest.ControlPlane:
        calls.append(1)
        raise envtest.EnvtestError("control plane did not start: no such file")

    monkeypatch.setattr(other, "_start", broken)
    with pytest.raises(envtest.EnvtestError, match="no such file"):
        other.start()
    assert calls == [1]


@pytest.mark.envtest
def test_the_apiserver_runs_the_launchers_flags_and_ours_as_the_pid_it_recorded(
    control_plane: envtest.ControlPlane,
) -> None:
    """The launcher takes kube-apiserver from $KUBEBUILDER_ASSETS: the control plane points it at a
    wrapper that execs the real binary with :data:`envtest.APISERVER_FLAGS` after the launcher's own, so
    the PID the launcher recorded (and stop kills) is the apiserver itself, not a shell."""
    pid = int((control_plane.run_dir / "apiserver.pid").read_text())
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
    assets = envtest.assets_dir()
    assert assets is not None
    assert Path(f"/proc/{pid}/exe").resolve() == (assets / "kube-apiserver").resolve()
    assert "--authorization-mode=RBAC" in argv  # the launcher's
    assert argv[-len(envtest.APISERVER_FLAGS) :] == list(envtest.APISERVER_FLAGS)
