"""The small interfaces the domain needs from the outside world.

Each has one real adapter in ``retrain.adapters`` (the cloud and the emulators differ only by
endpoint); the Workflows executions API, which has no emulator, has a local twin in
``cloudworkflows.server`` reached through the same REST shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol

from retrain.contracts import RunEvent, RunEventType
from retrain.domain.events import ObjectArrival, ObjectVersion
from retrain.domain.runs import BatchState, Champion, Pending, Run, RunStatus, Trigger, now_iso
from retrain.domain.transitions import RunChange

log = logging.getLogger("retrain.events")


class ArrivalStatus(StrEnum):
    NEW = "new"
    """The first time this object version is seen."""
    DUPLICATE = "duplicate"
    """That event, or that object version, was recorded before."""


@dataclass(frozen=True)
class ArrivalOutcome:
    """What recording an arrival did."""

    status: ArrivalStatus


class SealVerdict(StrEnum):
    SEALED = "sealed"
    """A new batch and its run (``run``) exist now."""
    ALREADY_SEALED = "already-sealed"
    """The batch had been sealed before (a retried seal); ``run`` is its run."""
    NOTHING_PENDING = "nothing-pending"
    """No arrival since the last seal: nothing sealed."""
    NOTHING_NEW = "nothing-new"
    """Every object's content trained before or is in the live or pending run: no run."""


@dataclass(frozen=True)
class SealOutcome:
    """What sealing did: ``run`` is the (pending) run the new content joined, ``reason`` says why not."""

    run: Run | None
    verdict: SealVerdict
    reason: str
    objects: tuple[ObjectVersion, ...] = ()
    """The objects whose content is new (one per content hash)."""
    skipped: int = 0
    """Objects of the batch that add nothing (their content is held by a run already)."""

    @classmethod
    def nothing_new(cls, skipped: int) -> SealOutcome:
        """A batch none of whose content is new: no run."""
        reason = (
            f"nothing new: {skipped} object(s) skipped, their content trained before or is in the live or "
            "pending run"
        )
        return cls(None, SealVerdict.NOTHING_NEW, reason, skipped=skipped)


@dataclass(frozen=True)
class SealPreview:
    """What sealing a dataset now would do, read without writing anything (``retrain plan``)."""

    dataset: str
    objects: tuple[ObjectVersion, ...]
    """Objects whose content is new: they would join the pending run (one per content hash)."""
    skipped: int
    """Arrivals since the last seal that would add nothing (content trained, live or pending)."""
    pending_run: Run | None
    """The dataset's pending run, which they would join (None: sealing would create one)."""
    pending_objects: tuple[ObjectVersion, ...]
    """What that pending run holds already."""


class StartVerdict(StrEnum):
    CLAIMED = "claimed"
    """The run holds its dataset's live slot now; its object list is fixed."""
    QUEUED = "queued"
    """Another live run holds the slot: the run stays pending."""
    STARTING = "starting"
    """Someone else claimed its start moments ago and may still be at it."""
    STARTED = "started"
    """It has an execution already (or no longer exists)."""
    EMPTY = "empty"
    """Nothing was left for it to train (its content went to another run): it was dropped."""


@dataclass(frozen=True)
class StartClaim:
    verdict: StartVerdict
    objects: tuple[ObjectVersion, ...]
    """Every object the run trains (one per content hash), when claimed."""
    snapshot: str = ""
    """The run's snapshot id: the hash of its objects' content hashes."""
    token: str = ""
    """This claim's token, when claimed: the plan is kept and an execution bound only under it, so a
    starter whose claim a sweep took over (it seemed stuck) can no longer change the run."""


