"""The kubelet's part: a pod bound to a twin node runs each container's ``command + args`` as a local
process (in its own process group) from the container's local image (:mod:`retrain_local.images`).
Container paths are translated to host paths, Cloud Storage FUSE volumes are host folders written back to
the bucket (:mod:`retrain_local.gcsfuse`), torchrun's rendezvous variables point at 127.0.0.1, and the pod's
status is written through its status subresource."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.api_core.exceptions import Forbidden

from retrain.adapters.credentials import LOCAL_TOKEN_VAR
from retrain_local import processes
from retrain_local.cluster.faults import Faults
from retrain_local.cluster.status import timestamp
from retrain_local.forkserver import ForkServer
from retrain_local.gcsfuse import DRIVER as GCSFUSE_DRIVER
from retrain_local.gcsfuse import FuseMount, named_paths
from retrain_local.images import LocalImage, translate

log = logging.getLogger(__name__)

#: What a pod's process takes from the twin's own environment (a container starts from its image's).
HOST_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "USER")
#: How often a running pod's Cloud Storage FUSE writes reach the bucket (and at the pod's end).
FUSE_SYNC_S = 2.0
#: Set in every process of a pod (its name): what stands in for the pod's cgroup when the node goes.
POD_MARK = "RETRAIN_TWIN_POD"


def _marked(pod_name: str) -> list[int]:
    """Every live process carrying ``pod_name``'s mark in its environment: the pod's containers and all
    they started, also those in sessions of their own (torchrun's workers) or left behind by a parent
    that exited.  Read from /proc (``environ``: the environment a process started with, inherited)."""
    mark = f"{POD_MARK}={pod_name}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except (OSError, ValueError):
            continue
    return found


@dataclass
class Pod:
    """One pod of a JobSet's attempt, as the kubelet runs it."""

    name: str
    rjob: str
    job_index: int
    index: int  # completion index within the Job
    rank: int
    node: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Any] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    forced_failure: str | None = None
    result: str | None = None  # "Succeeded" | "Failed"
    reason: str = ""
    fuse: dict[str, FuseMount] = field(default_factory=dict)  # mountPath -> its Cloud Storage FUSE
    synced_at: float = 0.0
    started_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Rendezvous:
    """Where a pod's torchrun meets the others of its attempt."""

    port: int
    world: int


