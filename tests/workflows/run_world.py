"""workflows/retrain.yaml's surroundings in memory, on virtual time, for tests of its paths that run in
milliseconds: the GKE control plane (DWS, the JobSet controller and the autoscaler as the cluster twin
plays them, reduced to what the workflow reads), Dataflow, the run_step function, Cloud Storage (the
tokenize report, the run's managed folder), the run record in Firestore and Pub/Sub.  Each is the
interpreter's connector for it, or, for the workflow's ``http.*`` calls, an in-process server; each
answers in the shape the local stack's real part answers (``retrain_local.connectors``: ``{body, code,
headers}``, a 404 or 409 as an HttpError map).  What the cluster or an operator does happens at the
virtual time the :class:`Scenario` gives it.

The same paths run through the whole local stack in tests/shared_stack/test_workflow_failures.py (real
emulators, the cluster twin, the run_step function): there the wiring is proven, here each branch's timing
and accounting, exactly.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import json
import threading
import uuid
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from cloudworkflows import (
    CallbackHub,
    ConnectorRegistry,
    VirtualClock,
    Workflow,
    WorkflowError,
    http_error,
    load_workflow,
)
from retrain.config import Settings
from retrain.contracts import (
    Accounting,
    Begun,
    CancelRequest,
    CompletionState,
    Finished,
    Handover,
    JobSetCompletion,
    JobSetRef,
    Results,
    StepName,
    StepRequest,
)
from retrain.domain.errors import Rejected
from retrain.domain.runs import Run, gpu_hours, node_cost_usd
from retrain.plan import workflow_argument
from retrain_local.dataflow import check_parameters
from retrain_local.http import LoopbackServer
from retrain_ops.deployment import Deployment

WORKFLOW = Path(__file__).resolve().parents[2] / "workflows" / "retrain.yaml"
RUN_ID = "books-20261128-040000-abc123"
JOB_ID = "2026-11-28_04_00_00-1"
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
EXECUTION_ID = "0f0e0d0c-0000-4000-8000-000000000001"


@dataclass
class Scenario:
    """What happens around one run, in seconds after the event that starts it."""

    tokenize_s: float | None = 300.0
    """The Dataflow job ends this long after its launch (None: never)."""
    tokenize_state: str = "JOB_STATE_DONE"
    """How it ends."""
    tokens: int = 50_000
    """What its report counts."""
    provision_s: float | None = 120.0
    """DWS answers a capacity request this long after it is made (None: never)."""
    provision_condition: str = "Provisioned"
    """Its answer: ``Provisioned``, or ``Failed``."""
    train_s: float | None = 3600.0
    """The JobSet reaches its terminal condition this long after it is created (None: never)."""
    train_condition: str = "Completed"
    """Which: ``Completed``, or ``Failed``."""
    revoke_s: float | None = None
    """DWS takes the capacity back this long after it provided it (None: never)."""
    notify: bool = True
    """Whether the notifier's message reaches the run's callback (False: lost)."""
    cancel_at_s: float | None = None
    """An operator cancels the run this long after the execution starts (None: never)."""
    forged_at_s: float | None = None
    """Someone who may send callbacks POSTs a ``Failed`` completion to the run's channel, and a body
    that is not a JSON object, this long after the execution starts (None: never)."""
    scale_down_s: float = 600.0
    """The autoscaler removes nodes this long after their capacity request is deleted."""
    nodes: int | None = None
    """Nodes per run (None: infra/'s ``nodes``)."""
    withdraw_request_s: float | None = None
    """Someone deletes the run's capacity request this long after it is made (None: never)."""
    steps_account: bool = True
    """Whether run_step answers the ``account`` step (False: it is down then, answering 503)."""


class _Kube:
    """The GKE control plane the workflow reaches through ``gke.request``: objects by path, with uids,
    409 on a second create, 404 for what is not there, a delete's uid precondition; DWS provisions a
    request, the JobSet controller ends a JobSet and the autoscaler removes nodes, each at its time."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.objects: dict[str, dict[str, Any]] = {}
        self.nodes: list[str] = []
        self.created: list[tuple[float, str]] = []
        self.deleted: list[tuple[float, str]] = []

    def request(self, args: dict[str, Any], _: dict[str, Any]) -> Any:
        method, path = str(args.get("method", "GET")), str(args["path"])
        if method == "POST":
            return self._create(path, copy.deepcopy(args["body"]))
        if method == "DELETE":
            return self._delete(path, args.get("body") or {})
        if method != "GET":
            raise self._status(405, "MethodNotAllowed", f"{method} is not played here")
        if path == "/api/v1/nodes":
            selector = (args.get("query") or {}).get("labelSelector")
            pool = f"{NODE_POOL_LABEL}={self.world.argument['node_pool']}"
            items = [
                {"metadata": {"name": n, "labels": {NODE_POOL_LABEL: self.world.argument["node_pool"]}}}
                for n in self.nodes
                if selector in (None, pool)
            ]
            return self._answer({"kind": "NodeList", "items": items})
        if path not in self.objects:
            raise self._status(404, "NotFound", f"{path} not found")
        return self._answer(copy.deepcopy(self.objects[path]))

    def _answer(self, body: dict[str, Any], code: int = 200) -> dict[str, Any]:
        return {"body": body, "code": code, "headers": {"Content-Type": "application/json"}}

    def _status(self, code: int, reason: str, message: str) -> WorkflowError:
        """The API server's Status, raised as ``send`` raises any answer from 400 up."""
        status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message}
        return WorkflowError(http_error(code, body={**status, "reason": reason, "code": code}))

    def _create(self, collection: str, body: dict[str, Any]) -> Any:
        path = f"{collection}/{body['metadata']['name']}"
        if path in self.objects:
            raise self._status(409, "AlreadyExists", f"{path} already exists")
        body["metadata"]["uid"] = str(uuid.uuid4())
        self.objects[path] = body
        self.created.append((self.world.elapsed(), path))
        scenario, clock = self.world.scenario, self.world.clock
        if body["kind"] == "ProvisioningRequest" and scenario.provision_s is not None:
            clock.after(scenario.provision_s, lambda: self._provision(path, body["metadata"]["uid"]))
        if body["kind"] == "ProvisioningRequest" and scenario.withdraw_request_s is not None:
            clock.after(scenario.withdraw_request_s, lambda: self.objects.pop(path, None))
        if body["kind"] == "JobSet" and scenario.train_s is not None:
            clock.after(scenario.train_s, lambda: self._end_training(path, body))
        return self._answer(copy.deepcopy(body), 201)

    def _delete(self, path: str, options: dict[str, Any]) -> Any:
        current = self.objects.get(path)
        if current is None:
            raise self._status(404, "NotFound", f"{path} not found")
        wanted = (options.get("preconditions") or {}).get("uid")
        if wanted is not None and wanted != current["metadata"]["uid"]:
            raise self._status(409, "Conflict", f"{path}: precondition failed: uid {wanted}")
        del self.objects[path]
        self.deleted.append((self.world.elapsed(), path))
        if current["kind"] == "ProvisioningRequest" and self.nodes:
            self.world.clock.after(self.world.scenario.scale_down_s, self.nodes.clear)
        return self._answer({"kind": "Status", "status": "Success"})

    def _provision(self, path: str, uid: str) -> None:
        request = self.objects.get(path)
        if request is None or request["metadata"]["uid"] != uid:
            return  # withdrawn (or made again) meanwhile
        kind = self.world.scenario.provision_condition
        request["status"] = {"conditions": [{"type": kind, "status": "True", "reason": kind, "message": ""}]}
        if kind == "Provisioned":
            count = request["spec"]["podSets"][0]["count"]
            self.nodes = [f"gke-a3-{i}" for i in range(count)]
            if self.world.scenario.revoke_s is not None:
                self.world.clock.after(self.world.scenario.revoke_s, lambda: self._revoke(path, uid))

    def _revoke(self, path: str, uid: str) -> None:
        request = self.objects.get(path)
        if request is not None and request["metadata"]["uid"] == uid:
            revoked = {"type": "CapacityRevoked", "status": "True", "reason": "Revoked"}
            request["status"]["conditions"].append({**revoked, "message": "preempted"})
            self.nodes = []  # preempted: the nodes go with it (retrain_local.cluster, revoke)

    def _end_training(self, path: str, jobset: dict[str, Any]) -> None:
        if self.objects.get(path) is not jobset:
            return
        state = self.world.scenario.train_condition
        jobset["status"] = {"conditions": [{"type": state, "status": "True", "reason": state, "message": ""}]}
        if self.world.scenario.notify:
            meta = jobset["metadata"]
            completion = JobSetCompletion(
                type=JobSetCompletion.TYPE,
                run_id=RUN_ID,
                state=CompletionState(state),
                succeeded=state == "Completed",
                reason=state,
                message="",
                start_time=None,
                finish_time=None,
                restarts=0,
                jobset=JobSetRef(meta["name"], meta["namespace"], meta["uid"]),
                callback_url=self.world.callback_url,
                dedupe_key=f"{meta['uid']}/{state}",
            )
            self.world.deliver(completion.to_json())


