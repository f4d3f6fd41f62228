"""The messages that cross a language boundary, each declared once, field by field.

retrain is five languages talking to each other: Python (functions, jobs), Workflows YAML, HCL,
Kubernetes YAML and JSON messages.  Every message between two of them is one type here; producers
build it and consumers parse it through that type, and ``tests/test_contracts.py`` reads the other
side (``workflows/retrain.yaml``, ``infra/``) and fails when it names a field or a value not declared
here.

============================  ======================================  =====================================
boundary                      producer                                consumer
============================  ======================================  =====================================
:class:`SchedulerTick`        Cloud Scheduler (``infra/app/scheduler``) ``Ingest.on_scheduler_tick``
:class:`WorkflowArgument`     ``retrain.plan.workflow_argument``      ``workflows/retrain.yaml`` (``args``)
run record                    the workflow's ``record`` steps, Ingest ``retrain.domain.runs.Run`` readers
:class:`RunManifest`          ``Ingest.start``                        ``retrain tokenize --manifest``
:class:`TokenizeReport`       ``retrain tokenize`` (Dataflow)         the workflow's ``tokenize`` step
:class:`JobSetCompletion`     the notifier (in the cluster)           ``Ingest.on_jobset_event``
:class:`CallbackPayload`      the relay, ``retrain cancel``           the workflow's waits
:class:`StepRequest`          the workflow's ``python_step`` calls    the ``run_step`` function
:class:`Handover`, `Results`  ``retrain.steps``                       the workflow's ``train`` and ``judge``
:class:`Accounting`           ``retrain.steps`` (``account``)         the workflow's end of a run
:class:`RunEvent`             ``announce`` (YAML), Ingest, Steps    subscribers, ``retrain events``
============================  ======================================  =====================================

The run record itself is :class:`retrain.domain.runs.Run` (its statuses :class:`RunStatus`): the domain
owns it, and it is re-exported here so that every contract can be found in one place.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from retrain.domain.datasets import dataset_name, optional_dataset
from retrain.domain.errors import Rejected
from retrain.domain.events import ObjectVersion
from retrain.domain.runs import Run as RunRecord
from retrain.domain.runs import RunStatus

__all__ = [
    "Accounting",
    "CallbackPayload",
    "CompletionState",
    "Handover",
    "JobSetCompletion",
    "JobSetRef",
    "Results",
    "RunEvent",
    "RunEventType",
    "RunManifest",
    "RunRecord",
    "RunStatus",
    "SchedulerJob",
    "SchedulerTick",
    "StepName",
    "StepRequest",
    "TokenizeReport",
    "WorkflowArgument",
    "field_names",
]


def field_names(cls: type) -> frozenset[str]:
    """The declared fields of a contract (what the other side may name)."""
    return frozenset(f.name for f in fields(cls))


# --- Cloud Scheduler -> on_scheduler_tick ---------------------------------------------------------


class SchedulerJob(StrEnum):
    """The periodic jobs ``infra/app`` declares (``var.scheduler_jobs``), one message key each."""

    SEAL = "seal"
    """Seal every dataset's pending arrivals now and start their runs (the scheduled cut)."""
    SWEEPER = "sweeper"
    """Seal quiet or old batches, finish seals and starts a crash cut short, record executions that
    ended silently, and start queued runs."""
    REAPER = "reaper"
    """Delete the JobSets, ProvisioningRequests and PodTemplates no live run owns; report GPU nodes up."""
    AUDIT = "audit"
    """Account for every landed object against the ledger (``retrain.audit``): log what is not, and
    record the arrivals of objects whose events never came."""


@dataclass(frozen=True)
class SchedulerTick:
    """The Pub/Sub message a Cloud Scheduler job publishes: ``{"job": "<name>"}`` (the job's key in
    ``var.scheduler_jobs``; ``infra/app/scheduler.tf`` writes it as the data and the ``job`` attribute)."""

    job: SchedulerJob
    """Which periodic job this tick runs."""
    dataset: str | None = None
    """Only for ``seal``: seal this dataset alone (absent: every dataset with pending arrivals)."""

    @classmethod
    def parse(cls, message: Mapping[str, Any]) -> SchedulerTick:
        """The tick a message carries; Rejected (acknowledged, logged) for anything else."""
        unknown = set(message) - field_names(cls)
        if unknown:
            raise Rejected(f"scheduler tick has unknown field(s) {sorted(unknown)}")
        try:
            job = SchedulerJob(str(message.get("job")))
        except ValueError:
            raise Rejected(
                f"unknown scheduler job {message.get('job')!r} (one of {[j.value for j in SchedulerJob]})"
            ) from None
        return cls(job, optional_dataset(message.get("dataset")))

    def to_json(self) -> bytes:
        body: dict[str, Any] = {"job": str(self.job)}
        if self.dataset is not None:
            body["dataset"] = self.dataset
        return json.dumps(body).encode()


