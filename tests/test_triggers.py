"""Seals other than the marker, one run at a time per dataset, the sweeper's crash recovery, and what
a seal would do before it is made (``retrain plan``, the cost cap): on the ledger's and Cloud Storage's
fakes (on the emulators where the test is of Firestore's own behaviour), retrain's executions service, and
functions-framework's own app."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import functions_framework
import pytest
from fakes.ledger import InMemoryLedger
from fakes.objects import InMemoryObjects
from run_events_support import Told
from stack_support import overwrite_run

from cloudworkflows import ExecutionsServer
from retrain import config
from retrain.adapters import objects
from retrain.adapters.ledger import FirestoreLedger
from retrain.adapters.workflows import WorkflowsExecutions
from retrain.contracts import RunManifest
from retrain.domain.events import ObjectArrival
from retrain.domain.runs import RunStatus, Trigger
from retrain.ingest import Ingest
from retrain.ingest.outcomes import Outcome
from retrain.plan import budget_month
from retrain.ports import Ledger, ObjectStore
from retrain.steps import Steps
from retrain_ops import cli
from retrain_ops.deployment import Deployment

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def ingest(request: pytest.FixtureRequest, project: str, held_executions: ExecutionsServer) -> Ingest:
    """Ingest on the ledger's and Cloud Storage's fakes (``tests/fakes``, held to the real adapters by
    ``tests/test_ledger.py`` and ``tests/ports/test_object_store.py``), and for a test of what Firestore
    does too (``on_both``) on the emulators; retrain's executions service either way."""
    settings = dataclasses.replace(
        config.load({}),
        project=project,
        artifacts_bucket=f"art-{project}",
        quiet_period_s=60,
        max_batch_age_s=3600,
        stuck_after_s=30,
    )
    ledger: Ledger
    store: ObjectStore
    if getattr(request, "param", "in-memory") == "firestore":
        request.getfixturevalue("firestore_host")
        request.getfixturevalue("gcs_host")
        artifacts = objects.storage_client().create_bucket(settings.artifacts_bucket)
        artifacts.versioning_enabled = True  # as deployed (infra/platform/storage.tf)
        artifacts.patch()
        ledger, store = FirestoreLedger(project), objects  # type: ignore[assignment]
    else:
        ledger = InMemoryLedger()
        store = InMemoryObjects(buckets=[settings.landing_bucket], versioned=[settings.artifacts_bucket])
    return Ingest(
        settings,
        ledger,
        WorkflowsExecutions(
            project,
            settings.region,
            settings.workflow,
            held_executions.base_url,
            grpc_endpoint=held_executions.grpc_target,
        ),
        store,
        events=Told(),
    )


#: A test of what Firestore does too (concurrent writers contend): Ingest on the fakes and on the emulators.
on_both = pytest.mark.parametrize(
    "ingest",
    [
        pytest.param("in-memory", id="in-memory"),
        pytest.param("firestore", id="firestore-emulator", marks=pytest.mark.emulators),
    ],
    indirect=True,
)


def arrive(ingest: Ingest, dataset: str, name: str, size: int = 10) -> None:
    arrival = ObjectArrival(f"ev-{uuid.uuid4()}", "land", f"incoming/{dataset}/{name}", 1, size, "", "t")
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


def test_sweeper_seals_after_the_quiet_period(ingest: Ingest) -> None:
    arrive(ingest, "quiet", "1.txt")
    assert ingest.sweep() == []  # still within the quiet period
    (sealed,) = ingest.sweep(now=later(61))
    assert sealed.action == "started" and ingest.ledger.get_run(sealed.run_id).trigger == "quiet-period"


def test_retrain_run_after_the_sweeper_sealed_first_names_the_run_that_has_the_data(
    ingest: Ingest, capsys: pytest.CaptureFixture[str]
) -> None:
    """`retrain run` just after a timer sealed the batch: nothing is pending, and it says which run holds
    the data (CI once saw a bare "nothing pending" where the sweeper had just made the run)."""
    arrive(ingest, "quiet", "1.txt")
    (sealed,) = ingest.sweep(now=later(61))
    assert cli.seal_or_retry(argparse.Namespace(retry=None, dataset="quiet"), ingest) == 0
    said = capsys.readouterr().err
    assert f"nothing pending: no run started; quiet's data is in run {sealed.run_id} (" in said, said
    assert "sealed by quiet-period)" in said, said
    arrive(ingest, "other", "1.txt")  # another dataset's pending data: sealed by the manual run
    assert cli.seal_or_retry(argparse.Namespace(retry=None, dataset="other"), ingest) == 0
    said = capsys.readouterr().err
    assert "nothing pending" not in said and "started" in said, said


def test_sweeper_seals_a_batch_at_max_age_while_data_keeps_arriving(ingest: Ingest) -> None:
    """Never quiet (the last arrival is always recent) yet old: only the max-age branch can seal it."""
    ingest.settings = dataclasses.replace(ingest.settings, quiet_period_s=1e9, max_batch_age_s=5)
    arrive(ingest, "busy", "1.txt")
    assert ingest.sweep() == []  # younger than max age
    arrive(ingest, "busy", "2.txt")  # still arriving: the batch is not quiet
    assert ingest.sweep(now=later(4.5)) == []  # the clock the sweeper is given, not slept
    (aged,) = ingest.sweep(now=later(5.5))
    assert aged.action == "started" and ingest.ledger.get_run(aged.run_id).trigger == "max-age"
    assert [o.uri for o in ingest.ledger.run_objects(ingest.ledger.get_run(aged.run_id))] == [
        "gs://land/incoming/busy/1.txt",
        "gs://land/incoming/busy/2.txt",
    ]


