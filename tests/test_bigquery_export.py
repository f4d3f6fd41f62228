"""A watched BigQuery table's new rows become a landed object and a run: the BigQuery emulator (optional
tier), the real Firestore and GCS emulators, and the trigger served by functions-framework, fed the
recorded audit-log deliveries of tests/events/bigquery."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests

from retrain.adapters import objects
from retrain.adapters.ledger import FirestoreLedger
from retrain.adapters.warehouse import BigQueryWarehouse

if TYPE_CHECKING:
    from conftest import ServedFunction

pytestmark = pytest.mark.emulators

EVENTS = Path(__file__).parent / "events" / "bigquery"
TABLE = "proj.sales.orders"  # the table the recorded events name
T0 = dt.datetime(2026, 11, 20, 12, 0, tzinfo=dt.UTC)


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


def test_the_warehouse_reads_ranges_in_watermark_order(warehouse: BigQueryWarehouse, gcs_host: str) -> None:
    insert(warehouse, range(100, 104))
    hi = warehouse.high_watermark(TABLE, "ingested_at")
    assert hi == T0 + dt.timedelta(seconds=103)
    middle = list(
        warehouse.rows(TABLE, "ingested_at", T0 + dt.timedelta(seconds=100), T0 + dt.timedelta(seconds=102))
    )
    assert [r["id"] for r in middle] == [101, 102]
    bucket = f"exp-{uuid.uuid4().hex[:8]}"
    objects.storage_client().create_bucket(bucket)
    n = warehouse.export(TABLE, f"gs://{bucket}/x.jsonl", "id", 101, 103)
    exported = lines(f"gs://{bucket}/x.jsonl")
    assert n == 2 and [(r["id"], r["text"], r["ingested_at"]) for r in exported] == [
        (102, "order 102", "2026-11-20T12:01:42+00:00"),
        (103, "order 103", "2026-11-20T12:01:43+00:00"),
    ]
    assert [Decimal(r["price"]) for r in exported] == [Decimal("102.5"), Decimal("103.5")]  # NUMERIC, exact
    assert warehouse.high_watermark("proj.sales.orders", "id") >= 103
    with pytest.raises(ValueError):
        warehouse.high_watermark("proj.sales.orders`; DROP TABLE x; --", "id")


def test_a_table_write_exports_only_new_rows_then_seals(
    function: ServedFunction, warehouse: BigQueryWarehouse
) -> None:
    url, log, artifacts = function.url, function.log, function.artifacts
    ledger = FirestoreLedger(function.project)
    watermark = ledger.watermark(TABLE)
    assert watermark is None
    insert(warehouse, range(0, 3))  # (the table also holds the rows of the test above)

    assert post(url, "table_data_change").status_code == 200
    (run,) = [r for r in ledger.list_runs() if r.dataset == "orders"]
    assert run.trigger == "bigquery" and run.objects == 1
    manifest = json.loads(objects.read_bytes(f"gs://{artifacts}/runs/{run.run_id}/objects.json"))
    (first,) = [o["uri"] for o in manifest["objects"]]
    assert first.startswith(f"gs://{artifacts}/bigquery/orders/proj.sales.orders/")
    exported = lines(first)
    assert [r["id"] for r in exported] == [0, 1, 2, 100, 101, 102, 103]  # every row, in watermark order

    # The same load also arrives as a jobChange: nothing is new, nothing is written twice.
    assert post(url, "load_done").status_code == 200
    assert "nothing-new" in log.read_text().splitlines()[-1]

    insert(warehouse, range(200, 202))  # a later load
    assert post(url, "table_data_change").status_code == 200
    runs = [r for r in ledger.list_runs() if r.dataset == "orders"]
    assert len(runs) == 2 and runs[1].status == "pending"  # queued behind the live first run
    (second,) = [a.uri for a in objects.list_objects(f"gs://{artifacts}/bigquery/orders/") if a.uri != first]
    assert [r["id"] for r in lines(second)] == [200, 201]  # only the new rows
    assert ledger.watermark(TABLE) == T0 + dt.timedelta(seconds=201)


def test_a_row_stamped_in_the_future_never_moves_the_watermark_past_now(warehouse: BigQueryWarehouse) -> None:
    """One row stamped in 2099 would hide every later row for good if the watermark took it: the
    watermark stops at the export's start, and the row waits for its time."""
    from google.cloud import bigquery

    table = "proj.sales.poisoned"
    schema = [bigquery.SchemaField("text", "STRING"), bigquery.SchemaField("ingested_at", "TIMESTAMP")]
    warehouse.client.create_table(bigquery.Table(table, schema=schema), exists_ok=True)
    future = dt.datetime(2099, 1, 1, tzinfo=dt.UTC)
    rows = [
        {"text": "now", "ingested_at": T0.isoformat()},
        {"text": "later", "ingested_at": future.isoformat()},
    ]
    assert warehouse.client.insert_rows_json(table, rows) == []
    assert warehouse.high_watermark(table, "ingested_at") == future  # unbounded: what MAX says
    now = dt.datetime.now(dt.UTC)
    assert warehouse.high_watermark(table, "ingested_at", not_after=now) == T0
    # a row that arrives later, stamped before now, is still above the watermark: it will be exported
    assert warehouse.client.insert_rows_json(table, [{"text": "next", "ingested_at": now.isoformat()}]) == []
    assert warehouse.high_watermark(table, "ingested_at", not_after=dt.datetime.now(dt.UTC)) == now
