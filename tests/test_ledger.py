"""The ledger port's behaviour, one suite for the in-memory fake (``tests/fakes/ledger.py``, unit tier) and
the Firestore ledger on the real Firestore emulator (integration tier): dedup, batches, seals, snapshots,
claims, exports.  What only Firestore does (contention, lock timeouts, the stored documents, the hot
path's raw commit) is tested on the emulator alone (``firestore_only``)."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fakes.ledger import InMemoryLedger
from google.cloud import firestore
from stack_support import overwrite_run

from retrain.adapters.ledger import FirestoreLedger
from retrain.adapters.ledger.base import _key
from retrain.domain.events import ObjectArrival, ObjectVersion
from retrain.domain.runs import BatchState, Champion, RunStatus, Trigger
from retrain.domain.transitions import RunEnd, RunPlanned
from retrain.ports import ExportJob, Ledger, SealVerdict, StartVerdict, Watermark

#: How long a start claim stays fresh in these tests: longer than any of them, however loaded the machine
#: (a storm's test once took 171 s, and its first claim went stale before its second storm).
FRESH = 24 * 3600.0


def progress(mark: Watermark) -> tuple[object, bool, int, str]:
    """What a watermark says of the next export: (value, backlog, failures, retry_after)."""
    return (mark.value, mark.backlog, mark.failures, mark.retry_after)


def uris(versions: Any) -> tuple[str, ...]:
    """The object names of object versions (what these tests compare)."""
    return tuple(v.uri for v in versions)


def arrival(name: str, event_id: str | None = None, generation: int = 1, md5: str = "") -> ObjectArrival:
    return ObjectArrival(
        event_id or f"ev-{name}-{generation}",
        "land",
        f"incoming/{name}",
        generation,
        10,
        md5 or f"md5-{name}",
        "2026-11-21T00:00:00Z",
    )


@pytest.fixture(
    params=[
        pytest.param("in-memory", id="in-memory"),
        pytest.param("firestore", id="firestore-emulator", marks=pytest.mark.emulators),
    ]
)
def ledger(request: pytest.FixtureRequest) -> Ledger:
    """The same tests against the fake and against the Firestore ledger on the emulator."""
    if request.param == "in-memory":
        return InMemoryLedger()
    request.getfixturevalue("firestore_host")
    return FirestoreLedger(request.getfixturevalue("project"))


#: A test of what only Firestore does: the ledger fixture's Firestore parameter alone.
firestore_only = pytest.mark.parametrize(
    "ledger", [pytest.param("firestore", id="firestore-emulator", marks=pytest.mark.emulators)], indirect=True
)


def test_redelivered_event_and_same_object_version_are_duplicates(ledger: Ledger) -> None:
    assert ledger.record_arrival(arrival("a"), "ds", "h-a").status == "new"
    assert ledger.record_arrival(arrival("a"), "ds", "h-a").status == "duplicate"  # the event, redelivered
    same_object = arrival("a", event_id="another-id")
    assert ledger.record_arrival(same_object, "ds", "h-a").status == "duplicate"  # same bucket/name/gen
    assert ledger.record_arrival(arrival("a", generation=2), "ds", "h-a2").status == "new"
    sealed = ledger.seal("ds", "manual")
    assert sealed.run is not None and len(sealed.objects) == 2  # both versions, once each


def test_seal_makes_one_run_with_every_object_then_nothing(ledger: Ledger) -> None:
    for name in ("a", "b", "c"):
        ledger.record_arrival(arrival(name), "ds", f"h-{name}")
    (pending,) = ledger.pending()
    assert (pending.dataset, pending.objects) == ("ds", 3)
    assert pending.first_arrival_at <= pending.last_arrival_at
    sealed = ledger.seal("ds", "manual")
    assert sealed.run is not None
    assert uris(sealed.objects) == ("gs://land/incoming/a", "gs://land/incoming/b", "gs://land/incoming/c")
    stored = ledger.get_run(sealed.run.run_id)
    assert stored is not None and stored.status == "pending" and stored.trigger == Trigger.MANUAL
    assert ledger.seal("ds", "manual").verdict == SealVerdict.NOTHING_PENDING
    assert ledger.pending() == []
    # arrivals after the seal open the next batch; while the run is pending, it joins that run
    ledger.record_arrival(arrival("d"), "ds", "h-d")
    later = ledger.seal("ds", "manual")
    assert uris(later.objects) == ("gs://land/incoming/d",) and later.run is not None
    assert later.run.run_id == sealed.run.run_id
    assert uris(ledger.run_objects(later.run)) == (*uris(sealed.objects), "gs://land/incoming/d")


def test_identical_data_never_trains_twice(ledger: Ledger) -> None:
    for name in ("a", "b"):
        ledger.record_arrival(arrival(name), "ds", f"h-{name}")
    first = ledger.seal("ds", "manual")
    assert first.run is not None
    # the same content re-uploaded under other names (and in another order) is the same snapshot
    ledger.record_arrival(arrival("copy-of-b", generation=7), "ds", "h-b")
    ledger.record_arrival(arrival("copy-of-a", generation=9), "ds", "h-a")
    again = ledger.seal("ds", "manual")
    assert (again.run, again.verdict, again.skipped) == (None, SealVerdict.NOTHING_NEW, 2)
    assert "2 object(s) skipped" in again.reason
    assert [r.run_id for r in ledger.list_runs()] == [first.run.run_id]


def test_one_pending_run_absorbs_seals_until_it_starts(ledger: Ledger) -> None:
    """Per-object content identity: each content joins one run, whatever the grouping; a started run's
    list is fixed, and what arrives after joins the next pending run."""
    ledger.record_arrival(arrival("a"), "ds", "h-a")
    first = ledger.seal("ds", "manual").run
    assert first is not None
    claim = ledger.claim_start(first, stale_after_s=FRESH)
    assert (claim.verdict, uris(claim.objects)) == (StartVerdict.CLAIMED, ("gs://land/incoming/a",))
    assert ledger.claim_start(first, stale_after_s=FRESH).verdict == StartVerdict.STARTING  # claimed already
    for name, content in (("b", "h-b"), ("a-again", "h-a"), ("c", "h-c")):
        ledger.record_arrival(arrival(name), "ds", content)
        sealed = ledger.seal("ds", "manual")
        assert sealed.run is None or sealed.run.run_id != first.run_id
    second = ledger.seal("ds", "manual")
    pending = ledger.pending_run("ds")
    assert second.verdict == SealVerdict.NOTHING_PENDING and pending is not None
    assert uris(ledger.run_objects(pending)) == (
        "gs://land/incoming/b",
        "gs://land/incoming/c",
    )  # h-a: trained
    assert ledger.claim_start(pending, stale_after_s=FRESH).verdict == StartVerdict.QUEUED  # first is live
    overwrite_run(ledger, first.run_id, {"status": "succeeded"})
    started = ledger.claim_start(pending, stale_after_s=FRESH)
    assert started.verdict == StartVerdict.CLAIMED and len(started.objects) == 2
    assert ledger.get_run(pending.run_id).objects == 2  # type: ignore[union-attr]


@firestore_only
def test_a_storm_of_seals_contends_only_to_claim(
    ledger: FirestoreLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every seal of a storm tries to start the dataset's pending run (29 at once in the synced folder's
    test).  Of 32 concurrent claims exactly one wins, and none fails (in a transaction each they
    deadlocked on the emulator: 31 of 32 failed after 40 s); once a start is claimed, or the dataset has
    a live run, a claim reads so and answers without writing anything."""
    ledger.record_arrival(arrival("a"), "ds", "h-a")
    first = ledger.seal("ds", "manual").run
    assert first is not None
    with ThreadPoolExecutor(32) as pool:
        storm = Counter(pool.map(lambda _: ledger.claim_start(first, stale_after_s=FRESH).verdict, range(32)))
    assert storm == {StartVerdict.CLAIMED: 1, StartVerdict.STARTING: 31}

    writes: list[str] = []
    batch, transaction = ledger.db.batch, ledger.db.transaction
    monkeypatch.setattr(ledger.db, "batch", lambda: writes.append("batch") or batch())
    monkeypatch.setattr(
        ledger.db, "transaction", lambda **kw: writes.append("transaction") or transaction(**kw)
    )
    with ThreadPoolExecutor(8) as pool:
        again = Counter(pool.map(lambda _: ledger.claim_start(first, stale_after_s=FRESH).verdict, range(16)))
    assert again == {StartVerdict.STARTING: 16} and writes == []
    ledger.record_arrival(arrival("b"), "ds", "h-b")
    behind = ledger.seal("ds", "manual").run  # its content joins a new pending run
    assert behind is not None and behind.run_id != first.run_id
    writes.clear()
    assert [ledger.claim_start(behind, stale_after_s=FRESH).verdict for _ in range(4)] == [
        StartVerdict.QUEUED
    ] * 4
    assert writes == []
    overwrite_run(ledger, first.run_id, {"status": "succeeded"})
    writes.clear()
    assert ledger.claim_start(behind, stale_after_s=FRESH).verdict == StartVerdict.CLAIMED
    assert writes == ["batch", "batch"]  # the claim, then the run's object count and snapshot