def test_a_run_the_trainer_would_refuse_is_refused_before_capacity_with_its_reason(ingest: Ingest) -> None:
    """Impossible batch arithmetic (12 sequences over 8 data-parallel GPUs): the run ends failed with
    the reason, no workflow execution starts (so no capacity is asked for), and the dataset is free."""
    ingest.settings = dataclasses.replace(ingest.settings, global_batch_size=12)
    arrive(ingest, "bad", "1.txt")
    refused = ingest.seal("bad", "manual")
    assert refused.action == "refused"
    run = ingest.ledger.get_run(refused.run_id)
    assert run is not None and run.status == RunStatus.FAILED and run.execution is None
    assert run.failure == "Refused"
    assert run.reason == (
        "the trainer would refuse this run: global batch size 12 is not divisible by micro batch size 1 x "
        "data-parallel size 8 = 8 (8 GPUs / (TP 1 x PP 1))"
    )
    assert run.nodes_at_end == 0
    assert isinstance(ingest.events, Told)
    assert ingest.events.of(run.run_id) == [("queued", None), ("refused", "Refused")]
    assert ingest.events.events[-1].reason == run.reason
    ingest.settings = dataclasses.replace(ingest.settings, global_batch_size=16)
    arrive(ingest, "bad", "2.txt")
    assert ingest.seal("bad", "manual").action == "started"  # the refused run holds nothing up


def test_one_run_at_a_time_per_dataset(ingest: Ingest) -> None:
    arrive(ingest, "d", "1.txt")
    first = ingest.seal("d", "manual")
    arrive(ingest, "d", "2.txt")
    second = ingest.seal("d", "manual")
    assert (first.action, second.action) == ("started", "queued")
    queued = ingest.ledger.get_run(second.run_id)
    assert queued.status == "pending" and queued.execution is None
    assert [o.action for o in ingest.sweep(now=later(31))] == ["queued"]  # first still live
    overwrite_run(ingest.ledger, first.run_id, {"status": str(RunStatus.SUCCEEDED)})
    (started,) = ingest.sweep(now=later(31))
    assert started.action == "started" and started.run_id == second.run_id
    assert ingest.ledger.get_run(second.run_id).execution


def test_a_crash_between_seal_and_start_loses_nothing(
    ingest: Ingest, held_executions: ExecutionsServer
) -> None:
    arrive(ingest, "c", "1.txt")
    sealed = ingest.ledger.seal("c", "gcs-marker")  # ...and the function died before starting the workflow
    assert sealed.run is not None and ingest.ledger.get_run(sealed.run.run_id).execution is None
    (recovered,) = ingest.sweep()
    assert recovered.action == "started" and recovered.run_id == sealed.run.run_id
    assert ingest.sweep(now=later(31)) == []  # exactly once
    assert held_executions.get(recovered.detail)["state"] == "ACTIVE"
    manifest = json.loads(
        ingest.store.read_bytes(f"{ingest.settings.artifacts_uri}/runs/{sealed.run.run_id}/objects.json")
    )
    stored = ingest.ledger.get_run(sealed.run.run_id)
    assert [o["uri"] for o in manifest["objects"]] == ["gs://land/incoming/c/1.txt"] and manifest[
        "snapshot"
    ] == stored.snapshot != ""


def test_a_crash_between_claiming_a_start_and_starting_is_recovered_once_stale(
    ingest: Ingest, held_executions: ExecutionsServer
) -> None:
    arrive(ingest, "k", "1.txt")
    sealed = ingest.ledger.seal("k", "manual")
    assert sealed.run is not None
    ingest.ledger.claim_start(sealed.run, ingest.settings.stuck_after_s)  # ...and died right after
    assert [o.action for o in ingest.sweep()] == ["queued"]  # its starter may still be at it
    ingest.settings = dataclasses.replace(ingest.settings, stuck_after_s=0)
    (recovered,) = ingest.sweep()
    assert recovered.action == "started" and held_executions.get(recovered.detail)["state"] == "ACTIVE"


