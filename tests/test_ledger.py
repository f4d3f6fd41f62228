"""The Firestore ledger against the real Firestore emulator: dedup, batches, seals, snapshots."""

from __future__ import annotations

import itertools
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from retrain.adapters.ledger import FirestoreLedger
from retrain.domain.events import ObjectArrival

pytestmark = pytest.mark.emulators


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


@pytest.fixture
def ledger(firestore_host: str, project: str) -> FirestoreLedger:
    return FirestoreLedger(project)


def test_redelivered_event_and_same_object_version_are_duplicates(ledger: FirestoreLedger) -> None:
    first = ledger.record_arrival(arrival("a"), "ds", "h-a")
    assert first.status == "new"
    assert ledger.record_arrival(arrival("a"), "ds", "h-a").status == "duplicate"  # same event id
    same_object = arrival("a", event_id="another-id")
    assert ledger.record_arrival(same_object, "ds", "h-a").status == "duplicate"  # same bucket/name/gen
    newer = ledger.record_arrival(arrival("a", generation=2), "ds", "h-a2")
    assert newer.status == "new" and newer.batch_id == first.batch_id


def test_seal_makes_one_run_with_every_object_then_nothing(ledger: FirestoreLedger) -> None:
    for name in ("a", "b", "c"):
        ledger.record_arrival(arrival(name), "ds", f"h-{name}")
    sealed = ledger.seal("ds", "test")
    assert sealed.run is not None
    assert sealed.objects == ("gs://land/incoming/a", "gs://land/incoming/b", "gs://land/incoming/c")
    stored = ledger.get_run(sealed.run.run_id)
    assert (
        stored is not None and stored.objects == 3 and stored.status == "pending" and stored.trigger == "test"
    )
    assert ledger.seal("ds", "test").reason == "nothing pending"
    # arrivals after the seal open a new batch
    later = ledger.record_arrival(arrival("d"), "ds", "h-d")
    assert later.batch_id != sealed.run.batch_id


def test_identical_data_never_trains_twice(ledger: FirestoreLedger) -> None:
    for name in ("a", "b"):
        ledger.record_arrival(arrival(name), "ds", f"h-{name}")
    first = ledger.seal("ds", "test")
    assert first.run is not None
    # the same content re-uploaded under other names (and in another order) is the same snapshot
    ledger.record_arrival(arrival("copy-of-b", generation=7), "ds", "h-b")
    ledger.record_arrival(arrival("copy-of-a", generation=9), "ds", "h-a")
    again = ledger.seal("ds", "test")
    assert again.run is None and first.run.run_id in again.reason
    assert [r.run_id for r in ledger.list_runs()] == [first.run.run_id]


def test_datasets_have_separate_batches(ledger: FirestoreLedger) -> None:
    ledger.record_arrival(arrival("a"), "one", "h-a")
    ledger.record_arrival(arrival("b"), "two", "h-b")
    one, two = ledger.seal("one", "t"), ledger.seal("two", "t")
    assert one.objects == ("gs://land/incoming/a",) and two.objects == ("gs://land/incoming/b",)


def test_concurrent_duplicated_reordered_arrivals_land_exactly_once(ledger: FirestoreLedger) -> None:
    objects = [arrival(f"f{i:03d}") for i in range(40)]
    deliveries = objects + random.Random(7).sample(objects, 15)  # at-least-once: some twice
    random.Random(8).shuffle(deliveries)
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda a: ledger.record_arrival(a, "ds", "h-" + a.name).status, deliveries))
    assert outcomes.count("new") == 40 and outcomes.count("duplicate") == 15
    sealed = ledger.seal("ds", "t")
    assert sealed.objects == tuple(sorted(a.uri for a in objects))
    assert len(set(itertools.chain(sealed.objects))) == 40