def test_a_run_that_did_not_succeed_gives_its_content_back_once(ledger: Ledger) -> None:
    """A failed (or cancelled) run's content is not "trained": identical bytes dropped again are new
    again, nothing re-runs by itself, and a requeue brings back the very versions the run held."""
    for name in ("a", "b"):
        ledger.record_arrival(arrival(name, generation=3), "ds", f"h-{name}")
    failed = ledger.seal("ds", "manual").run
    assert failed is not None
    assert ledger.claim_start(failed, stale_after_s=FRESH).verdict == StartVerdict.CLAIMED
    overwrite_run(ledger, failed.run_id, {"status": "failed"})
    # identical content under another name is still counted trained until the run gives it back
    ledger.record_arrival(arrival("copy-of-a", generation=5), "ds", "h-a")
    assert ledger.seal("ds", "manual").verdict == SealVerdict.NOTHING_NEW

    assert ledger.give_back(failed) == 2
    assert ledger.give_back(failed) == 0  # idempotent: a retried finish step gives nothing twice
    stored = ledger.get_run(failed.run_id)
    assert stored is not None and stored.content_returned
    assert uris(ledger.run_objects(stored)) == ("gs://land/incoming/a", "gs://land/incoming/b")  # its record
    assert ledger.pending() == []  # nothing re-runs by itself
    ledger.record_arrival(arrival("copy-of-a", generation=6), "ds", "h-a")  # dropped again: new again
    again = ledger.seal("ds", "manual").run
    assert again is not None and uris(ledger.run_objects(again)) == ("gs://land/incoming/copy-of-a",)

    assert ledger.requeue(stored) == 2
    assert ledger.requeue(stored) == 2  # the same two arrivals, not four
    retried = ledger.seal("ds", "manual")  # joins the pending run; h-a is held by it already
    assert retried.run is not None and retried.run.run_id == again.run_id and retried.skipped == 1
    assert {(v.uri, v.generation) for v in ledger.run_objects(retried.run)} == {
        ("gs://land/incoming/copy-of-a", 6),
        ("gs://land/incoming/b", 3),
    }


