"""Where an event becomes a run.

Arrivals are recorded in the ledger (deduplicated, contention-free); a seal cuts the dataset's
timeline, and a sealed batch whose snapshot is new becomes one run: its object list is written as the
run's manifest and one workflow execution starts.  A write to a watched BigQuery table is first
exported (its new rows, by a bounded BigQuery job into the artifacts bucket: ``retrain.exports``) and
its files recorded like any arrival.  JobSet completions come back the other way and are relayed to the
waiting execution's callback.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from functools import partial
from typing import Any

from retrain.audit import Account, AuditReport, audit, log_report, repair
from retrain.config import Settings, is_dataset_name
from retrain.contracts import (
    CallbackPayload,
    ExecutionArgument,
    Forecast,
    JobSetCompletion,
    RunEventType,
    RunManifest,
    SchedulerJob,
    SchedulerTick,
)
from retrain.domain.bigquery_events import (
    ExportFinished,
    NotRelevant,
    OwnExportDone,
    TableWritten,
    parse_bigquery_audit,
)
from retrain.domain.errors import ExecutionLost, PlanError, Rejected, Retry
from retrain.domain.events import ObjectArrival, check_object_name, parse_gcs_finalized
from retrain.domain.runs import BatchState, Champion, FailureKind, Run, RunStatus, iso, now_iso, parse_iso
from retrain.exports import Progress, Step, TableExports, arrival_of, written_files
from retrain.logs import Alert
from retrain.plan import (
    Estimate,
    budget_month,
    check_before_capacity,
    estimate,
    manifest_object,
    near_monthly_budget,
    over_budget,
    over_monthly_budget,
    spent_this_month,
    training_plan,
    workflow_argument,
)
from retrain.ports import (
    ArrivalStatus,
    Cluster,
    ExecutionState,
    Ledger,
    ObjectChanged,
    ObjectStore,
    Orchestrator,
    RunEvents,
    SealOutcome,
    SealVerdict,
    StartVerdict,
    Warehouse,
    tell,
)

log = logging.getLogger("retrain.ingest")


class Action(StrEnum):
    """What handling one event did."""

    RECORDED = "recorded"
    """An arrival was recorded in its dataset's open batch."""
    DUPLICATE = "duplicate"
    """The event, or that object version, was seen before."""
    IGNORED = "ignored"
    """Not training data, or nothing waits for it (acknowledged)."""
    STARTED = "started"
    """A run's workflow execution started."""
    QUEUED = "queued"
    """A run waits behind its dataset's live run."""
    NOTHING_TO_SEAL = "nothing-to-seal"
    """A seal found no arrival since the last one."""
    NOTHING_NEW = "nothing-new"
    """A watched table has no row after its watermark."""
    EXPORTING = "exporting"
    """A watched table's new rows are being exported by a BigQuery job; the next write or tick
    finishes it."""
    EXPORT_FAILED = "export-failed"
    """A watched table's export job failed, was refused or ran past its deadline; its rows go with the
    next one."""
    EXPORT_DEFERRED = "export-deferred"
    """A watched table's next export waits (the tick starts it): a backoff after failures, or rows
    stamped too recently to take yet."""
    EMPTY = "empty"
    """A run whose objects are all empty ended at once, succeeded with nothing to train: no job, no
    capacity (their content counts as trained: empty bytes dropped again start nothing)."""
    ALREADY_TRAINED = "already-trained"
    """Nothing new: every object's content trained before or is in the live or pending run."""
    REFUSED = "refused"
    """The trainer would refuse the run as planned, or it is over the cost cap (its record says why):
    no capacity was requested."""
    ERROR = "error"
    """Handling this item failed (logged); the round went on, and the next one retries it."""
    RECORDED_FAILURE = "recorded-failure"
    """A run whose execution ended without an outcome was recorded as failed."""
    RECORDED_SUCCESS = "recorded-success"
    """A run whose execution was lost after its results were recorded was recorded as succeeded."""
    GAVE_BACK = "gave-back"
    """A run that ended without succeeding gave back the content it still held (its finish step had not)."""
    RELAYED = "relayed"
    """A JobSet completion reached its run's callback."""
    AUDITED = "audited"
    """The audit ran (the detail counts where every object stands)."""
    REAPED = "reaped"
    """The reaper ran (the detail says what it deleted and which GPU nodes are up)."""


@dataclass(frozen=True)
class Outcome:
    """What handling one event did, for logs, the CLI and tests."""

    action: Action
    detail: str = ""
    run_id: str | None = None