# --- Ingest.start -> workflows/retrain.yaml ----------------------------------------------------------

#: An execution's id as Workflows makes it (``GOOGLE_CLOUD_WORKFLOW_EXECUTION_ID``): a UUID.
EXECUTION_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")


@dataclass(frozen=True)
class ExecutionArgument:
    """The argument of one execution of ``workflows/retrain.yaml`` (``start`` in ``main``): which run, and
    the start claim of the starter that created the execution.  Nothing else: whoever may create
    executions (``workflows.executions.create``) can name only a run the ledger planned, and the plan it
    runs is the ledger's (:class:`WorkflowArgument`, handed over by the ``begin`` step), never the
    caller's."""

    run_id: str
    """The run: the ledger document ``runs/<run_id>``."""
    claim: str
    """The start claim ``Ledger.claim_start`` gave the starter.  ``begin`` binds the execution to the
    run only while the run's claim is still this one: when a sweep took over a start that seemed stuck,
    the slow starter's execution ends at ``begin`` without touching anything, so a run has one
    execution."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- the run plan: the ledger -> workflows/retrain.yaml ------------------------------------------------


@dataclass(frozen=True)
class WorkflowArgument:
    """The run plan, decided in typed Python when the run starts and kept on the run record (``plan``):
    ``begin`` hands it to the execution (``args`` in ``main``, ``run`` in its sub-workflows).  Held to the
    Executions API's 32 KB argument limit all the same (it once travelled as the argument, and a plan that
    size is a plan gone wrong), so object lists travel in the :class:`RunManifest`, never here."""

    run_id: str
    """The run's id: the ledger document ``runs/<run_id>`` and the ``retrain.dev/run-id`` label."""
    dataset: str
    """The dataset the run trains."""
    project: str
    """Google Cloud project id of every resource the workflow calls."""
    region: str
    """Region of the Dataflow job and the GKE cluster."""
    cluster: str
    """GKE cluster name (``gke.request``'s ``cluster_id``)."""
    node_pool: str
    """The DWS GPU node pool whose nodes the release waits to see gone."""
    namespace: str
    """Kubernetes namespace of the JobSet, ProvisioningRequest and PodTemplate."""
    nodes: int
    """GPU nodes the run trains on."""
    gpus_per_node: int
    """GPUs per node, for the record's GPU-hours."""
    artifacts_bucket: str
    """Bucket holding the manifest, the tokenize report, shards and checkpoints."""
    manifest_object: str
    """Object (in ``artifacts_bucket``) holding the :class:`RunManifest`."""
    manifest_generation: int | None
    """The manifest's generation as ``Ingest.start`` wrote it, just before starting the execution: the
    tokenize job reads exactly that version (``gs://BUCKET/OBJECT#GENERATION``, Cloud Storage's notation
    for one version), so a later rewrite of ``runs/`` cannot change what the run trains. None only in a
    plan that was never started (``retrain plan``)."""
    report_object: str
    """Object (in ``artifacts_bucket``) where the tokenize job writes its :class:`TokenizeReport`."""
    objects: int
    """How many objects the manifest lists (for the record; the list itself is in the manifest)."""
    shard_root: str
    """``gs://`` root of the content-addressed Megatron shards, shared by every run."""
    run_root: str
    """``gs://`` folder of this run's outputs."""
    report: str
    """``gs://`` URI of the tokenize report (``report_object`` as a URI)."""
    dataflow_template: str
    """``gs://`` URI of the tokenization flex-template spec."""
    dataflow_service_account: str
    """Email of the service account Dataflow workers run as (never the default compute account)."""
    dataflow_subnetwork: str
    """Subnetwork (self link) of the Dataflow workers; they get private IPs only."""
    dataflow_temp_location: str
    """``gs://`` folder for Dataflow's temporary files."""
    hold_out_objects: int
    """How many of the run's objects the tokenize job holds out of the blend as the dataset's eval set
    (:func:`retrain.plan.hold_out_objects`; 0 when the dataset has one): the report's ``held_out``."""
    training: dict[str, Any]
    """The :class:`retrain.trainers.TrainingPlan` (its blend empty): the workflow hands it back with
    the tokenize report to the ``handover`` step (:class:`StepRequest`), which renders the JobSet."""
    jobset_name: str
    """Name of the training JobSet (the release deletes it)."""
    run_account: dict[str, Any]
    """The Kubernetes ServiceAccount the run's pods run as, one per run
    (:func:`retrain.k8s.render.render_run_account`): the workflow creates it before tokenizing and
    deletes it at release."""
    run_principal: str
    """The IAM principal of ``run_account``'s pods (``principal://iam.googleapis.com/projects/NUMBER/
    locations/global/workloadIdentityPools/PROJECT.svc.id.goog/subject/ns/NAMESPACE/sa/KSA``): the only
    member of ``run_folder``'s policy."""
    run_folder: str
    """The managed folder ``runs/<run_id>/`` (in ``artifacts_bucket``, nested in ``runs/``): the workflow
    creates it and sets its policy to ``roles/storage.objectAdmin`` for ``run_principal`` before
    tokenizing, so the run's pods may write their checkpoints and events there and nowhere else; the
    release deletes it (and its policy) again."""
    podtemplate: dict[str, Any]
    """The PodTemplate the ProvisioningRequest refers to."""
    provisioning_request: dict[str, Any]
    """The DWS ProvisioningRequest for the run's nodes."""
    tokenize_timeout_s: int
    """How long the run waits for its tokenize job."""
    provision_timeout_s: int
    """How long the run waits for DWS to provision its nodes before it fails (CapacityTimeout)."""
    provision_reask_s: int
    """A capacity request still not provisioned after this long is deleted and made again: one left
    Accepted can wait indefinitely while a new one is often served at once (kubernetes-sigs/kueue#3245),
    and one whose node pool went away is never failed (kubernetes/autoscaler#9490)."""
    train_timeout_s: int
    """How long the run waits for the JobSet to finish."""
    train_deadline_reason: str
    """What sets ``train_timeout_s`` (the training timeout, or the per-run cost cap): the reason a run
    stopped there records."""
    release_timeout_s: int
    """How long the release waits for the pool's nodes to be gone."""
    poll_interval_s: float
    """Seconds between polls of the Dataflow job and the ProvisioningRequest."""
    completion_check_s: float
    """The training wait reads the JobSet itself at least this often (a completion message is a hint)."""
    price_per_node_hour: float
    """USD per node-hour, for the record's cost."""
    ticks_topic: str
    """Full id of the Scheduler ticks topic: when the run ends, the workflow publishes a ``sweeper``
    :class:`SchedulerTick` there, so the dataset's pending run starts at once."""
    events_topic: str
    """Full id of the run events topic: the workflow's ``announce`` publishes each state change of the run
    there (:class:`RunEvent`)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- Ingest.start -> retrain tokenize ---------------------------------------------------------------


@dataclass(frozen=True)
class RunManifest:
    """``runs/<run_id>/objects.json`` in the artifacts bucket: exactly what a run trains on, written
    before its execution starts and read by the tokenize job (``--manifest``)."""

    run_id: str
    """The run this manifest belongs to."""
    dataset: str
    """The run's dataset."""
    batch_id: str
    """The sealed batch the objects came from."""
    snapshot: str
    """The snapshot id: the hash of the objects' content hashes."""
    objects: list[ObjectVersion] = field(default_factory=list)
    """Every object, once each: ``{"uri": "gs://bucket/name", "generation": N, "size": B,
    "content_hash": "md5:...:jsonl"}``.  The name is literal (never a pattern) and the tokenize job reads
    exactly that generation, or, once that generation is gone, the object's current one when it holds
    the same content (the content hash's md5)."""

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.objects)

    def to_json(self) -> bytes:
        body = {**asdict(self), "objects": [o.to_dict() for o in self.objects]}
        return json.dumps(body, indent=1).encode()

    @classmethod
    def parse(cls, data: bytes | str) -> RunManifest:
        """A manifest from its JSON; ValueError naming what is wrong."""
        body = json.loads(data)
        if not isinstance(body, dict) or not isinstance(body.get("objects"), list):
            raise ValueError(
                'not a run manifest: expected {"objects": [{"uri": ..., "generation": ...}], ...}'
            )
        versions = [ObjectVersion.parse(o) for o in body["objects"]]
        known = {k: body[k] for k in field_names(cls) if k in body and k != "objects"}
        return cls(**{"run_id": "", "dataset": "", "batch_id": "", "snapshot": "", **known}, objects=versions)


