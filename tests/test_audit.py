"""The audit's accounting (retrain.audit.classify): every object version lands in exactly one place, and
what is wrong is named with what to do.  Pure: records and listings built here, no emulator."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from retrain import config
from retrain.audit import Account, classify
from retrain.contracts import RunManifest
from retrain.domain.events import ObjectVersion
from retrain.domain.runs import Evaluation, ObjectSetAside, Run, RunStatus
from retrain.ports import DatasetRecords, Holding, ObjectInfo, RecordedArrival, Rejection

SETTINGS = config.load({})
NOW = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
LONG_AGO = NOW - timedelta(hours=2)
LAND = f"gs://{SETTINGS.landing_bucket}/{SETTINGS.landing_prefix}news/"
CUT = "2026-11-26T11:00:00.000000Z"
FIRST_CHECKPOINT = Evaluation(3.0, None, None, None, True, "the dataset's first checkpoint")
BEFORE, AFTER = "2026-11-26T10:00:00.000000Z", "2026-11-26T11:30:00.000000Z"


def version(name: str, generation: int = 1, content: str | None = None) -> ObjectVersion:
    return ObjectVersion(LAND + name, generation, 10, f"md5:{content or name}:text")


def listed(v: ObjectVersion, updated: datetime = LONG_AGO) -> ObjectInfo:
    return ObjectInfo(v.uri, v.size, v.generation, v.md5, updated)


def run(run_id: str, status: RunStatus, **fields: object) -> Run:
    return Run(run_id=run_id, dataset="news", trigger="manual", status=status, **fields)  # type: ignore[arg-type]


def accounts(
    records: DatasetRecords,
    live: list[ObjectInfo],
    rejections: dict[tuple[str, int], Rejection] | None = None,
    manifests: dict[str, RunManifest | None] | None = None,
) -> dict[tuple[str, int], tuple[Account, str | None]]:
    entries = classify(SETTINGS, records, live, rejections or {}, manifests or {}, NOW)
    out = {(e.uri.rsplit("/", 1)[-1], e.generation): (e.account, e.run_id) for e in entries}
    assert len(out) == len(entries), "an object version is accounted twice"
    return out


def test_trained_held_pending_duplicate_and_the_marker_are_accounted_for() -> None:
    trained, held, pending = version("a"), version("b"), version("c")
    synced = version("a", 2, content="a")  # the same file uploaded again: a new generation, same bytes
    marker = version(SETTINGS.seal_marker, 7, content="marker")
    records = DatasetRecords(
        "news",
        CUT,
        [
            RecordedArrival(trained, BEFORE),
            RecordedArrival(held, BEFORE),
            RecordedArrival(synced, BEFORE),
            RecordedArrival(pending, AFTER),
        ],
        [Holding(trained, "r1"), Holding(held, "r2")],
        [run("r1", RunStatus.SUCCEEDED), run("r2", RunStatus.TRAINING)],
        {},
    )
    got = accounts(records, [listed(synced), listed(held), listed(pending), listed(marker)])
    assert got == {
        ("a", 1): (Account.TRAINED, "r1"),  # gone from the bucket, but its content trained
        ("a", 2): (Account.DUPLICATE, "r1"),
        ("b", 1): (Account.HELD, "r2"),
        ("c", 1): (Account.PENDING, None),
        (SETTINGS.seal_marker, 7): (Account.MARKER, None),
    }


def test_content_a_failed_run_gave_back_waits_for_a_retry_unless_it_is_gone() -> None:
    kept, gone = version("k"), version("g")
    records = DatasetRecords(
        "news",
        CUT,
        [RecordedArrival(kept, BEFORE), RecordedArrival(gone, BEFORE)],
        [],
        [run("failed-1", RunStatus.FAILED, content_returned=True)],
        {"failed-1": [kept, gone]},
    )
    got = accounts(records, [listed(kept)])
    assert got == {
        ("k", 1): (Account.RETURNED, "failed-1"),
        ("g", 1): (Account.WITHDRAWN, "failed-1"),
    }
    returned = next(e for e in classify(SETTINGS, records, [listed(kept)], {}, {}, NOW) if e.uri == kept.uri)
    assert returned.action == "`retrain run --retry failed-1` trains it" and not returned.account.finding


def test_content_of_a_run_whose_checkpoint_was_refused_is_not_called_trained() -> None:
    """Its data trained, but not into the lineage: the audit names it, with the retry that would train
    it on the champion; once retried, it is given back like a failed run's."""
    mine = version("m")
    refused = Evaluation(3.5, 3.1, "r0", "the dataset's eval set", False, "worse than the champion")
    holding = DatasetRecords(
        "news",
        CUT,
        [RecordedArrival(mine, BEFORE)],
        [Holding(mine, "r1")],
        [run("r1", RunStatus.SUCCEEDED, eval=refused)],
        {},
    )
    assert accounts(holding, [listed(mine)]) == {("m", 1): (Account.REFUSED, "r1")}
    (entry,) = classify(SETTINGS, holding, [listed(mine)], {}, {}, NOW)
    assert entry.action.startswith("`retrain run --retry r1` trains it on the champion")
    assert not entry.account.finding
    unread = version("u")
    quarantined = [ObjectSetAside(unread.uri, 1, "unreadable", "not Parquet")]
    ended = run(
        "r1", RunStatus.SUCCEEDED, eval=refused, content_returned=True, quarantined_objects=quarantined
    )
    retried = DatasetRecords(
        "news",
        CUT,
        [RecordedArrival(mine, BEFORE), RecordedArrival(unread, BEFORE)],
        [],
        [ended],
        {"r1": [mine, unread]},
    )
    assert accounts(retried, [listed(mine), listed(unread)]) == {
        ("m", 1): (Account.RETURNED, "r1"),
        ("u", 1): (Account.SET_ASIDE, "r1"),  # a retry would set it aside again: not "--retry trains it"
    }