class _Dataflow:
    """Flex-template launches, job states and cancels (jobs.update)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.state = "JOB_STATE_PENDING"
        self.cancelled_at: float | None = None

    def launch(self, args: dict[str, Any], _: dict[str, Any]) -> Any:
        """Refused as the local launcher refuses (retrain_local.dataflow): a spec that is not the
        deployed template's, parameters its metadata does not declare, an environment left out."""
        launch = args["body"]["launchParameter"]
        uri, spec = _deployment().template_spec()
        if launch.get("containerSpecGcsPath") != uri:
            raise WorkflowError(
                http_error(400, f"no template spec at {launch.get('containerSpecGcsPath')!r}")
            )
        check_parameters(dict(launch.get("parameters") or {}), json.loads(spec).get("metadata") or {})
        for required in ("serviceAccountEmail", "subnetwork", "tempLocation"):
            if not (launch.get("environment") or {}).get(required):
                raise WorkflowError(http_error(400, f"launchParameter.environment.{required} is required"))
        self.state = "JOB_STATE_RUNNING"
        scenario = self.world.scenario
        if scenario.tokenize_s is not None:
            self.world.clock.after(scenario.tokenize_s, self._end)
        return {"job": {"id": JOB_ID, "name": launch["jobName"]}}

    def _end(self) -> None:
        if self.state == "JOB_STATE_RUNNING":
            self.state = self.world.scenario.tokenize_state

    def get(self, args: dict[str, Any], _: dict[str, Any]) -> Any:
        if args["jobId"] != JOB_ID or self.state == "JOB_STATE_PENDING":
            raise WorkflowError(http_error(404, f"job {args['jobId']} not found"))
        return {"id": args["jobId"], "currentState": self.state}

    def update(self, args: dict[str, Any], _: dict[str, Any]) -> Any:
        requested = (args.get("body") or {}).get("requestedState")
        if requested != "JOB_STATE_CANCELLED":
            raise WorkflowError(http_error(400, f"requestedState {requested!r} is not supported locally"))
        self.get(args, {})
        if self.state == "JOB_STATE_RUNNING":
            self.state, self.cancelled_at = "JOB_STATE_CANCELLED", self.world.elapsed()
        return {"id": args["jobId"], "currentState": self.state}


