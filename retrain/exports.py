"""A watched BigQuery table's new rows, exported by bounded jobs.

A write to a watched table starts one ``EXPORT DATA`` job for the rows above the table's watermark
(never past the export's own start less a lag, at most ``bigquery_export_max_rows`` of them) into the
artifacts bucket, and records it first.  The job outlives no deadline: BigQuery stops it at its own
time limit, the handler waits for it only a share of its own timeout, and whoever comes next (the
job's own end in the audit log, the table's next write, or the Scheduler's tick) finishes it: its
files become arrivals and the watermark moves, in one transaction.  Rows left above it (the job's
limit, rows stamped later, a write while it ran) make the table due: the tick starts its next export.
A failed job (or one refused, or past its deadline and cancelled once it has stopped) is forgotten,
and the tick exports its rows again after a backoff, with half the rows for each failure in a row; a
crash between recording a job and starting it is finished by starting it then.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from retrain.config import Settings
from retrain.domain.bigquery_events import EXPORT_JOB_PREFIX
from retrain.domain.errors import Retry
from retrain.domain.events import ObjectArrival
from retrain.domain.runs import iso, now_iso
from retrain.ports import (
    ExportBook,
    ExportJob,
    ExportRefused,
    ExportState,
    ExportStatus,
    ObjectInfo,
    ObjectStore,
    Warehouse,
    Watermark,
)

log = logging.getLogger("retrain.exports")


#: Backoff after a failed export: the first retry after this, doubling with each failure, at most a day.
RETRY_AFTER_S, RETRY_AFTER_MAX_S = 60.0, 86400.0


class Progress(StrEnum):
    """What one step of a table's export did."""

    NOTHING_NEW = "nothing-new"
    """No row above the watermark (up to the export's start)."""
    RUNNING = "running"
    """A job is under way (just started, or still running): the next write or tick finishes it."""
    LANDED = "landed"
    """A job finished: its files are recorded as arrivals of ``dataset`` and the watermark moved."""
    FAILED = "failed"
    """A job failed, ran past its deadline or was refused: forgotten; the tick exports its rows again
    after a backoff."""
    DEFERRED = "deferred"
    """The next export waits (the tick starts it): the last ones failed and it waits out its backoff,
    or the new rows are stamped too recently to take yet."""
    TAKEN = "taken"
    """Another invocation finished the job first."""


@dataclass(frozen=True)
class Step:
    progress: Progress
    detail: str
    dataset: str = ""
    files: int = 0


def bigquery_files(destination: str) -> re.Pattern[str]:
    """Which object URIs a job wrote to ``destination``: the name taken literally, but for BigQuery's
    one wildcard, which it replaces by a 12-digit, zero-padded file number ("Exporting data into one or
    more files", cloud.google.com/bigquery/docs/exporting-data)."""
    head, star, tail = destination.partition("*")
    return re.compile(re.escape(head) + (r"[0-9]{12}" if star else "") + re.escape(tail))


def written_files(store: ObjectStore, destination: str) -> list[ObjectInfo]:
    """The objects a BigQuery job wrote to ``destination`` (see :func:`bigquery_files`), as listed."""
    files = bigquery_files(destination)
    return [info for info in store.list_objects(destination.split("*", 1)[0]) if files.fullmatch(info.uri)]


def arrival_of(info: ObjectInfo, event: str) -> ObjectArrival:
    """A listed object as an arrival, its event id ``event/name`` (it had no finalize event of its own)."""
    bucket, name = info.uri.removeprefix("gs://").split("/", 1)
    return ObjectArrival(
        event_id=f"{event}/{name}",
        bucket=bucket,
        name=name,
        generation=int(info.generation or 0),
        size=info.size,
        md5_hash=info.md5_hash or "",
        time=now_iso(),
    )


def export_folder(dataset: str, table: str) -> str:
    """The folder (in the artifacts bucket, ending in ``/``) where ``table``'s exports for ``dataset``
    land: its lineage names the table for what is under it."""
    return f"bigquery/{dataset}/{_safe_name(table)}/"


def _safe_name(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(value)).strip("-")[:80] or "x"


def retry_after(failures: int, now: datetime) -> str:
    """When the next export may start after ``failures`` in a row (exponential backoff)."""
    delay = min(RETRY_AFTER_S * 2 ** max(0, failures - 1), RETRY_AFTER_MAX_S)
    return iso(now + timedelta(seconds=delay))