def test_a_start_claim_left_by_a_crash_is_taken_over_once_stale(ledger: Ledger) -> None:
    ledger.record_arrival(arrival("z"), "ds", "h-z")
    run = ledger.seal("ds", "manual").run
    assert run is not None
    first = ledger.claim_start(run, stale_after_s=FRESH)
    assert first.verdict == StartVerdict.CLAIMED and first.token
    # ...the starter died before attaching an execution
    assert ledger.claim_start(run, stale_after_s=FRESH).verdict == StartVerdict.STARTING
    second = ledger.claim_start(run, stale_after_s=0)
    assert second.verdict == StartVerdict.CLAIMED and second.token != first.token
    assert ledger.record_claimed(run.run_id, second.token, RunPlanned({"run_id": run.run_id}))
    execution = "projects/p/locations/l/workflows/w/executions/e-1"
    assert ledger.attach_execution(run.run_id, second.token, execution) == {"run_id": run.run_id}
    assert ledger.claim_start(run, stale_after_s=0).verdict == StartVerdict.STARTED


def test_a_slow_starter_whose_claim_was_taken_over_changes_nothing(ledger: Ledger) -> None:
    """A start that outlasts ``stuck_after_s`` is taken over by a sweep: the two starters each keep a plan
    and create an execution, and only the claim's holder may.  The slow one's writes are refused, and so
    is its execution, whether it binds before or after the other's; the run's execution binds again under
    another name of itself (the API may name the project by its number), and gets the plan."""
    ledger.record_arrival(arrival("z"), "ds", "h-z")
    run = ledger.seal("ds", "manual").run
    assert run is not None
    slow = ledger.claim_start(run, stale_after_s=FRESH)
    sweep = ledger.claim_start(run, stale_after_s=0)  # the slow starter seems stuck
    parent = "projects/{}/locations/l/workflows/w/executions/"
    assert ledger.attach_execution(run.run_id, sweep.token, parent.format("p") + "early") is None  # no plan
    plan = {"run_id": run.run_id, "by": "sweep"}
    assert ledger.record_claimed(run.run_id, sweep.token, RunPlanned(plan, base_step=7))
    assert not ledger.record_claimed(run.run_id, slow.token, RunPlanned({**plan, "by": "slow"}, base_step=1))
    assert not ledger.record_claimed(run.run_id, slow.token, RunEnd(RunStatus.FAILED, "slow"))  # nor end it
    assert ledger.plan_of(run.run_id) == plan
    stored = ledger.get_run(run.run_id)
    assert stored is not None and (stored.base_step, stored.status) == (7, "pending")

    assert ledger.attach_execution(run.run_id, slow.token, parent.format("p") + "slow") is None
    assert ledger.attach_execution(run.run_id, sweep.token, parent.format("p") + "swept") == plan
    assert ledger.attach_execution(run.run_id, sweep.token, parent.format("123") + "swept") == plan  # itself
    assert ledger.attach_execution(run.run_id, sweep.token, parent.format("p") + "another") is None
    assert ledger.attach_execution(run.run_id, slow.token, parent.format("p") + "slow") is None
    assert not ledger.record_claimed(run.run_id, sweep.token, RunPlanned({}))  # bound: the plan is fixed
    assert ledger.get_run(run.run_id).execution == parent.format("p") + "swept"  # type: ignore[union-attr]
    assert ledger.claim_start(run, stale_after_s=0).verdict == StartVerdict.STARTED


