"""The BigQuery trigger served by the real functions-framework: recorded audit-log deliveries in, objects
recorded and batches sealed against the real Firestore and GCS emulators."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests

from retrain.adapters import objects
from retrain.adapters.ledger import FirestoreLedger
from retrain_local.landing import upload

if TYPE_CHECKING:
    from conftest import ServedFunction

pytestmark = pytest.mark.emulators

EVENTS = Path(__file__).parent / "events" / "bigquery"


def delivery(name: str) -> dict[str, Any]:
    return dict(json.loads((EVENTS / f"{name}.json").read_text()))


def post(url: str, d: dict[str, Any]) -> requests.Response:
    return requests.post(url, headers=d["headers"], data=json.dumps(d["body"]), timeout=60)


@pytest.fixture(scope="module")
def function(serve_function: Callable[..., ServedFunction]) -> ServedFunction:
    return serve_function("on_bigquery_event", RETRAIN_LANDING_BUCKET="land")  # the recorded events' bucket


def test_a_finished_export_into_the_landing_bucket_becomes_one_run(function: ServedFunction) -> None:
    url = function.url
    parts = [f"gs://land/incoming/orders/export-2026-11-20/part-00000000000{i}.jsonl" for i in range(3)]
    for i, uri in enumerate(parts):
        upload(json.dumps({"text": f"order {i}"}).encode() + b"\n", uri)
    upload(b"not part of the export", "gs://land/incoming/orders/export-2026-11-20/notes.txt")

    assert post(url, delivery("extract_done")).status_code == 200
    runs = [r for r in FirestoreLedger(function.project).list_runs() if r.dataset == "orders"]
    assert len(runs) == 1 and runs[0].trigger == "bigquery-export" and runs[0].objects == 3
    manifest = json.loads(objects.read_bytes(f"gs://{function.artifacts}/runs/{runs[0].run_id}/objects.json"))
    assert [o["uri"] for o in manifest["objects"]] == parts

    assert post(url, delivery("extract_done")).status_code == 200  # at-least-once: a redelivery
    assert len([r for r in FirestoreLedger(function.project).list_runs() if r.dataset == "orders"]) == 1


def test_a_failed_export_seals_nothing(function: ServedFunction) -> None:
    url, log = function.url, function.log
    assert post(url, delivery("extract_failed")).status_code == 200
    assert "ignored export projects/proj/jobs/bqjob_r1a2b3c4_export_1 failed" in log.read_text()


def test_an_export_whose_files_are_not_listed_yet_is_retried(function: ServedFunction) -> None:
    url = function.url
    d = copy.deepcopy(delivery("extract_done"))
    config = d["body"]["protoPayload"]["metadata"]["jobChange"]["job"]["jobConfig"]["extractConfig"]
    config["destinationUris"] = ["gs://land/incoming/orders/not-yet/part-*.jsonl"]
    assert post(url, d).status_code == 500  # an error: the platform redelivers later


@pytest.mark.parametrize(
    "destination",
    ["gs://someone-elses/incoming/orders/part-*.jsonl", "gs://land/elsewhere/part-*.jsonl"],
)
def test_an_export_outside_the_landing_prefix_is_rejected(function: ServedFunction, destination: str) -> None:
    url, log = function.url, function.log
    d = copy.deepcopy(delivery("extract_done"))
    config = d["body"]["protoPayload"]["metadata"]["jobChange"]["job"]["jobConfig"]["extractConfig"]
    config["destinationUris"] = [destination]
    assert post(url, d).status_code == 200  # acknowledged: never redelivered
    assert "rejected BigQuery event" in log.read_text().splitlines()[-1]


def test_writes_to_unwatched_tables_and_job_insertions_do_nothing(function: ServedFunction) -> None:
    url, log = function.url, function.log
    for name, said in (
        ("table_data_change", "table proj.sales.orders is not watched"),
        ("load_inserted", "not a job change"),
    ):
        assert post(url, delivery(name)).status_code == 200
        assert said in log.read_text().splitlines()[-1]