# --- retrain tokenize -> the workflow --------------------------------------------------------------


class SetAside(StrEnum):
    """Why the tokenize job set an object aside whole (a report's ``quarantined_objects`` ``reason``)."""

    UNREADABLE = "unreadable"
    """Not there, or not what its name says (a ``.parquet`` that is not Parquet), or reading it failed."""
    OBJECT_CHANGED = "object_changed"
    """The generation that arrived is gone and the object does not hold its bytes now."""
    DECOMPRESSED_TOO_LARGE = "decompressed_too_large"
    """Its pages decompress past the job's limit (a decompression bomb)."""


def tokenize_detail_uri(report_uri: str) -> str:
    """Where a tokenize report's per-object detail goes: ``..._shards.json`` beside it (``shards_uri``)."""
    return report_uri.removesuffix(".json") + "_shards.json"


@dataclass(frozen=True)
class TokenizeReport:
    """``runs/<run_id>/tokenize_report.json``: what tokenizing a run's objects produced.  Written last
    by the tokenize job (its commit marker); the workflow reads it once the job is done."""

    documents: int
    """Documents written, over every object's shard."""
    tokens: int
    """Tokens written (a run with none fails before any capacity is requested)."""
    quarantined: int
    """Records set aside with a reason (``input_records = documents + quarantined``)."""
    input_records: int
    """Records read."""
    bytes: int
    """Bytes read."""
    seconds: float
    """Wall time of the tokenize job."""
    new_objects: int
    """Objects tokenized by this job."""
    reused_objects: int
    """Objects whose shard already existed (same content), reused."""
    tokenized: dict[str, int]
    """The totals above restricted to the newly tokenized objects."""
    shards_uri: str | None
    """Where each object's entry is (``tokenize_report_shards.json`` beside the report: ``{"shards": [...],
    "quarantined_objects": [...]}``,
    one per object version: ``object``, ``generation`` (as the manifest recorded it; None for an object
    named by a pattern), ``sha256``, ``data_prefix``, ``documents``, ``tokens``, ``reused``).  Not in the
    report itself, which the workflow reads into a variable whatever the run's size."""
    packs: list[dict[str, Any]]
    """The datasets the trainer reads, at most ``--max-packs`` of them whatever the run's size
    (:mod:`retrain_tokenize.packs`): each ``data_prefix``, ``tokens``, ``shards`` (how many objects' shards it
    concatenates; a pack of one is that shard) and ``written`` (by this job, or reused)."""
    data_prefix_blend: list[Any]
    """Megatron's blend over the packs: ``[weight, prefix, weight, prefix, ...]``, weights proportional to
    tokens."""
    held_out: dict[str, Any] | None
    """The dataset's new eval set, carved from this run's objects (``--hold-out-objects``) and not in the
    blend: ``data_prefix`` (a pack of their shards under the shard root; one shard: that shard),
    ``tokens`` and ``shards``.  None when nothing was held out; each held-out object's entry in
    ``shards_uri`` says ``held_out``."""
    quarantine_reasons: dict[str, int]
    """Quarantined records by reason, over every shard (the records are in each shard's
    ``_quarantine.jsonl``)."""
    quarantined_objects: list[dict[str, Any]]
    """Objects set aside whole, each ``object``, ``generation``, ``reason`` (``unreadable``,
    ``object_changed``, ``decompressed_too_large``) and ``detail``: the others are tokenized all the same.
    The first 100 only (the workflow copies them into the run record); every one is in ``shards_uri``'s
    object under ``quarantined_objects``."""
    quarantined_object_count: int
    """How many objects were set aside whole."""
    tokenizer: dict[str, Any]
    """The tokenizer's files, kept beside the shards for the trainer (:class:`retrain.trainers.
    TokenizerFiles`): ``type`` and ``vocab_file``/``merge_file`` or ``tokenizer_json`` (``gs://``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- the notifier -> on_jobset_event -> the waiting execution ---------------------------------------


class CompletionState(StrEnum):
    """How a run's training ended, as its callback reports it."""

    COMPLETED = "Completed"
    """The JobSet's ``Completed`` condition is true."""
    FAILED = "Failed"
    """The JobSet's ``Failed`` condition is true (restarts exhausted)."""
    CANCELLED = "Cancelled"
    """An operator cancelled the run (``retrain cancel``); never sent by the notifier."""


