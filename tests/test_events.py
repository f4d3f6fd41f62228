"""CloudEvent validation: what is accepted, and the reason given for everything else."""

from __future__ import annotations

from typing import Any

import pytest

from retrain.domain.events import GCS_FINALIZED, Rejected, parse_gcs_finalized

ATTRS = {
    "type": GCS_FINALIZED,
    "id": "1234",
    "source": "//storage.googleapis.com/projects/_/buckets/land",
    "time": "2026-11-21T00:00:00Z",
}
DATA = {
    "bucket": "land",
    "name": "incoming/a.jsonl",
    "generation": "1700000000000001",
    "size": "42",
    "md5Hash": "XrY7u+Ae7tCTyyK7j1rNww==",
}


def test_valid_event_becomes_an_arrival() -> None:
    a = parse_gcs_finalized(ATTRS, DATA)
    assert (a.bucket, a.name, a.generation, a.size) == ("land", "incoming/a.jsonl", 1700000000000001, 42)
    assert a.uri == "gs://land/incoming/a.jsonl"
    assert a.identity == "land/incoming/a.jsonl#1700000000000001"


@pytest.mark.parametrize(
    ("attrs", "data", "reason"),
    [
        ({**ATTRS, "type": "google.cloud.storage.object.v1.deleted"}, DATA, "unexpected event type"),
        ({k: v for k, v in ATTRS.items() if k != "id"}, DATA, "event id"),
        (ATTRS, "not a map", "not a JSON object"),
        (ATTRS, {k: v for k, v in DATA.items() if k != "name"}, "no 'name'"),
        (ATTRS, {**DATA, "bucket": "Bad_Bucket!"}, "valid bucket name"),
        ({**ATTRS, "source": "//storage.googleapis.com/projects/_/buckets/other"}, DATA, "does not match"),
        (ATTRS, {**DATA, "name": "incoming/../etc/passwd"}, "'..'"),
        (ATTRS, {**DATA, "name": "incoming/a\x00b"}, "control characters"),
        (ATTRS, {**DATA, "name": "incoming/a\nb"}, "control characters"),
        (ATTRS, {**DATA, "name": "/abs"}, "leading '/'"),
        (ATTRS, {**DATA, "name": "x" * 1025}, "longer than 1024"),
        (ATTRS, {**DATA, "name": "é" * 513}, "longer than 1024"),
        (ATTRS, {**DATA, "generation": "abc"}, "not an integer"),
        (ATTRS, {**DATA, "generation": "0"}, "must be positive"),
        (ATTRS, {**DATA, "name": 7}, "not a string"),
    ],
)
def test_malformed_events_are_rejected_with_a_reason(attrs: dict[str, Any], data: Any, reason: str) -> None:
    with pytest.raises(Rejected) as e:
        parse_gcs_finalized(attrs, data)
    assert reason in e.value.reason
