"""A run's OpenLineage events: what the spec's own model accepts (openlineage-python's classes, generated
from its JSON schema), naming the run's inputs and its checkpoint, within Data Lineage's limits; and
the Data Lineage adapter's requests as Google documents them."""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, RunEvent, RunState
from openlineage.client.event_v2 import Run as OLRun
from openlineage.client.serde import Serde

from retrain.domain.runs import Run, RunStatus
from retrain.lineage import LINKS_PER_EVENT, MAX_LINKS, SCHEMA_URL, openlineage_events, run_uuid

CHECKPOINT = "gs://art/runs/news-2/megatron_gpt/checkpoints/step=120-last"
BASE = "gs://art/runs/news-1/megatron_gpt/checkpoints/step=60-last"


def a_run(**override: Any) -> Run:
    fields: dict[str, Any] = {
        "run_id": "news-2",
        "dataset": "news",
        "trigger": "gcs-marker",
        "status": RunStatus.SUCCEEDED,
        "blend": [1.0, "gs://art/shards/pack-abc/data_text_document"],
        "checkpoint": CHECKPOINT,
        "base_checkpoint": BASE,
        "created_at": "2026-11-27T10:00:00.000000Z",
        "tokenizing_at": "2026-11-27T10:00:20.000000Z",
        "finished_at": "2026-11-27T10:32:20.000000Z",
    }
    return Run(**{**fields, **override})


def through_the_spec(event: dict[str, Any]) -> dict[str, Any]:
    """The event rebuilt with OpenLineage's generated model (it refuses a bad runId, eventTime, type or a
    missing field), and serialized as OpenLineage serializes it, less the empty facets it adds."""
    rebuilt = RunEvent(
        eventType=RunState(event["eventType"]),
        eventTime=event["eventTime"],
        run=OLRun(runId=event["run"]["runId"]),
        job=Job(namespace=event["job"]["namespace"], name=event["job"]["name"]),
        producer=event["producer"],
        inputs=[InputDataset(namespace=d["namespace"], name=d["name"]) for d in event["inputs"]],
        outputs=[OutputDataset(namespace=d["namespace"], name=d["name"]) for d in event["outputs"]],
    )

    def bare(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: bare(v) for k, v in node.items() if not (k.endswith("acets") and v == {})}
        return [bare(v) for v in node] if isinstance(node, list) else node

    return dict(bare(Serde.to_dict(rebuilt)))


def test_a_runs_events_are_what_the_spec_writes_and_name_its_inputs_and_checkpoint() -> None:
    objects = ["gs://land/incoming/news/a.jsonl", "gs://land/incoming/news/b.jsonl"]
    events = openlineage_events(a_run(), objects)
    for event in events:
        assert through_the_spec(event) == event
        assert event["schemaURL"] == SCHEMA_URL and event["run"]["runId"] == run_uuid("news-2")
    assert [e["eventType"] for e in events] == ["START", "RUNNING", "COMPLETE"]
    (running,) = [e for e in events if e["eventType"] == "RUNNING"]
    assert running["inputs"] == [
        {
            "namespace": "gs://art",
            "name": "runs/news-1/megatron_gpt/checkpoints/step=60-last",
        },  # the champion
        {"namespace": "gs://land", "name": "incoming/news/a.jsonl"},
        {"namespace": "gs://land", "name": "incoming/news/b.jsonl"},
    ]
    assert running["outputs"] == [
        {"namespace": "gs://art", "name": "shards/pack-abc"},
        {"namespace": "gs://art", "name": "runs/news-2/megatron_gpt/checkpoints/step=120-last"},
    ]
    assert events[0]["eventTime"] == "2026-11-27T10:00:20.000000Z"  # it began tokenizing
    assert events[-1]["eventTime"] == "2026-11-27T10:32:20.000000Z"  # and ended
    assert uuid.UUID(run_uuid("news-2")) and run_uuid("news-2") != run_uuid("news-3")


@pytest.mark.parametrize(("status", "closes"), [(RunStatus.FAILED, "FAIL"), (RunStatus.CANCELLED, "ABORT")])
def test_a_run_that_did_not_succeed_closes_its_lineage_so(status: RunStatus, closes: str) -> None:
    events = openlineage_events(a_run(status=status, checkpoint=None), ["gs://land/incoming/news/a.jsonl"])
    assert events[-1]["eventType"] == closes and through_the_spec(events[-1]) == events[-1]


def test_a_run_of_any_size_stays_within_data_lineages_limits() -> None:
    """2,500 objects in 50 folders: each event within 100 links, the run within 1,000 and 5 MB, every
    object still named (by its folder)."""
    objects = [f"gs://land/incoming/news/day{d:02d}/part-{i:05d}.jsonl" for d in range(50) for i in range(50)]
    events = openlineage_events(a_run(), objects)
    links = [len(e["inputs"]) * len(e["outputs"]) for e in events]
    assert max(links) <= LINKS_PER_EVENT and sum(links) <= MAX_LINKS
    assert all(len(json.dumps(e).encode()) < 5 * 2**20 for e in events)
    named = {d["name"] for e in events for d in e["inputs"]}
    assert {f"incoming/news/day{d:02d}" for d in range(50)} <= named
    assert all(through_the_spec(e) == e for e in events)


def test_rows_of_a_watched_table_are_named_as_that_table() -> None:
    exports = {"gs://art/bigquery/news/proj.raw.articles/": "proj.raw.articles"}
    (running,) = [
        e
        for e in openlineage_events(
            a_run(), ["gs://art/bigquery/news/proj.raw.articles/7-ab12/000.json"], exports
        )
        if e["eventType"] == "RUNNING"
    ]
    assert {"namespace": "bigquery", "name": "proj.raw.articles"} in running["inputs"]


class _DataLineage(BaseHTTPRequestHandler):
    """Google's Data Lineage REST endpoint as its reference documents it: POST
    /v1/{parent=projects/*/locations/*}:processOpenLineageRunEvent, the event as the body, requestId as
    a query parameter (at most 36 ASCII characters)."""

    seen: list[tuple[str, dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.path, body))
        answer = json.dumps({"process": "projects/p/locations/us-central1/processes/1"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_adapter_sends_each_event_as_google_documents_it_once_per_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from urllib.parse import parse_qs, urlsplit

    from retrain.adapters.lineage import ENDPOINT_VAR, DataLineage

    server = HTTPServer(("127.0.0.1", 0), _DataLineage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv(ENDPOINT_VAR, f"http://127.0.0.1:{server.server_address[1]}")
        events = openlineage_events(a_run(), ["gs://land/incoming/news/a.jsonl"])
        DataLineage("proj", "us-central1").report("news-2", events)
        DataLineage("proj", "us-central1").report("news-2", events)  # a finish step retried
    finally:
        server.shutdown()
    sent = _DataLineage.seen
    assert len(sent) == 2 * len(events)
    ids = []
    for (path, body), event in zip(sent, events + events, strict=True):
        url = urlsplit(path)
        assert url.path == "/v1/projects/proj/locations/us-central1:processOpenLineageRunEvent"
        (request_id,) = parse_qs(url.query)["requestId"]
        assert len(request_id) <= 36 and request_id.isascii()
        assert body == event
        ids.append(request_id)
    assert ids[: len(events)] == ids[len(events) :] and len(set(ids)) == len(events)  # idempotent retries