def record_silent_end(
    ledger: Ledger, orchestrator: Orchestrator, run: Run, events: RunEvents | None = None
) -> Outcome | None:
    """Record as failed a run whose workflow execution ended (a crash, a hard cancel) without writing
    its outcome, or no longer exists at all (the executions service lost it); None while the execution
    is active or the record is already final."""
    try:
        execution = orchestrator.get(str(run.execution))
    except ExecutionLost:
        execution = {"state": str(ExecutionState.LOST)}
    state = ExecutionState(execution.get("state", ExecutionState.STATE_UNSPECIFIED))
    if not state.ended:
        return None
    current = ledger.get_run(run.run_id)  # re-read: the workflow writes its outcome before it ends
    if current is None or current.status.terminal:
        return None
    if current.checkpoint:
        # Trained, its results recorded (its checkpoint judged, promoted or not): only what came after
        # (the release, the final record) was cut short, so it succeeded; the reaper releases.
        how = "was lost" if state == ExecutionState.LOST else f"ended {state}"
        reason = f"trained; its execution {run.execution} {how} while releasing (the reaper releases)"
        ledger.update_run(
            run.run_id, {"status": str(RunStatus.SUCCEEDED), "reason": reason, "finished_at": now_iso()}
        )
        tell(events, RunEventType.SUCCEEDED, current, reason=reason)
        return Outcome(Action.RECORDED_SUCCESS, reason, run.run_id)
    if state == ExecutionState.LOST:
        reason = f"execution lost: {run.execution} no longer exists (nothing will release its capacity)"
    else:
        error = (execution.get("error") or {}).get("payload")
        reason = f"workflow execution ended {state} without recording an outcome" + (
            f": {error}" if error else ""
        )
    ledger.update_run(
        run.run_id,
        {
            "status": str(RunStatus.FAILED),
            "failure": str(FailureKind.EXECUTION_LOST),
            "reason": reason,
            "finished_at": now_iso(),
        },
    )
    tell(events, RunEventType.FAILED, current, reason=reason, failure=str(FailureKind.EXECUTION_LOST))
    ledger.give_back(current)  # identical bytes dropped again are new; `run --retry` re-runs them
    return Outcome(Action.RECORDED_FAILURE, reason, run.run_id)


