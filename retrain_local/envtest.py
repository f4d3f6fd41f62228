"""A real Kubernetes control plane (etcd + kube-apiserver; no controllers, no kubelet) for runs and tests.

The binaries follow the controller-runtime *envtest* layout: ``$KUBEBUILDER_ASSETS`` or
``<repo>/../shared/envtest`` holds ``kube-apiserver`` and ``etcd`` (and the ``start-control-plane.sh``
launcher).  :class:`ControlPlane` starts them on free loopback ports, loads the CRDs of the API groups a
GKE cluster running this deployment serves (:data:`CLUSTER_GROUPS`) from ``<repo>/../shared/crds`` (or
``$RETRAIN_CRDS_DIR``) through the Python client (``kubectl apply`` refuses CRDs carrying CEL rules on
v1.20), waits until they are established and creates the ``default``
ServiceAccount (no token controller runs, so nothing else would).  :meth:`ControlPlane.stop` kills the
processes it started by PID.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from retrain_local import processes
from retrain_ops.k8s_schema import load_crds

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"
BINARIES = ("kube-apiserver", "etcd")
#: The custom API groups the deployed cluster serves, and so the control plane: JobSet (its controller's
#: release manifest, infra/app/k8s.tf), the cluster autoscaler's ProvisioningRequest (GKE's, for DWS
#: queued provisioning) and GKE's multi-networking (Network, GKENetworkParamSet: GPUDirect-TCPX).  Not
#: Kueue, whose CRDs ../shared/crds also holds: the deployment installs no Kueue (tests/test_contracts.py),
#: so an object of its kinds is refused here as on the cluster; and a kube-apiserver serving Kueue's
#: schemas (its Workload CRD alone is 1.4 MB) spent 8 more CPU seconds starting and 7 more a minute idle.
CLUSTER_GROUPS = frozenset({"jobset.x-k8s.io", "autoscaling.x-k8s.io", "networking.gke.io"})


#: Flags kube-apiserver gets beyond the launcher's, each one that changes no answer a client is given,
#: only work the apiserver does on its own (kube-apiserver --help of v1.20; measured alone, an apiserver
#: with no client spent 1.5 to 1.7 CPU s a minute idle with the launcher's flags, 0.66 with these):
#: API Priority and Fairness' queuing (it sheds load as 429s; nothing here loads the apiserver so), the
#: watch cache (watches and lists are served from etcd itself, as resourceVersion semantics allow), and
#: the pprof endpoints.
APISERVER_FLAGS: tuple[str, ...] = (
    "--enable-priority-and-fairness=false",
    "--watch-cache=false",
    "--profiling=false",
)


def launch_assets(assets: Path, into: Path, flags: tuple[str, ...]) -> Path:
    """An envtest assets folder in ``into`` whose ``kube-apiserver`` is ``assets``' own run with ``flags``
    after the launcher's (``exec``: the launcher's recorded PID is the apiserver's) and whose ``etcd`` is
    ``assets``' own: the launcher takes its binaries from ``$KUBEBUILDER_ASSETS``, and its flags are its
    own."""
    into.mkdir(parents=True, exist_ok=True)
    wrapper = into / "kube-apiserver"
    real = shlex.quote(str(assets.resolve() / "kube-apiserver"))
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@" {shlex.join(flags)}\n')
    wrapper.chmod(0o755)
    etcd = into / "etcd"
    etcd.unlink(missing_ok=True)
    etcd.symlink_to((assets / "etcd").resolve())
    return into


class EnvtestError(RuntimeError):
    """The control plane could not be found, started or prepared."""


def _free_port_pair() -> int:
    """A port P with P+10 free too (the launcher puts etcd's peer port at ETCD_PORT + 10)."""
    for _ in range(50):
        p = processes.free_port()
        if p + 10 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10))
            except OSError:
                continue
        return p
    raise EnvtestError("no free port pair for etcd")


def assets_dir() -> Path | None:
    """The folder holding ``kube-apiserver`` and ``etcd``, or None."""
    candidates = []
    if os.environ.get("KUBEBUILDER_ASSETS"):
        candidates.append(Path(os.environ["KUBEBUILDER_ASSETS"]))
    candidates.append(SHARED / "envtest")
    for c in candidates:
        if all(os.access(c / b, os.X_OK) for b in BINARIES):
            return c
    return None