class TableExports:
    """The export jobs of the watched tables, over the ports alone."""

    def __init__(
        self, settings: Settings, ledger: ExportBook, warehouse: Warehouse, store: ObjectStore
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.warehouse = warehouse
        self.store = store

    def on_write(self, table: str, dataset: str) -> Step:
        """A watched table was written: advance its export under way (whose end leaves what came after it
        to the next export), else start one for its new rows and wait for it a while (a small export
        lands within the handler)."""
        job = self.ledger.pending_export(table)
        if job is not None and self.ledger.want_export(table):
            return self.advance(job, wait_s=self.settings.bigquery_export_wait_s)
        started = self.start(table, dataset)
        if isinstance(started, Step):
            return started
        return self.advance(started, wait_s=self.settings.bigquery_export_wait_s)

    def on_job_done(self, job_id: str) -> Step:
        """BigQuery says export job ``job_id`` ended: finish (or forget) its export now; Retry when
        BigQuery does not show it yet (the event is redelivered)."""
        job = next((j for j in self.ledger.pending_exports() if j.job_id == job_id), None)
        if job is None:  # landed already (a seal it missed is the quiet period's), or forgotten
            return Step(Progress.TAKEN, f"export job {job_id} is no export under way")
        step = self.advance(job)
        if step.progress == Progress.RUNNING:
            raise Retry(f"{step.detail}; its end is not visible yet")
        return step

    def due(self) -> list[tuple[str, str]]:
        """Watched tables (and their datasets) with rows that may wait above the watermark (the last
        export took the most one job may, rows were stamped after its start, the table was written while
        it ran, or it failed), no export under way, and no backoff to wait out: the tick starts their
        next export."""
        now = iso(datetime.now(UTC))
        out = []
        for table, dataset in self.settings.watched_tables.items():
            mark = self.ledger.export_mark(table)
            if mark.backlog and mark.retry_after <= now and self.ledger.pending_export(table) is None:
                out.append((table, dataset))
        return out

    def resume(self, table: str, dataset: str) -> Step:
        """Start the next export of a table that is due (the tick leaves it to run)."""
        mark = self.ledger.export_mark(table)
        started = self.start(table, dataset)
        if isinstance(started, Step):
            if started.progress == Progress.NOTHING_NEW:  # (rows too recent to take keep it due)
                self.ledger.end_backlog(table, mark.value)
            return started
        return self._running(started, "under way")

    def start(self, table: str, dataset: str) -> ExportJob | Step:
        """Record, then start, a job exporting ``table``'s rows above its watermark; the Step when there
        is nothing to export, the table waits out a backoff or BigQuery refuses; the job under way when
        another invocation recorded one first (which then leaves these rows to the next export)."""
        s = self.settings
        mark = self.ledger.export_mark(table)
        now = datetime.now(UTC)
        if mark.failures and mark.retry_after > iso(now):
            return Step(
                Progress.DEFERRED,
                f"{table}: {mark.failures} export(s) failed; the next starts after {mark.retry_after}",
            )
        try:
            job = self._plan(table, dataset, mark, now)
        except ExportRefused as e:
            log.error("%s: export refused: %s", table, e)
            return Step(Progress.FAILED, f"{table}: export refused: {e}")
        if isinstance(job, Step):
            return job
        if self.ledger.begin_export(job):
            try:
                self.warehouse.start_export(job, s.bigquery_watermark_column, s.bigquery_export_timeout_s)
            except ExportRefused as e:
                return self._fail(job, f"refused: {e}")
            log.info("%s: export %s of rows in (%s, %s] started", table, job.job_id, job.after, job.through)
            return job
        other = self.ledger.pending_export(table)
        if other is not None and self.ledger.want_export(table):
            return other
        # Another export landed meanwhile and moved the watermark: what waits above it is the tick's.
        self.ledger.mark_backlog(table)
        return Step(Progress.TAKEN, f"{table}: another export moved the watermark; the tick goes on")

    def _plan(self, table: str, dataset: str, mark: Watermark, now: datetime) -> ExportJob | Step:
        """The job for ``table``'s rows above ``mark`` up to now (less the lag), at most a job's rows
        (halved for each failure in a row), or the Step when there are none."""
        s = self.settings
        column = s.bigquery_watermark_column
        location = self.warehouse.location(table, column)
        span = self.warehouse.export_range(
            table,
            column,
            after=mark.value,
            not_after=now - timedelta(seconds=s.bigquery_watermark_lag_s),
            max_rows=max(1, s.bigquery_export_max_rows >> min(mark.failures, 30)),
            max_step=s.bigquery_watermark_max_step,
        )
        if span.through is None or (mark.value is not None and span.through <= mark.value):
            if span.later is not None and not isinstance(span.later, datetime):
                # every new row lies more than the max step above: they wait for the rows between (the
                # next write looks again), or for the step to be raised; never taken blindly
                log.warning(
                    "%s: rows from %s=%s lie more than %s above %s: they wait (bigquery_watermark_max_step)",
                    table,
                    column,
                    span.later,
                    s.bigquery_watermark_max_step,
                    mark.value,
                )
                return Step(
                    Progress.NOTHING_NEW,
                    f"{table}: its new rows lie more than {s.bigquery_watermark_max_step} above "
                    f"{mark.value}: they wait",
                )
            if span.later is not None:  # every new row is stamped within the lag (or ahead)
                due_at = span.later + timedelta(seconds=s.bigquery_watermark_lag_s)
                self.ledger.mark_backlog(table, retry_after=iso(due_at))
                return Step(Progress.DEFERRED, f"{table}: its new rows are too recent; due at {iso(due_at)}")
            return Step(Progress.NOTHING_NEW, f"{table}: no rows after {mark.value}")
        job_id = f"{EXPORT_JOB_PREFIX}{uuid.uuid4().hex}"
        folder = f"{export_folder(dataset, table)}{_safe_name(span.through)}-{job_id[-8:]}"
        return ExportJob(
            table=table,
            dataset=dataset,
            job_id=job_id,
            location=location,
            after=mark.value,
            through=span.through,
            destination=f"gs://{s.artifacts_bucket}/{folder}/*.jsonl",
            started_at=iso(now),
            deadline=iso(now + timedelta(seconds=s.bigquery_export_timeout_s)),
            capped=span.capped,
        )

    def advance(self, job: ExportJob, wait_s: float = 0.0) -> Step:
        """Look at ``job`` (after waiting up to ``wait_s``): finish it when it is done, start it when its
        start was cut short, forget it when it failed, was refused or ran past its deadline."""
        overdue = datetime.now(UTC) >= datetime.fromisoformat(job.deadline)
        status = self.warehouse.export_status(job, wait_s)
        if status.state == ExportState.MISSING:
            if overdue:
                return self._fail(job, f"never started by its deadline {job.deadline}")
            try:
                s = self.settings
                self.warehouse.start_export(job, s.bigquery_watermark_column, s.bigquery_export_timeout_s)
            except ExportRefused as e:
                return self._fail(job, f"refused: {e}")
            return self._running(job, "started (its first start was cut short)")
        if status.state == ExportState.RUNNING:
            if not overdue:
                return self._running(job, "running")
            self.warehouse.cancel_export(job)
            status = self.warehouse.export_status(job)  # a cancel may come too late: it may be done
            if status.state == ExportState.RUNNING and not self._given_up(job):
                # forgotten only once it has stopped, so that nothing it writes is left behind
                return self._running(job, f"past its deadline {job.deadline}: cancelled, stopping")
            if status.state in (ExportState.RUNNING, ExportState.MISSING):
                return self._fail(job, f"still running at its deadline {job.deadline}: cancelled")
        if status.state == ExportState.FAILED:
            return self._fail(job, status.error)
        return self._finish(job, status, overdue)

    def _given_up(self, job: ExportJob) -> bool:
        """A cancelled job still running this long after its deadline is forgotten all the same."""
        deadline = datetime.fromisoformat(job.deadline)
        return datetime.now(UTC) >= deadline + timedelta(seconds=self.settings.bigquery_export_timeout_s)

    def _fail(self, job: ExportJob, reason: str) -> Step:
        """Forget ``job`` (unless another invocation finished it meanwhile), drop what it wrote, and
        leave its rows to the next export after a backoff."""
        failures = self.ledger.export_mark(job.table).failures + 1
        if not self.ledger.abandon_export(job, reason, retry_after(failures, datetime.now(UTC))):
            return Step(Progress.TAKEN, f"{job.table}: export {job.job_id} was ended by another invocation")
        self._drop_files(job)
        log.warning("%s: export %s failed (%d in a row): %s", job.table, job.job_id, failures, reason)
        return Step(
            Progress.FAILED,
            f"{job.table}: export {job.job_id} failed ({reason}); its rows go with the next export",
        )

    def _running(self, job: ExportJob, what: str) -> Step:
        return Step(
            Progress.RUNNING,
            f"{job.table}: export {job.job_id} of rows in ({job.after}, {job.through}] {what}",
        )

    def _finish(self, job: ExportJob, status: ExportStatus, overdue: bool) -> Step:
        written = written_files(self.store, job.destination)
        if status.files is not None and len(written) < status.files:  # a listing can trail the job
            if overdue:
                return self._fail(job, f"{len(written)} of its {status.files} files listed by its deadline")
            return self._running(job, f"done; {len(written)} of its {status.files} files listed so far")
        # (an empty file holds no rows: they were deleted since the range was read)
        arrivals = [
            arrival_of(info, job.job_id) for info in written if info.size and info.generation is not None
        ]
        if not self.ledger.finish_export(job, arrivals):
            return Step(Progress.TAKEN, f"{job.table}: export {job.job_id} was ended by another invocation")
        log.info(
            "%s: export %s of rows in (%s, %s] landed: %d file(s)",
            job.table,
            job.job_id,
            job.after,
            job.through,
            len(arrivals),
        )
        detail = f"{job.table}: rows in ({job.after}, {job.through}] landed in {len(arrivals)} file(s)"
        return Step(Progress.LANDED, detail, job.dataset, len(arrivals))

    def _drop_files(self, job: ExportJob) -> None:
        """What a failed job wrote before it failed: never recorded, so never trained."""
        for info in written_files(self.store, job.destination):
            self.store.delete(info.uri)
