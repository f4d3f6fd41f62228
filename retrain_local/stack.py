"""The whole system on one machine: real emulators, a real control plane, twins only where none exists.

  GCS emulator ──finalize CloudEvent (posted by the stack, shaped like Eventarc's)──▶ functions-framework
  (on_object_finalized) ──Firestore emulator (ledger)──▶ executions service (workflows/retrain.yaml in
  retrain's interpreter) ──connectors──▶ local Dataflow (Beam, FnApiRunner) · kube-apiserver (envtest)
  ◀── cluster twin (DWS provisioner, JobSet controller, kubelet) ── notifier ──▶ Pub/Sub emulator
  ──push──▶ functions-framework (on_jobset_event) ──callback──▶ the waiting execution.

Every part runs as the identity infra/ deploys it with, and every call is checked against infra/'s IAM
and k8s/'s RBAC (``retrain_local.identities``): Cloud Storage and Firestore behind fronts that check each
call, each function behind Cloud Run's invoker check, the cluster's API behind GKE's front, and the
executions service, the GKE API, the workflow's connectors and the notifier checking their callers.

The stack writes its endpoints (and the operator's token) to ``<state_dir>/stack.json``, readable by its
owner only, so other commands (drop, runs, status) find it while it runs in the background.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain import config
from retrain.adapters import objects
from retrain.adapters.cluster import CONTAINER_ENDPOINT_VAR, pool_size
from retrain.adapters.credentials import LOCAL_TOKEN_VAR
from retrain_local import delivery, emulators, processes
from retrain_local.connectors import KubeEndpoint, LocalDataflow, local_registry
from retrain_local.firestore_front import FirestoreFront
from retrain_local.gke_api import GkeApiServer
from retrain_local.iam import Kind, Resource
from retrain_local.identities import OPERATOR, Caller, Deployed, Guard
from retrain_local.invoker_front import InvokerFront
from retrain_local.kube_front import KubeFront
from retrain_local.pubsub_front import PubSubFront
from retrain_local.storage_front import STORAGE_API, StorageFront
from retrain_ops.deployment import (
    DWS_BOOKING_WINDOW_S,
    LOCAL_TIME_FACTOR,
    Deployment,
    ManifestValues,
    ScheduledJob,
)

log = logging.getLogger("retrain.stack")

REPO_ROOT = Path(__file__).resolve().parents[1]
FUNCTIONS_SOURCE = REPO_ROOT / "functions" / "main.py"
WORKFLOW_FILE = REPO_ROOT / "workflows" / "retrain.yaml"

Progress = Callable[[str], None]

#: Where the stack records every process it starts (retrain_local.processes).
PROCESS_REGISTRY = "processes.jsonl"
#: Where a stopped stack leaves who used which permission, and every refusal (retrain_local.identities).
IAM_REPORT = "iam-report.json"
#: The ledger is exported this often (and at a clean stop): a crash of the stack loses at most this much.
LEDGER_EXPORT_S = 5.0


def periodically(every_s: float, fn: Callable[[], None], what: str) -> Callable[[], None]:
    """Run ``fn`` every ``every_s`` in a thread (errors logged); returns the function that stops it."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                fn()
            except Exception as e:
                log.warning("%s: %s", what, e)

    threading.Thread(target=loop, name=what, daemon=True).start()
    return stop.set


def _quiet(_: str) -> None:
    return None