@dataclass(frozen=True)
class JobSetRef:
    """Which JobSet a completion is about."""

    name: str
    """The JobSet's name."""
    namespace: str
    """Its namespace."""
    uid: str
    """Its uid: a re-created JobSet of the same name is another one."""


@dataclass(frozen=True)
class JobSetCompletion:
    """The JSON message the notifier publishes to the JobSet-events topic when a training JobSet
    reaches a terminal state (once per JobSet and state), relayed by ``on_jobset_event``."""

    type: str
    """Always ``jobset.terminal``."""
    run_id: str
    """The run (the JobSet's ``retrain.dev/run-id`` annotation)."""
    state: CompletionState
    """``Completed`` or ``Failed``."""
    succeeded: bool
    """``state == Completed``."""
    reason: str
    """The terminal condition's reason."""
    message: str
    """The terminal condition's message."""
    start_time: str | None
    """When the JobSet was created (RFC 3339)."""
    finish_time: str | None
    """When the terminal condition became true (RFC 3339)."""
    restarts: int
    """How many times the JobSet was restarted."""
    jobset: JobSetRef
    """The JobSet."""
    callback_url: str | None
    """The waiting execution's callback (the JobSet's ``retrain.dev/callback-url`` annotation)."""
    dedupe_key: str
    """``<uid>:<state>``: the same completion published twice has the same key."""

    TYPE = "jobset.terminal"

    def to_json(self) -> bytes:
        body = asdict(self)
        body["state"] = str(self.state)
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def parse(cls, message: Mapping[str, Any]) -> JobSetCompletion:
        """A completion from its JSON object; Rejected with the reason for anything else."""
        url = message.get("callback_url")
        if not isinstance(url, str) or not url:
            raise Rejected("JobSet event carries no callback URL")
        state = message.get("state")
        if state not in (CompletionState.COMPLETED, CompletionState.FAILED):
            raise Rejected(f"JobSet event has unknown state {state!r}")
        raw_ref = message.get("jobset")
        ref: Mapping[str, Any] = raw_ref if isinstance(raw_ref, dict) else {}
        return cls(
            type=str(message.get("type", cls.TYPE)),
            run_id=str(message.get("run_id") or ""),
            state=CompletionState(state),
            succeeded=state == CompletionState.COMPLETED,
            reason=str(message.get("reason") or ""),
            message=str(message.get("message") or ""),
            start_time=message.get("start_time"),
            finish_time=message.get("finish_time"),
            restarts=int(message.get("restarts") or 0),
            jobset=JobSetRef(
                str(ref.get("name", "")), str(ref.get("namespace", "")), str(ref.get("uid", ""))
            ),
            callback_url=url,
            dedupe_key=str(message.get("dedupe_key") or ""),
        )