def test_a_start_that_outlasts_its_claim_leaves_the_run_one_execution(
    ingest: Ingest, held_executions: ExecutionsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start slower than ``stuck_after_s`` (shared cores, a slow Executions API) is taken over by a
    sweep, which starts the run too.  The slow starter's execution is not bound to the run: the run
    records the sweep's, and the slow one's begin step refuses it (it ends before touching anything)."""
    arrive(ingest, "slow", "1.txt")
    sealed = ingest.ledger.seal("slow", "manual")
    assert sealed.run is not None
    create = ingest.orchestrator.start
    swept: list[str] = []
    stalled: list[bool] = []

    def slow_create(argument: dict[str, object]) -> str:
        if not stalled:  # the first starter stalls here, past stuck_after_s: a sweep takes over
            stalled.append(True)
            ingest.settings = dataclasses.replace(ingest.settings, stuck_after_s=0)
            swept.extend(o.detail for o in ingest.sweep() if o.action == "started")
        return create(argument)

    monkeypatch.setattr(ingest.orchestrator, "start", slow_create)
    slow = ingest.start(sealed.run)
    run = ingest.ledger.get_run(sealed.run.run_id)
    assert run is not None and len(swept) == 1
    assert (slow.action, slow.detail, run.execution) == ("started", swept[0], swept[0])
    made = {e["name"]: json.loads(e["argument"]) for e in held_executions.list()}
    mine = {name: a["claim"] for name, a in made.items() if a["run_id"] == run.run_id}
    assert len(mine) == 2 and len(set(mine.values())) == 2  # each starter made one, under its own claim
    steps = Steps(ingest.settings, ingest.ledger, ingest.store)
    begun = {name: steps.begin(run.run_id, claim, name.rsplit("/", 1)[-1]) for name, claim in mine.items()}
    assert {name for name, b in begun.items() if b.plan is not None} == {run.execution}
    (refused,) = (b for b in begun.values() if b.plan is None)
    assert refused.reason == f"run {run.run_id} is another execution's (its start claim is not this one's)"
    assert manifest_versions(ingest, run.run_id) == [run.manifest_generation]  # written once, for both


def manifest_versions(ingest: Ingest, run_id: str) -> list[int | None]:
    """Every version, live or noncurrent, of the run's manifest (the artifacts bucket is versioned)."""
    uri = f"{ingest.settings.artifacts_uri}/runs/{run_id}/objects.json"
    return [o.generation for o in ingest.store.list_objects(uri, versions=True)]


def stall_before_pricing(
    ingest: Ingest, monkeypatch: pytest.MonkeyPatch, then_settings: dict[str, object] | None = None
) -> None:
    """The next starter stalls where it reads the champion (after its claim, before pricing and its
    manifest) past stuck_after_s: a sweep takes over and starts the run; then the settings change by
    ``then_settings``, and the stalled starter goes on."""
    champion = ingest.ledger.champion
    stalled: list[str] = []

    def slow_champion(dataset: str) -> object:
        if not stalled:
            stalled.append(dataset)
            ingest.settings = dataclasses.replace(ingest.settings, stuck_after_s=0)
            assert [o.action for o in ingest.sweep()] == ["started"]
            ingest.settings = dataclasses.replace(ingest.settings, **(then_settings or {}))
        return champion(dataset)

    monkeypatch.setattr(ingest.ledger, "champion", slow_champion)


def test_a_slow_starter_never_rewrites_the_manifest_its_successor_recorded(
    ingest: Ingest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A starter stalled after the seal but before its manifest, past stuck_after_s: a sweep takes over,
    writes the manifest and starts the run.  The slow one then finds the same bytes there and writes
    nothing (a rewrite would make the recorded generation noncurrent, gone after the bucket's retention);
    had the content changed between the claims, its stale bytes are refused too, while the claim's
    holder may still rewrite at the generation it read."""
    arrive(ingest, "stale", "1.txt")
    arrive(ingest, "stale", "2.txt")
    sealed = ingest.ledger.seal("stale", "manual")
    assert sealed.run is not None
    stall_before_pricing(ingest, monkeypatch)
    ingest.start(sealed.run)
    run = ingest.ledger.get_run(sealed.run.run_id)
    assert run is not None and run.execution and run.manifest_generation is not None
    assert manifest_versions(ingest, run.run_id) == [run.manifest_generation]

    other = RunManifest(run.run_id, run.dataset, run.batch_id, "another-snapshot", [])
    assert ingest.starts.write_manifest(run, "a-claim-taken-over", other) is None
    assert manifest_versions(ingest, run.run_id) == [run.manifest_generation]


def test_the_claims_holder_rewrites_a_manifest_whose_content_changed_at_the_generation_it_read(
    ingest: Ingest,
) -> None:
    arrive(ingest, "changed", "1.txt")
    sealed = ingest.ledger.seal("changed", "manual")
    assert sealed.run is not None
    claim = ingest.ledger.claim_start(sealed.run, ingest.settings.stuck_after_s)
    first = RunManifest(sealed.run.run_id, "changed", sealed.run.batch_id, "s1", list(claim.objects))
    written = ingest.starts.write_manifest(sealed.run, claim.token, first)
    assert ingest.starts.write_manifest(sealed.run, claim.token, first) == written  # the same bytes: as is
    second = dataclasses.replace(first, snapshot="s2")
    rewritten = ingest.starts.write_manifest(sealed.run, claim.token, second)
    assert rewritten is not None and written is not None and rewritten > written
    assert manifest_versions(ingest, sealed.run.run_id) == [written, rewritten]
    uri = f"{ingest.settings.artifacts_uri}/runs/{sealed.run.run_id}/objects.json"
    assert ingest.store.read_bytes(uri) == second.to_json()


def test_a_slow_starter_that_would_refuse_the_run_leaves_it_to_the_one_that_took_over(
    ingest: Ingest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slow starter stalls before pricing; a sweep takes over and starts the run; then the slow one,
    under a cost cap the run is over, would refuse it: its end is not written, nothing is given back."""
    arrive(ingest, "capped", "1.txt")
    sealed = ingest.ledger.seal("capped", "manual")
    assert sealed.run is not None
    stall_before_pricing(ingest, monkeypatch, then_settings={"max_run_cost_usd": 0.01})
    outcome = ingest.start(sealed.run)
    run = ingest.ledger.get_run(sealed.run.run_id)
    assert (
        run is not None and run.execution and (outcome.action, outcome.detail) == ("started", run.execution)
    )
    assert run.status == RunStatus.PENDING and run.failure is None and not run.content_returned


@on_both
def test_coalescing_under_concurrent_drops_and_a_redrop(ingest: Ingest) -> None:
    """The scenario of a new user: 8 concurrent droppers of 200 files, each sealing when done, then the
    same 200 files again under new names: every content trains exactly once, in at most two runs."""
    contents = [f"md5:{uuid.uuid4().hex}" for _ in range(200)]

    def dropper(k: int, prefix: str) -> Outcome:
        for i in range(k, 200, 8):
            arrival = ObjectArrival(
                f"ev-{uuid.uuid4()}", "land", f"incoming/s/{prefix}{i:03d}.txt", 1, 10, "", "t"
            )
            ingest.ledger.record_arrival(arrival, "s", contents[i])
        return ingest.seal("s", "gcs-marker")

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda k: dropper(k, "a-"), range(8)))
    runs = ingest.ledger.list_runs()
    # the live run, and at most one pending run that absorbed every later seal
    assert 1 <= len(runs) <= 2 and sum(1 for r in runs if r.execution) == 1
    live = next(r for r in runs if r.execution)
    # One run started, once: every seal that says "started" names it and its one execution (a seal that
    # joined the run before its start was claimed says so too when it looks after the start; how many
    # did depends on the interleaving, three of eight in one loaded run).
    started_runs = {(o.run_id, o.detail) for o in outcomes if o.action == "started"}
    assert started_runs == {(live.run_id, live.execution)}, outcomes
    with ThreadPoolExecutor(8) as pool:  # the same bytes again, under other names
        redrop = [o.action for o in pool.map(lambda k: dropper(k, "b-"), range(8))]
    # nothing new: no seal of the same bytes starts or creates a run (what each seal says depends on the
    # interleaving: skipped as held already, or its window cut by a concurrent dropper first)
    assert "started" not in redrop and len(redrop) == 8
    assert len(ingest.ledger.list_runs()) == len(runs)
    overwrite_run(ingest.ledger, live.run_id, {"status": str(RunStatus.SUCCEEDED)})
    started = [o.run_id for o in ingest.sweep() if o.action == "started"]
    assert started == [r.run_id for r in runs if not r.execution]
    holders = [h.run_id for h in ingest.ledger.dataset_records("s").holdings]
    assert len(holders) == 200 and set(holders) == {r.run_id for r in runs}
    manifests = [
        json.loads(ingest.store.read_bytes(f"{ingest.settings.artifacts_uri}/runs/{r.run_id}/objects.json"))[
            "objects"
        ]
        for r in runs
    ]
    names = [o["uri"].rsplit("/", 1)[-1] for m in manifests for o in m]
    assert len(names) == 200 and all(n.startswith("a-") for n in names)  # each content once, never again


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
    assert ingest.ledger.get_run(first.run_id).failure == "ExecutionLost"  # type: ignore[union-attr]
    assert isinstance(ingest.events, Told)  # queued by its seal, failed by the sweeper: each told once
    assert ingest.events.of(first.run_id) == [("queued", None), ("failed", "ExecutionLost")]


def test_an_execution_lost_after_its_results_is_recorded_succeeded_and_the_dataset_moves_on(
    ingest: Ingest, held_executions: ExecutionsServer
) -> None:
    """Trained, results recorded (a checkpoint), then the execution vanished while releasing: the run
    keeps its success (it says the release was cut short) and its content stays trained."""
    arrive(ingest, "lost", "1.txt")
    first = ingest.seal("lost", "manual")
    run = ingest.ledger.get_run(first.run_id)
    assert run is not None and run.execution
    ckpt = f"gs://art/runs/{run.run_id}/checkpoints/megatron_gpt--step=4-last"
    overwrite_run(ingest.ledger, run.run_id, {"status": "training", "checkpoint": ckpt})
    held_executions.forget(run.execution)
    (outcome,) = ingest.sweep(now=later(31))
    assert outcome.action == "recorded-success"
    ended = ingest.ledger.get_run(run.run_id)
    assert ended is not None and ended.status == RunStatus.SUCCEEDED and not ended.content_returned
    assert ended.reason and "lost while releasing" in ended.reason
    arrive(ingest, "lost", "2.txt")
    assert ingest.seal("lost", "manual").action == "started"  # the dataset is free


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
        "RETRAIN_WORKFLOWS_GRPC_ENDPOINT": held_executions.grpc_target,
    }
    objects.storage_client().create_bucket(env["RETRAIN_ARTIFACTS_BUCKET"])
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield project
    for k, v in old.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.mark.emulators