class Ingest:
    """Every trigger's handler (functions/, the CLI and the sweeper call these), over the ports alone."""

    def __init__(
        self,
        settings: Settings,
        ledger: Ledger,
        orchestrator: Orchestrator,
        store: ObjectStore,
        warehouse: Warehouse | None = None,
        cluster: Cluster | None = None,
        events: RunEvents | None = None,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.orchestrator = orchestrator
        self.store = store
        self.warehouse = warehouse
        self.cluster = cluster
        self.events = events

    # --- objects landing in the bucket ---

    def dataset_of(self, name: str) -> str:
        """``incoming/<dataset>/...`` names a dataset; files directly under the prefix use the default."""
        dataset = self.settings.dataset_of_object(name)
        if dataset is None:
            head = name[len(self.settings.landing_prefix) :].partition("/")[0]
            raise Rejected(f"dataset folder {head!r} is not a valid dataset name")
        return dataset

    def on_object_finalized(self, attributes: Mapping[str, Any], data: Any) -> Outcome:
        """A GCS finalize event: record the object, or seal on the marker. Raises Rejected; an object
        under the landing prefix that is refused is recorded with its reason (``retrain audit`` shows
        it), so that every object that lands there is an arrival or a recorded rejection."""
        arrival = parse_gcs_finalized(attributes, data)
        if arrival.bucket != self.settings.landing_bucket:
            raise Rejected(f"bucket {arrival.bucket!r} is not the landing bucket")
        if not arrival.name.startswith(self.settings.landing_prefix):
            return Outcome(Action.IGNORED, f"{arrival.name} is outside the landing prefix: not training data")
        try:
            dataset = self.dataset_of(arrival.name)
        except Rejected as e:
            self.ledger.record_rejection(arrival.version, e.reason)
            raise
        if arrival.name.rsplit("/", 1)[-1] == self.settings.seal_marker:
            return self.seal(dataset, trigger="gcs-marker")
        return self._record(arrival, dataset)

    def _record(self, arrival: ObjectArrival, dataset: str) -> Outcome:
        if (
            self.ledger.record_arrival(arrival, dataset, arrival.content_hash).status
            == ArrivalStatus.DUPLICATE
        ):
            return Outcome(Action.DUPLICATE, arrival.identity)
        return Outcome(Action.RECORDED, f"{arrival.uri} -> dataset {dataset}")

    # --- BigQuery ---

    def on_bigquery_event(self, attributes: Mapping[str, Any], data: Any) -> Outcome:
        """A BigQuery audit-log event: export a watched table's new rows, or take in a finished extract
        job's files; either way the batch is sealed once the data has landed. Raises Rejected."""
        change = parse_bigquery_audit(attributes, data, own_principal=self.settings.functions_service_account)
        if isinstance(change, NotRelevant):
            return Outcome(Action.IGNORED, change.reason)
        if isinstance(change, ExportFinished):
            return self._take_export(change)
        if isinstance(change, OwnExportDone):
            if self.warehouse is None:
                return Outcome(Action.IGNORED, f"export job {change.job_id}: no BigQuery warehouse here")
            return self._export_outcome(self._exports().on_job_done, change.job_id)
        return self._export_new_rows(change)

    def _landing_name(self, uri: str) -> str:
        """The object name of a gs:// URI that must lie under the landing prefix, else Rejected."""
        bucket, _, name = uri.removeprefix("gs://").partition("/")
        if not uri.startswith("gs://") or bucket != self.settings.landing_bucket:
            raise Rejected(f"{uri[:200]!r} is not in the landing bucket")
        if not name.startswith(self.settings.landing_prefix):
            raise Rejected(f"{uri[:200]!r} is not under the landing prefix")
        return check_object_name(name.replace("*", "x"))  # validated with its wildcard filled in

    def _take_export(self, export: ExportFinished) -> Outcome:
        names = [self._landing_name(u) for u in export.destination_uris]
        datasets = {self.dataset_of(n) for n in names}
        if len(datasets) != 1:
            raise Rejected(f"export {export.job} writes to several datasets: {sorted(datasets)}")
        (dataset,) = datasets
        if export.error:
            return Outcome(Action.IGNORED, f"export {export.job} failed: {export.error}")
        found = 0
        for destination in export.destination_uris:
            for info in written_files(self.store, destination):
                if info.generation is None:
                    continue
                # the files' own finalize events may come before or after
                self._record(arrival_of(info, export.event_id), dataset)
                found += 1
        if not found:
            # Not there yet (a listing can trail the job by moments): fail so the platform retries.
            raise Retry(f"export {export.job} finished but none of its files are listed yet")
        log.info("export %s: %d file(s) in dataset %s", export.job, found, dataset)
        return self.seal(dataset, "bigquery-export")

    def _export_new_rows(self, written: TableWritten) -> Outcome:
        """Export the rows the table gained since its watermark (a bounded job: :mod:`retrain.exports`)
        and seal them once they have landed."""
        dataset = self.settings.watched_tables.get(written.table)
        if dataset is None:
            return Outcome(Action.IGNORED, f"table {written.table} is not watched")
        return self._export_outcome(self._exports().on_write, written.table, dataset)

    def _exports(self) -> TableExports:
        if self.warehouse is None:
            raise Retry("a watched table changed but no BigQuery warehouse is configured")
        return TableExports(self.settings, self.ledger, self.warehouse, self.store)

    def _export_outcome(self, do: Callable[..., Step], *args: Any) -> Outcome:
        """Take one step of an export (``do(*args)``); seal what it landed."""
        step = do(*args)
        if step.progress == Progress.LANDED and step.files:
            return self.seal(step.dataset, "bigquery")
        action = {
            Progress.RUNNING: Action.EXPORTING,
            Progress.FAILED: Action.EXPORT_FAILED,
            Progress.DEFERRED: Action.EXPORT_DEFERRED,
            Progress.TAKEN: Action.DUPLICATE,
        }.get(step.progress, Action.NOTHING_NEW)
        return Outcome(action, step.detail)

    # --- seals and starts ---

    def seal(self, dataset: str, trigger: str) -> Outcome:
        """Seal the dataset's pending arrivals and start their run (or queue it behind the live one)."""
        return self._started(self.ledger.seal(dataset, trigger))

    def _materialized(self, batch_id: str) -> Outcome:
        return self._started(self.ledger.materialize(batch_id))

    def _started(self, sealed: SealOutcome) -> Outcome:
        if sealed.verdict == SealVerdict.NOTHING_PENDING:
            return Outcome(Action.NOTHING_TO_SEAL, sealed.reason)
        if sealed.run is None:
            log.info("seal: %s", sealed.reason)
            return Outcome(Action.ALREADY_TRAINED, sealed.reason)
        if sealed.run.execution:
            return Outcome(Action.STARTED, sealed.run.execution, sealed.run.run_id)
        tell(self.events, RunEventType.QUEUED, sealed.run)  # each seal that joins it: one event, by id
        return self.start(sealed.run)

    def start(self, run: Run) -> Outcome:
        """Start a pending run's workflow if its dataset has no live run; otherwise it stays pending
        (later seals join it) until the live run ends.

        The object list is fixed here and goes to the run's manifest (arguments are capped at 32 KB)."""
        claim = self.ledger.claim_start(run, self.settings.stuck_after_s)
        if claim.verdict == StartVerdict.QUEUED:
            log.info("run %s pending behind the live run of dataset %s", run.run_id, run.dataset)
            return Outcome(Action.QUEUED, f"dataset {run.dataset} has a live run", run.run_id)
        if claim.verdict == StartVerdict.EMPTY:
            return Outcome(Action.ALREADY_TRAINED, f"run {run.run_id} had nothing left to train", run.run_id)
        if claim.verdict == StartVerdict.STARTING:
            return Outcome(Action.QUEUED, "its start was claimed moments ago and is under way", run.run_id)
        if claim.verdict == StartVerdict.STARTED:
            current = self.ledger.get_run(run.run_id)
            return Outcome(Action.STARTED, str(current.execution if current else ""), run.run_id)
        run = dataclasses.replace(run, objects=len(claim.objects), snapshot=claim.snapshot)
        manifest = RunManifest(run.run_id, run.dataset, run.batch_id, run.snapshot, list(claim.objects))
        if manifest.total_bytes == 0:
            return self._nothing_to_train(run, claim.token, manifest)
        champion = self.ledger.champion(run.dataset)
        cost = self._price(champion)
        if (too_dear := over_budget(self.settings, cost) or self._budget_refusal(run, cost)) is not None:
            return self._refuse(run, claim.token, too_dear)
        try:
            argument = workflow_argument(self.settings, run, champion, manifest.total_bytes)
        except PlanError as e:
            return self._refuse(run, claim.token, f"the trainer would refuse this run: {e}")
        written = self._write_manifest(run, claim.token, manifest)
        argument = dataclasses.replace(argument, manifest_generation=written)
        # The plan is the ledger's, kept under this claim: the execution's argument names only the run
        # and the claim, and its begin step reads the plan back (ExecutionArgument says why).
        kept = self.ledger.update_claimed(
            run.run_id,
            claim.token,
            {
                "plan": argument.to_dict(),
                "service_account": argument.run_account["metadata"]["name"],
                "profile": argument.training["profile"],
                "base_checkpoint": champion.checkpoint if champion else None,
                "base_step": champion.step if champion else 0,
                "estimated_cost_usd": round(cost.cost_usd, 2),
                "cost_cap_usd": self.settings.max_run_cost_usd or None,
                "budget_month": budget_month(datetime.now(UTC)),
                "manifest_generation": written,
            },
        )
        if not kept:
            return self._superseded(run)
        execution = self.orchestrator.start(ExecutionArgument(run.run_id, claim.token).to_dict())
        if self.ledger.attach_execution(run.run_id, claim.token, execution) is None:
            # Its begin step finds the claim is another's and ends it before it touches anything.
            return self._superseded(run, execution)
        log.info("run %s started: %d objects, execution %s", run.run_id, run.objects, execution)
        return Outcome(Action.STARTED, execution, run.run_id)

    def _superseded(self, run: Run, execution: str = "") -> Outcome:
        """This starter's claim was taken over (a sweep took it to be stuck): the other starter's
        execution is the run's; this one's, if it made one, ends at its begin step."""
        log.warning(
            "run %s: its start was taken over by another starter%s",
            run.run_id,
            f"; execution {execution} will end at its begin step" if execution else "",
        )
        current = self.ledger.get_run(run.run_id)
        if current is not None and current.execution:
            return Outcome(Action.STARTED, current.execution, run.run_id)
        return Outcome(Action.QUEUED, "its start was taken over by another starter", run.run_id)

    def _note_idle_nodes(self, nodes_up: list[dict[str, Any]]) -> None:
        """Log GPU nodes idle past ``alert_idle_nodes_s`` for their alert: idle since the last run ended
        (as recent runs record it), and never longer than the oldest node has been up."""
        ends = [parse_iso(r.finished_at) for r in self.ledger.list_runs(50)]
        last_end = max((t for t in ends if t is not None), default=None)
        up_s = max(float(n.get("up_s", 0.0)) for n in nodes_up)
        idle_s = min(up_s, (datetime.now(UTC) - last_end).total_seconds()) if last_end else up_s
        if idle_s > self.settings.alert_idle_nodes_s:
            log.warning(
                "%d GPU node(s) up with no live run for %.0f s: %s",
                len(nodes_up),
                idle_s,
                ", ".join(str(n.get("name")) for n in nodes_up),
                extra={"alert": Alert.IDLE_NODES},
            )

    def _note_capacity_wait(self, run: Run, now: datetime) -> None:
        """Log a run waiting for capacity past ``alert_capacity_wait_s`` for its alert (each sweep, while
        it waits: the alert policy limits how often it notifies)."""
        since = parse_iso(run.provisioning_at) if run.status == RunStatus.PROVISIONING else None
        waited = (now - since).total_seconds() if since else 0.0
        if waited > self.settings.alert_capacity_wait_s:
            log.warning(
                "run %s has waited %.0f s for capacity (DWS has not provisioned %d node(s))",
                run.run_id,
                waited,
                self.settings.nodes,
                extra={"alert": Alert.CAPACITY_WAIT, "run_id": run.run_id, "dataset": run.dataset},
            )

    def _write_manifest(self, run: Run, claim: str, manifest: RunManifest) -> int | None:
        """Write the run's manifest; the generation written (the version the audit and report read and
        the tokenize job is pinned to: the run record's ``manifest_generation``).

        Written only where none is (ifGenerationMatch=0): a starter whose claim a sweep took over must
        not rewrite the manifest its successor recorded, whose version would then be noncurrent and, after
        the bucket's retention, gone from under the run's audit and report.  The same bytes already there
        (a starter of this run before, on the same content) are this claim's manifest; other bytes (the
        run's content changed between the two claims) are rewritten only at the generation read and only
        while the claim is still this one; None when it is not (the caller's claimed update then fails).
        Left open: a starter that checked its claim and stalls before that rewrite, past two takeovers,
        can still make a successor's recorded version noncurrent (still readable until the retention)."""
        uri = f"{self.settings.artifacts_uri}/{manifest_object(run.run_id)}"
        data = manifest.to_json()
        try:
            return self.store.write_bytes(uri, data, "application/json", if_generation_match=0)
        except ObjectChanged:
            there = self.store.stat(uri)
        if self.store.read_bytes(uri, there.generation) == data:
            return there.generation
        if not self.ledger.update_claimed(run.run_id, claim, {"manifest_generation": None}):
            return None
        try:
            return self.store.write_bytes(uri, data, "application/json", if_generation_match=there.generation)
        except ObjectChanged:  # another starter wrote meanwhile: the claim is most likely not this one's
            return None

    def _nothing_to_train(self, run: Run, claim: str, manifest: RunManifest) -> Outcome:
        """End a run whose every object is empty: it would tokenize to nothing and fail, so it succeeds
        now, without a job or capacity (its manifest is written, for its lineage and the audit)."""
        written = self._write_manifest(run, claim, manifest)
        reason = f"nothing to train: its {len(manifest.objects)} object(s) are empty"
        now = now_iso()
        ended = self.ledger.update_claimed(
            run.run_id,
            claim,
            {
                "status": str(RunStatus.SUCCEEDED),
                "reason": reason,
                "manifest_generation": written,
                "objects": len(manifest.objects),
                "nodes_at_end": 0,
                "work_ended_at": now,
                "finished_at": now,
            },
        )
        if not ended:
            return self._superseded(run)
        tell(self.events, RunEventType.SUCCEEDED, run, reason=reason, cost_usd=0.0)
        log.info("run %s: %s", run.run_id, reason)
        return Outcome(Action.EMPTY, reason, run.run_id)

    def _settle(self, run: Run) -> Outcome | None:
        """Give back what a run that ended without succeeding still holds (a promoted one keeps it: its
        checkpoint holds that content)."""
        if run.promoted:
            return None
        returned = self.ledger.give_back(run)
        log.warning(
            "run %s ended %s holding its content: %d object(s) given back", run.run_id, run.status, returned
        )
        return Outcome(Action.GAVE_BACK, f"{returned} object(s) of {run.status} run {run.run_id}", run.run_id)

    def _price(self, champion: Champion | None) -> Estimate:
        """The next run's estimate, from the champion run's record when the dataset has one."""
        return estimate(self.settings, self.ledger.get_run(champion.run_id) if champion else None)

    def _spent(self, dataset: str, but: str = "") -> float:
        """What ``dataset`` spent this calendar month (ended runs' costs, live runs' estimates)."""
        return spent_this_month(self.ledger.runs_budgeted_in(budget_month(datetime.now(UTC))), dataset, but)

    def _budget_refusal(self, run: Run, cost: Estimate) -> str | None:
        """Why ``run``, estimated at ``cost``, would pass its dataset's monthly budget (None: it would
        not); one that would take it past ``alert_budget_fraction`` of it is logged for the budget alert."""
        if self.settings.monthly_budget_of(run.dataset) <= 0:
            return None  # no budget: no query
        spent = self._spent(run.dataset, run.run_id)
        refusal = over_monthly_budget(self.settings, run.dataset, spent, cost)
        if refusal is None and (near := near_monthly_budget(self.settings, run.dataset, spent, cost)):
            extra = {"alert": Alert.BUDGET, "run_id": run.run_id, "dataset": run.dataset}
            log.warning("run %s starts: %s", run.run_id, near, extra=extra)
        return refusal

    def _refuse(self, run: Run, claim: str, reason: str) -> Outcome:
        """End a run before it asks for any capacity, its content given back (eligible again: dropped
        again, or ``run --retry`` once whatever refused it is fixed); not when a sweep took its start
        over (the other starter decides)."""
        ended = self.ledger.update_claimed(
            run.run_id,
            claim,
            {
                "status": str(RunStatus.FAILED),
                "failure": str(FailureKind.REFUSED),
                "reason": reason,
                "nodes_at_end": 0,
                "finished_at": now_iso(),
            },
        )
        if not ended:
            return self._superseded(run)
        tell(self.events, RunEventType.REFUSED, run, reason=reason, failure=str(FailureKind.REFUSED))
        returned = self.ledger.give_back(run)
        log.warning(
            "run %s refused before any capacity was requested (%d objects given back): %s",
            run.run_id,
            returned,
            reason,
        )
        return Outcome(Action.REFUSED, reason, run.run_id)

    def on_scheduler_tick(self, message: Mapping[str, Any]) -> list[Outcome]:
        """A Cloud Scheduler job's tick (:class:`SchedulerTick`): seal, sweeper, reaper or audit."""
        tick = SchedulerTick.parse(message)
        if tick.job == SchedulerJob.SWEEPER:
            return self.sweep()
        if tick.job == SchedulerJob.REAPER:
            return [self.reap()]
        if tick.job == SchedulerJob.AUDIT:
            return [self.audit()]
        return self.seal_pending(tick.dataset, "scheduler")

    def audit(self) -> Outcome:
        """Account for every landed object (:mod:`retrain.audit`); log what is not, and record the arrivals
        of objects whose finalize events never came (Eventarc stops retrying after a day).  The other
        findings wait for an operator (``retrain audit --repair``): they mean a run to retry or a fault."""
        report = audit(self.settings, self.ledger, self.store)
        log_report(report)
        lost = [e for e in report.findings if e.account == Account.UNRECORDED]
        repair(AuditReport(lost, report.checked_at), self.settings, self.ledger, self.store)
        detail = f"{len(report.entries)} object version(s): {report.counts()}"
        if lost:
            detail += f"; {len(lost)} arrival(s) recorded"
        return Outcome(Action.AUDITED, detail)

    def reap(self) -> Outcome:
        """Delete the cluster objects no live run owns (a crashed or hard-cancelled execution leaves
        its JobSet and capacity request behind); say which GPU nodes are still up."""
        if self.cluster is None:
            raise Retry("the reaper needs the cluster, and none is configured")
        report = self.cluster.reap(self.ledger)
        deleted = [f"{d['kind']} {d['name']}" for d in report["deleted"]]
        nodes = [n["name"] for n in report["nodes_up"]]
        detail = f"deleted {deleted or 'nothing'}; GPU nodes up: {nodes or 'none'}"
        if report["idle_nodes"]:
            log.warning("reaper: GPU nodes up with no live run: %s", nodes)
            self._note_idle_nodes(report["nodes_up"])
        if report["errors"]:
            raise Retry(f"reaper: {report['errors']}")
        if not report["nodes_up"]:
            observed = self._record_release()
            if observed:
                detail += f"; zero nodes recorded for {', '.join(observed)}"
        return Outcome(Action.REAPED, detail)

    def _record_release(self) -> list[str]:
        """The pool is at zero nodes: every ended run whose record never observed its release (its
        execution was lost, so nothing recorded ``nodes_at_end``) gets the zero the reaper sees, so that
        the record, which operators trust, says its GPUs are released.  The node time such a run used
        cannot be observed after the fact: its ``gpu_node_seconds`` stay what its execution recorded."""
        observed = []
        for run in self.ledger.unobserved_release():
            self.ledger.update_run(run.run_id, {"nodes_at_end": 0, "release_observed_at": now_iso()})
            observed.append(run.run_id)
        return observed

    def retry(self, run_id: str) -> Outcome:
        """Run a failed or cancelled run's objects again, or those of a run whose checkpoint the eval gate
        refused (on the champion this time): its content is given back (if its end did not already), its
        objects arrive again, and its dataset is sealed now, so a run takes them (with whatever else is
        pending)."""
        run = self.ledger.get_run(run_id)
        if run is None:
            raise Rejected(f"no run {run_id}")
        if run.promoted:
            raise Rejected(f"run {run_id} was promoted: the champion holds its content, never trained twice")
        if not run.status.terminal or (run.status == RunStatus.SUCCEEDED and not run.refused):
            raise Rejected(
                f"run {run_id} is {run.status}: only a failed or cancelled run, or one whose checkpoint the "
                "eval gate refused, is retried"
            )
        self.ledger.give_back(run)
        returned = self.ledger.requeue(run)
        log.info("retrying run %s: its %d object(s) arrive again", run_id, returned)
        return self.seal(run.dataset, f"retry of {run_id}")

    def forecast(self, dataset: Any = None) -> list[Forecast]:
        """What sealing every dataset with new data or a pending run (or only ``dataset``) would train,
        and its cost; nothing is written."""
        if dataset is not None and not is_dataset_name(dataset):
            raise Rejected("dataset must be a valid dataset name")
        if dataset:
            names = [dataset]
        else:
            waiting = {p.dataset for p in self.ledger.pending()}
            names = sorted(waiting | {r.dataset for r in self.ledger.runs_in(RunStatus.PENDING)})
        return [self._forecast(name) for name in names]

    def _forecast(self, dataset: str) -> Forecast:
        preview = self.ledger.preview(dataset)
        new_bytes = sum(v.size for v in preview.objects)
        held_bytes = sum(v.size for v in preview.pending_objects)
        champion = self.ledger.champion(dataset)
        cost = self._price(champion)
        budget = self.settings.monthly_budget_of(dataset)
        spent = (
            self._spent(dataset, preview.pending_run.run_id if preview.pending_run else "")
            if budget > 0
            else 0.0
        )
        refused = over_budget(self.settings, cost) or over_monthly_budget(self.settings, dataset, spent, cost)
        try:  # what start would check before asking for capacity
            check_before_capacity(self.settings, training_plan(self.settings, "plan", champion, dataset))
        except PlanError as e:
            refused = refused or f"the trainer would refuse this run: {e}"
        trains = len(preview.objects) + len(preview.pending_objects)
        if not trains:
            reason = (
                f"nothing new: {preview.skipped} object(s) skipped, their content trained before or is "
                "in the live run"
            )
        elif refused:
            reason = f"a run would be refused: {refused}"
        elif not preview.objects and preview.pending_run is not None:
            reason = (
                f"nothing new to seal; pending run {preview.pending_run.run_id} holds "
                f"{len(preview.pending_objects)} object(s) and starts when the dataset's live run ends"
            )
        else:
            reason = f"a run would train {trains} object(s)"
        return Forecast(
            dataset=dataset,
            objects=len(preview.objects),
            bytes=new_bytes,
            skipped=preview.skipped,
            pending_run=preview.pending_run.run_id if preview.pending_run else None,
            pending_objects=len(preview.pending_objects),
            estimated_tokens=int((new_bytes + held_bytes) * self.settings.tokens_per_byte),
            training_tokens=cost.training_tokens,
            estimated_node_hours=round(cost.node_hours, 4),
            estimated_cost_usd=round(cost.cost_usd, 2),
            max_cost_usd=self.settings.max_run_cost_usd,
            monthly_budget_usd=budget,
            budget_left_usd=round(max(0.0, budget - spent), 2) if budget > 0 else None,
            basis=cost.basis,
            would_run=bool(trains) and refused is None,
            reason=reason,
        )

    def seal_pending(self, dataset: Any, trigger: str) -> list[Outcome]:
        """Seal every dataset's pending data (or only ``dataset``'s): ticks and manual triggers."""
        if dataset is not None and not is_dataset_name(dataset):
            raise Rejected("dataset must be a valid dataset name")
        return [self.seal(p.dataset, trigger) for p in self.ledger.pending(dataset)]

    def sweep(self, now: datetime | None = None) -> list[Outcome]:
        """What a timer must do, in order: seal quiet or old batches, finish seals and starts a crash cut
        short, record executions that died without an outcome (and reap what they left), start queued
        runs, and advance BigQuery exports (and start those that are due).  Each item is handled on its
        own: one failure is logged, and the round goes on."""
        began, now = time.monotonic(), now or datetime.now(UTC)
        s = self.settings
        stuck_before, quiet_before, old_before = (
            iso(now - timedelta(seconds=x)) for x in (s.stuck_after_s, s.quiet_period_s, s.max_batch_age_s)
        )
        outcomes: list[Outcome] = []

        def each(what: str, fn: Callable[[], Outcome | None]) -> Outcome | None:
            try:
                outcome = fn()
            except Exception as e:  # the next round retries it; this one goes on
                log.exception("sweep: %s failed", what)
                outcome = Outcome(Action.ERROR, f"{what}: {type(e).__name__}: {e}")
            if outcome is not None:
                outcomes.append(outcome)
            return outcome

        for pending in self.ledger.pending():
            if pending.last_arrival_at < quiet_before:
                each(f"seal {pending.dataset}", partial(self.seal, pending.dataset, "quiet-period"))
            elif pending.first_arrival_at < old_before:
                each(f"seal {pending.dataset}", partial(self.seal, pending.dataset, "max-age"))
        sealing: set[str] = set()  # datasets whose sealer is still putting a batch into the pending run
        for batch in self.ledger.batches_in(BatchState.SEALED):
            if batch.get("sealed_at", "") < stuck_before:
                each(f"batch {batch['batch_id']}", partial(self._materialized, batch["batch_id"]))
            else:
                sealing.add(str(batch.get("dataset")))
        ended = False
        live = (RunStatus.TOKENIZING, RunStatus.PROVISIONING, RunStatus.TRAINING, RunStatus.PENDING)
        for run in self.ledger.runs_in(*live):
            self._note_capacity_wait(run, now)
            if run.execution:
                silent = each(
                    f"run {run.run_id}",
                    partial(record_silent_end, self.ledger, self.orchestrator, run, self.events),
                )
                ended |= silent is not None and silent.action in (
                    Action.RECORDED_FAILURE,
                    Action.RECORDED_SUCCESS,  # its release was cut short: what it left is reaped too
                )
        if ended and self.cluster is not None:
            each("reaping what ended runs left", self.reap)  # their JobSets and capacity go now
        for run in self.ledger.unsettled():
            # ended without succeeding, its content still held: its finish step did not run or failed
            each(f"give back {run.run_id}", partial(self._settle, run))
        for run in self.ledger.runs_in(RunStatus.PENDING):
            # queued behind a finished run, or orphaned by a crash (a start claimed moments ago is left
            # to its starter: claim_start says so).  Not while its dataset's sealer is still joining a
            # batch into it: started then, the rest of that batch (10,000 objects join 400 at a time)
            # would go to another run, one batch cut in two.
            if not run.execution and run.dataset not in sealing:
                each(f"start {run.run_id}", partial(self.start, run))
        if self.warehouse is not None:
            # Last, and only while the round is within half the function's timeout: BigQuery may be
            # slow, and what is left waits for the next tick.
            exports, until = self._exports(), began + s.function_timeout_s / 2

            def within_time(what: str, step: Callable[[], Step]) -> bool:
                if time.monotonic() > until:
                    log.warning("sweep: out of time; %s waits for the next tick", what)
                    return False
                each(f"export {what}", partial(self._export_outcome, step))
                return True

            for job in self.ledger.pending_exports():
                if not within_time(job.job_id, partial(exports.advance, job)):
                    break
            for table, dataset in exports.due():  # read after: what just landed may leave rows behind
                if not within_time(table, partial(exports.resume, table, dataset)):
                    break
        return outcomes

    # --- completions ---

    def on_jobset_event(self, message: Mapping[str, Any]) -> Outcome:
        """Relay a JobSet terminal state (a :class:`JobSetCompletion` from the notifier) to its run's
        workflow callback (as a :class:`CallbackPayload`), once confirmed: the message must name a live
        run, that run's own callback, and a JobSet that exists, carries the run's label and the message's
        uid, and has the terminal state the message says.  Anything else is Rejected with its reason
        (the workflow confirms again from the JobSet before acting: a message is only ever a hint)."""
        completion = JobSetCompletion.parse(message)
        run = self.ledger.get_run(completion.run_id)
        if run is None:
            raise Rejected(f"JobSet event names run {completion.run_id!r}, which does not exist")
        if run.status.terminal:
            return Outcome(Action.IGNORED, f"run {run.run_id} already ended {run.status}", run.run_id)
        if not run.callback_url:
            raise Rejected(f"run {run.run_id} has no callback endpoint")
        if completion.callback_url and completion.callback_url != run.callback_url:
            raise Rejected(f"JobSet event names a callback that is not run {run.run_id}'s")
        self._confirm(completion)
        url = run.callback_url
        try:
            status = self.orchestrator.send_callback(url, CallbackPayload.of(completion).to_dict())
        except ValueError as e:
            raise Rejected(str(e)) from None
        if status == 404:
            # The execution is gone (finished, cancelled or timed out): nothing waits, so acknowledge.
            return Outcome(Action.IGNORED, f"callback {url} no longer exists")
        if status >= 300:
            raise Retry(f"callback {url} answered {status}")
        return Outcome(Action.RELAYED, str(completion.state), completion.run_id)

    def _confirm(self, completion: JobSetCompletion) -> None:
        """The JobSet the message names is the run's, and in the state the message says; else Rejected."""
        if self.cluster is None:
            raise Retry("confirming a completion needs the cluster, and none is configured")
        ref = completion.jobset
        if ref.namespace and ref.namespace != self.settings.namespace:
            raise Rejected(f"JobSet {ref.name} is in namespace {ref.namespace!r}, not retrain's")
        problem = self.cluster.confirm_completion(
            self.settings.namespace, ref.name, ref.uid, completion.run_id, str(completion.state)
        )
        if problem:
            raise Rejected(problem)