@functools.cache
def _deployment() -> Deployment:
    """infra/'s values, read once (every world runs on the deployment's own)."""
    return Deployment()


def deployed_settings() -> Settings:
    """The settings infra/ deploys (its periods and deadlines, in the cloud's seconds)."""
    return _deployment().settings()


@functools.cache
def _workflow() -> Workflow:
    return load_workflow(WORKFLOW)


def _firestore_value(value: dict[str, Any]) -> Any:
    """One Firestore REST value, decoded."""
    (kind, v), *_ = value.items()
    if kind == "nullValue":
        return None
    if kind == "integerValue":
        return int(v)
    if kind == "mapValue":
        return {k: _firestore_value(x) for k, x in (v.get("fields") or {}).items()}
    if kind == "arrayValue":
        return [_firestore_value(x) for x in v.get("values") or []]
    return v


@dataclass
class World:
    """One run's execution of workflows/retrain.yaml and everything it calls (see the module docstring)."""

    scenario: Scenario = field(default_factory=Scenario)
    workflow: Workflow | None = None
    """The definition to run (by default workflows/retrain.yaml, loaded once for all worlds)."""
    clock: VirtualClock = field(default_factory=VirtualClock)
    record: dict[str, Any] = field(default_factory=dict)
    """The run record as the workflow's patches left it."""
    writes: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    """Each patch: when (seconds after the start) and its fields."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """The run events published."""
    steps: list[str] = field(default_factory=list)
    """The run_step calls, by step name."""
    folders: list[tuple[str, str]] = field(default_factory=list)
    """The managed-folder calls: method and path."""
    callback_url: str | None = None
    """The run's channel, as the workflow recorded it (where the notifier's message goes)."""
    cancel: tuple[str, str] | None = None
    """The operator's cancel as the ledger holds it (who, why), once made."""
    folder_open: bool = False
    """Whether the run's managed folder exists."""

    def __post_init__(self) -> None:
        deployment = _deployment()
        self.settings = deployment.settings()
        if self.scenario.nodes is not None:  # the global batch grows with them (a multiple of DP)
            batch = self.settings.global_batch_size * self.scenario.nodes
            self.settings = dataclasses.replace(
                self.settings, nodes=self.scenario.nodes, global_batch_size=batch
            )
        self.started = self.clock.now()
        self.kube, self.dataflow = _Kube(self), _Dataflow(self)
        self.server = LoopbackServer(self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.hub = CallbackHub(self.url, clock=self.clock)
        self.env = deployment.execution_env({"RETRAIN_STEPS_URL": f"{self.url}/steps"})
        run = Run(RUN_ID, "books", "gcs-marker", objects=40)
        self.argument = workflow_argument(self.settings, run, None).to_dict()

    def elapsed(self) -> float:
        return self.clock.now() - self.started

    def deliver(self, body: bytes) -> None:
        assert self.callback_url is not None, "no callback endpoint recorded yet"
        path = urlsplit(self.callback_url).path
        self.hub.deliver(path, "POST", {"Content-Type": "application/json"}, body)

    def run(self) -> Any:
        """The execution, to its end: its result, or the WorkflowError it raised."""
        connectors = ConnectorRegistry(token="ya29.workflow")
        connectors.origins["https://storage.googleapis.com"] = self.url
        for name, fn in {
            "gke.request": self.kube.request,
            "googleapis.dataflow.v1b3.projects.locations.flexTemplates.launch": self.dataflow.launch,
            "googleapis.dataflow.v1b3.projects.locations.jobs.get": self.dataflow.get,
            "googleapis.dataflow.v1b3.projects.locations.jobs.update": self.dataflow.update,
            "googleapis.storage.v1.objects.get": self._read_report,
            "googleapis.firestore.v1.projects.databases.documents.patch": self._patch,
            "googleapis.pubsub.v1.projects.topics.publish": self._publish,
        }.items():
            connectors.register(name, fn)
        if self.scenario.cancel_at_s is not None:
            self.clock.after(self.scenario.cancel_at_s, self._cancel)
        if self.scenario.forged_at_s is not None:
            self.clock.after(self.scenario.forged_at_s, self._forge)
        name = f"projects/{self.settings.project}/locations/{self.settings.region}/workflows/retrain"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        try:
            return (self.workflow or _workflow()).run(
                {"run_id": RUN_ID, "claim": "claim-1"},
                connectors=connectors,
                env=self.env,
                hub=self.hub,
                clock=self.clock,
                execution_name=f"{name}/executions/{EXECUTION_ID}",
            )
        except WorkflowError as e:
            return e
        finally:
            self.server.shutdown()
            self.server.server_close()

    def _forge(self) -> None:
        self.deliver(json.dumps({"state": "Failed", "reason": "forged"}).encode())
        self.deliver(b'["not", "a", "map"]')

    def _cancel(self) -> None:
        self.cancel = ("oncall@example.com", "wrong data")
        self.deliver(json.dumps({"state": "Cancelled"}).encode())

    # -- connectors --------------------------------------------------------------------------------

    def _read_report(self, args: dict[str, Any], _: dict[str, Any]) -> Any:
        assert args["alt"] == "media" and unquote(args["object"]) == self.argument["report_object"]
        return {
            "documents": 40,
            "tokens": self.scenario.tokens,
            "quarantined": 0,
            "quarantine_reasons": {},
            "quarantined_objects": [],
            "quarantined_object_count": 0,
        }

    def _patch(self, args: dict[str, Any], _: dict[str, Any]) -> Any:
        assert args["name"].endswith(f"/documents/runs/{RUN_ID}")
        assert args["currentDocument"] == {"exists": True}  # a record the workflow never creates
        fields = {k: _firestore_value(v) for k, v in args["body"]["fields"].items()}
        assert sorted(args["updateMask"]["fieldPaths"]) == sorted(fields)
        self.writes.append((self.elapsed(), fields))
        self.record.update(fields)
        self.callback_url = self.record.get("callback_url", self.callback_url)
        return {"name": args["name"], "fields": args["body"]["fields"]}

    def _publish(self, args: dict[str, Any], _: dict[str, Any]) -> Any:
        for message in args["body"]["messages"]:
            self.events.append(json.loads(base64.b64decode(message["data"])))
        return {"messageIds": [str(len(self.events))]}

    # -- the run_step function and Cloud Storage's managed folders, over HTTP ----------------------

    def _steps(self, body: Any) -> tuple[int, dict[str, Any]]:
        """run_step's answers (``retrain.steps``), in its contracts' shapes, to a body it would take
        (``StepRequest.parse``; a 400 as the function answers ``Rejected`` otherwise): the plan is the one
        ``retrain.plan.workflow_argument`` makes from infra/'s settings; the JobSet holds only what the
        workflow reads of it (its name and run id: tests/k8s/ test the rendered one); results promote
        the checkpoint; a run that did not succeed gives its objects back."""
        try:
            request = StepRequest.parse(body)
        except Rejected as e:
            return 400, {"error": e.reason}
        assert request.run_id == RUN_ID
        self.steps.append(str(request.step))
        if request.step == StepName.BEGIN:
            assert request.execution == EXECUTION_ID
            return 200, asdict(Begun(self.argument, ""))
        if request.step == StepName.HANDOVER:
            meta = {
                "name": self.argument["jobset_name"],
                "namespace": self.argument["namespace"],
                "annotations": {"retrain.dev/run-id": RUN_ID},
            }
            jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": meta}
            return 200, asdict(Handover(jobset, ["python", "megatron_gpt_pretraining.py"]))
        if request.step == StepName.CANCEL:
            by, reason = self.cancel or (None, "")
            return 200, asdict(CancelRequest(by, reason))
        if request.step == StepName.RESULTS:
            checkpoint = f"gs://{self.argument['artifacts_bucket']}/runs/{RUN_ID}/checkpoints/last"
            return 200, asdict(Results(checkpoint, {"steps": 100}, True, ""))
        if request.step == StepName.ACCOUNT:
            if not self.scenario.steps_account:
                return 503, {"error": "run_step is down"}
            seconds, a = request.gpu_node_seconds, self.argument
            accounting = Accounting(
                gpu_hours(seconds, a["gpus_per_node"]), node_cost_usd(seconds, a["price_per_node_hour"])
            )
            return 200, asdict(accounting)
        return 200, asdict(Finished(0 if self.record.get("status") == "succeeded" else 40))

    def _folder(self, method: str, path: str, query: str) -> tuple[int, dict[str, Any]]:
        """Cloud Storage's managed folders of the artifacts bucket (``retrain_local.storage_front``): a
        second create is a 409, a policy set on or a delete of a folder that is not there a 404."""
        self.folders.append((method, path))
        bucket = f"/storage/v1/b/{self.argument['artifacts_bucket']}/managedFolders"
        if method == "POST" and path == bucket:
            if self.folder_open:
                return 409, {"error": {"code": 409, "message": "the managed folder exists"}}
            self.folder_open = True
            return 200, {}
        name = path.removeprefix(bucket + "/").removesuffix("/iam")
        if not path.startswith(bucket + "/") or name != self.argument["run_folder"]:
            return 400, {"error": f"not the run's folder: {path}"}
        if not self.folder_open and (method, path) != ("POST", bucket):
            return 404, {"error": {"code": 404, "message": f"no managed folder {name}"}}
        if method == "DELETE":
            assert query.lower() == "allownonempty=true", query  # the objects stay; the folder goes
            self.folder_open = False
        return 200, {}

    def _handler(self) -> Any:
        world = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                assert self.headers.get("Authorization") == "Bearer ya29.workflow"
                path, _, query = self.path.partition("?")
                if path == "/steps":
                    code, answer = world._steps(body)
                else:
                    code, answer = world._folder(self.command, unquote(path), query)
                payload = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, *_: Any) -> None:
                pass

        return Handler