@dataclass(frozen=True)
class CallbackPayload:
    """The body POSTed to a run's callback endpoint.  Each is a hint the workflow confirms: a completion
    from the JobSet's own status, a ``Cancelled`` one (``retrain cancel``) from the cancel the ledger
    holds for the run (:class:`CancelRequest`)."""

    state: CompletionState
    """How training ended, or ``Cancelled``."""
    reason: str = ""
    """Why (the JobSet condition's reason; for a cancel, the ledger's words are the ones kept)."""
    run_id: str = ""
    """The run the payload is about."""
    jobset: str = ""
    """The JobSet's name (empty for a cancel)."""
    message: str = ""
    """The terminal condition's message."""
    restarts: int = 0
    """JobSet restarts."""
    start_time: str | None = None
    """When the JobSet was created."""
    finish_time: str | None = None
    """When it finished."""

    @classmethod
    def of(cls, completion: JobSetCompletion) -> CallbackPayload:
        return cls(
            state=completion.state,
            reason=completion.reason,
            run_id=completion.run_id,
            jobset=completion.jobset.name,
            message=completion.message,
            restarts=completion.restarts,
            start_time=completion.start_time,
            finish_time=completion.finish_time,
        )

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["state"] = str(self.state)
        return body


# --- the workflow -> the run_step function (typed Python between its steps) -----------------------