def test_an_execution_binds_only_to_a_pending_run(ledger: Ledger) -> None:
    ledger.record_arrival(arrival("y"), "ds", "h-y")
    run = ledger.seal("ds", "manual").run
    assert run is not None
    claim = ledger.claim_start(run, stale_after_s=FRESH)
    assert ledger.record_claimed(run.run_id, claim.token, RunPlanned({"run_id": run.run_id}))
    overwrite_run(ledger, run.run_id, {"status": "cancelled"})  # e.g. ended by an operator before it began
    assert (
        ledger.attach_execution(run.run_id, claim.token, "projects/p/locations/l/workflows/w/executions/e")
        is None
    )


@firestore_only
def test_a_start_claim_outlasts_a_lock_held_past_the_emulators_lock_timeout(
    ledger: FirestoreLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim writes the dataset's document, which a transaction elsewhere may have read: on the
    emulator that reader's lock stops the write until the lock timeout (about 2 s, "Transaction lock
    timeout").  Here a reader holds the document for 3 s: with no time to retry the claim fails, with
    the deployed budget its random backoff carries it through."""
    from retrain.adapters.ledger import base as module

    deployed = module.CONTENDED_BUDGET_S
    ledger.record_arrival(arrival("a"), "ds", "h-a")
    run = ledger.seal("ds", "manual").run
    assert run is not None

    def claim_while_locked(budget_s: float) -> StartVerdict | str:
        monkeypatch.setattr(module, "CONTENDED_BUDGET_S", budget_s)
        holding = threading.Event()

        @firestore.transactional
        def hold(tx: firestore.Transaction) -> None:
            ledger._dataset("ds").get(transaction=tx)
            holding.set()
            time.sleep(3.0)

        holder = threading.Thread(target=hold, args=(ledger.db.transaction(),))
        holder.start()
        holding.wait(10)
        try:
            return ledger.claim_start(run, stale_after_s=0).verdict
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        finally:
            holder.join()

    assert claim_while_locked(budget_s=0.0) == "Aborted: 409 Transaction lock timeout."
    assert claim_while_locked(budget_s=deployed) == StartVerdict.CLAIMED


def test_a_cancel_is_requested_once_and_only_of_a_run_that_has_not_ended(ledger: Ledger) -> None:
    ledger.record_arrival(arrival("c"), "ds", "h-c")
    run = ledger.seal("ds", "manual").run
    assert run is not None
    assert ledger.request_cancel(run.run_id, "alice@example.com", "wrong data")
    assert ledger.request_cancel(run.run_id, "bob@example.com", "again")  # the first request stands
    stored = ledger.get_run(run.run_id)
    assert stored is not None and (stored.cancel_requested_by, stored.cancel_reason) == (
        "alice@example.com",
        "wrong data",
    )
    overwrite_run(ledger, run.run_id, {"status": "cancelled"})
    assert not ledger.request_cancel(run.run_id, "alice@example.com", "ended")
    assert not ledger.request_cancel("ds-no-such-run", "alice@example.com", "unknown")


def test_a_promotion_is_made_once_and_the_next_runs_continue_from_it(ledger: Ledger) -> None:
    assert ledger.champion("ds") is None
    first = Champion("ds-1", "gs://art/runs/ds-1/ckpt", 60, val_loss=3.1)
    assert ledger.promote("ds", first) and ledger.champion("ds") == first
    second = Champion("ds-2", "gs://art/runs/ds-2/ckpt", 120, val_loss=2.9, fingerprint="sha256:f")
    assert ledger.promote("ds", second) and ledger.champion("ds") == second
    assert ledger.promote("ds", first) and ledger.champion("ds") == second  # promoted before: not again
    assert ledger.champion("other") is None


def test_a_months_runs_are_the_ones_budgeted_in_it(ledger: Ledger) -> None:
    made = []
    for name, month in (("a", "2026-10"), ("b", "2026-11"), ("c", "2026-11")):
        ledger.record_arrival(arrival(name), f"ds-{name}", f"h-{name}")
        run = ledger.seal(f"ds-{name}", "manual").run
        assert run is not None
        overwrite_run(ledger, run.run_id, {"budget_month": month})
        made.append(run.run_id)
    assert sorted(r.run_id for r in ledger.runs_budgeted_in("2026-11")) == sorted(made[1:])
    assert [r.run_id for r in ledger.runs_budgeted_in("2026-09")] == []
    assert [r.run_id for r in ledger.list_runs(limit=2)] == made[1:]  # the latest, oldest first


def test_a_run_gives_back_only_what_it_could_not_read_and_that_content_arrives_again(ledger: Ledger) -> None:
    """A run that trained but could not read some objects gives back their content alone (it keeps the
    rest); the versions of a content are listed newest first, and one arriving again is pending again."""
    for name in ("a", "b", "c"):
        ledger.record_arrival(arrival(name), "ds", f"h-{name}")
    run = ledger.seal("ds", "manual").run
    assert run is not None and ledger.claim_start(run, stale_after_s=FRESH).verdict == StartVerdict.CLAIMED
    unread = [v for v in ledger.run_objects(run) if v.uri.endswith("/b")]
    assert ledger.give_back(run, unread) == 1
    assert ledger.give_back(run, unread) == 0  # it holds it no more
    kept = ledger.get_run(run.run_id)
    assert kept is not None and kept.returned_untrained == 1 and not kept.content_returned
    assert uris(ledger.run_objects(kept)) == ("gs://land/incoming/a", "gs://land/incoming/c")
    ledger.record_arrival(arrival("b", generation=2), "ds", "h-b")  # the same content, a newer version
    assert [v.generation for v in ledger.versions_of("ds", "h-b")] == [2, 1]
    assert ledger.seal("ds", "manual").run is not None  # h-b is new again: it joins a pending run
    (back,) = [v for v in ledger.versions_of("ds", "h-b") if v.generation == 1]
    ledger.arrive_again("ds", back, "read again")
    ledger.arrive_again("ds", back, "read again")  # once per reason
    (pending,) = ledger.pending("ds")
    assert pending.objects == 1


def test_a_refused_object_is_recorded_once_per_version_and_a_run_records_its_end(ledger: Ledger) -> None:
    bad = ObjectVersion("gs://land/incoming/News/a.jsonl", 5)
    ledger.record_rejection(bad, "not a valid dataset name")
    ledger.record_rejection(bad, "not a valid dataset name: redelivered")  # the same version: rewritten
    ledger.record_rejection(ObjectVersion("gs://land/incoming/News/a.jsonl", 6), "x" * 2000)
    rejections = sorted(ledger.rejections(), key=lambda r: r.version.generation)
    assert [(r.version.generation, r.reason) for r in rejections] == [
        (5, "not a valid dataset name: redelivered"),
        (6, "x" * 1000),  # kept to its first thousand characters
    ]
    assert ledger.datasets() == []  # a refusal names no dataset
    ledger.record_arrival(arrival("a"), "two", "h-a")
    ledger.record_arrival(arrival("b"), "one", "h-b")
    assert sorted(ledger.datasets()) == ["one", "two"]
    run = ledger.seal("one", "manual").run
    assert run is not None
    ledger.record(run.run_id, RunEnd(RunStatus.FAILED, "refused: no tokens", nodes_at_end=0))
    ended = ledger.get_run(run.run_id)
    assert ended is not None and (ended.status, ended.reason, ended.nodes_at_end) == (
        RunStatus.FAILED,
        "refused: no tokens",
        0,
    )
    assert [r.run_id for r in ledger.unsettled()] == [run.run_id]  # it still holds its content


def test_a_preview_says_what_a_seal_would_do_and_writes_nothing(ledger: Ledger) -> None:
    ledger.record_arrival(arrival("a"), "ds", "h-a")
    pending = ledger.seal("ds", "manual").run
    assert pending is not None
    for name, content in (("b", "h-b"), ("copy-of-a", "h-a"), ("c", "h-c")):
        ledger.record_arrival(arrival(name), "ds", content)
    preview = ledger.preview("ds")
    assert uris(preview.objects) == ("gs://land/incoming/b", "gs://land/incoming/c")
    assert preview.skipped == 1 and preview.pending_run is not None
    assert preview.pending_run.run_id == pending.run_id
    assert uris(preview.pending_objects) == ("gs://land/incoming/a",)
    assert ledger.preview("ds") == preview  # it wrote nothing
    (waiting,) = ledger.pending("ds")
    assert waiting.objects == 3


def test_a_pending_run_that_ended_before_it_started_is_replaced_by_the_next_seal(ledger: Ledger) -> None:
    ledger.record_arrival(arrival("a"), "ds", "h-a")
    cancelled = ledger.seal("ds", "manual").run
    assert cancelled is not None
    overwrite_run(ledger, cancelled.run_id, {"status": "cancelled"})  # an operator ended it before it began
    assert ledger.pending_run("ds") is None
    ledger.record_arrival(arrival("b"), "ds", "h-b")
    fresh = ledger.seal("ds", "scheduler").run
    assert fresh is not None and fresh.run_id != cancelled.run_id and fresh.trigger == Trigger.SCHEDULER
    assert ledger.pending_run("ds") == fresh
    assert uris(ledger.run_objects(fresh)) == ("gs://land/incoming/b",)  # h-a is still the cancelled run's


def test_datasets_have_separate_batches(ledger: Ledger) -> None:
    ledger.record_arrival(arrival("a"), "one", "h-a")
    ledger.record_arrival(arrival("b"), "two", "h-b")
    assert sorted(p.dataset for p in ledger.pending()) == ["one", "two"]
    assert [p.dataset for p in ledger.pending("two")] == ["two"]
    one, two = ledger.seal("one", "manual"), ledger.seal("two", "manual")
    assert uris(one.objects) == ("gs://land/incoming/a",) and uris(two.objects) == ("gs://land/incoming/b",)


def test_concurrent_duplicated_reordered_arrivals_land_exactly_once(ledger: Ledger) -> None:
    objects = [arrival(f"f{i:03d}") for i in range(40)]
    deliveries = objects + random.Random(7).sample(objects, 15)  # at-least-once: some twice
    random.Random(8).shuffle(deliveries)
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda a: ledger.record_arrival(a, "ds", "h-" + a.name).status, deliveries))
    assert outcomes.count("new") == 40 and outcomes.count("duplicate") == 15
    sealed = ledger.seal("ds", "manual")
    assert uris(sealed.objects) == tuple(sorted(a.uri for a in objects))


def test_seals_racing_arrivals_put_every_arrival_in_exactly_one_batch(ledger: Ledger) -> None:
    """The batch boundary is a commit timestamp: whatever the interleaving, nothing is lost or doubled."""
    objects = [arrival(f"r{i:04d}") for i in range(300)]
    batches: list[tuple[str, ...]] = []
    done = threading.Event()

    def sealer() -> None:
        while not done.is_set():
            sealed = ledger.seal("race", "manual")
            if sealed.run is not None:
                batches.append(uris(sealed.objects))

    thread = threading.Thread(target=sealer)
    thread.start()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda a: ledger.record_arrival(a, "race", "h-" + a.name), objects))
    done.set()
    thread.join()
    last = ledger.seal("race", "manual")
    if last.run is not None:
        batches.append(uris(last.objects))
    counts = Counter(uri for batch in batches for uri in batch)
    assert len(batches) > 1  # the seals really did cut the stream
    assert counts == Counter(a.uri for a in objects)  # every arrival exactly once


def export_job(table: str, after: object, through: object, job_id: str = "job-1") -> ExportJob:
    return ExportJob(
        table=table,
        dataset="ds",
        job_id=job_id,
        location="US",
        after=after,
        through=through,
        destination=f"gs://art/bigquery/ds/{job_id}/*.jsonl",
        started_at="2026-11-25T00:00:00+00:00",
        deadline="2026-11-25T01:00:00+00:00",
    )


def test_an_export_is_recorded_before_it_starts_and_moves_the_watermark_once(ledger: Ledger) -> None:
    table = "p.sales.orders"
    assert ledger.export_mark(table).value is None and ledger.pending_export(table) is None
    first = export_job(table, None, 10)
    assert ledger.begin_export(first)
    assert ledger.pending_export(table) == first and ledger.pending_exports() == [first]
    # one export under way per table
    assert not ledger.begin_export(export_job(table, None, 11, "job-2"))
    # only the job under way can finish
    assert not ledger.finish_export(export_job(table, None, 10, "job-2"), [arrival("bq-x")])
    assert ledger.finish_export(first, [arrival("bq-1"), arrival("bq-2")])
    assert not ledger.finish_export(first, [arrival("bq-1")])  # finished once
    assert progress(ledger.export_mark(table)) == (10, False, 0, "")
    assert ledger.pending_export(table) is None
    assert not ledger.begin_export(export_job(table, None, 12, "job-4"))  # it read another watermark
    capped = dataclasses.replace(export_job(table, 10, 12, "job-5"), capped=True)
    assert ledger.begin_export(capped) and ledger.finish_export(capped, [arrival("bq-3")])
    assert progress(ledger.export_mark(table)) == (12, True, 0, "")
    ledger.end_backlog(table, 10)  # read before the watermark moved to 12: the backlog stays
    assert ledger.export_mark(table).backlog
    ledger.end_backlog(table, 12)
    assert progress(ledger.export_mark(table)) == (12, False, 0, "")
    # a write while an export is under way leaves a backlog behind it too
    assert not ledger.want_export(table)  # none under way
    written_meanwhile = export_job(table, 12, 13, "job-6")
    assert ledger.begin_export(written_meanwhile) and ledger.want_export(table)
    assert ledger.pending_export(table) == written_meanwhile
    assert ledger.finish_export(written_meanwhile, []) and ledger.export_mark(table).backlog
    sealed = ledger.seal("ds", "manual")
    assert uris(sealed.objects) == tuple(f"gs://land/incoming/bq-{i}" for i in (1, 2, 3))
    assert ledger.export_mark(table).value == 13


def test_an_abandoned_export_leaves_the_watermark_for_the_next_one(ledger: Ledger) -> None:
    table = "p.sales.returns"
    failed = export_job(table, None, 10)
    assert ledger.begin_export(failed)
    assert not ledger.abandon_export(export_job(table, None, 10, "someone-else"), "not ours", "")
    assert ledger.pending_export(table) == failed
    assert ledger.abandon_export(failed, "Not found: Table p:sales.returns", "2026-11-25T00:01:00+00:00")
    assert not ledger.abandon_export(failed, "again", "")  # once
    assert ledger.pending_export(table) is None
    assert progress(ledger.export_mark(table)) == (None, True, 1, "2026-11-25T00:01:00+00:00")
    second = export_job(table, None, 10, "job-2")
    assert ledger.begin_export(second) and ledger.abandon_export(
        second, "timeout", "2026-11-25T00:03:00+00:00"
    )
    assert ledger.export_mark(table).failures == 2  # counted in a row
    again = export_job(table, None, 10, "job-3")
    assert ledger.begin_export(again) and ledger.finish_export(again, [arrival("bq-r")])
    assert progress(ledger.export_mark(table)) == (10, False, 0, "")  # landed: the failures are forgotten


@firestore_only
def test_an_abandoned_exports_reason_is_kept_until_one_lands(ledger: FirestoreLedger) -> None:
    """What an operator reads on the watermark's document (split from the test above, whose port-level
    part runs on the fake too)."""
    table = "p.sales.returns"
    failed = export_job(table, None, 10)
    assert ledger.begin_export(failed)
    assert ledger.abandon_export(failed, "Not found: Table p:sales.returns", "2026-11-25T00:01:00+00:00")
    mark = ledger.db.collection("watermarks").document(_key(table)).get().to_dict() or {}
    assert mark["last_failure"]["job_id"] == "job-1" and "Not found" in mark["last_failure"]["reason"]
    again = export_job(table, None, 10, "job-3")
    assert ledger.begin_export(again) and ledger.finish_export(again, [arrival("bq-r")])
    mark = ledger.db.collection("watermarks").document(_key(table)).get().to_dict() or {}
    assert "last_failure" not in mark


@firestore_only
def test_both_ways_of_recording_an_arrival_store_the_same_document(ledger: FirestoreLedger) -> None:
    # record_arrival builds its create as raw protobuf (a storm's hot path); finish_export uses the client
    ledger.record_arrival(arrival("fast", generation=3), "ds", "md5:md5-fast:text")
    job = export_job("p.d.t", None, 1)
    assert ledger.begin_export(job) and ledger.finish_export(job, [arrival("tx", generation=3)])
    docs = [d.to_dict() or {} for shard in ledger._arrival_shards("ds") for d in shard.stream()]
    fast, tx = sorted(docs, key=lambda d: str(d["uri"]))
    assert {k: type(v) for k, v in fast.items()} == {k: type(v) for k, v in tx.items()}
    assert (fast["generation"], fast["size"], fast["content_hash"]) == (3, 10, "md5:md5-fast:text")
    assert tx["content_hash"] == arrival("tx").content_hash
    assert fast["event_id"] == "ev-fast-3" and fast["time"] == "2026-11-21T00:00:00Z"
    assert fast["arrived_at"] < tx["arrived_at"]  # the server's commit time, as in the transaction


@pytest.mark.integration
def test_an_unreachable_ledger_is_retried_until_the_commit_deadline_then_raised(
    monkeypatch: pytest.MonkeyPatch, project: str
) -> None:
    # The hot path's own stub follows the client's Commit retry (ServiceUnavailable, 60 s); shortened here.
    from google.api_core.exceptions import ServiceUnavailable

    from retrain.adapters.ledger import arrivals
    from retrain_local.processes import free_port

    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", f"127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.setattr(arrivals, "COMMIT_DEADLINE_S", 3.0)
    unreachable = FirestoreLedger(project)
    unreachable._known_datasets.add("ds")  # straight to the hot path's commit
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable):
        unreachable.record_arrival(arrival("a"), "ds", "h-a")
    # retried with jittered backoff (0.1 s growing by 1.3: the first second is about eight attempts), then
    # given up once the next sleep would pass the deadline
    assert 1.0 < time.monotonic() - started < 6.0


@firestore_only
def test_a_batch_an_earlier_release_sealed_for_a_retry_still_makes_its_run(
    ledger: FirestoreLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Earlier releases recorded a retry's trigger as ``retry of RUN``: such a batch, sealed before an
    upgrade and finished after it (the sweeper finishing a seal a crash cut short), still makes its run,
    a retry of RUN."""
    dataset = f"legacy{uuid.uuid4().hex[:6]}"
    ledger.record_arrival(arrival("r"), dataset, "h-r")
    finish = ledger.materialize
    monkeypatch.setattr(ledger, "materialize", lambda batch_id: None)  # the sealer crashed here
    ledger.seal(dataset, Trigger.MANUAL)
    (batch,) = [b for b in ledger.batches_in(BatchState.SEALED) if b["dataset"] == dataset]
    legacy = {"trigger": "retry of ds-older", "retry_of": firestore.DELETE_FIELD}
    ledger.db.collection("batches").document(batch["batch_id"]).update(legacy)
    sealed = finish(batch["batch_id"])
    assert sealed.run is not None and (sealed.run.trigger, sealed.run.retry_of) == (Trigger.RETRY, "ds-older")