def test_run_step_answers_503_where_the_workflow_may_retry(functions_env: str) -> None:
    """begin and cancel are idempotent: their failures answer 503, which the workflow's http.default_retry
    retries (a ledger hiccup in cancel's confirmation would otherwise fail the run); a malformed request
    400.  (Here the failure is a record whose status this release cannot read.)"""
    app = functions_framework.create_app("run_step", str(REPO / "functions" / "main.py"))
    http = app.test_client()
    FirestoreLedger(functions_env).db.collection("runs").document("unreadable").set({"status": "bogus"})
    cancel = http.post("/", json={"step": "cancel", "run_id": "unreadable"})
    assert cancel.status_code == 503 and "bogus" in cancel.get_json()["error"]
    begin = {"step": "begin", "run_id": "unreadable", "claim": "c", "execution": "e-1"}
    assert http.post("/", json=begin).status_code == 503
    assert http.post("/", json={"step": "cancel"}).status_code == 400  # no run_id
    fine = http.post("/", json={"step": "cancel", "run_id": "nobody"})
    assert fine.status_code == 200 and fine.get_json() == {"requested_by": None, "reason": ""}


@pytest.mark.emulators
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


@pytest.mark.emulators
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


def test_a_crash_right_after_the_cut_loses_nothing(ingest: Ingest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cut and its batch are one commit: if the function dies before the batch becomes a run, the
    sweeper finds the sealed batch and finishes it."""
    arrive(ingest, "x", "1.txt")
    finish = ingest.ledger.materialize

    def crash(batch_id: str) -> None:
        raise RuntimeError("the function died here")

    monkeypatch.setattr(ingest.ledger, "materialize", crash)
    with pytest.raises(RuntimeError):
        ingest.seal("x", "manual")
    monkeypatch.setattr(ingest.ledger, "materialize", finish)
    assert ingest.ledger.pending("x") == []  # the window is cut: nothing is pending any more
    ingest.settings = dataclasses.replace(ingest.settings, stuck_after_s=0)
    (started,) = [o for o in ingest.sweep() if o.run_id]
    assert started.action == "started"
    run = ingest.ledger.get_run(started.run_id)
    assert [o.uri for o in ingest.ledger.run_objects(run)] == ["gs://land/incoming/x/1.txt"]
    assert run.trigger == "manual"


def test_a_failed_run_is_retried_on_request_with_its_own_objects(ingest: Ingest) -> None:
    """Nothing re-runs by itself; ``retrain run --retry RUN`` (Ingest.retry) does, once, and only a run
    that did not succeed."""
    from retrain.domain.errors import Rejected

    arrive(ingest, "again", "1.txt")
    arrive(ingest, "again", "2.txt")
    first = ingest.seal("again", "manual")
    assert first.action == "started"
    with pytest.raises(Rejected, match="only a failed or cancelled run"):
        ingest.retry(first.run_id)  # still live
    overwrite_run(ingest.ledger, first.run_id, {"status": "failed", "reason": "training failed"})
    retried = ingest.retry(first.run_id)
    assert retried.action == "started" and retried.run_id != first.run_id
    second = ingest.ledger.get_run(retried.run_id)
    assert second is not None and (second.trigger, second.retry_of) == (Trigger.RETRY, first.run_id)
    assert [o.uri for o in ingest.ledger.run_objects(second)] == [
        "gs://land/incoming/again/1.txt",
        "gs://land/incoming/again/2.txt",
    ]
    overwrite_run(ingest.ledger, retried.run_id, {"status": "succeeded", "eval": {"promoted": True}})
    with pytest.raises(Rejected, match="was promoted: the champion holds its content"):
        ingest.retry(retried.run_id)
    # failed after promoting (its release failed): the champion holds its content, which must not train twice
    overwrite_run(ingest.ledger, retried.run_id, {"status": "failed"})
    with pytest.raises(Rejected, match="was promoted: the champion holds its content"):
        ingest.retry(retried.run_id)
    with pytest.raises(Rejected, match="no run"):
        ingest.retry("nope-1")


def test_a_run_whose_checkpoint_the_gate_refused_keeps_its_content_until_retried(ingest: Ingest) -> None:
    """Its data trained, but not into the lineage: nothing gives it back by itself (the same data from
    the same champion would most likely be refused again, GPU time spent in a loop); ``--retry`` does,
    and the next run takes it on the champion."""
    arrive(ingest, "gated", "1.txt")
    first = ingest.seal("gated", "manual")
    refused = {"promoted": False, "reason": "val_loss 3.5 is worse than the champion's"}
    overwrite_run(ingest.ledger, first.run_id, {"status": "succeeded", "eval": refused})
    run = ingest.ledger.get_run(first.run_id)
    assert run is not None and run.refused and not run.promoted
    assert [o for o in ingest.sweep() if o.run_id == first.run_id] == []  # the sweeper leaves it
    assert [o.uri for o in ingest.ledger.run_objects(run)] == ["gs://land/incoming/gated/1.txt"]  # kept
    retried = ingest.retry(first.run_id)
    assert retried.action == "started" and retried.run_id != first.run_id
    second = ingest.ledger.get_run(retried.run_id)
    assert second is not None and (second.trigger, second.retry_of) == (Trigger.RETRY, first.run_id)
    assert [o.uri for o in ingest.ledger.run_objects(second)] == ["gs://land/incoming/gated/1.txt"]


def arrive_content(ingest: Ingest, dataset: str, name: str, content: str, size: int = 10) -> None:
    arrival = ObjectArrival(f"ev-{uuid.uuid4()}", "land", f"incoming/{dataset}/{name}", 1, size, "", "t")
    ingest.ledger.record_arrival(arrival, dataset, f"md5:{content}")


#: The defaults' estimate, by hand: 60 steps x 8 sequences x 2048 tokens = 983,040 tokens at 20,000
#: tokens/s = 49.15 node-seconds, plus 900 s start-up and release for the one node = 949.15 node-seconds
#: = 0.2637 node-hours, at $88.49 = $23.33.
DEFAULT_COST_USD = 23.33


def test_a_forecast_says_what_sealing_would_train_and_writes_nothing(ingest: Ingest) -> None:
    (empty,) = ingest.forecast("f")
    assert (empty.objects, empty.would_run, empty.reason) == (
        0,
        False,
        "nothing new: 0 object(s) skipped, their content trained before or is in the live run",
    )
    arrive_content(ingest, "f", "1.txt", "one", size=1000)
    arrive_content(ingest, "f", "2.txt", "two", size=3000)
    arrive_content(ingest, "f", "2-copy.txt", "two", size=3000)  # identical bytes under another name
    (before,) = ingest.forecast("f")
    assert (before.objects, before.bytes, before.skipped, before.pending_run) == (2, 4000, 1, None)
    assert before.estimated_tokens == 1120  # 4000 bytes at 0.28 tokens per byte
    assert (before.training_tokens, before.estimated_cost_usd) == (983_040, DEFAULT_COST_USD)
    assert before.would_run and before.reason == "a run would train 2 object(s)"
    assert ingest.forecast("f") == [before]  # asking twice changes nothing: still pending, still new
    assert [p.dataset for p in ingest.ledger.pending("f")] == ["f"]

    started = ingest.seal("f", "manual")
    assert started.action == "started"
    run = ingest.ledger.get_run(started.run_id)
    assert run is not None and run.objects == 2 and run.estimated_cost_usd == DEFAULT_COST_USD
    arrive_content(ingest, "f", "1-again.txt", "one")  # in the live run already
    arrive_content(ingest, "f", "3.txt", "three")
    (during,) = ingest.forecast("f")
    assert (during.objects, during.skipped, during.pending_run, during.would_run) == (1, 1, None, True)
    queued = ingest.seal("f", "manual")
    assert queued.action == "queued"
    arrive_content(ingest, "f", "4.txt", "four")
    (behind,) = ingest.forecast()  # every dataset with new data: only f
    assert (behind.dataset, behind.objects, behind.pending_run, behind.pending_objects) == (
        "f",
        1,
        queued.run_id,
        1,
    )


def test_a_run_over_the_cost_cap_is_refused_and_its_training_deadline_follows_the_cap(ingest: Ingest) -> None:
    ingest.settings = dataclasses.replace(ingest.settings, max_run_cost_usd=10.0)
    arrive(ingest, "dear", "1.txt")
    (forecast,) = ingest.forecast("dear")
    reason = (
        f"estimated ${DEFAULT_COST_USD} is over the per-run cap of $10.00 "
        "(settings: 20000 tokens/s per node, 900 s start-up and release per node)"
    )
    assert not forecast.would_run and forecast.reason == f"a run would be refused: {reason}"
    refused = ingest.seal("dear", "manual")
    assert refused.action == "refused"
    run = ingest.ledger.get_run(refused.run_id)
    assert run is not None and run.status == RunStatus.FAILED and run.reason == reason
    assert run.execution is None and run.content_returned  # no capacity asked for; its data is free again

    # Under a $50 cap the same objects run: 50 / 88.49 node-hours = 2034 s of node time on one node, of
    # which start-up and release take 900 s, so it may train 1134 s; DWS ends the nodes at 2034 s.
    ingest.settings = dataclasses.replace(ingest.settings, max_run_cost_usd=50.0)
    retried = ingest.retry(refused.run_id)
    assert retried.action == "started"
    argument = ingest.ledger.plan_of(retried.run_id)
    assert argument is not None
    assert (argument["train_timeout_s"], argument["train_deadline_reason"]) == (
        1134,
        "the per-run cost cap of $50.00",
    )
    assert argument["provisioning_request"]["spec"]["parameters"] == {"maxRunDurationSeconds": "2034"}
    started = ingest.ledger.get_run(retried.run_id)
    assert started is not None and (started.estimated_cost_usd, started.cost_cap_usd) == (
        DEFAULT_COST_USD,
        50.0,
    )


def test_a_forecast_says_when_the_trainer_would_refuse_the_run(ingest: Ingest) -> None:
    ingest.settings = dataclasses.replace(ingest.settings, global_batch_size=12)  # 12 over 8 GPUs
    arrive(ingest, "odd", "1.txt")
    (forecast,) = ingest.forecast("odd")
    assert not forecast.would_run
    assert forecast.reason.startswith(
        "a run would be refused: the trainer would refuse this run: global batch"
    )


def test_a_datasets_own_runs_price_the_next_one() -> None:
    """The champion's record (node time for the steps it trained) prices the next run, scaled to its
    steps: a continued run's consumed samples count its base's too, its steps do not."""
    from retrain.domain.runs import Run, TrainingMetrics
    from retrain.plan import estimate

    settings = config.load({})  # 60 steps a run, $88.49 a node-hour
    metrics = TrainingMetrics(60, 30, 2.0, 2.1, 10**9 // 2048, 10**9)
    champion = Run("d-1", "d", "manual", metrics=metrics, gpu_node_seconds=1800)
    cost = estimate(settings, champion)
    # 1800 node-seconds for 30 steps -> 3600 for 60 = 1 node-hour
    assert (cost.node_hours, round(cost.cost_usd, 2)) == (1.0, 88.49)
    assert cost.basis == "run d-1: 1800 node-seconds for 30 steps"


def test_the_sweeper_gives_back_what_a_run_that_ended_without_succeeding_still_holds(ingest: Ingest) -> None:
    """Its finish step never ran (the run_step function was down at its end): the content would be held
    for good, so the next sweep gives it back."""
    arrive(ingest, "held", "1.txt")
    arrive(ingest, "held", "2.txt")
    started = ingest.seal("held", "manual")
    overwrite_run(ingest.ledger, started.run_id, {"status": "failed", "reason": "training failed"})
    outcomes = [o for o in ingest.sweep() if o.action == "gave-back"]
    assert [(o.action, o.run_id) for o in outcomes] == [("gave-back", started.run_id)]
    run = ingest.ledger.get_run(started.run_id)
    assert run is not None and run.content_returned
    assert [o for o in ingest.sweep() if o.action == "gave-back"] == []  # once


def test_an_execution_that_ended_failed_after_its_results_is_recorded_succeeded(
    ingest: Ingest, held_executions: ExecutionsServer
) -> None:
    """Trained and judged, then the execution failed (a release that raised): the run succeeded, and its
    content, which the checkpoint holds, is never given back to train twice."""
    arrive(ingest, "late", "1.txt")
    first = ingest.seal("late", "manual")
    run = ingest.ledger.get_run(first.run_id)
    assert run is not None and run.execution
    ckpt = f"gs://art/runs/{run.run_id}/checkpoints/megatron_gpt--step=4-last"
    overwrite_run(
        ingest.ledger, run.run_id, {"status": "training", "checkpoint": ckpt, "eval": {"promoted": True}}
    )
    held_executions.cancel(run.execution)
    deadline = time.monotonic() + 10
    while held_executions.get(run.execution)["state"] == "ACTIVE":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (outcome,) = [o for o in ingest.sweep(now=later(31)) if o.run_id == run.run_id]
    assert outcome.action == "recorded-success"
    ended = ingest.ledger.get_run(run.run_id)
    assert ended is not None and ended.status == RunStatus.SUCCEEDED and not ended.content_returned
    assert ended.reason and "ended CANCELLED while releasing" in ended.reason


def _finalized(settings: config.Settings, name: str) -> tuple[dict[str, str], dict[str, str]]:
    from retrain.domain.events import GCS_FINALIZED, GCS_SOURCE_PREFIX

    bucket = settings.landing_bucket
    attributes = {"type": GCS_FINALIZED, "id": f"ev-{uuid.uuid4()}", "source": GCS_SOURCE_PREFIX + bucket}
    data = {"bucket": bucket, "name": name, "generation": "5", "size": "3", "md5Hash": uuid.uuid4().hex}
    return attributes, data


def test_every_object_under_the_prefix_is_an_arrival_or_a_recorded_rejection(ingest: Ingest) -> None:
    """Names that look like retrain's own outputs are data like any other (retrain never writes into the
    landing bucket); a folder that is no dataset name is refused, and the refusal is recorded."""
    from retrain.domain.errors import Rejected

    for name in ("daily_report.json", "support_quarantine.jsonl", "q3_text_document.txt", "_retrain/x.txt"):
        outcome = ingest.on_object_finalized(*_finalized(ingest.settings, f"incoming/look/{name}"))
        assert outcome.action == "recorded", name
    assert ingest.ledger.pending("look")[0].objects == 4
    with pytest.raises(Rejected, match="not a valid dataset name"):
        ingest.on_object_finalized(*_finalized(ingest.settings, "incoming/News/a.jsonl"))
    (rejection,) = ingest.ledger.rejections()
    assert rejection.version.uri.endswith("incoming/News/a.jsonl") and rejection.version.generation == 5
    assert "not a valid dataset name" in rejection.reason
    outside = ingest.on_object_finalized(*_finalized(ingest.settings, "elsewhere/a.jsonl"))
    assert outside.action == "ignored"  # outside the landing prefix: not training data, and not audited


def test_the_audit_job_records_an_object_whose_event_never_came(ingest: Ingest) -> None:
    """An object landed and its finalize event was lost (Eventarc gives up after a day): the Scheduler's
    audit job finds it unrecorded, records its arrival as the event would have, and the next seal takes
    it; the audit is clean afterwards."""
    from retrain.audit import Account, audit

    landing = f"land-{uuid.uuid4().hex[:12]}"  # its own: the audit reads the whole bucket
    ingest.settings = dataclasses.replace(ingest.settings, audit_grace_s=0, landing_bucket=landing)
    ingest.store.create_bucket(landing)  # type: ignore[attr-defined]
    dataset = f"lost{uuid.uuid4().hex[:6]}"
    uri = f"gs://{ingest.settings.landing_bucket}/incoming/{dataset}/never-announced.jsonl"
    ingest.store.write_bytes(uri, b'{"text": "its event was lost"}\n')
    before = audit(ingest.settings, ingest.ledger, ingest.store, dataset)
    assert [(e.uri, e.account) for e in before.findings] == [(uri, Account.UNRECORDED)]
    (outcome,) = ingest.on_scheduler_tick({"job": "audit"})
    assert outcome.action == "audited" and "1 arrival(s) recorded" in outcome.detail
    after = audit(ingest.settings, ingest.ledger, ingest.store, dataset)
    assert [(e.uri, e.account) for e in after.entries] == [(uri, Account.PENDING)]
    started = ingest.seal(dataset, "manual")
    assert started.action == "started"
    run = ingest.ledger.get_run(started.run_id)
    assert run is not None and [v.uri for v in ingest.ledger.run_objects(run)] == [uri]


def test_the_sweeper_leaves_a_pending_run_to_the_sealer_still_joining_a_batch_into_it(ingest: Ingest) -> None:
    """A large batch joins its run 400 contents at a time; a sweep in between must not start the run,
    or the rest of the batch goes to another run (one batch cut in two).  Once the batch is stuck (its
    sealer died), the sweeper finishes it and starts the run: one run holding everything."""
    for i in range(3):
        arrive(ingest, "big", f"{i}.txt")
    first = ingest.ledger.seal("big", "manual").run  # joined, not started yet: the pending run
    assert first is not None and first.execution is None
    for i in range(3, 5):
        arrive(ingest, "big", f"{i}.txt")
    finish = ingest.ledger.materialize
    ingest.ledger.materialize = lambda batch_id: None  # type: ignore[method-assign,assignment,return-value]
    ingest.ledger.seal("big", "manual")  # cut; its sealer still joining when the sweep comes
    ingest.ledger.materialize = finish  # type: ignore[method-assign]
    assert [o for o in ingest.sweep() if o.run_id] == []  # the pending run is left to its sealer
    ingest.settings = dataclasses.replace(ingest.settings, stuck_after_s=0)
    started = [o for o in ingest.sweep() if o.action == "started"]
    assert [o.run_id for o in started] == [first.run_id]
    run = ingest.ledger.get_run(first.run_id)
    assert run is not None and run.objects == 5 and len(ingest.ledger.run_objects(run)) == 5


def test_the_execution_is_told_the_generation_of_the_manifest_it_was_started_for(ingest: Ingest) -> None:
    """Ingest.start writes the manifest, then keeps the plan with its generation
    (WorkflowArgument.manifest_generation), which the workflow hands the tokenize job as ``#GENERATION``."""
    arrive(ingest, "pinned", "1.txt")
    (started,) = ingest.seal_pending("pinned", "manual")
    run = ingest.ledger.get_run(started.run_id)
    assert run is not None and run.execution
    argument = ingest.ledger.plan_of(run.run_id)
    assert argument is not None
    manifest = f"{ingest.settings.artifacts_uri}/{argument['manifest_object']}"
    assert argument["manifest_generation"] == ingest.store.stat(manifest).generation
    assert run.manifest_generation == argument["manifest_generation"]  # what audit and report read
    assert argument["manifest_generation"] > 0