class StepName(StrEnum):
    """The workflow's calls into Python (``retrain.steps``)."""

    BEGIN = "begin"
    """The execution starts: bind it to its run if the run's start claim is still the argument's, and
    answer the run's plan from the ledger (:class:`Begun`)."""
    HANDOVER = "handover"
    """Tokenizing is done: render the trainer's command and JobSet from the tokenize report."""
    RESULTS = "results"
    """The JobSet completed: read what the trainer wrote, record it, promote the checkpoint."""
    ACCOUNT = "account"
    """Its nodes are gone: price the node time the workflow observed, by the estimate's formula
    (:class:`Accounting`), which the workflow records with the run's end."""
    FINISH = "finish"
    """The run ended (its outcome recorded): one that did not succeed gives its content back."""
    CANCEL = "cancel"
    """A callback said ``Cancelled``: answer the operator's cancel as the ledger holds it
    (:class:`CancelRequest`).  The callback is only a wake-up: whoever may send callbacks cannot stop a
    run, nor say who asked, without ``retrain cancel``'s record in the ledger."""


@dataclass(frozen=True)
class StepRequest:
    """The body the workflow POSTs to the ``run_step`` function (OIDC-authenticated, internal)."""

    step: StepName
    """Which step."""
    run_id: str
    """The run."""
    training: dict[str, Any] = field(default_factory=dict)
    """Ignored: the plan is the ledger's (``begin`` hands it to the execution, every other step reads it
    again by ``run_id``).  Accepted because executions an earlier release started still send it."""
    callback_url: str = ""
    """``handover`` only: the execution's callback, annotated on the JobSet for the notifier."""
    gpu_node_seconds: float = 0.0
    """``account`` only: the GPU node time the workflow observed, from the capacity's arrival to the
    nodes' removal, times the nodes."""
    claim: str = ""
    """``begin`` only: the execution argument's start claim (:class:`ExecutionArgument`)."""
    execution: str = ""
    """``begin`` only: the execution's id (``GOOGLE_CLOUD_WORKFLOW_EXECUTION_ID``)."""

    @classmethod
    def parse(cls, body: Any) -> StepRequest:
        """A request from its JSON body; Rejected naming what is wrong."""
        if not isinstance(body, dict):
            raise Rejected("the body must be a JSON object")
        unknown = set(body) - field_names(cls)
        if unknown:
            raise Rejected(f"unknown field(s) {sorted(unknown)}")
        try:
            step = StepName(str(body.get("step")))
        except ValueError:
            raise Rejected(
                f"unknown step {body.get('step')!r} (one of {[s.value for s in StepName]})"
            ) from None
        run_id = body.get("run_id")
        if not isinstance(run_id, str) or not run_id:
            raise Rejected("run_id (a string) is required")
        if step == StepName.CANCEL:
            return cls(step, run_id)
        if step == StepName.BEGIN:
            claim, execution = body.get("claim"), body.get("execution")
            if not isinstance(claim, str) or not claim:
                raise Rejected("begin: claim (a string) is required")
            if not isinstance(execution, str) or not EXECUTION_ID_RE.fullmatch(execution):
                raise Rejected("begin: execution (the execution's id) is required")
            return cls(step, run_id, claim=claim, execution=execution)
        if step == StepName.ACCOUNT:
            seconds = body.get("gpu_node_seconds")
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < 1e12:
                raise Rejected("account: gpu_node_seconds (a number of seconds, 0 or more) is required")
            return cls(step, run_id, gpu_node_seconds=float(seconds))
        return cls(step, run_id, callback_url=str(body.get("callback_url") or ""))


@dataclass(frozen=True)
class Begun:
    """``begin``'s answer: the plan to run, or why this execution runs nothing."""

    plan: dict[str, Any] | None
    """The run's :class:`WorkflowArgument` as the ledger keeps it; None: this execution is not the run's
    (another starter's claim holds it, it has another execution, it is not pending) and ends at once."""
    reason: str
    """Why not, when ``plan`` is None."""


@dataclass(frozen=True)
class CancelRequest:
    """``cancel``'s answer: the operator's cancel as the ledger recorded it."""

    requested_by: str | None
    """Who asked (:attr:`retrain.domain.runs.Run.cancel_requested_by`); None: the ledger holds no cancel
    for the run, and the callback that said so is ignored."""
    reason: str
    """The operator's words ("no reason given" when there were none)."""


