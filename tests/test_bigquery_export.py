"""A watched BigQuery table's new rows become landed objects and a run, through bounded EXPORT DATA jobs:
the BigQuery emulator (optional tier; its exported files reach the GCS emulator through
retrain_local.bigquery_gcs), the real Firestore and GCS emulators, and the trigger served by
functions-framework, fed the recorded audit-log deliveries of tests/events/bigquery.  What a write's
handler leaves unfinished, the Scheduler's tick (Ingest.sweep) finishes."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests

from cloudworkflows import ExecutionsServer
from retrain import config
from retrain.adapters import objects
from retrain.adapters.ledger import FirestoreLedger
from retrain.adapters.ledger.base import _key
from retrain.adapters.warehouse import BigQueryWarehouse
from retrain.adapters.workflows import WorkflowsExecutions
from retrain.domain.errors import Retry
from retrain.domain.runs import RunStatus, iso
from retrain.exports import Progress, TableExports
from retrain.ingest import Action, Ingest
from retrain.ports import ExportJob, ExportRefused, ExportState, ExportStatus, RowRange, Watermark

if TYPE_CHECKING:
    from conftest import ServedFunction

pytestmark = pytest.mark.emulators

EVENTS = Path(__file__).parent / "events" / "bigquery"
TABLE = "proj.sales.orders"  # the table the recorded events name
T0 = dt.datetime(2026, 11, 20, 12, 0, tzinfo=dt.UTC)


def progress(mark: Watermark) -> tuple[object, bool, int, str]:
    """What a watermark says of the next export: (value, backlog, failures, retry_after)."""
    return (mark.value, mark.backlog, mark.failures, mark.retry_after)


def post(url: str, name: str) -> requests.Response:
    d = json.loads((EVENTS / f"{name}.json").read_text())
    return requests.post(url, headers=d["headers"], data=json.dumps(d["body"]), timeout=120)


@pytest.fixture(scope="module")
def warehouse(bigquery_host: str) -> BigQueryWarehouse:
    from google.cloud import bigquery

    w = BigQueryWarehouse("proj")
    w.client.create_dataset("sales", exists_ok=True)
    schema = [
        bigquery.SchemaField("id", "INT64"),
        bigquery.SchemaField("text", "STRING"),
        bigquery.SchemaField("price", "NUMERIC"),
        bigquery.SchemaField("ingested_at", "TIMESTAMP"),
    ]
    w.client.create_table(bigquery.Table(TABLE, schema=schema), exists_ok=True)
    return w


def insert(w: BigQueryWarehouse, ids: range) -> None:
    rows = [
        {
            "id": i,
            "text": f"order {i}",
            "price": f"{i}.50",
            "ingested_at": (T0 + dt.timedelta(seconds=i)).isoformat(),
        }
        for i in ids
    ]
    assert w.client.insert_rows_json(TABLE, rows) == []


def lines(uri: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in objects.read_bytes(uri).splitlines()]


@pytest.fixture(scope="module")
def function(
    serve_function: Callable[..., ServedFunction], warehouse: BigQueryWarehouse, bigquery_host: str
) -> ServedFunction:
    return serve_function(
        "on_bigquery_event", BIGQUERY_EMULATOR_HOST=bigquery_host, RETRAIN_BIGQUERY_TABLES=f"{TABLE}=orders"
    )


def make_table(w: BigQueryWarehouse, table: str) -> str:
    from google.cloud import bigquery

    schema = [
        bigquery.SchemaField("id", "INT64"),
        bigquery.SchemaField("text", "STRING"),
        bigquery.SchemaField("ingested_at", "TIMESTAMP"),
    ]
    w.client.delete_table(table, not_found_ok=True)
    w.client.create_table(bigquery.Table(table, schema=schema))
    return table


def add_rows(w: BigQueryWarehouse, table: str, stamps: dict[int, dt.datetime]) -> None:
    rows = [{"id": i, "text": f"row {i}", "ingested_at": at.isoformat()} for i, at in stamps.items()]
    assert w.client.insert_rows_json(table, rows) == []


class Killed(BaseException):
    """The process dies."""


class KilledAtStart(BigQueryWarehouse):
    def start_export(self, job: ExportJob, column: str, timeout_s: float) -> None:
        raise Killed


class StartLost(BigQueryWarehouse):
    def start_export(self, job: ExportJob, column: str, timeout_s: float) -> None:
        pass


def exported_ids(artifacts: str, folder: str) -> list[int]:
    """Every row id in the files under ``folder`` (JSON exports write INT64 as strings on Google)."""
    return sorted(
        int(r["id"]) for o in objects.list_objects(f"gs://{artifacts}/{folder}") for r in lines(o.uri)
    )


@pytest.fixture
def ingest(
    warehouse: BigQueryWarehouse, firestore_host: str, held_executions: ExecutionsServer, project: str
) -> Ingest:
    """The handlers in this process, on a fresh project, watching proj.sales.backlog and proj.sales.gone."""
    settings = dataclasses.replace(
        config.load({}),
        project=project,
        artifacts_bucket=f"art-{project}",
        bigquery_tables="proj.sales.backlog=backlog,proj.sales.gone=gone",
        bigquery_export_max_rows=3,
    )
    objects.storage_client().create_bucket(settings.artifacts_bucket)
    orchestrator = WorkflowsExecutions(
        project,
        settings.region,
        settings.workflow,
        held_executions.base_url,
        grpc_endpoint=held_executions.grpc_target,
    )
    return Ingest(settings, FirestoreLedger(project), orchestrator, objects, warehouse)


def test_an_export_range_stops_at_now_and_at_the_row_bound(warehouse: BigQueryWarehouse) -> None:
    table = make_table(warehouse, "proj.sales.ranges")
    add_rows(warehouse, table, {i: T0 + dt.timedelta(seconds=i) for i in range(10)})
    add_rows(warehouse, table, {50: T0 + dt.timedelta(seconds=4)})  # shares its stamp with row 4
    add_rows(warehouse, table, {99: dt.datetime(2099, 1, 1, tzinfo=dt.UTC)})  # stamped far in the future
    column, now = "ingested_at", dt.datetime.now(dt.UTC)
    # unbounded, MAX would take the future row and hide every row still to come behind it
    future = dt.datetime(2099, 1, 1, tzinfo=dt.UTC)
    assert warehouse.export_range(table, column) == RowRange(future)
    # the future row waits for its time: the range says rows wait above it, and from when
    assert warehouse.export_range(table, column, not_after=now) == RowRange(
        T0 + dt.timedelta(seconds=9), True, future
    )
    # at most max_rows rows, but rows sharing the last value come along (rows 0-3, then 4 and 50)
    assert warehouse.export_range(table, column, not_after=now, max_rows=4) == RowRange(
        T0 + dt.timedelta(seconds=3), capped=True, later=future
    )
    assert warehouse.export_range(table, column, not_after=now, max_rows=5) == RowRange(
        T0 + dt.timedelta(seconds=4), capped=True, later=future
    )
    after = T0 + dt.timedelta(seconds=4)
    assert warehouse.export_range(table, column, after=after, max_rows=7) == RowRange(future)
    last = T0 + dt.timedelta(seconds=9)
    assert warehouse.export_range(table, column, after=last, not_after=now) == RowRange(None, True, future)
    assert warehouse.export_range(table, "id", after=9, not_after=now, max_rows=1) == RowRange(50, True)
    with pytest.raises(ValueError, match=r"not project\.dataset\.table"):
        warehouse.export_range("proj.sales.orders`; DROP TABLE x; --", column)
    # only a TIMESTAMP or INT64 column may be a watermark (one that grows, and that the ledger keeps)
    assert warehouse.location(table, column) == (warehouse.client.get_table(table).location or "")
    with pytest.raises(ExportRefused, match=r"ranges\.text is STRING: a watermark is TIMESTAMP or INT64"):
        warehouse.location(table, "text")
    with pytest.raises(ExportRefused, match="has no column 'nope'"):
        warehouse.location(table, "nope")
    with pytest.raises(ExportRefused, match="Not found"):
        warehouse.location("proj.sales.never", column)


def test_an_int64_watermark_moves_at_most_its_max_step(ingest: Ingest, warehouse: BigQueryWarehouse) -> None:
    """One row with a huge id would move an INT64 watermark past every row still to come (the time bound
    guards only TIMESTAMP): it moves at most max_step past the last export (on a first export, past the
    smallest id), and rows beyond wait, with a warning, for the ids between or a larger step."""
    table = make_table(warehouse, "proj.sales.ids")
    poison = 2**62
    add_rows(warehouse, table, {**{i: T0 for i in range(1, 6)}, 40: T0, poison: T0})
    assert warehouse.export_range(table, "id") == RowRange(poison)  # unbounded: the poison wins
    assert warehouse.export_range(table, "id", max_step=20) == RowRange(5, True, 40)  # from the smallest, 1
    assert warehouse.export_range(table, "id", after=5, max_step=20) == RowRange(None, True, 40)
    assert warehouse.export_range(table, "id", after=5, max_step=50) == RowRange(40, True, poison)
    assert warehouse.export_range(table, "id", after=5, max_step=20, max_rows=1) == RowRange(None, True, 40)
    # through the exports: the watermark at 40, only the poison above it: nothing is exported
    settings = dataclasses.replace(
        ingest.settings, bigquery_watermark_column="id", bigquery_watermark_max_step=20
    )
    ingest.ledger.db.collection("watermarks").document(_key(table)).set({"value": 40})
    step = TableExports(settings, ingest.ledger, warehouse, objects).on_write(table, "ids")
    assert (step.progress, step.detail) == (
        Progress.NOTHING_NEW,
        f"{table}: its new rows lie more than 20 above 40: they wait",
    )
    assert ingest.ledger.export_mark(table).value == 40 and ingest.ledger.pending_export(table) is None


def test_a_table_write_exports_only_new_rows_then_seals(
    function: ServedFunction, warehouse: BigQueryWarehouse
) -> None:
    url, log, artifacts = function.url, function.log, function.artifacts
    ledger = FirestoreLedger(function.project)
    assert ledger.watermark(TABLE) is None
    insert(warehouse, range(0, 3))

    assert post(url, "table_data_change").status_code == 200
    (run,) = [r for r in ledger.list_runs() if r.dataset == "orders"]
    assert run.trigger == "bigquery" and run.objects == 1
    manifest = json.loads(objects.read_bytes(f"gs://{artifacts}/runs/{run.run_id}/objects.json"))
    (first,) = [o["uri"] for o in manifest["objects"]]
    assert first.startswith(f"gs://{artifacts}/bigquery/orders/proj.sales.orders/")
    assert first.endswith("/000000000000.jsonl")  # BigQuery's wildcard, filled in
    exported = lines(first)
    assert [int(r["id"]) for r in exported] == [0, 1, 2]  # every row, in watermark order
    assert [Decimal(r["price"]) for r in exported] == [Decimal("0.50"), Decimal("1.50"), Decimal("2.50")]
    assert ledger.pending_export(TABLE) is None

    # The same load also arrives as a jobChange: nothing is new, nothing is written twice.
    assert post(url, "load_done").status_code == 200
    assert "nothing-new" in log.read_text().splitlines()[-1]

    insert(warehouse, range(200, 202))  # a later load
    assert post(url, "table_data_change").status_code == 200
    runs = [r for r in ledger.list_runs() if r.dataset == "orders"]
    assert len(runs) == 2 and runs[1].status == "pending"  # queued behind the live first run
    assert exported_ids(artifacts, "bigquery/orders/") == [0, 1, 2, 200, 201]  # only the new rows, once
    assert ledger.watermark(TABLE) == T0 + dt.timedelta(seconds=201)


def test_a_backlog_is_exported_by_bounded_jobs_in_turn(ingest: Ingest, warehouse: BigQueryWarehouse) -> None:
    table = make_table(warehouse, "proj.sales.backlog")
    add_rows(warehouse, table, {i: T0 + dt.timedelta(seconds=i) for i in range(7)})
    artifacts, ledger = ingest.settings.artifacts_bucket, ingest.ledger

    exports = TableExports(ingest.settings, ledger, warehouse, objects)
    first = exports.on_write(table, "backlog")  # the most one job may take: 3 rows
    assert (first.progress, first.files) == (Progress.LANDED, 1)
    assert exported_ids(artifacts, "bigquery/backlog/") == [0, 1, 2]
    assert progress(ledger.export_mark(table)) == (T0 + dt.timedelta(seconds=2), True, 0, "")
    live = ingest.seal("backlog", "bigquery")
    assert live.action == Action.STARTED

    # A tick starts the next bounded job; the next finishes it (its rows join a pending run, which
    # waits behind the live one) and starts the one after.
    assert [o.action for o in ingest.sweep()] == [Action.EXPORTING]
    assert [o.action for o in ingest.sweep()] == [Action.QUEUED, Action.EXPORTING]
    assert ledger.watermark(table) == T0 + dt.timedelta(seconds=5)
    assert [o.action for o in ingest.sweep()] == [Action.QUEUED, Action.QUEUED]  # the pending run waits
    assert progress(ledger.export_mark(table)) == (
        T0 + dt.timedelta(seconds=6),
        False,
        0,
        "",
    )  # nothing waits
    assert exported_ids(artifacts, "bigquery/backlog/") == list(range(7))  # every row once
    assert ledger.pending_export(table) is None
    assert [o.action for o in ingest.sweep()] == [Action.QUEUED]  # only the pending run, waiting
    (pending,) = [r for r in ledger.list_runs() if r.dataset == "backlog" and r.run_id != live.run_id]
    assert pending.status == RunStatus.PENDING and len(ledger.run_objects(pending)) == 2  # jobs 2 and 3


def test_an_export_cut_short_before_its_job_started_is_started_then_finished_by_the_tick(
    ingest: Ingest, warehouse: BigQueryWarehouse
) -> None:
    table = make_table(warehouse, "proj.sales.backlog")
    add_rows(warehouse, table, {i: T0 + dt.timedelta(seconds=i) for i in range(2)})
    dying = TableExports(ingest.settings, ingest.ledger, KilledAtStart("proj", warehouse.client), objects)
    with pytest.raises(Killed):  # the handler dies after recording the job, before BigQuery has it
        dying.on_write(table, "backlog")
    job = ingest.ledger.pending_export(table)
    assert job is not None and warehouse.export_status(job).state == ExportState.MISSING

    (restarted,) = ingest.sweep()
    assert restarted.action == Action.EXPORTING and "its first start was cut short" in restarted.detail
    (landed,) = ingest.sweep()
    assert landed.action == Action.STARTED  # the run of its rows
    assert exported_ids(ingest.settings.artifacts_bucket, "bigquery/backlog/") == [0, 1]
    assert ingest.ledger.watermark(table) == T0 + dt.timedelta(seconds=1)


def test_a_failed_export_is_forgotten_and_its_rows_go_with_the_next_ones_after_a_backoff(
    ingest: Ingest, warehouse: BigQueryWarehouse
) -> None:
    table = make_table(warehouse, "proj.sales.gone")
    add_rows(warehouse, table, {1: T0})
    lost = TableExports(ingest.settings, ingest.ledger, StartLost("proj", warehouse.client), objects)
    assert lost.on_write(table, "gone").progress == Progress.RUNNING  # recorded; its start never arrived
    job = ingest.ledger.pending_export(table)
    assert job is not None
    partial = job.destination.replace("*", "000000000000")  # what a failing job may leave behind
    objects.write_bytes(partial, b'{"id": 1, "text": "half"}\n')
    warehouse.client.delete_table(table)  # so the job BigQuery runs now fails
    assert [o.action for o in ingest.sweep()] == [Action.EXPORTING]
    (failed,) = ingest.sweep()
    assert failed.action == Action.EXPORT_FAILED and "its rows go with the next export" in failed.detail
    assert ingest.ledger.pending_export(table) is None and ingest.ledger.watermark(table) is None
    assert list(objects.list_objects(f"gs://{ingest.settings.artifacts_bucket}/bigquery/gone/")) == []
    mark = ingest.ledger.export_mark(table)
    assert (mark.backlog, mark.failures) == (True, 1) and mark.retry_after > iso(dt.datetime.now(dt.UTC))

    make_table(warehouse, table)
    add_rows(warehouse, table, {1: T0, 2: T0 + dt.timedelta(seconds=1)})
    exports = TableExports(ingest.settings, ingest.ledger, warehouse, objects)
    deferred = exports.on_write(table, "gone")  # within the backoff: nothing starts
    assert deferred.progress == Progress.DEFERRED and mark.retry_after in deferred.detail
    assert ingest.sweep() == []
    # The backoff over, the tick exports the rows, half as many per job after one failure.
    ingest.ledger.db.collection("watermarks").document(_key(table)).update({"retry_after": iso(T0)})
    assert [o.action for o in ingest.sweep()] == [Action.EXPORTING]
    # row 1 landed (1 row of 3: halved), so row 2 waits, and its export starts at once
    assert [o.action for o in ingest.sweep()] == [Action.STARTED, Action.EXPORTING]
    mark = ingest.ledger.export_mark(table)
    assert (mark.value, mark.failures) == (T0, 0)  # landed: the failures are forgotten
    assert [o.action for o in ingest.sweep()] == [Action.QUEUED]  # row 2, behind the live run
    assert exported_ids(ingest.settings.artifacts_bucket, "bigquery/gone/") == [1, 2]


def test_an_export_refused_by_bigquery_says_why(ingest: Ingest, warehouse: BigQueryWarehouse) -> None:
    from google.cloud import bigquery

    table = "proj.sales.gone"
    warehouse.client.delete_table(table, not_found_ok=True)
    schema = [bigquery.SchemaField("text", "STRING"), bigquery.SchemaField("ingested_at", "STRING")]
    warehouse.client.create_table(bigquery.Table(table, schema=schema))
    refused = TableExports(ingest.settings, ingest.ledger, warehouse, objects).on_write(table, "gone")
    assert refused.progress == Progress.FAILED
    assert "gone.ingested_at is STRING: a watermark is TIMESTAMP or INT64" in refused.detail
    assert ingest.ledger.pending_export(table) is None


class Overdue(BigQueryWarehouse):
    """BigQuery reports the job running (past its deadline) until it is cancelled; ``cancel_too_late``:
    the job had finished all the same (a cancel may lose that race)."""

    cancelled: list[str]
    cancel_too_late = False

    def export_status(self, job: ExportJob, wait_s: float = 0.0) -> ExportStatus:
        if self.cancel_too_late and job.job_id in self.cancelled:
            return super().export_status(job, wait_s)
        return ExportStatus(ExportState.RUNNING)

    def cancel_export(self, job: ExportJob) -> None:
        self.cancelled.append(job.job_id)
        super().cancel_export(job)


@pytest.mark.parametrize("cancel_too_late", [False, True])
def test_an_export_past_its_deadline_is_cancelled(
    ingest: Ingest, warehouse: BigQueryWarehouse, cancel_too_late: bool
) -> None:
    table = make_table(warehouse, "proj.sales.backlog")
    add_rows(warehouse, table, {1: T0})
    bigquery = Overdue("proj", warehouse.client)
    bigquery.cancelled, bigquery.cancel_too_late = [], cancel_too_late
    exports = TableExports(ingest.settings, ingest.ledger, bigquery, objects)
    started = exports.start(table, "backlog")
    assert isinstance(started, ExportJob)
    assert exports.advance(started).progress == Progress.RUNNING and bigquery.cancelled == []
    just_past = dataclasses.replace(started, deadline=iso(dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)))
    first = exports.advance(just_past)
    assert bigquery.cancelled == [started.job_id]
    folder = f"gs://{ingest.settings.artifacts_bucket}/bigquery/backlog/"
    if cancel_too_late:  # it had finished: what it wrote lands
        assert first.progress == Progress.LANDED and ingest.ledger.watermark(table) == T0
        assert exported_ids(ingest.settings.artifacts_bucket, "bigquery/backlog/") == [1]
    else:  # kept until it stops, so that nothing it still writes is left behind
        assert first.progress == Progress.RUNNING and "cancelled, stopping" in first.detail
        assert ingest.ledger.pending_export(table) == started
        long_past = dataclasses.replace(started, deadline=iso(T0))  # forgotten all the same
        step = exports.advance(long_past)
        assert step.progress == Progress.FAILED and "still running at its deadline" in step.detail
        assert ingest.ledger.watermark(table) is None and list(objects.list_objects(folder)) == []


def test_rows_written_while_an_export_is_under_way_go_with_the_next_one(
    ingest: Ingest, warehouse: BigQueryWarehouse
) -> None:
    table = make_table(warehouse, "proj.sales.gone")
    add_rows(warehouse, table, {1: T0})
    lost = TableExports(ingest.settings, ingest.ledger, StartLost("proj", warehouse.client), objects)
    assert lost.on_write(table, "gone").progress == Progress.RUNNING  # under way: rows up to T0
    add_rows(warehouse, table, {2: T0 + dt.timedelta(seconds=1)})
    exports = TableExports(ingest.settings, ingest.ledger, warehouse, objects)
    under_way = ingest.ledger.pending_export(table)
    assert exports.start(table, "gone") == under_way  # a start racing it takes it, and wants more
    assert (ingest.ledger.db.collection("exports").document(_key(table)).get().to_dict() or {})["wanted"]
    second = exports.on_write(table, "gone")
    assert second.progress == Progress.RUNNING and "first start was cut short" in second.detail

    # The tick lands the first job's row and, the table having been written meanwhile, starts the next.
    assert [o.action for o in ingest.sweep()] == [Action.STARTED, Action.EXPORTING]
    assert [o.action for o in ingest.sweep()] == [Action.QUEUED]  # row 2 landed, behind the live run
    assert exported_ids(ingest.settings.artifacts_bucket, "bigquery/gone/") == [1, 2]
    assert progress(ingest.ledger.export_mark(table)) == (T0 + dt.timedelta(seconds=1), False, 0, "")
    assert [o.action for o in ingest.sweep()] == [Action.QUEUED]


def test_the_end_of_an_export_job_finishes_its_export_at_once(
    ingest: Ingest, warehouse: BigQueryWarehouse
) -> None:
    """The export job's own jobChange to DONE (its audit log, recorded in export_data_done.json) lands
    its rows without waiting for the tick."""
    table = make_table(warehouse, "proj.sales.backlog")
    add_rows(warehouse, table, {1: T0})
    delivery = json.loads((EVENTS / "export_data_done.json").read_text())
    attributes = {k[3:]: v for k, v in delivery["headers"].items() if k.startswith("ce-")}
    job_id = attributes["resourcename"].rsplit("/", 1)[1]
    # the export, as a write's handler records and starts it (under the id the recorded event names)
    location = warehouse.location(table, "ingested_at")
    job = ExportJob(
        table=table,
        dataset="backlog",
        job_id=job_id,
        location=location,
        after=None,
        through=T0,
        destination=f"gs://{ingest.settings.artifacts_bucket}/bigquery/backlog/done/*.jsonl",
        started_at=iso(dt.datetime.now(dt.UTC)),
        deadline=iso(dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)),
    )
    assert ingest.ledger.begin_export(job)
    warehouse.start_export(job, "ingested_at", 3600)
    own = delivery["body"]["protoPayload"]["authenticationInfo"]["principalEmail"]
    handler = Ingest(
        dataclasses.replace(ingest.settings, functions_service_account=own),
        ingest.ledger,
        ingest.orchestrator,
        objects,
        warehouse,
    )
    landed = handler.on_bigquery_event(attributes, delivery["body"])
    assert landed.action == Action.STARTED and ingest.ledger.watermark(table) == T0
    assert exported_ids(ingest.settings.artifacts_bucket, "bigquery/backlog/") == [1]
    again = handler.on_bigquery_event(attributes, delivery["body"])  # delivered twice
    assert again.action == Action.DUPLICATE and "no export under way" in again.detail


def test_an_export_jobs_end_that_bigquery_does_not_show_yet_is_retried(
    ingest: Ingest, warehouse: BigQueryWarehouse
) -> None:
    table = make_table(warehouse, "proj.sales.backlog")
    add_rows(warehouse, table, {1: T0})
    still = Overdue("proj", warehouse.client)  # BigQuery still reports it running
    still.cancelled = []
    exports = TableExports(ingest.settings, ingest.ledger, still, objects)
    job = exports.start(table, "backlog")
    assert isinstance(job, ExportJob)
    with pytest.raises(Retry, match="its end is not visible yet"):  # the event is delivered again
        exports.on_job_done(job.job_id)
    assert ingest.ledger.pending_export(table) == job
    landed = TableExports(ingest.settings, ingest.ledger, warehouse, objects).on_job_done(job.job_id)
    assert landed.progress == Progress.LANDED


def test_rows_stamped_within_the_lag_wait_and_the_tick_takes_them(
    ingest: Ingest, warehouse: BigQueryWarehouse
) -> None:
    """A load stamps its rows as it starts and its event comes seconds later: rows that recent wait
    (another writer may still commit rows stamped before them), and the table is due once they may be
    taken, not before (no query every tick meanwhile)."""
    table = make_table(warehouse, "proj.sales.backlog")
    stamp = dt.datetime.now(dt.UTC)
    add_rows(warehouse, table, {1: stamp})
    waiting = TableExports(ingest.settings, ingest.ledger, warehouse, objects).on_write(table, "backlog")
    assert waiting.progress == Progress.DEFERRED and "too recent" in waiting.detail
    due_at = iso(stamp + dt.timedelta(seconds=ingest.settings.bigquery_watermark_lag_s))
    assert progress(ingest.ledger.export_mark(table)) == (None, True, 0, due_at)
    assert ingest.sweep() == []  # not due yet
    # The lag over (the stored time moved back, and the tick's lag is none), the tick takes them.
    ingest.ledger.db.collection("watermarks").document(_key(table)).update({"retry_after": iso(T0)})
    settings = dataclasses.replace(ingest.settings, bigquery_watermark_lag_s=0.0)
    later = Ingest(settings, ingest.ledger, ingest.orchestrator, objects, warehouse)
    assert [o.action for o in later.sweep()] == [Action.EXPORTING]
    assert [o.action for o in later.sweep()] == [Action.STARTED]
    assert exported_ids(settings.artifacts_bucket, "bigquery/backlog/") == [1]
