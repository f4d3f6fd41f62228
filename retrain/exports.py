"""A watched BigQuery table's new rows, exported by bounded jobs.

A write to a watched table starts one ``EXPORT DATA`` job for the rows above the table's watermark
(never past the export's own start, at most ``bigquery_export_max_rows`` of them) into the artifacts
bucket, and records it first.  The job outlives no deadline: BigQuery stops it at its own time limit,
the handler waits for it only a share of its own timeout, and whoever comes next (the table's next
write, or the Scheduler's tick) finishes it: its files become arrivals and the watermark moves, in one
transaction.  A failed job (or one past its deadline, cancelled) is forgotten and its range exported
again; a crash between recording a job and starting it is finished by starting it then.
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
from retrain.domain.events import ObjectArrival
from retrain.domain.runs import iso, now_iso
from retrain.ports import ExportJob, ExportState, ExportStatus, Ledger, ObjectInfo, ObjectStore, Warehouse

log = logging.getLogger("retrain.exports")


class Progress(StrEnum):
    """What one step of a table's export did."""

    NOTHING_NEW = "nothing-new"
    """No row above the watermark (up to now)."""
    RUNNING = "running"
    """A job is under way (just started, or still running): the next write or tick finishes it."""
    LANDED = "landed"
    """A job finished: its files are recorded as arrivals of ``dataset`` and the watermark moved."""
    FAILED = "failed"
    """A job failed or ran past its deadline: forgotten, its rows go with the next export."""
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


def _safe_name(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(value)).strip("-")[:80] or "x"


class TableExports:
    """The export jobs of the watched tables, over the ports alone."""

    def __init__(self, settings: Settings, ledger: Ledger, warehouse: Warehouse, store: ObjectStore) -> None:
        self.settings = settings
        self.ledger = ledger
        self.warehouse = warehouse
        self.store = store

    def on_write(self, table: str, dataset: str) -> Step:
        """A watched table was written: advance its export under way, else start one for its new rows
        and wait for it a while (a small export lands within the handler)."""
        job = self.ledger.pending_export(table)
        if job is not None and self.ledger.want_export(table):  # its rows go with the next one
            return self.advance(job, wait_s=self.settings.bigquery_export_wait_s)
        started = self.start(table, dataset)
        if isinstance(started, Step):
            return started
        return self.advance(started, wait_s=self.settings.bigquery_export_wait_s)

    def backlogged(self) -> list[tuple[str, str]]:
        """Watched tables (and their datasets) whose last export left rows behind it (it took the most
        one job may, or the table was written while it ran) and that have no export under way: the
        Scheduler's tick starts their next one."""
        return [
            (table, dataset)
            for table, dataset in self.settings.watched_tables.items()
            if self.ledger.export_backlog(table) and self.ledger.pending_export(table) is None
        ]

    def resume(self, table: str, dataset: str) -> Step:
        """Start the next export of a backlogged table (the tick leaves it to run)."""
        started = self.start(table, dataset)
        if isinstance(started, Step):
            if started.progress == Progress.NOTHING_NEW:
                self.ledger.end_backlog(table)
            return started
        return self._running(started, "started")

    def start(self, table: str, dataset: str) -> ExportJob | Step:
        """Record, then start, a job exporting ``table``'s rows above its watermark; the Step when there
        is nothing to export, or the job another invocation recorded first."""
        s = self.settings
        after = self.ledger.watermark(table)
        now = datetime.now(UTC)
        column = s.bigquery_watermark_column
        span = self.warehouse.export_range(
            table, column, after=after, not_after=now, max_rows=s.bigquery_export_max_rows
        )
        if span.through is None or (after is not None and span.through <= after):
            return Step(Progress.NOTHING_NEW, f"{table}: no rows after {after}")
        job_id = f"retrain-export-{uuid.uuid4().hex}"
        folder = f"bigquery/{dataset}/{_safe_name(table)}/{_safe_name(span.through)}-{job_id[-8:]}"
        job = ExportJob(
            table=table,
            dataset=dataset,
            job_id=job_id,
            location=self.warehouse.location(table),
            after=after,
            through=span.through,
            destination=f"gs://{s.artifacts_bucket}/{folder}/*.jsonl",
            started_at=iso(now),
            deadline=iso(now + timedelta(seconds=s.bigquery_export_timeout_s)),
            capped=span.capped,
        )
        if not self.ledger.begin_export(job):
            other = self.ledger.pending_export(table)
            if other is None:  # the watermark moved under us: its rows were exported by another job
                return Step(Progress.TAKEN, f"{table}: another export moved the watermark past {after}")
            return other
        self.warehouse.start_export(job, column, s.bigquery_export_timeout_s)
        log.info("%s: export %s of rows in (%s, %s] started", table, job_id, after, span.through)
        return job

    def advance(self, job: ExportJob, wait_s: float = 0.0) -> Step:
        """Look at ``job`` (after waiting up to ``wait_s``): finish it when it is done, start it when its
        start was cut short, forget it when it failed or ran past its deadline."""
        status = self.warehouse.export_status(job, wait_s)
        if status.state == ExportState.MISSING:
            self.warehouse.start_export(
                job, self.settings.bigquery_watermark_column, self.settings.bigquery_export_timeout_s
            )
            return self._running(job, "started (its first start was cut short)")
        if status.state == ExportState.RUNNING:
            if datetime.now(UTC) < datetime.fromisoformat(job.deadline):
                return self._running(job, "running")
            self.warehouse.cancel_export(job)
            status = ExportStatus(
                ExportState.FAILED, error=f"still running at its deadline {job.deadline}: cancelled"
            )
        if status.state == ExportState.FAILED:
            self._drop_files(job)
            self.ledger.abandon_export(job, status.error)
            log.warning("%s: export %s failed: %s", job.table, job.job_id, status.error)
            return Step(
                Progress.FAILED,
                f"{job.table}: export {job.job_id} failed ({status.error}); its rows go with the next export",
            )
        return self._finish(job, status)

    def _running(self, job: ExportJob, what: str) -> Step:
        return Step(
            Progress.RUNNING,
            f"{job.table}: export {job.job_id} of rows in ({job.after}, {job.through}] {what}",
        )

    def _written(self, job: ExportJob) -> list[ObjectInfo]:
        files = bigquery_files(job.destination)
        listed = self.store.list_objects(job.destination.split("*", 1)[0])
        return [info for info in listed if files.fullmatch(info.uri)]

    def _finish(self, job: ExportJob, status: ExportStatus) -> Step:
        written = self._written(job)
        if status.files is not None and len(written) < status.files:  # a listing can trail the job
            return self._running(job, f"done; {len(written)} of its {status.files} files listed so far")
        arrivals = []
        for info in written:
            if not info.size or info.generation is None:  # no rows (deleted since the range was read)
                continue
            bucket, name = info.uri.removeprefix("gs://").split("/", 1)
            arrivals.append(
                ObjectArrival(
                    event_id=f"{job.job_id}/{name}",
                    bucket=bucket,
                    name=name,
                    generation=info.generation,
                    size=info.size,
                    md5_hash=info.md5_hash or "",
                    time=now_iso(),
                )
            )
        if not self.ledger.finish_export(job, arrivals):
            return Step(
                Progress.TAKEN, f"{job.table}: export {job.job_id} was finished by another invocation"
            )
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
        for info in self._written(job):
            self.store.delete(info.uri)