@dataclass(frozen=True)
class Handover:
    """``handover``'s answer: what the workflow submits, and what it will run."""

    jobset: dict[str, Any]
    """The training JobSet, submitted as is."""
    command: list[str]
    """The trainer's argv (container command and arguments), also in the run record."""


@dataclass(frozen=True)
class Accounting:
    """``account``'s answer: what the run's node time cost, at the price its plan was made with."""

    gpu_hours: float
    """The node time in GPU-hours (its plan's GPUs per node)."""
    cost_usd: float
    """The node time at its plan's price of a node-hour (:func:`retrain.domain.runs.node_cost_usd`)."""


@dataclass(frozen=True)
class Finished:
    """``finish``'s answer."""

    returned: int
    """Objects given back (eligible again; ``run --retry`` re-runs them); 0 for a run that succeeded."""


@dataclass(frozen=True)
class Results:
    """``results``' answer (already in the run record): what the trainer left."""

    checkpoint: str | None
    """``gs://`` folder of the run's last checkpoint (None: the trainer saved none)."""
    metrics: dict[str, Any] | None
    """:class:`retrain.domain.runs.TrainingMetrics` (None: no TensorBoard events were found)."""
    promoted: bool
    """Whether the checkpoint became its dataset's champion (the next run continues from it)."""
    reason: str
    """What is missing, if anything."""