def test_a_run_past_its_datasets_monthly_budget_is_refused_before_capacity(
    ingest: Ingest, caplog: pytest.LogCaptureFixture
) -> None:
    """The dataset's runs made this month count (an ended run's cost, a live one's estimate); a run whose
    estimate would pass the budget ends refused with the reason before any capacity, `retrain plan` says
    what is left beforehand, and a run made last month counts for nothing."""
    arrive(ingest, "budgeted", "1.txt")
    (unbudgeted,) = ingest.forecast("budgeted")
    cost = unbudgeted.estimated_cost_usd
    assert cost > 1.0 and unbudgeted.budget_left_usd is None
    budget = round(1.5 * cost, 2)  # one run fits; a second, after the first cost budget - cost / 2, does not
    ingest.settings = dataclasses.replace(ingest.settings, monthly_budget_usd=budget)
    (fresh,) = ingest.forecast("budgeted")
    assert (fresh.monthly_budget_usd, fresh.budget_left_usd, fresh.would_run) == (budget, budget, True)
    first = ingest.seal("budgeted", "manual")
    assert first.action == "started"
    overwrite_run(ingest.ledger, first.run_id, {"status": "succeeded", "cost_usd": budget - cost / 2})

    arrive(ingest, "budgeted", "2.txt")
    (after,) = ingest.forecast("budgeted")
    assert after.budget_left_usd == round(cost / 2, 2) and not after.would_run
    assert f"over its monthly budget of ${budget:.2f}" in after.reason
    refused = ingest.seal("budgeted", "manual")
    assert refused.action == "refused"
    run = ingest.ledger.get_run(refused.run_id)
    assert (
        run is not None
        and run.status == RunStatus.FAILED
        and run.failure == "Refused"
        and run.execution is None
    )
    assert run.reason and run.reason.startswith(f"estimated ${cost:.2f} would take dataset budgeted's spend")

    # the same spend made last month: the budget is whole again, and the refused run's objects train
    month = budget_month(datetime.now(UTC))
    assert ingest.ledger.get_run(first.run_id).budget_month == month  # type: ignore[union-attr]
    overwrite_run(ingest.ledger, first.run_id, {"budget_month": "2000-01"})
    assert ingest.forecast("budgeted")[0].budget_left_usd == budget
    retried = ingest.retry(refused.run_id)
    assert retried.action == "started"

    # a start retried after its first attempt priced it (a crash before the execution started) does not
    # count its own estimate twice: queued behind the live run, priced, then started once that run ended
    arrive(ingest, "budgeted", "3.txt")
    queued = ingest.seal("budgeted", "manual")
    assert queued.action == "queued"
    overwrite_run(ingest.ledger, queued.run_id, {"estimated_cost_usd": cost, "budget_month": month})
    overwrite_run(ingest.ledger, retried.run_id, {"status": "succeeded", "cost_usd": cost / 4})
    pending = ingest.ledger.get_run(queued.run_id)
    with caplog.at_level(logging.WARNING, logger="retrain.ingest"):
        assert pending is not None and ingest.start(pending).action == "started"  # 1.25 x cost of 1.5 x cost
    # past alert_budget_fraction (0.8) of the budget, within it: the budget alert's entry, for this run alone
    (near,) = [r for r in caplog.records if getattr(r, "alert", None) == "budget"]
    assert near.run_id == queued.run_id and "83%" in near.getMessage()  # type: ignore[attr-defined]


