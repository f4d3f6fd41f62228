"""Arrivals: an object landing in the bucket, or a watched BigQuery table's new rows exported there, recorded
in its dataset's open batch (deduplicated, contention-free); a seal marker, or an export's files landed,
seal the batch (:mod:`.starts`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from retrain.domain.bigquery_events import (
    ExportFinished,
    NotRelevant,
    OwnExportDone,
    TableWritten,
    parse_bigquery_audit,
)
from retrain.domain.errors import Rejected, Retry
from retrain.domain.events import ObjectArrival, check_object_name, parse_gcs_finalized
from retrain.domain.runs import Trigger
from retrain.exports import Progress, Step, TableExports, arrival_of, written_files
from retrain.ingest.context import Context, Job
from retrain.ingest.outcomes import Action, Outcome
from retrain.ingest.starts import Starts
from retrain.ports import ArrivalStatus

log = logging.getLogger("retrain.ingest")


class Arrivals(Job):
    """Objects landing in the bucket and a watched table's new rows, recorded; sealed once landed."""

    def __init__(self, ctx: Context, starts: Starts) -> None:
        super().__init__(ctx)
        self.starts = starts

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
            return self.starts.seal(dataset, Trigger.GCS_MARKER)
        return self._record(arrival, dataset)

    def _record(self, arrival: ObjectArrival, dataset: str) -> Outcome:
        if (
            self.ledger.record_arrival(arrival, dataset, arrival.content_hash).status
            == ArrivalStatus.DUPLICATE
        ):
            return Outcome(Action.DUPLICATE, arrival.identity)
        return Outcome(Action.RECORDED, f"{arrival.uri} -> dataset {dataset}")

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
            return self.export_step(self.exports().on_job_done, change.job_id)
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
        return self.starts.seal(dataset, Trigger.BIGQUERY_EXPORT)

    def _export_new_rows(self, written: TableWritten) -> Outcome:
        """Export the rows the table gained since its watermark (a bounded job: :mod:`retrain.exports`)
        and seal them once they have landed."""
        dataset = self.settings.watched_tables.get(written.table)
        if dataset is None:
            return Outcome(Action.IGNORED, f"table {written.table} is not watched")
        return self.export_step(self.exports().on_write, written.table, dataset)

    def exports(self) -> TableExports:
        if self.warehouse is None:
            raise Retry("a watched table changed but no BigQuery warehouse is configured")
        return TableExports(self.settings, self.ledger, self.warehouse, self.store)

    def export_step(self, do: Callable[..., Step], *args: Any) -> Outcome:
        """Take one step of an export (``do(*args)``); seal what it landed."""
        step = do(*args)
        if step.progress == Progress.LANDED and step.files:
            return self.starts.seal(step.dataset, Trigger.BIGQUERY)
        action = {
            Progress.RUNNING: Action.EXPORTING,
            Progress.FAILED: Action.EXPORT_FAILED,
            Progress.DEFERRED: Action.EXPORT_DEFERRED,
            Progress.TAKEN: Action.DUPLICATE,
        }.get(step.progress, Action.NOTHING_NEW)
        return Outcome(action, step.detail)