@dataclass(frozen=True)
class Forecast:
    """``retrain plan``'s answer for one dataset (``--json`` prints these fields): what sealing it now
    would train and what that run would cost.  Nothing is written to find out."""

    dataset: str
    """The dataset."""
    objects: int
    """Objects whose content is new since the last seal: they would join the pending run."""
    bytes: int
    """Their size."""
    skipped: int
    """Arrivals since the last seal that would add nothing (content trained before, or in the live
    or pending run)."""
    pending_run: str | None
    """The pending run they would join (None: sealing would make one)."""
    pending_objects: int
    """Objects that pending run holds already (they train in the same run)."""
    estimated_tokens: int
    """Tokens in the run's new data (its bytes at ``tokens_per_byte``), before tokenizing."""
    training_tokens: int
    """Tokens the run trains on: steps x global batch x sequence length."""
    estimated_node_hours: float
    """GPU node time the run would take (see ``basis``)."""
    estimated_cost_usd: float
    """That node time at the price of a node-hour."""
    max_cost_usd: float
    """The per-run cost cap (0: none)."""
    monthly_budget_usd: float
    """The dataset's budget for this calendar month (0: none)."""
    budget_left_usd: float | None
    """What is left of it: the budget less what the dataset's runs made this month cost or, while they
    run, are estimated to cost (the pending run the data would join left out); None without a budget."""
    basis: str
    """Where the throughput behind the estimate came from."""
    would_run: bool
    """Whether the dataset has a run to start (sealing now would make or extend it; it starts now or
    after the dataset's live run) that would not be refused (the cost cap, the trainer's checks)."""
    reason: str
    """Why, in a sentence."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- a run's state changes -> the run events topic (subscribers: whatever a deployment adds) -------


class RunEventType(StrEnum):
    """What happened to a run: a run event's ``type`` (``dev.retrain.run.v1.<value>`` as a CloudEvent).

    Each one happens at most once per run, so ``<run_id>/<type>`` identifies an event and a subscriber
    deduplicates on it (the CloudEvent's ``id``)."""

    QUEUED = "queued"
    """A seal gave the dataset's pending run content; it starts when its dataset has no live run."""
    TOKENIZING = "tokenizing"
    """The run started: its Dataflow job tokenizes the new objects."""
    PROVISIONING = "provisioning"
    """Waiting for capacity: the run's DWS ProvisioningRequest is made."""
    TRAINING = "training"
    """The nodes came; the NeMo JobSet is submitted."""
    RELEASING = "releasing"
    """Training is over (or never came): the run gives back every node."""
    SUCCEEDED = "succeeded"
    """Ended with its checkpoint judged (``cost_usd`` and ``reason`` say what it took)."""
    FAILED = "failed"
    """Ended without training through (``failure`` says the kind, ``reason`` the words)."""
    CANCELLED = "cancelled"
    """An operator cancelled it (``reason`` says who and why)."""
    REFUSED = "refused"
    """Ended before asking for capacity: over a cost cap or budget, or a plan the trainer would refuse."""
    PROMOTED = "promoted"
    """Its checkpoint became the dataset's champion (``checkpoint``, ``verdict``): the next run continues
    from it; a downstream deployment may take it."""


#: The CloudEvents version the run events follow, and their ``type`` prefix (reverse-DNS, versioned).
CLOUDEVENTS_SPECVERSION = "1.0"
RUN_EVENT_TYPE_PREFIX = "dev.retrain.run.v1."


@dataclass(frozen=True)
class RunEvent:
    """A run's state change, published to the run events topic as a CloudEvent in Pub/Sub's *binary*
    content mode: this JSON as the message data, the CloudEvents attributes as ``ce-`` message
    attributes and ``Content-Type`` as the data's media type (the Pub/Sub protocol binding for CloudEvents,
    github.com/cloudevents/spec pubsub-protocol-binding.md, 3.1).  Published at least once (the workflow
    and the functions publish after the record changes, with the client's retries): a subscriber
    deduplicates on ``id``."""

    type: RunEventType
    """What happened."""
    run_id: str
    """The run: the ledger's ``runs/<run_id>`` and the ``retrain.dev/run-id`` label of its objects."""
    dataset: str
    """The dataset the run trains."""
    time: str
    """When it happened (RFC 3339, UTC)."""
    reason: str | None = None
    """Why, in a sentence, where the record has one (the outcome of an ended run)."""
    failure: str | None = None
    """For ``failed``, ``refused`` and ``cancelled``: the :class:`retrain.domain.runs.FailureKind`."""
    cost_usd: float | None = None
    """For an ended run: what its GPU nodes cost (node time at the price of a node-hour)."""
    checkpoint: str | None = None
    """For ``promoted``: the ``gs://`` folder of the new champion checkpoint."""
    verdict: dict[str, Any] | None = None
    """For ``promoted``: the eval gate's :class:`retrain.domain.runs.Evaluation`."""

    @property
    def id(self) -> str:
        return f"{self.run_id}/{self.type}"

    def attributes(self, project: str) -> dict[str, str]:
        """The Pub/Sub message attributes: the CloudEvents context attributes, ``ce-`` prefixed."""
        return {
            "ce-specversion": CLOUDEVENTS_SPECVERSION,
            "ce-id": self.id,
            "ce-type": RUN_EVENT_TYPE_PREFIX + str(self.type),
            "ce-source": run_event_source(project, self.dataset),
            "ce-subject": f"runs/{self.run_id}",
            "ce-time": self.time,
            "Content-Type": "application/json",
        }

    def data(self) -> bytes:
        return json.dumps({**asdict(self), "type": str(self.type)}, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, attributes: Mapping[str, str]) -> RunEvent:
        """The event a Pub/Sub message carries; Rejected when it is not one (or its attributes and data
        disagree)."""
        try:
            body = json.loads(data)
        except ValueError as e:
            raise Rejected(f"a run event's data is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise Rejected("a run event's data is not a JSON object")
        unknown, missing = set(body) - field_names(cls), {"type", "run_id", "dataset", "time"} - set(body)
        if unknown or missing:
            raise Rejected(f"run event: unknown field(s) {sorted(unknown)}, missing {sorted(missing)}")
        try:
            event = cls(**{**body, "type": RunEventType(body["type"])})
        except ValueError:
            raise Rejected(f"unknown run event type {body['type']!r}") from None
        dataset_name(event.dataset, "a run event's dataset")
        kinds = {"cost_usd": (int, float), "verdict": (dict,)}
        wrong = [
            k
            for k, v in body.items()
            if k != "type" and v is not None and not isinstance(v, kinds.get(k, (str,)))
        ]
        if wrong:
            raise Rejected(f"a run event's {sorted(wrong)} have the wrong type")
        expected = event.attributes(project="")
        expected.pop("ce-source")
        differing = sorted(k for k, v in expected.items() if attributes.get(k) != v)
        if not str(attributes.get("ce-source", "")).endswith(f"/datasets/{event.dataset}"):
            differing.append("ce-source")
        if differing:
            raise Rejected(f"a run event's attributes {differing} disagree with its data")
        return event


def run_event_source(project: str, dataset: str) -> str:
    """The CloudEvents ``source`` of a dataset's run events (a URI reference naming its context)."""
    return f"//retrain.dev/projects/{project}/datasets/{dataset}"