@dataclass(frozen=True)
class ExportJob:
    """One bounded export of a watched table's new rows: a BigQuery ``EXPORT DATA`` job that the handler
    of a table write starts and a later invocation (the next write, or the Scheduler's tick) finishes.
    Recorded before the job starts, so a crash in between is finished (or started) by the next one."""

    table: str
    """``project.dataset.table`` being exported."""
    dataset: str
    """The retrain dataset its rows join."""
    job_id: str
    """BigQuery job id, chosen when the export is recorded: starting it twice starts one job."""
    location: str
    """Where the job runs (the table's location; "" lets the client choose)."""
    after: Any
    """The watermark the export starts from (exclusive; None: the table's first export)."""
    through: Any
    """The last watermark value it takes (inclusive): the watermark once it is finished."""
    destination: str
    """``gs://`` URI with BigQuery's one ``*`` wildcard, in the artifacts bucket."""
    started_at: str
    """RFC 3339 time it was recorded."""
    deadline: str
    """RFC 3339 time after which a job still running is cancelled and the range exported again."""
    capped: bool = False
    """More rows were waiting above ``through`` (the range took the most one job may): once this one is
    finished, the next tick starts the next (as it does when the table is written while this one runs)."""


@dataclass(frozen=True)
class RowRange:
    """How far the next export of a table goes."""

    through: Any
    """The last watermark value it takes (None: no row above the watermark)."""
    capped: bool = False
    """Rows above ``through`` wait for the next export (the range took the most one job may, or rows are
    stamped after the export's start)."""
    later: Any = None
    """The earliest stamp of the rows that wait for their time, or (an integer column) the smallest value
    of the rows beyond the max step (None: none wait)."""


@dataclass(frozen=True)
class Watermark:
    """How far a watched table has been exported, and whether (and when) the next export is due."""

    value: Any = None
    """The last exported value of the watermark column (None: never exported)."""
    backlog: bool = False
    """Rows may wait above ``value``: the Scheduler's tick starts the next export."""
    failures: int = 0
    """Exports that failed in a row since the last one landed: each halves the next one's rows."""
    retry_after: str = ""
    """RFC 3339 time before which no export starts, after a failure (exponential backoff)."""


class ExportRefused(Exception):
    """BigQuery refuses the export as asked (a missing table or column, a column that cannot be a
    watermark, a forbidden destination): retrying the same request cannot help."""


class ExportState(StrEnum):
    """Where an export job stands, as BigQuery reports it."""

    MISSING = "missing"
    """BigQuery has no such job: its start was cut short after it was recorded."""
    RUNNING = "running"
    """PENDING or RUNNING."""
    SUCCEEDED = "succeeded"
    """DONE without an error: its files are written."""
    FAILED = "failed"
    """DONE with an error (including a cancel, or its own time limit)."""


@dataclass(frozen=True)
class ExportStatus:
    state: ExportState
    files: int | None = None
    """How many files the job wrote (``exportDataStatistics.fileCount``; None when not reported)."""
    error: str = ""


class ObjectChanged(Exception):
    """A conditional write found the object at another generation than it was conditioned on (Cloud
    Storage's 412 Precondition Failed): nothing was written."""


@dataclass(frozen=True)
class ObjectInfo:
    """An object's identity and size, as listing or stat-ing it tells."""

    uri: str
    size: int
    generation: int | None = None
    """Changes whenever the content is rewritten: GCS's generation; a local file's mtime in ns."""
    md5_hash: str | None = None
    updated: datetime | None = None
    """When this version was written (GCS's ``updated``; a local file's mtime)."""


@dataclass(frozen=True)
class Rejection:
    """An object under the landing prefix that retrain refused, and why: recorded, so that every object
    that lands is an arrival or a rejection someone can read (``retrain audit``)."""

    version: ObjectVersion
    reason: str
    at: str
    """When it was refused (RFC 3339)."""


@dataclass(frozen=True)
class RecordedArrival:
    """One arrival as the ledger holds it."""

    version: ObjectVersion
    """The object version, with the content hash it arrived with."""
    arrived_at: str
    """Its commit time (RFC 3339): arrivals after the dataset's last cut are pending."""


@dataclass(frozen=True)
class Holding:
    """One ``contents/`` entry: the run that holds (trains, or trained) one content, through one version."""

    version: ObjectVersion
    run_id: str


