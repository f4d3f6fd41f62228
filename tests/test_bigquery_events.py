"""BigQuery audit-log CloudEvents, as recorded in tests/events/bigquery, parsed into what retrain does."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from retrain.domain.bigquery_events import (
    ExportFinished,
    NotRelevant,
    OwnExportDone,
    TableWritten,
    parse_bigquery_audit,
    table_id,
)
from retrain.domain.events import Rejected

EVENTS = Path(__file__).parent / "events" / "bigquery"


def recorded(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(CloudEvent attributes, data) of a recorded delivery, as functions-framework hands them over."""
    delivery = json.loads((EVENTS / f"{name}.json").read_text())
    attributes = {k[3:]: v for k, v in delivery["headers"].items() if k.startswith("ce-")}
    return attributes, delivery["body"]


def test_a_finished_extract_job_is_an_export() -> None:
    change = parse_bigquery_audit(*recorded("extract_done"))
    assert change == ExportFinished(
        event_id=recorded("extract_done")[0]["id"],
        job="projects/proj/jobs/bqjob_r1a2b3c4_export_1",
        destination_uris=("gs://land/incoming/orders/export-2026-11-20/part-*.jsonl",),
        source_table="proj.sales.orders",
        error=None,
    )


def test_a_failed_extract_job_carries_its_error() -> None:
    change = parse_bigquery_audit(*recorded("extract_failed"))
    assert isinstance(change, ExportFinished) and change.error and "too large" in change.error


def test_a_load_is_a_table_write_whether_seen_as_data_change_or_job_change() -> None:
    data_change = parse_bigquery_audit(*recorded("table_data_change"))
    job_change = parse_bigquery_audit(*recorded("load_done"))
    assert isinstance(data_change, TableWritten) and isinstance(job_change, TableWritten)
    assert data_change.table == job_change.table == "proj.sales.orders"
    assert data_change.job == job_change.job == "projects/proj/jobs/bqjob_r9z8y7_load_1"


def test_job_insertions_and_unfinished_or_failed_jobs_are_not_relevant() -> None:
    assert isinstance(parse_bigquery_audit(*recorded("load_inserted")), NotRelevant)
    attributes, data = recorded("load_done")
    running = copy.deepcopy(data)
    running["protoPayload"]["metadata"]["jobChange"]["after"] = "RUNNING"
    running["protoPayload"]["metadata"]["jobChange"]["job"]["jobStatus"]["jobState"] = "RUNNING"
    assert isinstance(parse_bigquery_audit(attributes, running), NotRelevant)
    failed = copy.deepcopy(data)
    failed["protoPayload"]["metadata"]["jobChange"]["job"]["jobStatus"]["errorResult"] = {"message": "x"}
    assert "failed" in parse_bigquery_audit(attributes, failed).reason  # type: ignore[union-attr]
    nothing = copy.deepcopy(recorded("table_data_change"))
    nothing[1]["protoPayload"]["metadata"]["tableDataChange"]["insertedRowsCount"] = "0"
    assert isinstance(parse_bigquery_audit(*nothing), NotRelevant)


def _broken(name: str, change: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    attributes, data = copy.deepcopy(recorded(name))
    change(attributes, data)
    return attributes, data


@pytest.mark.parametrize(
    "attributes,data",
    [
        _broken("load_done", lambda a, d: a.update(type="google.cloud.storage.object.v1.finalized")),
        _broken("load_done", lambda a, d: a.update(source="//evil.example.com/projects/proj/logs/x")),
        _broken("load_done", lambda a, d: a.pop("id")),
        _broken("load_done", lambda a, d: d.pop("protoPayload")),
        _broken("load_done", lambda a, d: d["protoPayload"].update(serviceName="storage.googleapis.com")),
        _broken("load_done", lambda a, d: d["protoPayload"]["metadata"].update({"@type": "x.AuditData"})),
        _broken(
            "load_done", lambda a, d: d["protoPayload"]["metadata"]["jobChange"]["job"].update(jobName="../x")
        ),
        _broken(
            "table_data_change",
            lambda a, d: d["protoPayload"].update(resourceName="projects/proj/datasets/../tables/t"),
        ),
        _broken(
            "table_data_change",
            lambda a, d: d["protoPayload"]["metadata"]["tableDataChange"].update(insertedRowsCount="many"),
        ),
        _broken(
            "extract_done",
            lambda a, d: d["protoPayload"]["metadata"]["jobChange"]["job"]["jobConfig"][
                "extractConfig"
            ].update(destinationUrisTruncated=True),
        ),
        (
            {
                "type": "google.cloud.audit.log.v1.written",
                "id": "x",
                "source": "//cloudaudit.googleapis.com/projects/p/logs/data_access",
            },
            "not json",
        ),
    ],
)
def test_malformed_events_are_rejected_with_a_reason(attributes: dict[str, Any], data: Any) -> None:
    with pytest.raises(Rejected) as e:
        parse_bigquery_audit(attributes, data)
    assert e.value.reason


def test_table_names() -> None:
    assert table_id("projects/my-proj/datasets/d_1/tables/t-2") == "my-proj.d_1.t-2"
    for bad in (
        "projects/p/datasets/d",
        "projects/p/datasets/d/tables/a/b",
        "projects/P!/datasets/d/tables/t",
    ):
        with pytest.raises(Rejected):
            table_id(bad)


@pytest.mark.parametrize("name", ["load_done", "table_data_change", "extract_done"])
def test_the_functions_own_jobs_do_not_trigger_it_again(name: str) -> None:
    """The export's own queries and jobs are audit-logged too; Eventarc cannot filter on the caller, so
    an event whose principal is the functions' account (RETRAIN_FUNCTIONS_SERVICE_ACCOUNT) is ignored."""
    attributes, data = recorded(name)
    caller = data["protoPayload"]["authenticationInfo"]["principalEmail"]
    assert not isinstance(
        parse_bigquery_audit(attributes, data, own_principal="other@p.iam.gserviceaccount.com"), NotRelevant
    )
    ignored = parse_bigquery_audit(attributes, data, own_principal=caller)
    assert isinstance(ignored, NotRelevant) and caller in ignored.reason


def test_the_end_of_one_of_retrains_own_export_jobs_is_recognised() -> None:
    """Of the functions' own jobs, the end of an export job matters: its export is finished at once."""
    attributes, data = recorded("export_data_done")
    own = data["protoPayload"]["authenticationInfo"]["principalEmail"]
    assert parse_bigquery_audit(attributes, data, own_principal=own) == OwnExportDone(
        attributes["id"], "retrain-export-0f1e2d3c4b5a69788796a5b4c3d2e1f0"
    )
    # anyone else's EXPORT DATA job writes no table: nothing to do
    assert isinstance(
        parse_bigquery_audit(attributes, data, own_principal="x@p.iam.gserviceaccount.com"), NotRelevant
    )
    # still running, or another of its own jobs (a watermark query): nothing to do
    running = copy.deepcopy(data)
    running["protoPayload"]["metadata"]["jobChange"]["after"] = "RUNNING"
    running["protoPayload"]["metadata"]["jobChange"]["job"]["jobStatus"]["jobState"] = "RUNNING"
    assert isinstance(parse_bigquery_audit(attributes, running, own_principal=own), NotRelevant)
    query = copy.deepcopy(data)
    query["protoPayload"]["metadata"]["jobChange"]["job"]["jobName"] = "projects/proj/jobs/bquxjob_1a2b"
    assert isinstance(parse_bigquery_audit(attributes, query, own_principal=own), NotRelevant)