class Kubelet:
    def __init__(
        self,
        core: Any,
        *,
        namespace: str,
        workdir: Path,
        images: dict[str, LocalImage],
        pod_env: dict[str, str],
        pod_identity: Callable[[str, str], Mapping[str, str]] | None,
        faults: Faults,
        fork_server: ForkServer | None = None,
    ) -> None:
        self.core = core
        self.namespace = namespace
        self.workdir = workdir
        self.images = images
        self.pod_env = pod_env
        self.pod_identity = pod_identity
        self.faults = faults
        self.fork_server = fork_server
        self._crashed_once = False

    def run(self, pod: Pod, obj: dict[str, Any], meet: Rendezvous, attempt_dir: Path) -> None:
        """Start the pod's containers; one that cannot start (no local image, no command, a refused
        mount) fails the pod as the kubelet would."""
        cwd = attempt_dir / pod.name
        cwd.mkdir(parents=True, exist_ok=True)
        logf = open(self.workdir / "logs" / f"{pod.name}.log", "ab")  # noqa: SIM115 - closed when the run ends
        pod.logs.append(logf)
        ksa = str(obj["spec"].get("serviceAccountName") or "default")
        identity = dict(self.pod_identity(obj["metadata"]["namespace"], ksa)) if self.pod_identity else {}
        for c in obj["spec"].get("containers") or []:
            pod.containers.append(c["name"])
            self._start_container(pod, obj, c, meet, cwd, identity, logf)
        crash_now = self.faults.crash_pods_always or (self.faults.crash_pod_once and not self._crashed_once)
        if crash_now and pod.rank == 0 and pod.procs:
            self._crashed_once = True
            self.kill(pod)
            pod.forced_failure = "container killed (fault injection)"
        self.status(pod, "Running")

    def _start_container(
        self,
        pod: Pod,
        obj: dict[str, Any],
        c: dict[str, Any],
        meet: Rendezvous,
        cwd: Path,
        identity: dict[str, str],
        logf: Any,
    ) -> None:
        image = self.images.get(str(c.get("image", "")))
        if image is None:
            pod.forced_failure = (
                f"ErrImagePull: container {c['name']}: image {c.get('image')!r} has no local stand-in "
                f"(the local images are {sorted(self.images)})"
            )
            return
        raw = list(c.get("command") or []) + list(c.get("args") or [])
        if not raw:
            pod.forced_failure = (
                f"container {c['name']} has no command (image entrypoints are not run locally)"
            )
            return
        paths = self._mount(pod, obj, c, cwd, identity, dict(image.files), raw)
        if paths is None or pod.forced_failure:  # the pod already failed (here or in an earlier container)
            return
        env = {k: v for k, v in os.environ.items() if k in HOST_ENV} | dict(image.env)
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = translate(str(e["value"]), paths)
            elif (e.get("valueFrom") or {}).get("fieldRef"):
                env[e["name"]] = _field_ref(obj, e["valueFrom"]["fieldRef"]["fieldPath"])
        env.update(self.pod_env)
        env.update(identity)
        env[POD_MARK] = pod.name
        env.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(meet.port),
                "WORLD_SIZE": str(meet.world),
                "RANK": str(pod.rank),
                "NODE_RANK": str(pod.rank),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "JOB_COMPLETION_INDEX": str(pod.index),
                "HOSTNAME": obj["spec"]["hostname"],
            }
        )
        argv = [translate(_expand(a, env), paths) for a in raw]
        env["PATH"] = os.pathsep.join([*image.path, env.get("PATH", "")])
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        try:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as e:
            pod.forced_failure = f"container {c['name']}: {e}"
            return
        processes.record(proc.pid, f"pod {pod.name}/{c['name']}")
        pod.procs.append(proc)

    def _mount(
        self,
        pod: Pod,
        obj: dict[str, Any],
        c: dict[str, Any],
        cwd: Path,
        identity: dict[str, str],
        paths: dict[str, str],
        raw: list[str],
    ) -> dict[str, str] | None:
        """The container's paths (container path -> host path) with its volumes mounted: Cloud Storage FUSE
        volumes fetched (only the objects its command and environment name), emptyDirs made; None when a
        mount is refused, as the gcsfuse sidecar fails it."""
        volumes = {v["name"]: v for v in obj["spec"].get("volumes") or []}
        named = [*raw, *(str(e.get("value", "")) for e in c.get("env") or [])]
        for vm in c.get("volumeMounts") or []:
            volume, mount_path = volumes.get(vm["name"]) or {}, vm["mountPath"]
            csi = volume.get("csi") or {}
            if csi.get("driver") == GCSFUSE_DRIVER:
                read_only = bool(vm.get("readOnly") or csi.get("readOnly"))
                host = cwd / "root" / mount_path.lstrip("/")
                bucket = csi["volumeAttributes"]["bucketName"]
                fuse = pod.fuse.setdefault(
                    mount_path, FuseMount(bucket, host, read_only, identity.get(LOCAL_TOKEN_VAR))
                )
                try:
                    fuse.fetch(named_paths(mount_path, named))
                except Forbidden as refused:
                    pod.forced_failure = f"MountVolume.SetUp failed for volume {vm['name']!r}: {refused}"
                    return None
                paths[mount_path] = str(host)
            elif "emptyDir" in volume:
                host = cwd / "volumes" / vm["name"]
                host.mkdir(parents=True, exist_ok=True)
                paths[mount_path] = str(host)
        return paths

    def kill(self, pod: Pod) -> None:
        """Every process of the pod, as a node that goes takes them all: each container's process group,
        and every process carrying the pod's mark (torchrun starts its workers in sessions of their own,
        which outlive a killed launcher: a preempted attempt trained on to the end)."""
        for proc in pod.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for pid in _marked(
            pod.name
        ):  # what left the containers' sessions (torchrun's workers have their own)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if self.fork_server:  # ranks forked there carry the mark in their environment, not in /proc's
            self.fork_server.kill(POD_MARK, pod.name)
        for proc in pod.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def status(self, pod: Pod, phase: str, reason: str = "", message: str = "") -> None:
        from kubernetes.client import ApiException

        ts = timestamp()
        containers = pod.containers or ["main"]
        if phase == "Running":
            state: dict[str, Any] = {"running": {"startedAt": ts}}
        else:
            code = 0 if phase == "Succeeded" else next((p.returncode for p in pod.procs if p.returncode), 1)
            state = {
                "terminated": {
                    "exitCode": 128 - code if code < 0 else code,  # killed by a signal: 128 + its number
                    "reason": reason or phase,
                    "message": message,
                    "finishedAt": ts,
                    "startedAt": ts,
                }
            }
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": "127.0.0.1",
            "podIP": "127.0.0.1",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if phase == "Running" else "False",
                    "lastTransitionTime": ts,
                }
            ],
            "containerStatuses": [
                {
                    "name": n,
                    "ready": phase == "Running",
                    "restartCount": 0,
                    "image": "local",
                    "imageID": "",
                    "state": state,
                }
                for n in containers
            ],
        }
        if phase == "Running":
            status["startTime"] = ts
        if reason:
            status["reason"], status["message"] = reason, message
        try:
            self.core.patch_namespaced_pod_status(
                pod.name, self.namespace, {"status": status}, _content_type="application/merge-patch+json"
            )
        except ApiException as e:
            if e.status != 404:
                raise

    def finish(self, pod: Pod, result: str, reason: str, message: str) -> None:
        refused = self.sync(pod)  # what the container wrote through its FUSE mounts is in the bucket
        if refused and result == "Succeeded":  # a file closed under a refused write fails its writer
            result, reason, message = "Failed", "Error", f"gcsfuse: {refused}"
        pod.result, pod.reason = result, message or reason
        self.status(pod, result, reason, message)

    def sync(self, pod: Pod, every_s: float = 0.0) -> str | None:
        """Write the pod's FUSE mounts back; a write Cloud Storage refused, if any."""
        t = time.monotonic()
        if t - pod.synced_at < every_s:
            return None
        pod.synced_at = t
        refused = None
        for fuse in pod.fuse.values():
            try:
                fuse.sync()
            except Forbidden as e:
                refused = refused or str(e)
                log.warning("twin: gcsfuse %s of %s: %s", fuse.bucket, pod.name, e)
            except Exception as e:  # the emulator going away must not stop the twin
                log.warning("twin: gcsfuse %s of %s: %s", fuse.bucket, pod.name, e)
        return refused

    @staticmethod
    def close_logs(pods: list[Pod]) -> None:
        for pod in pods:
            for f in pod.logs:
                with contextlib.suppress(OSError):
                    f.close()


def _field_ref(obj: dict[str, Any], path: str) -> str:
    """A downward-API ``fieldRef``'s value for the pod object ``obj``."""
    meta = obj["metadata"]
    m = re.fullmatch(r"metadata\.(annotations|labels)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    return {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "spec.nodeName": obj["spec"].get("nodeName", ""),
        "status.podIP": "127.0.0.1",
        "status.hostIP": "127.0.0.1",
    }.get(path, "")


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args; $$(VAR) escapes."""
    return re.sub(
        r"\$\$\(|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
        lambda m: "$(" if m.group(0) == "$$(" else env.get(m.group(1), m.group(0)),
        arg,
    )