@dataclass(frozen=True)
class DatasetRecords:
    """Everything the ledger holds on one dataset's data, read at once for ``retrain audit``."""

    dataset: str
    last_cut: str | None
    """The commit time of its latest seal (None: never sealed)."""
    arrivals: list[RecordedArrival]
    holdings: list[Holding]
    runs: list[Run]
    returned: dict[str, list[ObjectVersion]]
    """Run id -> the object versions whose content it gave back (``runs/{run}/objects``)."""


class ArrivalLog(Protocol):
    """What landed: each object version's arrival or rejection, by dataset."""

    def record_arrival(self, arrival: ObjectArrival, dataset: str, content_hash: str) -> ArrivalOutcome: ...

    def record_rejection(self, version: ObjectVersion, reason: str) -> None: ...

    def rejections(self) -> list[Rejection]: ...

    def datasets(self) -> list[str]: ...

    def dataset_records(self, dataset: str) -> DatasetRecords: ...


class Batches(Protocol):
    """Seals and coalescing: a dataset's pending arrivals, cut by a seal into a batch that joins one run."""

    def pending(self, dataset: str | None = None) -> list[Pending]: ...

    def seal(self, dataset: str, trigger: Trigger, retry_of: str | None = None) -> SealOutcome:
        """Cut the dataset's pending arrivals into a batch, which joins its pending run (made now, by
        ``trigger``, when there is none: a retry's names the run it re-runs)."""
        ...

    def preview(self, dataset: str) -> SealPreview: ...

    def materialize(self, batch_id: str) -> SealOutcome: ...

    def batches_in(self, state: BatchState) -> list[dict[str, Any]]: ...


class Holdings(Protocol):
    """Content identity: what each run holds, given back when it does not train it, arriving again."""

    def run_objects(self, run: Run) -> tuple[ObjectVersion, ...]: ...

    def give_back(self, run: Run, versions: Collection[ObjectVersion] | None = None) -> int: ...

    def versions_of(self, dataset: str, content_hash: str) -> list[ObjectVersion]: ...

    def arrive_again(self, dataset: str, version: ObjectVersion, why: str) -> None: ...

    def requeue(self, run: Run) -> int: ...


class ExportBook(Protocol):
    """A watched BigQuery table's exports: its watermark, backlog and the job in flight."""

    def export_mark(self, table: str) -> Watermark: ...

    def begin_export(self, job: ExportJob) -> bool: ...

    def want_export(self, table: str) -> bool: ...

    def end_backlog(self, table: str, value: Any) -> None: ...

    def mark_backlog(self, table: str, retry_after: str = "") -> None: ...

    def pending_export(self, table: str) -> ExportJob | None: ...

    def pending_exports(self) -> list[ExportJob]: ...

    def finish_export(self, job: ExportJob, arrivals: list[ObjectArrival]) -> bool: ...

    def abandon_export(self, job: ExportJob, reason: str, retry_after: str) -> bool: ...


class RunStore(Protocol):
    """The run records: a start's claim, the execution bound to it, and each run's fields."""

    def claim_start(self, run: Run, stale_after_s: float) -> StartClaim: ...

    def runs_in(self, *statuses: RunStatus) -> list[Run]: ...

    def unsettled(self) -> list[Run]: ...

    def unobserved_release(self) -> list[Run]: ...

    def record_claimed(self, run_id: str, claim: str, change: RunChange) -> bool:
        """Write ``change`` to the run's record while its start claim is ``claim``, it is pending and it
        has no execution; False (nothing written) otherwise: a starter whose claim a sweep took over
        changes nothing (not its plan, not its end)."""
        ...

    def attach_execution(self, run_id: str, claim: str, execution: str) -> dict[str, Any] | None:
        """Bind ``execution`` to the run if its start claim is ``claim``, it has a plan, and it is pending
        with no execution (or is bound to this one already and has not ended: the same execution id,
        whatever the name's project form); the run's plan, or None when not."""
        ...

    def record(self, run_id: str, change: RunChange) -> None:
        """Write ``change`` to the run's record (its fields are the change's own,
        :mod:`retrain.domain.transitions`)."""
        ...

    def request_cancel(self, run_id: str, requested_by: str, reason: str) -> bool:
        """Record an operator's cancel on a run that has not ended (the first request stands); False when
        the run is unknown or ended.  The workflow confirms a Cancelled callback here."""
        ...

    def get_run(self, run_id: str) -> Run | None: ...

    def plan_of(self, run_id: str) -> dict[str, Any] | None:
        """The plan the run's start kept (:class:`retrain.domain.transitions.RunPlanned`: the workflow's
        argument), the one copy every step reads; None for an unknown run or one not planned."""
        ...

    def list_runs(self, limit: int = 100) -> list[Run]: ...

    def runs_budgeted_in(self, month: str) -> list[Run]:
        """Every run whose start was priced in ``month`` (``YYYY-MM``, :attr:`Run.budget_month`)."""
        ...