def launcher() -> Path | None:
    """``start-control-plane.sh``: next to the assets, else in ``<repo>/../shared/envtest``."""
    assets = assets_dir()
    for c in [assets, SHARED / "envtest"]:
        if c is not None and (c / "start-control-plane.sh").is_file():
            return c / "start-control-plane.sh"
    return None


def crds_dir() -> Path:
    return Path(os.environ.get("RETRAIN_CRDS_DIR") or SHARED / "crds")


def envtest_unavailable_reason() -> str | None:
    """None when a control plane can be started here, else why not (for ``pytest.skip``)."""
    if assets_dir() is None:
        where = os.environ.get("KUBEBUILDER_ASSETS") or "(KUBEBUILDER_ASSETS unset)"
        return (
            f"envtest binaries {'/'.join(BINARIES)} not found in $KUBEBUILDER_ASSETS={where} "
            f"nor in {SHARED / 'envtest'}"
        )
    if launcher() is None:
        return f"start-control-plane.sh not found next to the envtest binaries nor in {SHARED / 'envtest'}"
    if not any(crds_dir().glob("*.yaml")):
        return f"no CRD manifests in {crds_dir()} (set RETRAIN_CRDS_DIR)"
    for tool in ("openssl", "curl"):
        if not any(os.access(Path(p) / tool, os.X_OK) for p in os.environ.get("PATH", "").split(":") if p):
            return f"start-control-plane.sh needs {tool} on PATH"
    return None