def test_a_batch_of_empty_objects_ends_at_once_with_nothing_to_train(ingest: Ingest) -> None:
    """Empty files would tokenize to nothing and fail their run (and page someone): the run succeeds at
    once with the reason, no job or capacity asked for; a batch with data in it runs as ever."""
    arrive(ingest, "hollow", "empty.jsonl", size=0)
    arrive(ingest, "hollow", "also-empty.txt", size=0)
    ended = ingest.seal("hollow", "manual")
    assert ended.action == "empty"
    run = ingest.ledger.get_run(ended.run_id)
    assert run is not None and run.status == RunStatus.SUCCEEDED and run.execution is None
    assert (run.reason, run.nodes_at_end, run.objects) == (
        "nothing to train: its 2 object(s) are empty",
        0,
        2,
    )
    manifest = json.loads(
        ingest.store.read_bytes(f"{ingest.settings.artifacts_uri}/runs/{run.run_id}/objects.json")
    )
    assert len(manifest["objects"]) == 2  # its lineage, as any run's
    assert isinstance(ingest.events, Told)
    assert ingest.events.of(run.run_id) == [("queued", None), ("succeeded", None)]
    arrive(ingest, "hollow", "data.jsonl")  # and the dataset is free for data
    assert ingest.seal("hollow", "manual").action == "started"