class Champions(Protocol):
    """Each dataset's best model so far, which the next run continues from."""

    def champion(self, dataset: str) -> Champion | None: ...

    def promote(self, dataset: str, champion: Champion) -> bool: ...


class Ledger(ArrivalLog, Batches, Holdings, ExportBook, RunStore, Champions, Protocol):
    """Durable, transactional record of arrivals, batches and runs (Firestore): every part its consumers use
    one by one (a consumer names the part it needs, and a fake of it stays small)."""


#: ``retrain reap``'s exit codes.
EXIT_OK, EXIT_ERRORS, EXIT_NODES_UP = 0, 1, 3


@dataclass
class Reaped:
    """One object the reaper deleted (or, in a dry run, would delete) or kept, and why."""

    kind: str
    name: str
    run_id: str
    why: str


@dataclass
class NodeUp:
    """A GPU node of the pool that is up, and for how long."""

    name: str
    up_s: float
    created_at: str
    instance_type: str | None = None
    gpus: int = 0
    ready: bool = False


@dataclass
class ReapReport:
    """What the reaper did (:func:`retrain.k8s.reaper.reap`): the sweeper reads it, ``retrain reap --json``
    prints it."""

    namespace: str
    node_pool: str
    max_age_s: float
    dry_run: bool
    deleted: list[Reaped] = field(default_factory=list)
    kept: list[Reaped] = field(default_factory=list)
    nodes_up: list[NodeUp] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    node_pool_size: dict[str, Any] | None = None
    """The node pool's autoscaling bounds as the GKE API reports them (``NodePoolSize.to_dict``); None
    when the cluster was reached without it (``--kubeconfig``)."""

    @property
    def live_runs(self) -> list[str]:
        """Runs that still own objects in the cluster (and may hold nodes)."""
        return sorted({k.run_id for k in self.kept})

    @property
    def idle_nodes(self) -> bool:
        """GPU nodes of the pool are up while no live run owns anything: nothing should hold them."""
        return bool(self.nodes_up) and not self.live_runs

    @property
    def exit_code(self) -> int:
        """``retrain reap``'s: 3 when GPU nodes are up with no live run, 1 when a delete failed."""
        if self.idle_nodes:
            return EXIT_NODES_UP
        return EXIT_ERRORS if self.errors else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(live_runs=self.live_runs, idle_nodes=self.idle_nodes, exit_code=self.exit_code)
        return d


class Cluster(Protocol):
    """The GKE cluster: the reaper's work, and the confirmation of a JobSet's completion."""

    def reap(self, runs: RunLookup) -> ReapReport:
        """Delete the training objects no live run owns; the report (what went, what stayed, nodes up)."""
        ...

    def confirm_completion(self, namespace: str, name: str, uid: str, run_id: str, state: str) -> str | None:
        """None when JobSet ``name`` exists with ``uid``, carries run ``run_id``'s label and is in terminal
        ``state``; otherwise why not."""
        ...


class RunLookup(Protocol):
    """The part of :class:`Ledger` the reaper needs."""

    def get_run(self, run_id: str) -> Run | None: ...