@dataclass
class Endpoints:
    """Where the running stack's parts listen; what other processes need to reach it."""

    firestore: str = ""
    pubsub: str = ""
    storage: str = ""
    workflows: str = ""
    workflows_grpc: str = ""
    ingest_function: str = ""
    relay_function: str = ""
    scheduler_function: str = ""
    steps_function: str = ""
    manual_function: str = ""
    """The operators' function (``run_http``: seal now, cancel a run), behind Cloud Run's invoker check."""
    container: str = ""
    token: str = ""
    """The operator's local token (``retrain.adapters.credentials``): what the CLI presents."""
    pid: int = 0

    def env(self) -> dict[str, str]:
        """Environment that points the client libraries (and retrain) at this stack, as the operator."""
        return {
            "FIRESTORE_EMULATOR_HOST": self.firestore,
            "PUBSUB_EMULATOR_HOST": self.pubsub,
            "STORAGE_EMULATOR_HOST": self.storage,
            "RETRAIN_WORKFLOWS_ENDPOINT": self.workflows,
            "RETRAIN_WORKFLOWS_GRPC_ENDPOINT": self.workflows_grpc,
            CONTAINER_ENDPOINT_VAR: self.container,
            LOCAL_TOKEN_VAR: self.token,
        }

    def save(self, path: Path) -> None:
        """Written readable by its owner alone: it holds the operator's token."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.__dict__, indent=2))

    @classmethod
    def load(cls, path: Path) -> Endpoints:
        """The endpoints a stack wrote; fields an older retrain wrote and this one lacks are left out,
        so that `retrain down` still stops a stack started before an upgrade."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in json.loads(path.read_text()).items() if k in known})


def stack_file(settings: config.Settings) -> Path:
    return Path(settings.state_dir).resolve() / "stack.json"


def attach(settings: config.Settings) -> Endpoints:
    """Point this process at a stack started by ``retrain up``; raises if none runs."""
    path = stack_file(settings)
    if not path.exists():
        raise RuntimeError("no local stack is running: start one with `retrain up` (or use `retrain demo`)")
    ep = Endpoints.load(path)
    try:
        os.kill(ep.pid, 0)
    except ProcessLookupError:
        raise RuntimeError(
            f"the local stack (pid {ep.pid}) is gone: `retrain down`, then `retrain up`"
        ) from None
    os.environ.update(ep.env())
    return ep


#: ``python -c`` body that runs functions-framework with this checkout's editable install of retrain
#: hidden (setuptools' ``__editable__`` finders) and without the working folder ``-c`` puts first on the
#: path, so that the function imports the uploaded copy of the package on its PYTHONPATH and nothing left
#: out of it, as in the cloud.
AS_DEPLOYED = (
    "import os, runpy, sys\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]\n"
    "editable = lambda f: getattr(f, '__module__', '').startswith('__editable__')\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]\n"
    "sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]\n"
    "sys.path_importer_cache.clear()\n"
    "runpy.run_module('functions_framework', run_name='__main__', alter_sys=True)\n"
)

_built_sources: dict[Path, Path] = {}


def deployed_functions_source(folder: Path) -> Path:
    """The function source as ``retrain deploy`` uploads it (``retrain_ops.deploy.build_functions_source``),
    built once per process into ``folder``/functions-source."""
    from retrain_ops.deploy import build_functions_source

    folder = folder.resolve()
    if folder not in _built_sources:
        _built_sources[folder] = build_functions_source(REPO_ROOT, folder / "functions-source")
    return _built_sources[folder]


def function_server(
    target: str, log_path: Path, env: dict[str, str], signature: str, port: int
) -> tuple[emulators.ManagedProcess, str]:
    """A function of the deployed source (functions/main.py with the retrain modules it imports, built
    next to ``log_path``), served on ``port`` by the real functions-framework; returns it and its URL."""
    source = deployed_functions_source(log_path.parent)
    argv = [
        sys.executable,
        "-c",
        AS_DEPLOYED,
        "--source",
        str(source / "main.py"),
        "--target",
        target,
        "--signature-type",
        signature,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(source), inherited]))}
    url = f"http://127.0.0.1:{port}"
    return emulators.ManagedProcess(f"function-{target}", argv, log_path, None, env, probe_url=url + "/"), url


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


