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
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain import config
from retrain.adapters import objects
from retrain.adapters.cluster import CONTAINER_ENDPOINT_VAR
from retrain.adapters.credentials import LOCAL_TOKEN_VAR
from retrain_local import delivery, emulators, in_cluster, processes, serverless
from retrain_local.connectors import KubeEndpoint, LocalDataflow, local_registry
from retrain_local.firestore_front import FirestoreFront
from retrain_local.gke_api import GkeApiServer
from retrain_local.identities import OPERATOR, Caller, Deployed, Guard
from retrain_local.kube_front import KubeFront
from retrain_local.lifetime import Lifetime, periodically
from retrain_local.pubsub_front import PubSubFront
from retrain_local.serverless import Functions
from retrain_local.storage_front import STORAGE_API, StorageFront
from retrain_ops.deployment import (
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
#: Where a stopped stack keeps its ledger (Firestore's export), inside its state folder.
FIRESTORE_DATA = "firestore-data"
#: The ledger is exported this often (and at a clean stop): a crash of the stack loses at most this much.
LEDGER_EXPORT_S = 5.0


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


def create_buckets(s: config.Settings, deployment: Deployment) -> None:
    """The buckets as infra/platform creates them, and the template spec infra/app/dataflow.tf writes."""
    client = objects.storage_client()  # as the operator, who applies Terraform
    versioned = deployment.versioned_buckets()
    for name in (s.landing_bucket, s.artifacts_bucket):
        bucket = client.lookup_bucket(name) or client.create_bucket(name)
        if bucket.versioning_enabled != versioned.get(name, False):
            bucket.versioning_enabled = versioned.get(name, False)
            bucket.patch()
    spec_uri, spec = deployment.template_spec()
    objects.write_bytes(spec_uri, spec, "application/json")


def ensure_topics(publisher: Any, s: config.Settings, deployment: Deployment) -> str:
    """The topics the stack publishes on, as infra/platform declares them (the run events topic retained:
    ``retrain events`` replays what it retains); the JobSet events topic's path."""
    topic = publisher.topic_path(s.project, s.jobset_topic)
    delivery.ensure_topic(publisher, topic)
    delivery.ensure_topic(publisher, s.events_topic, deployment.topic_retention_s("run_events"))
    return str(topic)


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
    lifetime: Lifetime = field(default_factory=Lifetime)
    """What the stack started, and how its stop undoes it."""
    standin_launcher: bool = False
    """Training launched by the stand-in ``torchrun`` (:mod:`retrain_local.torchrun`), not PyTorch's."""
    ledger_export_s: float | None = LEDGER_EXPORT_S
    """How often the ledger is exported while the stack runs (a crash loses at most this); None: at stop."""
    _ledger_lock: threading.Lock = field(default_factory=threading.Lock)
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

    def _start(self) -> None:
        """The phases, in dependency order: each names what it starts."""
        self._preflight()
        gcs_host = self._start_emulators()
        deployed = self._start_iam_fronts(gcs_host)
        functions = Functions(self, deployed)  # their fork server imports while the cluster starts
        control_plane, kube, kube_front, gke_api = self._start_control_plane()
        create_buckets(self.settings, self._deployment)
        child_env = {**self.endpoints.env(), **self.pod_env}  # a pod's or a Dataflow job's processes'
        values = self._start_cluster(control_plane.api_client(), gke_api, child_env)
        publisher, jobset_events = self._start_notifier(kube, values)
        self._start_executions(deployed, kube, kube_front, functions, child_env)
        jobs = self._deployment.scheduler_jobs()
        ticks = self._start_functions(functions, jobs)
        self._wire_subscriptions(deployed, functions, publisher, [jobset_events, *ticks], jobs)
        ep, s = self.endpoints, self.settings
        ep.save(stack_file(s))
        self.lifetime.on_stop(lambda: stack_file(s).unlink(missing_ok=True))
        self.progress("local stack is up")

    def _preflight(self) -> None:
        """The state folder taken (one stack per folder), every child recorded as it starts, and what the
        stack needs (Java, the Cloud SDK's emulators, envtest) present."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.lifetime.lock(self.state_dir)
        processes.use(self.state_dir / PROCESS_REGISTRY)
        self.lifetime.on_stop(lambda: processes.use(None))
        self.endpoints.pid = os.getpid()
        from retrain_local.envtest import envtest_unavailable_reason

        reason = emulators.java_emulators_unavailable_reason() or envtest_unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot start the local stack: {reason}")
        if self.fresh:
            for kept in (self.state_dir / "gcs", self.state_dir / FIRESTORE_DATA):
                shutil.rmtree(kept, ignore_errors=True)

    def _start_emulators(self) -> str:
        """Cloud Storage, Firestore (its ledger kept across stops), Pub/Sub; the storage emulator's host."""
        self.progress("starting emulators: GCS, Firestore, Pub/Sub")
        _, gcs_host = self.lifetime.spawn_on_a_free_port(lambda port: emulators.gcs(self.state_dir, port))
        kept = self.state_dir / FIRESTORE_DATA
        _, self._firestore_host = self.lifetime.spawn_on_a_free_port(
            lambda port: emulators.firestore(self.state_dir, port, import_from=kept)
        )
        _, self.endpoints.pubsub = self.lifetime.spawn_on_a_free_port(
            lambda port: emulators.pubsub(self.state_dir, port)
        )
        self.lifetime.on_stop(self._keep_ledger)
        if self.ledger_export_s is not None:
            self.lifetime.on_stop(periodically(self.ledger_export_s, self._keep_ledger, "ledger export"))
        return gcs_host

    def _start_iam_fronts(self, gcs_host: str) -> Deployed:
        """Who runs what (infra/), and the fronts that check every call against infra/'s IAM."""
        s, ep = self.settings, self.endpoints
        deployed = Deployed.read(self._deployment)
        guard = self.guard = Guard(deployed, enforce=s.local_iam)
        self.lifetime.on_stop(lambda: guard.write_usage(self.state_dir / IAM_REPORT))
        storage = StorageFront(gcs_host, guard).start()
        self.lifetime.on_stop(storage.stop)
        self.firestore_front = FirestoreFront(self._firestore_host, guard, s.project)
        self.lifetime.on_stop(self.firestore_front.stop)
        self.pubsub_front = PubSubFront(ep.pubsub, guard)
        self.lifetime.on_stop(self.pubsub_front.stop)
        ep.storage, ep.token = storage.url, guard.token(OPERATOR)
        ep.firestore = self.firestore_front.endpoint(OPERATOR)
        return deployed

    def _start_control_plane(self) -> tuple[Any, KubeEndpoint, KubeFront, GkeApiServer]:
        """kube-apiserver and etcd with the CRDs, GKE's front of it, and the GKE API that finds the cluster
        (retrain.adapters.cluster): that front as its endpoint, node pools as infra/platform declares them."""
        self.progress("starting the Kubernetes control plane (kube-apiserver + etcd, CRDs)")
        s, guard = self.settings, self.guard
        control_plane, kube, kube_front = in_cluster.control_plane(
            self.state_dir / "kube", guard, self.lifetime
        )
        gke_api = in_cluster.gke_api(self._deployment, kube_front.url, kube.ca_file, guard, s.project)
        self.lifetime.on_stop(gke_api.stop)
        self.endpoints.container = gke_api.base_url
        self.lifetime.setenv({**self.endpoints.env(), **config.to_env(s)})
        return control_plane, kube, kube_front, gke_api

    def _start_cluster(self, api: Any, gke_api: GkeApiServer, child_env: dict[str, str]) -> ManifestValues:
        """What Terraform applies in the cluster, and the cluster twin, within the pool's bounds."""
        self.progress("starting the cluster twin (DWS provisioner, JobSet controller, kubelet)")
        self.kube_api = api
        values = in_cluster.apply_manifests(api, self._deployment)
        twin = in_cluster.cluster_twin(
            api,
            self.settings,
            gke_api,
            workdir=self.state_dir / "pods",
            pod_env=child_env,
            pod_identity=lambda namespace, ksa: self.identity_env(self.workload_member(namespace, ksa)),
            standin_launcher=self.standin_launcher,
        )
        twin.start()
        self.lifetime.on_stop(twin.stop)
        self.twin = twin
        return values

    def _start_notifier(self, kube: KubeEndpoint, values: ManifestValues) -> tuple[Any, str]:
        """The topics, and the notifier (:func:`in_cluster.notifier`); the publisher and the JobSet events
        topic's path (every terminal state, failures too)."""
        from google.cloud import pubsub_v1  # type: ignore[attr-defined]

        self.progress("starting the notifier (JobSet terminal states to Pub/Sub)")
        publisher = pubsub_v1.PublisherClient()
        topic = ensure_topics(publisher, self.settings, self._deployment)
        as_member = Caller(self.guard, self.workload_member(values.namespace, values.notifier_ksa))
        self.notifier = in_cluster.notifier(
            self.kube_api, kube, values, self.settings, publisher, as_member, self.state_dir / "notifier.json"
        )
        self.lifetime.on_stop(self.notifier.stop)
        return publisher, topic

    def _start_executions(
        self,
        deployed: Deployed,
        kube: KubeEndpoint,
        kube_front: KubeFront,
        functions: Functions,
        child_env: dict[str, str],
    ) -> None:
        """run_step (the workflow's steps in Python), the local Dataflow, and the executions service that
        runs workflows/retrain.yaml as the workflow's account, its connectors bound to the stack."""
        ep = self.endpoints
        self.progress("starting the run_step function (the workflow's steps in Python)")
        ep.steps_function = functions.serve("run_step", signature="http")
        self.progress("starting the workflow executions service")
        guard = self.guard
        workflow_as = Caller(guard, deployed.workflow)
        dataflow = LocalDataflow.forking(  # its fork server imports Beam while the rest starts
            self.state_dir / "dataflow", child_env, caller=workflow_as, identity_env=self.identity_env
        )
        self.lifetime.on_stop(dataflow.stop)
        self.dataflow = dataflow
        registry = local_registry(
            firestore_host=self._firestore_host,
            pubsub_host=ep.pubsub,
            kube=KubeEndpoint(kube_front.url, workflow_as.token, kube.ca_file),
            dataflow=dataflow,
            caller=workflow_as,
        )
        registry.origins[STORAGE_API] = ep.storage  # the workflow's managed-folder calls (http.*)
        env = self._deployment.execution_env({"RETRAIN_STEPS_URL": ep.steps_function})
        server = serverless.executions_service(WORKFLOW_FILE, registry, env, guard)
        self.lifetime.on_stop(server.stop)
        ep.workflows, ep.workflows_grpc = server.base_url, server.grpc_target
        workflows_env = {
            "RETRAIN_WORKFLOWS_ENDPOINT": ep.workflows,
            "RETRAIN_WORKFLOWS_GRPC_ENDPOINT": ep.workflows_grpc,
        }
        self.lifetime.setenv(workflows_env)
        functions.env.update(workflows_env)
        self.executions = server

    def _start_functions(self, functions: Functions, jobs: list[ScheduledJob]) -> list[str]:
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
        self.lifetime.supervise_functions()
        return ticks

    def _wire_subscriptions(
        self,
        deployed: Deployed,
        functions: Functions,
        publisher: Any,
        sources: list[str],
        jobs: list[ScheduledJob],
    ) -> None:
        """The push subscriptions as infra/app/events.tf declares them (their names, who pushes, where dead
        letters go), the Scheduler twin, and Eventarc's redelivery."""
        from google.cloud import pubsub_v1  # type: ignore[attr-defined]

        from retrain_local.eventarc import Redelivery

        guard = self.guard
        subscriber = pubsub_v1.SubscriberClient()
        dead_letters = self._deployment.topic("dead_letter_topic_id")
        for source in sources:
            topic_id = source.rsplit("/", 1)[-1]
            endpoint = f"{functions.fronts[functions.push_routes[topic_id]]}/_push/{topic_id}"
            serverless.push_subscription(
                subscriber, publisher, deployed, guard, source, endpoint, dead_letters
            )
        delivery.dead_letter_subscription(subscriber, publisher, dead_letters)

        def publish_tick(job: ScheduledJob) -> None:
            publisher.publish(job.topic, job.data, **job.attributes).result(timeout=30)

        self.lifetime.on_stop(scheduler_twin(jobs, publish_tick, self.paused_jobs))
        redelivery = Redelivery(self.settings.project, self.endpoints.ingest_function, dead_letters).start()
        self.lifetime.on_stop(redelivery.stop)
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
        annotations = in_cluster.service_account_annotations(self.kube_api, namespace, ksa)
        return self.guard.workload_member(namespace, ksa, annotations)

    def function_down(self, target: str) -> contextlib.AbstractContextManager[None]:
        """Function ``target`` (e.g. ``on_object_finalized``) stopped, and kept down until the block ends,
        when the supervisor starts it again on its port: a crashed instance, for the fault suite."""
        return self.lifetime.function_down(target)

    def notifier_down(self) -> contextlib.AbstractContextManager[None]:
        """The in-cluster notifier stopped for the block (a pod evicted): no completion is published."""
        return in_cluster.evicted(self.notifier)

    def _keep_ledger(self) -> None:
        """Export the ledger so run records outlive the stack (`retrain runs` after `retrain demo`, and
        after a crash: it is exported every LEDGER_EXPORT_S too)."""
        with self._ledger_lock:
            kept = self.state_dir / FIRESTORE_DATA
            emulators.export_firestore(self._firestore_host, self.settings.project, kept)

    def stop(self) -> None:
        """Stop everything that started, newest first; never raises."""
        self.lifetime.stop()

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
        lambda port: emulators.firestore(state_dir, port, import_from=state_dir / FIRESTORE_DATA)
    )
    os.environ["FIRESTORE_EMULATOR_HOST"] = host
    try:
        yield
    finally:
        proc.stop()