class ExecutionState(StrEnum):
    """A workflow execution's state, as the Executions API names it, and LOST for one it no longer has."""

    STATE_UNSPECIFIED = "STATE_UNSPECIFIED"
    QUEUED = "QUEUED"
    ACTIVE = "ACTIVE"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    UNAVAILABLE = "UNAVAILABLE"
    LOST = "LOST"
    """The Executions API answers 404: nothing will record the run's outcome or release its capacity."""

    @property
    def ended(self) -> bool:
        return self in (
            ExecutionState.SUCCEEDED,
            ExecutionState.FAILED,
            ExecutionState.CANCELLED,
            ExecutionState.LOST,
        )


@dataclass(frozen=True)
class ExecutionStatus:
    """What the orchestrator says of one execution (``projects.locations.workflows.executions.get``)."""

    state: ExecutionState
    error: str | None = None
    """The payload of the error a FAILED execution ended with (``error.payload``), if any."""


class Orchestrator(Protocol):
    """Starts and signals executions of the retrain workflow (Cloud Workflows)."""

    def start(self, argument: Mapping[str, Any]) -> str: ...

    def get(self, execution: str) -> ExecutionStatus:
        """The execution's state; ExecutionLost when the service has no such execution (404)."""
        ...

    def send_callback(self, url: str, payload: Mapping[str, Any]) -> int: ...


class ObjectStore(Protocol):
    """Objects by ``gs://`` URI (Cloud Storage); ``retrain.adapters.objects`` is the adapter."""

    def read_bytes(self, uri: str, generation: int | None = None) -> bytes:
        """The object's bytes (of ``generation`` exactly, when given); FileNotFoundError without it."""
        ...

    def write_bytes(
        self, uri: str, data: bytes, content_type: str = ..., if_generation_match: int | None = None
    ) -> int | None:
        """Writes the object; its new generation (None where there is none: a local file).  With
        ``if_generation_match``, only while the live version is that generation (0: none is live), else
        ObjectChanged and nothing written."""
        ...

    def delete(self, uri: str) -> None: ...

    def stat(self, uri: str, generation: int | None = None) -> ObjectInfo: ...

    def list_objects(self, prefix: str, versions: bool = False) -> Iterator[ObjectInfo]: ...


class Warehouse(Protocol):
    """The rows a watched table gained, exported by bounded jobs as newline-delimited JSON (BigQuery)."""

    def export_range(
        self,
        table: str,
        column: str,
        after: Any = None,
        not_after: datetime | None = None,
        max_rows: int | None = None,
        max_step: int | None = None,
    ) -> RowRange: ...

    def location(self, table: str, column: str) -> str: ...

    def start_export(self, job: ExportJob, column: str, timeout_s: float) -> None: ...

    def export_status(self, job: ExportJob, wait_s: float = 0.0) -> ExportStatus: ...

    def cancel_export(self, job: ExportJob) -> None: ...


class RunEvents(Protocol):
    """Tells whoever subscribed what happened to a run (the run events topic: Pub/Sub)."""

    def publish(self, event: RunEvent) -> None:
        """Best effort: the state change it reports has happened already, so a publish that fails
        after the client's retries is logged, never raised."""
        ...


class Lineage(Protocol):
    """Where a run's OpenLineage events go beyond its folder (Google's Data Lineage API)."""

    def report(self, run_id: str, events: Sequence[dict[str, Any]]) -> None:
        """Best effort, as :meth:`RunEvents.publish`: the run has ended; a failure is logged."""
        ...


def tell(events: RunEvents | None, type: RunEventType, run: Run, **fields: Any) -> None:
    """Publish that ``type`` happened to ``run`` now (best effort, as :meth:`RunEvents.publish`), and log
    it as a structured entry (``run_event``: what the run-failed alert and the dashboard read)."""
    event = RunEvent(type, run.run_id, run.dataset, now_iso(), **fields)
    level = logging.WARNING if type in (RunEventType.FAILED, RunEventType.REFUSED) else logging.INFO
    said = f": {event.reason}" if event.reason else ""
    extra = {"run_id": run.run_id, "dataset": run.dataset, "run_event": json.loads(event.data())}
    log.log(level, "run %s %s%s", run.run_id, type, said, extra=extra)
    if events is not None:
        events.publish(event)