def test_what_is_lost_is_a_finding_with_what_to_do() -> None:
    never, stranded, unheld = version("never"), version("stranded"), version("unheld")
    fresh = version("fresh")
    records = DatasetRecords(
        "news",
        CUT,
        [RecordedArrival(stranded, BEFORE), RecordedArrival(unheld, BEFORE)],
        [Holding(stranded, "broken")],
        [run("broken", RunStatus.FAILED)],  # ended without giving its content back
        {},
    )
    live = [
        listed(never),
        listed(stranded),
        listed(unheld),
        listed(fresh, updated=NOW - timedelta(seconds=5)),
    ]
    got = accounts(records, live)
    assert got == {
        ("never", 1): (Account.UNRECORDED, None),  # its event never came
        ("fresh", 1): (Account.IN_FLIGHT, None),  # landed seconds ago: its event may be on its way
        ("stranded", 1): (Account.STRANDED, "broken"),
        ("unheld", 1): (Account.UNHELD, None),
    }
    findings = {e.uri.rsplit("/", 1)[-1]: e for e in classify(SETTINGS, records, live, {}, {}, NOW)}
    assert findings["never"].account.finding and "--repair" in findings["never"].action
    assert "--retry broken" in findings["stranded"].action


def test_a_promoted_run_keeps_its_content_whatever_its_status_says() -> None:
    """A run whose release failed after its checkpoint was promoted: its content is in the model."""
    v = version("p")
    records = DatasetRecords(
        "news",
        CUT,
        [RecordedArrival(v, BEFORE)],
        [Holding(v, "promoted")],
        [run("promoted", RunStatus.FAILED, eval=FIRST_CHECKPOINT)],
        {},
    )
    assert accounts(records, [listed(v)]) == {("p", 1): (Account.TRAINED, "promoted")}


def test_an_object_a_successful_run_could_not_read_is_untrained_until_given_back() -> None:
    unread, read = version("unread"), version("read")
    quarantined = [ObjectSetAside(unread.uri, 1, "unreadable", "not Parquet")]
    held = DatasetRecords(
        "news",
        CUT,
        [RecordedArrival(unread, BEFORE), RecordedArrival(read, BEFORE)],
        [Holding(unread, "r"), Holding(read, "r")],
        [run("r", RunStatus.SUCCEEDED, quarantined_objects=quarantined)],
        {},
    )
    assert accounts(held, [listed(unread), listed(read)])[("unread", 1)] == (Account.UNTRAINED, "r")
    purged = version("purged", content="unread")  # a copy of its bytes, withdrawn for good since
    given_back = DatasetRecords(
        "news",
        CUT,
        [*held.arrivals, RecordedArrival(purged, BEFORE)],
        [Holding(read, "r")],
        [run("r", RunStatus.SUCCEEDED, quarantined_objects=quarantined, returned_untrained=1)],
        {"r": [unread]},
    )
    got = accounts(given_back, [listed(unread), listed(read)])
    assert got == {
        ("unread", 1): (Account.SET_ASIDE, "r"),
        ("read", 1): (Account.TRAINED, "r"),
        ("purged", 1): (Account.WITHDRAWN, "r"),
    }


def test_content_outside_its_runs_manifest_and_rejected_objects() -> None:
    listed_v, extra = version("listed"), version("extra")
    records = DatasetRecords(
        "news",
        CUT,
        [RecordedArrival(listed_v, BEFORE), RecordedArrival(extra, BEFORE)],
        [Holding(listed_v, "r"), Holding(extra, "r")],
        [run("r", RunStatus.TRAINING, execution="e")],
        {},
    )
    manifest = RunManifest("r", "news", "b", "s", [listed_v])
    got = accounts(records, [listed(listed_v), listed(extra)], manifests={"r": manifest})
    assert got == {("listed", 1): (Account.HELD, "r"), ("extra", 1): (Account.OFF_MANIFEST, "r")}
    refused = version("refused")
    rejection = Rejection(refused, "dataset folder 'News' is not a valid dataset name", BEFORE)
    empty = DatasetRecords("news", CUT, [], [], [], {})
    got = accounts(empty, [listed(refused)], {(refused.uri, 1): rejection})
    assert got == {("refused", 1): (Account.REJECTED, None)}
