"""Seals other than the marker, one run at a time per dataset, and the sweeper's crash recovery:
the real Firestore emulator, retrain's executions service, and functions-framework's own app."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import functions_framework
import pytest

from retrain import config
from retrain.adapters import objects
from retrain.adapters.ledger import FirestoreLedger
from retrain.adapters.workflows import WorkflowsExecutions
from retrain.deployment import Deployment
from retrain.domain.events import ObjectArrival
from retrain.domain.runs import RunStatus
from retrain.ingest import Ingest
from retrain.workflows import ExecutionsServer

pytestmark = pytest.mark.emulators
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def ingest(firestore_host: str, gcs_host: str, project: str, held_executions: ExecutionsServer) -> Ingest:
    settings = dataclasses.replace(
        config.load({}),
        project=project,
        artifacts_bucket=f"art-{project}",
        trainer="datacheck",
        quiet_period_s=60,
        max_batch_age_s=3600,
        stuck_after_s=30,
    )
    objects.storage_client().create_bucket(settings.artifacts_bucket)
    return Ingest(
        settings,
        FirestoreLedger(project),
        WorkflowsExecutions(project, settings.region, settings.workflow, held_executions.base_url),
        objects,
    )


def arrive(ingest: Ingest, dataset: str, name: str) -> None:
    arrival = ObjectArrival(f"ev-{uuid.uuid4()}", "land", f"incoming/{dataset}/{name}", 1, 10, "", "t")
    ingest.ledger.record_arrival(arrival, dataset, f"md5:{uuid.uuid4()}")


def later(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


def test_scheduler_tick_seals_whatever_is_pending_and_nothing_else(ingest: Ingest) -> None:
    assert ingest.on_scheduler_tick({"job": "seal"}) == []
    arrive(ingest, "a", "1.txt")
    arrive(ingest, "b", "1.txt")
    outcomes = ingest.on_scheduler_tick({"job": "seal"})
    assert sorted(o.action for o in outcomes) == ["started", "started"]
    assert {r.trigger for r in ingest.ledger.list_runs()} == {"scheduler"}
    assert ingest.on_scheduler_tick({"job": "seal"}) == []


def test_sweeper_seals_after_the_quiet_period_or_at_max_age(ingest: Ingest) -> None:
    arrive(ingest, "quiet", "1.txt")
    assert ingest.sweep() == []  # still within the quiet period
    (sealed,) = ingest.sweep(now=later(61))
    assert sealed.action == "started" and ingest.ledger.get_run(sealed.run_id).trigger == "quiet-period"
    arrive(ingest, "busy", "1.txt")
    # keeps arriving (never quiet for 60 s) but the batch is older than max age
    (aged,) = [o for o in ingest.sweep(now=later(3601)) if o.run_id]
    assert ingest.ledger.get_run(aged.run_id).trigger in ("max-age", "quiet-period")


def test_one_run_at_a_time_per_dataset(ingest: Ingest) -> None:
    arrive(ingest, "d", "1.txt")
    first = ingest.seal("d", "manual")
    arrive(ingest, "d", "2.txt")
    second = ingest.seal("d", "manual")
    assert (first.action, second.action) == ("started", "queued")
    queued = ingest.ledger.get_run(second.run_id)
    assert queued.status == "pending" and queued.execution is None
    assert [o.action for o in ingest.sweep(now=later(31))] == ["queued"]  # first still live
    ingest.ledger.update_run(first.run_id, {"status": str(RunStatus.SUCCEEDED)})
    (started,) = ingest.sweep(now=later(31))
    assert started.action == "started" and started.run_id == second.run_id
    assert ingest.ledger.get_run(second.run_id).execution


def test_a_crash_between_seal_and_start_loses_nothing(
    ingest: Ingest, held_executions: ExecutionsServer
) -> None:
    arrive(ingest, "c", "1.txt")
    sealed = ingest.ledger.seal("c", "gcs-marker")  # ...and the function died before starting the workflow
    assert sealed.run is not None and ingest.ledger.get_run(sealed.run.run_id).execution is None
    assert ingest.sweep() == []  # too fresh: its own sealer may still be starting it
    (recovered,) = ingest.sweep(now=later(31))
    assert recovered.action == "started" and recovered.run_id == sealed.run.run_id
    assert ingest.sweep(now=later(31)) == []  # exactly once
    assert held_executions.get(recovered.detail)["state"] == "ACTIVE"
    manifest = json.loads(
        objects.read_bytes(f"{ingest.settings.artifacts_uri}/runs/{sealed.run.run_id}/objects.json")
    )
    assert (
        manifest["objects"] == ["gs://land/incoming/c/1.txt"] and manifest["snapshot"] == sealed.run.snapshot
    )


def test_an_execution_that_died_unrecorded_is_recorded_and_unblocks_the_dataset(
    ingest: Ingest, held_executions: ExecutionsServer
) -> None:
    arrive(ingest, "e", "1.txt")
    first = ingest.seal("e", "manual")
    held_executions.cancel(first.detail)  # a hard cancel: no workflow step runs to record the outcome
    deadline = time.monotonic() + 10
    while held_executions.get(first.detail)["state"] == "ACTIVE":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    arrive(ingest, "e", "2.txt")
    assert ingest.seal("e", "manual").action == "queued"
    outcomes = ingest.sweep(now=later(31))
    assert [o.action for o in outcomes] == ["recorded-failure", "started"]
    assert "without recording an outcome" in (ingest.ledger.get_run(first.run_id).reason or "")


def test_bad_ticks_are_rejected(ingest: Ingest) -> None:
    from retrain.domain.errors import Rejected

    for message in (
        {"action": "sweep"},  # the shape the local twin once sent; no job infra/ declares
        {"job": "explode"},
        {"job": "seal", "dataset": "../x"},
        {"job": "seal", "dataset": 3},
    ):
        with pytest.raises(Rejected):
            ingest.on_scheduler_tick(message)


@pytest.fixture(scope="module")
def functions_env(firestore_host: str, gcs_host: str, held_executions: ExecutionsServer) -> Iterator[str]:
    project = f"fn-{uuid.uuid4().hex[:8]}"
    env = {
        "RETRAIN_PROJECT": project,
        "RETRAIN_ARTIFACTS_BUCKET": f"art-{project}",
        "RETRAIN_WORKFLOWS_ENDPOINT": held_executions.base_url,
        "RETRAIN_TRAINER": "datacheck",
    }
    objects.storage_client().create_bucket(env["RETRAIN_ARTIFACTS_BUCKET"])
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield project
    for k, v in old.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_run_http_entrypoint(functions_env: str) -> None:
    app = functions_framework.create_app("run_http", str(REPO / "functions" / "main.py"))
    http = app.test_client()
    assert http.get("/").status_code == 405
    assert http.post("/", data="nope", content_type="text/plain").status_code == 400
    assert http.post("/", json={"dataset": "../etc"}).status_code == 400
    ledger = FirestoreLedger(functions_env)
    ledger.record_arrival(ObjectArrival("ev-h", "land", "incoming/h/1.txt", 1, 1, "", "t"), "h", "md5:h")
    resp = http.post("/", json={"dataset": "h"})
    assert resp.status_code == 200 and [o["action"] for o in resp.get_json()["outcomes"]] == ["started"]


def test_scheduler_tick_entrypoint(functions_env: str) -> None:
    app = functions_framework.create_app(
        "on_scheduler_tick", str(REPO / "functions" / "main.py"), "cloudevent"
    )
    ledger = FirestoreLedger(functions_env)
    ledger.record_arrival(ObjectArrival("ev-t", "land", "incoming/t/1.txt", 1, 1, "", "t"), "t", "md5:t")
    # Exactly what infra/app/scheduler.tf makes the "seal" job publish.
    (seal,) = [job for job in Deployment().scheduler_jobs() if job.name == "seal"]
    data = base64.b64encode(seal.data).decode()
    headers = {
        "ce-specversion": "1.0",
        "ce-id": "tick-1",
        "ce-type": "google.cloud.pubsub.topic.v1.messagePublished",
        "ce-source": "//pubsub.googleapis.com/projects/p/topics/scheduler-ticks",
    }
    resp = app.test_client().post("/", json={"message": {"data": data, "messageId": "1"}}, headers=headers)
    assert resp.status_code == 200
    assert [r.trigger for r in ledger.list_runs() if r.dataset == "t"] == ["scheduler"]
    bad = app.test_client().post("/", json={"message": {"data": "!!!", "messageId": "2"}}, headers=headers)
    assert bad.status_code == 200  # acknowledged, logged, not redelivered forever