class ControlPlane:
    """etcd + kube-apiserver on loopback, with the project's CRDs loaded.

    ``run_dir`` is wiped and recreated by the launcher (certificates, etcd data, logs, kubeconfig).
    """

    def __init__(self, run_dir: Path, apiserver_port: int | None = None, etcd_port: int | None = None):
        self.run_dir = Path(run_dir)
        self._chosen = apiserver_port is None and etcd_port is None
        self.apiserver_port = apiserver_port or processes.free_port()
        self.etcd_port = etcd_port or _free_port_pair()
        self._pids: list[int] = []

    @property
    def kubeconfig(self) -> Path:
        return self.run_dir / "kubeconfig"

    def api_client(self) -> Any:
        """A new ``kubernetes.client.ApiClient`` for this control plane (admin token)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def start(self, timeout_s: float = 90.0, attempts: int = 3) -> ControlPlane:
        """Start it; ports it chose itself are chosen again when another process took one between the
        choice and the bind (a free port is only free until someone binds it: parallel tests do)."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start(timeout_s)
            except EnvtestError as e:
                if not (self._chosen and attempt < attempts and processes.BIND_FAILED.search(str(e))):
                    raise
                self.apiserver_port, self.etcd_port = processes.free_port(), _free_port_pair()
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> ControlPlane:
        reason = envtest_unavailable_reason()
        if reason:
            raise EnvtestError(reason)
        script, assets = launcher(), assets_dir()
        assert script is not None and assets is not None
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        # beside run_dir, which the launcher wipes
        launching = launch_assets(
            assets, self.run_dir.parent / f"{self.run_dir.name}-assets", APISERVER_FLAGS
        )
        env = dict(os.environ, KUBEBUILDER_ASSETS=str(launching))
        try:
            proc = subprocess.run(
                ["bash", str(script), str(self.run_dir), str(self.apiserver_port), str(self.etcd_port)],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            failure = proc.stderr.strip() if proc.returncode != 0 else None
        except subprocess.TimeoutExpired:
            failure = f"start-control-plane.sh did not finish within {timeout_s}s"
        self._pids = [int(p.read_text()) for p in self._pid_files() if p.exists()]
        for pid, name in zip(self._pids, ("kube-apiserver", "etcd"), strict=False):
            processes.record(pid, name)
        atexit.register(self.stop)  # no orphans even when the caller forgets stop()
        if failure is not None:
            self.stop()
            logf = self.run_dir / "apiserver.log"
            log = logf.read_text()[-2000:] if logf.exists() else ""
            raise EnvtestError(f"control plane did not start: {failure}\n{log}")
        try:
            self._install_crds(timeout_s)
            self._ensure_default_service_account("default")
        except BaseException:
            self.stop()
            raise
        return self

    def _pid_files(self) -> list[Path]:
        return [self.run_dir / "apiserver.pid", self.run_dir / "etcd.pid"]

    def _install_crds(self, timeout_s: float) -> None:
        from kubernetes import client

        api = self.api_client()
        try:
            ext: Any = client.ApiextensionsV1Api(api)
            crds = [c for c in load_crds(crds_dir()) if c["spec"]["group"] in CLUSTER_GROUPS]
            names = []
            for crd in crds:
                try:
                    ext.create_custom_resource_definition(crd)
                except client.ApiException as e:
                    if e.status != 409:
                        raise EnvtestError(f"CRD {crd['metadata']['name']}: {e.status} {e.body}") from e
                names.append(crd["metadata"]["name"])
            deadline = time.monotonic() + timeout_s
            pending = set(names)
            while pending:
                for name in list(pending):
                    got = ext.read_custom_resource_definition(name)
                    conds = (got.status.conditions if got.status else None) or []
                    if any(c.type == "Established" and c.status == "True" for c in conds):
                        pending.discard(name)
                if not pending:
                    break
                if time.monotonic() > deadline:
                    raise EnvtestError(f"CRDs not established: {sorted(pending)}")
                time.sleep(0.1)
            # Discovery of new groups lags "Established" a little: wait until each group answers.
            for crd in crds:
                group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
                version = next(v["name"] for v in crd["spec"]["versions"] if v.get("storage"))
                while True:
                    try:
                        if crd["spec"]["scope"] == "Namespaced":
                            client.CustomObjectsApi(api).list_namespaced_custom_object(
                                group, version, "default", plural, limit=1
                            )
                        else:
                            client.CustomObjectsApi(api).list_cluster_custom_object(
                                group, version, plural, limit=1
                            )
                        break
                    except client.ApiException as e:
                        if e.status != 404 or time.monotonic() > deadline:
                            raise
                        time.sleep(0.1)
        finally:
            api.close()

    def _ensure_default_service_account(self, namespace: str) -> None:
        api = self.api_client()
        try:
            ensure_service_account(api, namespace)
        finally:
            api.close()

    def stop(self) -> None:
        """Kill the apiserver and etcd this control plane started (by PID) and wait for them."""
        atexit.unregister(self.stop)
        pids, self._pids = self._pids, []  # only what this instance started, and only once
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for pid in pids:
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    # The launcher backgrounded them, so they are not our children: reap is not ours to do; probe.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def ensure_service_account(api: Any, namespace: str, name: str = "default") -> None:
    """Create ServiceAccount ``name`` in ``namespace`` (and the namespace) when missing."""
    from kubernetes import client

    core: Any = client.CoreV1Api(api)
    try:
        core.create_namespace({"metadata": {"name": namespace}})
    except client.ApiException as e:
        if e.status != 409:
            raise
    try:
        core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    except client.ApiException as e:
        if e.status != 409:
            raise


def apply_documents(api: Any, docs: list[dict[str, Any]]) -> list[str]:
    """Create each object (as ``kubectl create`` would; one that exists is left as it is), custom
    resources included; returns ``Kind/name`` of each.  Errors from the API server propagate: a manifest
    it refuses is a broken manifest."""
    from kubernetes import client, utils

    custom = client.CustomObjectsApi(api)
    done = []
    for doc in docs:
        group, _, version = doc["apiVersion"].rpartition("/")
        meta = doc["metadata"]
        try:
            if "." in group and not group.endswith(".k8s.io"):  # ../shared/crds: JobSet, autoscaling, GKE
                plural = doc["kind"].lower() + "s"
                if "namespace" in meta:
                    ensure_service_account(api, meta["namespace"])
                    custom.create_namespaced_custom_object(group, version, meta["namespace"], plural, doc)
                else:
                    custom.create_cluster_custom_object(group, version, plural, doc)
            else:
                if "namespace" in meta:
                    ensure_service_account(api, meta["namespace"])
                utils.create_from_dict(api, doc)
        except client.ApiException as e:
            if e.status != 409:
                raise
        except utils.FailToCreateError as e:
            if any(getattr(x, "status", None) != 409 for x in e.api_exceptions):
                raise
        done.append(f"{doc['kind']}/{meta['name']}")
    return done