def scheduler_twin(
    jobs: list[ScheduledJob], publish: Callable[[ScheduledJob], None], paused: set[str] | None = None
) -> Callable[[], None]:
    """Cloud Scheduler's twin: publishes each job's message on its schedule, sped up by
    LOCAL_TIME_FACTOR (the first tick of each job comes one period after the start, as in the cloud);
    a job named in ``paused`` skips its ticks while it is there (``gcloud scheduler jobs pause``).
    Returns the function that stops it."""
    paused = set() if paused is None else paused
    stop = threading.Event()
    periods = {job.name: job.period_s / LOCAL_TIME_FACTOR for job in jobs}

    def loop() -> None:
        started = time.monotonic()
        due = {job.name: started + periods[job.name] for job in jobs}
        while True:
            job = min(jobs, key=lambda j: due[j.name])
            if stop.wait(max(0.0, due[job.name] - time.monotonic())):
                return
            due[job.name] += periods[job.name]
            if job.name in paused:
                continue
            try:
                publish(job)
            except Exception as e:  # a missed tick is harmless; the next one does the work
                log.warning("scheduler job %s: tick not published: %s", job.name, e)

    threading.Thread(target=loop, name="scheduler-twin", daemon=True).start()
    return stop.set


class _Functions:
    """The stack's Cloud Functions: each served as its own identity (infra/'s service account for it), behind
    Cloud Run's invoker check, reached by the push subscriptions routed to it."""

    def __init__(self, stack: LocalStack, deployed: Deployed) -> None:
        self.stack, self.deployed = stack, deployed
        self.env = {**config.to_env(stack.settings), "PYTHONUNBUFFERED": "1"}
        """What every function starts with (the executions service's endpoints join once it serves)."""
        self.fronts: dict[str, str] = {}  # function -> its invoker front's URL
        self.push_routes: dict[str, str] = {}  # topic id -> the function its push subscription reaches

    def serve(self, target: str, signature: str = "cloudevent") -> str:
        """Start ``target`` and its invoker front; the front's URL."""
        stack, function = self.stack, self.deployed.functions[target]
        env = {**self.env, **stack.identity_env(function.member)}
        log = stack.state_dir / f"function-{target}.log"
        _, url = stack._spawn_on_a_free_port(lambda port: function_server(target, log, env, signature, port))
        pushed = {t: p.member for t, p in self.deployed.pushes.items() if self.push_routes.get(t) == target}
        front = InvokerFront(
            url,
            function.service,
            stack.guard,
            trigger_member=function.trigger_member,
            storage_agent=self.deployed.storage_agent if target == "on_object_finalized" else None,
            push_members=pushed,
        ).start()
        stack._closers.append(front.stop)
        self.fronts[target] = front.url
        return front.url


@dataclass
class LocalStack:
    settings: config.Settings
    progress: Progress = _quiet
    fresh: bool = False
    """Start from empty buckets and an empty ledger instead of the state kept by the last stop."""
    pod_env: dict[str, str] = field(default_factory=dict)
    endpoints: Endpoints = field(default_factory=Endpoints)
    paused_jobs: set[str] = field(default_factory=set)
    """Scheduler jobs (``var.scheduler_jobs`` keys) whose ticks are skipped while named here."""
    redelivery: Any = None
    """Eventarc's twin for events that missed their first attempt (``retrain_local.eventarc.Redelivery``:
    its ``delivered`` counts them)."""
    _procs: list[emulators.ManagedProcess] = field(default_factory=list)
    _closers: list[Callable[[], None]] = field(default_factory=list)
    _saved_env: dict[str, str | None] = field(default_factory=dict)
    _ledger_lock: threading.Lock = field(default_factory=threading.Lock)
    _held_down: set[str] = field(default_factory=set)
    deployment: Deployment | None = None
    """What infra/ declares (topics, Scheduler jobs, the pool's bounds, the Kubernetes manifests) for
    the settings' project; by default read from infra/."""

    def __post_init__(self) -> None:
        if self.deployment is None:
            from retrain_local.images import tokenize_standin

            self.deployment = Deployment(
                project=self.settings.project, variables={"dataflow_image": tokenize_standin()}
            )

    @property
    def _deployment(self) -> Deployment:
        assert self.deployment is not None
        return self.deployment

    @property
    def state_dir(self) -> Path:
        return Path(self.settings.state_dir).resolve()

    def start(self) -> Endpoints:
        """Start every part, in dependency order; on any failure, stop what started and re-raise."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    def _setenv(self, values: dict[str, str]) -> None:
        """Point this process's clients at the stack; stop() puts the environment back as it was."""
        for key, value in values.items():
            if key not in self._saved_env:
                self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()

    def _spawn(self, proc: emulators.ManagedProcess, timeout_s: float = 90.0) -> None:
        """Start ``proc``, kept for the stop (and the functions' supervisor) from its start on; one that
        could not bind its port is dropped again (its successor on another port takes its place)."""
        self._procs.append(proc)
        try:
            proc.start(timeout_s)
        except processes.PortTaken:
            self._procs.remove(proc)
            raise

    def _spawn_on_a_free_port(
        self, make: Callable[[int], tuple[emulators.ManagedProcess, str]]
    ) -> tuple[emulators.ManagedProcess, str]:
        return processes.start_on_a_free_port(make, self._spawn)

    def _start(self) -> None:
        """The phases, in dependency order: each names what it starts."""
        self._preflight()
        gcs_host = self._start_emulators()
        deployed = self._start_iam_fronts(gcs_host)
        control_plane, kube, kube_front, gke_api = self._start_control_plane()
        self._create_buckets()
        child_env = {**self.endpoints.env(), **self.pod_env}  # a pod's or a Dataflow job's processes'
        values = self._start_cluster(control_plane.api_client(), gke_api, child_env)
        publisher, jobset_events = self._start_notifier(kube, values)
        functions = _Functions(self, deployed)
        self._start_executions(deployed, kube, kube_front, functions, child_env)
        jobs = self._deployment.scheduler_jobs()
        ticks = self._start_functions(functions, jobs)
        self._wire_subscriptions(deployed, functions, publisher, [jobset_events, *ticks], jobs)
        ep, s = self.endpoints, self.settings
        ep.save(stack_file(s))
        self._closers.append(lambda: stack_file(s).unlink(missing_ok=True))
        self.progress("local stack is up")

    def _preflight(self) -> None:
        """The state folder taken (one stack per folder), every child recorded as it starts, and what the
        stack needs (Java, the Cloud SDK's emulators, envtest) present."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        processes.use(self.state_dir / PROCESS_REGISTRY)
        self._closers.append(lambda: processes.use(None))
        self.endpoints.pid = os.getpid()
        from retrain_local.envtest import envtest_unavailable_reason

        reason = emulators.java_emulators_unavailable_reason() or envtest_unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot start the local stack: {reason}")
        if self.fresh:
            for kept in (self.state_dir / "gcs", self.firestore_data):
                shutil.rmtree(kept, ignore_errors=True)

    def _start_emulators(self) -> str:
        """Cloud Storage, Firestore (its ledger kept across stops) and Pub/Sub; the storage emulator's
        host."""
        self.progress("starting emulators: GCS, Firestore, Pub/Sub")
        _, gcs_host = self._spawn_on_a_free_port(lambda port: emulators.gcs(self.state_dir, port))
        _, self._firestore_host = self._spawn_on_a_free_port(
            lambda port: emulators.firestore(self.state_dir, port, import_from=self.firestore_data)
        )
        _, self.endpoints.pubsub = self._spawn_on_a_free_port(
            lambda port: emulators.pubsub(self.state_dir, port)
        )
        self._closers.append(self._keep_ledger)
        self._closers.append(periodically(LEDGER_EXPORT_S, self._keep_ledger, "ledger export"))
        return gcs_host

    def _start_iam_fronts(self, gcs_host: str) -> Deployed:
        """Who runs what (infra/), and the fronts that check every call against infra/'s IAM."""
        s, ep = self.settings, self.endpoints
        deployed = Deployed.read(self._deployment)
        guard = self.guard = Guard(deployed, enforce=s.local_iam)
        self._closers.append(lambda: guard.write_usage(self.state_dir / IAM_REPORT))
        storage = StorageFront(gcs_host, guard).start()
        self._closers.append(storage.stop)
        self.firestore_front = FirestoreFront(self._firestore_host, guard, s.project)
        self._closers.append(self.firestore_front.stop)
        self.pubsub_front = PubSubFront(ep.pubsub, guard)
        self._closers.append(self.pubsub_front.stop)
        ep.storage, ep.token = storage.url, guard.token(OPERATOR)
        ep.firestore = self.firestore_front.endpoint(OPERATOR)
        return deployed

    def _start_control_plane(self) -> tuple[Any, KubeEndpoint, KubeFront, GkeApiServer]:
        """kube-apiserver and etcd with the CRDs, GKE's front of it, and the GKE API that finds the cluster
        (retrain.adapters.cluster): that front as its endpoint, node pools as infra/platform declares them."""
        from retrain_local.envtest import ControlPlane

        self.progress("starting the Kubernetes control plane (kube-apiserver + etcd, CRDs)")
        s, guard = self.settings, self.guard
        control_plane = ControlPlane(self.state_dir / "kube")
        control_plane.start()
        self._closers.append(control_plane.stop)
        kube = KubeEndpoint.from_kubeconfig(control_plane.kubeconfig)
        kube_front = KubeFront(
            kube.server, kube.token, kube.ca_file, guard, control_plane.run_dir / "pki"
        ).start()
        self._closers.append(kube_front.stop)
        project = Resource(Kind.PROJECT, s.project)
        gke_api = GkeApiServer.for_control_plane(
            self._deployment,
            kube_front.url,
            kube.ca_file,
            authorize=lambda token, permission: guard.authorize(token, permission, project),
        ).start()
        self._closers.append(gke_api.stop)
        self.endpoints.container = gke_api.base_url
        self._setenv({**self.endpoints.env(), **config.to_env(s)})
        return control_plane, kube, kube_front, gke_api

    def _create_buckets(self) -> None:
        """The buckets as infra/platform creates them, and the template spec infra/app/dataflow.tf writes."""
        s = self.settings
        client = objects.storage_client()  # as the operator, who applies Terraform
        versioned = self._deployment.versioned_buckets()
        for name in (s.landing_bucket, s.artifacts_bucket):
            bucket = client.lookup_bucket(name) or client.create_bucket(name)
            if bucket.versioning_enabled != versioned.get(name, False):
                bucket.versioning_enabled = versioned.get(name, False)
                bucket.patch()
        spec_uri, spec = self._deployment.template_spec()
        objects.write_bytes(spec_uri, spec, "application/json")

    def _start_cluster(self, api: Any, gke_api: GkeApiServer, child_env: dict[str, str]) -> ManifestValues:
        """What Terraform applies in the cluster, and the cluster twin, within the pool's bounds."""
        from retrain_local.cluster import ClusterTwin
        from retrain_local.envtest import apply_documents
        from retrain_ops.manifests import documents

        self.progress("starting the cluster twin (DWS provisioner, JobSet controller, kubelet)")
        s = self.settings
        self.kube_api = api
        # Rendered by the same code from infra/'s values: the service accounts, the notifier's, the
        # reaper's and the workflow's RBAC, and the settings ConfigMap (Terraform writes it from
        # local.retrain_env); GKE's multi-networking objects (GPUDirect-TCPX) too.
        values = self._deployment.manifest_values()
        settings_map = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": values.settings_config_map, "namespace": values.namespace},
            "data": self._deployment.env,
        }
        apply_documents(api, [settings_map, *documents(values)])
        twin = ClusterTwin(
            api,  # GKE's own controllers (DWS, the JobSet controller, the kubelet) act as the cluster's admin
            scale_down_delay_s=s.scale_down_delay_s,
            booking_window_s=DWS_BOOKING_WINDOW_S / LOCAL_TIME_FACTOR,
            namespace=s.namespace,
            node_pool=s.node_pool,
            machine_type=s.machine_type,
            gpus_per_node=s.gpus_per_node,
            provision_delay_s=s.provision_delay_s,
            workdir=self.state_dir / "pods",
            pod_env=child_env,
            faults=parse_faults(s.twin_faults),
            pod_identity=lambda namespace, ksa: self.identity_env(self.workload_member(namespace, ksa)),
        )
        # The pool's bounds are the GKE API's (Terraform's google_container_node_pool.gpu_dws).
        size = {p.name: pool_size(p) for p in gke_api.cluster.node_pools}.get(s.node_pool)
        if size is None:
            raise RuntimeError(
                f"RETRAIN_NODE_POOL={s.node_pool} is no autoscaled node pool of infra/platform's cluster "
                f"({', '.join(p.name for p in gke_api.cluster.node_pools)})"
            )
        twin.set_autoscaling(size.min_nodes, size.max_nodes)
        twin.start()
        self._closers.append(twin.stop)
        self.twin = twin
        return values

    def _start_notifier(self, kube: KubeEndpoint, values: ManifestValues) -> tuple[Any, str]:
        """The topics, and the notifier: a pod, with its Kubernetes service account's own token for the API
        server and the Google account Workload Identity maps that account to for Pub/Sub.  The publisher
        and the JobSet events topic's path (every terminal state, failures too)."""
        from google.cloud import pubsub_v1  # type: ignore[attr-defined]

        from retrain.k8s.notifier import Notifier

        self.progress("starting the notifier (JobSet terminal states to Pub/Sub)")
        s = self.settings
        publisher = pubsub_v1.PublisherClient()
        topic = publisher.topic_path(s.project, s.jobset_topic)
        delivery.ensure_topic(publisher, topic)
        # retained as infra/platform declares it: `retrain events` replays what the topic retains
        delivery.ensure_topic(publisher, s.events_topic, self._deployment.topic_retention_s("run_events"))
        notifier_as = Caller(self.guard, self.workload_member(values.namespace, values.notifier_ksa))

        def publish(data: bytes, attributes: dict[str, str]) -> None:
            notifier_as.require("pubsub.topics.publish", Resource(Kind.TOPIC, s.jobset_topic))
            publisher.publish(topic, data, **attributes).result(timeout=30)

        notifier_api = (
            self._service_account_client(kube, values.namespace, values.notifier_ksa)
            if s.local_iam
            else self.kube_api
        )
        notifier = Notifier(
            notifier_api, publish, namespace=s.namespace, state_path=self.state_dir / "notifier.json"
        )
        notifier.start()
        self._closers.append(notifier.stop)
        self.notifier = notifier
        return publisher, topic

    def _start_executions(
        self,
        deployed: Deployed,
        kube: KubeEndpoint,
        kube_front: KubeFront,
        functions: _Functions,
        child_env: dict[str, str],
    ) -> None:
        """run_step (the workflow's steps in Python), the local Dataflow, and the executions service that
        runs workflows/retrain.yaml as the workflow's account, its connectors bound to the stack."""
        from cloudworkflows import ExecutionsServer, load_workflow

        ep = self.endpoints
        self.progress("starting the run_step function (the workflow's steps in Python)")
        ep.steps_function = functions.serve("run_step", signature="http")
        self.progress("starting the workflow executions service")
        guard = self.guard
        workflow_as = Caller(guard, deployed.workflow)
        dataflow = LocalDataflow(
            self.state_dir / "dataflow", child_env, caller=workflow_as, identity_env=self.identity_env
        )
        self._closers.append(dataflow.stop)
        self.dataflow = dataflow
        registry = local_registry(
            firestore_host=self._firestore_host,
            pubsub_host=ep.pubsub,
            kube=KubeEndpoint(kube_front.url, workflow_as.token, kube.ca_file),
            dataflow=dataflow,
            caller=workflow_as,
        )
        registry.origins[STORAGE_API] = ep.storage  # the workflow's managed-folder calls (http.*)
        workflow = load_workflow(WORKFLOW_FILE)
        server = ExecutionsServer(
            lambda _name: workflow,
            registry,
            self._deployment.execution_env({"RETRAIN_STEPS_URL": ep.steps_function}),
            authorize=lambda token, permission, name: guard.authorize(
                token, permission, Resource(Kind.WORKFLOW, name)
            ),
        )
        server.start()
        self._closers.append(server.stop)
        ep.workflows, ep.workflows_grpc = server.base_url, server.grpc_target
        workflows_env = {
            "RETRAIN_WORKFLOWS_ENDPOINT": ep.workflows,
            "RETRAIN_WORKFLOWS_GRPC_ENDPOINT": ep.workflows_grpc,
        }
        self._setenv(workflows_env)
        functions.env.update(workflows_env)
        self.executions = server

    def _start_functions(self, functions: _Functions, jobs: list[ScheduledJob]) -> list[str]:
        """The event functions, each behind Cloud Run's invoker check and started again when it dies (Cloud
        Run starts a new instance); the Scheduler's topics they are pushed from."""
        s, ep = self.settings, self.endpoints
        self.progress(
            "starting Cloud Functions (functions-framework): on_object_finalized, on_jobset_event, "
            "on_scheduler_tick, run_http"
        )
        ticks = sorted({job.topic for job in jobs})
        functions.push_routes.update({s.jobset_topic: "on_jobset_event"})
        functions.push_routes.update({t.rsplit("/", 1)[-1]: "on_scheduler_tick" for t in ticks})
        ep.ingest_function = functions.serve("on_object_finalized") + "/_eventarc"
        ep.relay_function = functions.serve("on_jobset_event")
        ep.scheduler_function = functions.serve("on_scheduler_tick")
        ep.manual_function = functions.serve("run_http", signature="http")
        self._closers.append(periodically(1.0, self._restart_dead_functions, "function supervisor"))
        return ticks

    def _wire_subscriptions(
        self,
        deployed: Deployed,
        functions: _Functions,
        publisher: Any,
        sources: list[str],
        jobs: list[ScheduledJob],
    ) -> None:
        """The push subscriptions as infra/app/events.tf declares them (their names, who pushes, where dead
        letters go), the Scheduler twin, and Eventarc's redelivery."""
        from google.cloud import pubsub_v1  # type: ignore[attr-defined]

        from retrain_local.eventarc import Redelivery

        s, guard = self.settings, self.guard
        subscriber = pubsub_v1.SubscriberClient()
        dead_letters = self._deployment.topic("dead_letter_topic_id")
        for source in sources:
            # dead-letter forwarding is Pub/Sub's agent's: publish on the dead-letter topic, consume on the
            # subscription (cloud.google.com/pubsub/docs/handling-failures#grant_forwarding_permissions)
            topic_id = source.rsplit("/", 1)[-1]
            push = deployed.pushes[topic_id]
            name = f"projects/{s.project}/subscriptions/{push.name}"
            guard.check(
                deployed.pubsub_agent, "pubsub.topics.publish", Resource(Kind.TOPIC, push.dead_letter_topic)
            )
            guard.check(
                deployed.pubsub_agent, "pubsub.subscriptions.consume", Resource(Kind.SUBSCRIPTION, push.name)
            )
            endpoint = f"{functions.fronts[functions.push_routes[topic_id]]}/_push/{topic_id}"
            delivery.push_subscription(subscriber, publisher, source, endpoint, dead_letters, name=name)
        delivery.dead_letter_subscription(subscriber, publisher, dead_letters)

        def publish_tick(job: ScheduledJob) -> None:
            publisher.publish(job.topic, job.data, **job.attributes).result(timeout=30)

        self._closers.append(scheduler_twin(jobs, publish_tick, self.paused_jobs))
        redelivery = Redelivery(s.project, self.endpoints.ingest_function, dead_letters).start()
        self._closers.append(redelivery.stop)
        self.redelivery = redelivery

    def identity_env(self, member: str) -> dict[str, str]:
        """The environment of a process that runs as ``member``: the stack's endpoints, its own Firestore
        and Pub/Sub endpoints and its own token."""
        return {
            **self.endpoints.env(),
            "FIRESTORE_EMULATOR_HOST": self.firestore_front.endpoint(member),
            "PUBSUB_EMULATOR_HOST": self.pubsub_front.endpoint(member),
            LOCAL_TOKEN_VAR: self.guard.token(member),
        }

    def workload_member(self, namespace: str, ksa: str) -> str:
        """Who a pod running as ``ksa`` is to Google (Workload Identity, as the guard decides it from the
        service account's annotation in the cluster and infra/'s bindings)."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            account = client.CoreV1Api(self.kube_api).read_namespaced_service_account(ksa, namespace)
            annotations = dict((account.metadata and account.metadata.annotations) or {})
        except ApiException as e:
            if e.status != 404:
                raise
            annotations = {}
        return self.guard.workload_member(namespace, ksa, annotations)

    def _service_account_client(self, kube: KubeEndpoint, namespace: str, ksa: str) -> Any:
        """A Kubernetes client that is ``ksa``, with a token the API server issues it (TokenRequest), as
        a pod's projected service account token."""
        from kubernetes import client

        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=2 * 86400)
        )
        answer = client.CoreV1Api(self.kube_api).create_namespaced_service_account_token(
            ksa, namespace, request
        )
        configuration = client.Configuration()
        configuration.host = kube.server
        configuration.ssl_ca_cert = kube.ca_file
        assert answer.status is not None, "TokenRequest answered without a token"
        configuration.api_key = {"authorization": f"Bearer {answer.status.token}"}
        return client.ApiClient(configuration)

    @property
    def firestore_data(self) -> Path:
        return self.state_dir / "firestore-data"

    def _take_lock(self) -> None:
        """One stack per state folder: a second ``retrain up`` refuses while this one starts or runs."""
        import fcntl

        lock = open(self.state_dir / "stack.lock", "w")  # noqa: SIM115 - held for the stack's lifetime
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise RuntimeError(f"another local stack is starting or running on {self.state_dir}") from None
        self._closers.append(lock.close)

    @contextlib.contextmanager
    def function_down(self, target: str) -> Iterator[None]:
        """Function ``target`` (e.g. ``on_object_finalized``) stopped, and kept down until the block ends,
        when the supervisor starts it again on its port: a crashed instance, for the fault suite."""
        (proc,) = [p for p in self._procs if p.name == f"function-{target}"]
        self._held_down.add(proc.name)
        proc.stop()
        try:
            yield
        finally:
            self._held_down.discard(proc.name)
            deadline = time.monotonic() + 60
            while proc.proc is None or proc.proc.poll() is not None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name} did not come back")
                time.sleep(0.2)

    @contextlib.contextmanager
    def notifier_down(self) -> Iterator[None]:
        """The in-cluster notifier stopped for the block (a pod evicted): no completion is published."""
        self.notifier.stop()
        try:
            yield
        finally:
            self.notifier.start()

    def _restart_dead_functions(self) -> None:
        for proc in self._procs:
            if proc.name in self._held_down:
                continue
            if proc.name.startswith("function-") and proc.proc is not None and proc.proc.poll() is not None:
                log.warning("%s exited with %s: starting it again", proc.name, proc.proc.returncode)
                proc.start()

    def _keep_ledger(self) -> None:
        """Export the ledger so run records outlive the stack (`retrain runs` after `retrain demo`, and
        after a crash: it is exported every LEDGER_EXPORT_S too)."""
        with self._ledger_lock:
            emulators.export_firestore(self._firestore_host, self.settings.project, self.firestore_data)

    def stop(self) -> None:
        """Stop everything that started, newest first; never raises."""
        while self._closers:
            closer = self._closers.pop()
            try:
                closer()
            except Exception as e:  # keep stopping the rest
                log.warning("while stopping: %s", e)
        while self._procs:
            self._procs.pop().stop()
        self._restore_env()

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()


@contextlib.contextmanager
def ledger_access(settings: config.Settings) -> Iterator[None]:
    """Reach the ledger: the running stack's, or (when none runs) the one its last stop kept."""
    if stack_file(settings).exists():
        attach(settings)
        yield
        return
    state_dir = Path(settings.state_dir).resolve()
    proc, host = processes.start_on_a_free_port(
        lambda port: emulators.firestore(state_dir, port, import_from=state_dir / "firestore-data")
    )
    os.environ["FIRESTORE_EMULATOR_HOST"] = host
    try:
        yield
    finally:
        proc.stop()
