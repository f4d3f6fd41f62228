"""Every landed object accounted for: the landing bucket (and BigQuery's exported files) against the ledger.

Each object version that landed is exactly one of: trained by a run that succeeded, held by its
dataset's live or pending run, a pending arrival (since the last seal), a duplicate of content in one of
those, trained by a run whose checkpoint the eval gate refused (not in the lineage: ``retrain run
--retry`` trains it on the champion), given back by a run that did not succeed (waiting for ``retrain run
--retry``), gone before any
run could read it, set aside whole by the run that held it (unreadable), refused with a recorded reason,
or a seal marker.  Anything else is a finding, named object by object with what to do; ``retrain audit``
exits non-zero on one, the Scheduler's ``audit`` job logs them (and records the arrivals of objects
whose events never came: Eventarc gives up after a day), and every stack test ends with an audit.

The ledger is read cut first and holdings last (``Ledger.dataset_records``), so a seal landing meanwhile
shows its arrivals as pending or held, never as neither; what changes between two reads is settled by
reading again (:func:`audit` with ``settle_s``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from retrain.config import Settings
from retrain.contracts import RunManifest
from retrain.domain.datasets import is_dataset_name
from retrain.domain.events import ObjectArrival, ObjectVersion
from retrain.domain.runs import Run, RunStatus, now_iso
from retrain.plan import manifest_object, set_aside
from retrain.ports import DatasetRecords, Holding, Ledger, ObjectInfo, ObjectStore, Rejection

log = logging.getLogger("retrain.audit")

#: Where BigQuery's exported files land in the artifacts bucket (``retrain.exports``): bigquery/DATASET/...
BIGQUERY_FOLDER = "bigquery/"


class Account(StrEnum):
    """Where one object version stands."""

    TRAINED = "trained"
    """Its content trained in a run that succeeded, read through this version."""
    HELD = "held"
    """Its content is in its dataset's live or pending run, through this version."""
    PENDING = "pending"
    """It arrived after its dataset's last seal: the next seal takes it."""
    DUPLICATE = "duplicate"
    """Its content is trained or held through another version (identical bytes train once)."""
    RETURNED = "returned"
    """A run that did not succeed gave its content back: ``retrain run --retry RUN`` trains it."""
    WITHDRAWN = "withdrawn"
    """Deleted or overwritten before any run read it, its content in no run: nothing is left to train."""
    REFUSED = "refused"
    """Its content trained in a run that succeeded whose checkpoint the eval gate refused: it is not in
    the lineage the next run continues; ``retrain run --retry RUN`` trains it on the champion."""
    SET_ASIDE = "set-aside"
    """The run that held it set it aside whole (unreadable, too large) and gave its content back."""
    REJECTED = "rejected"
    """Refused when it landed, with a recorded reason (a folder that is not a dataset name)."""
    MARKER = "marker"
    """A seal marker: it sealed its dataset."""
    EMPTY = "empty"
    """An exported BigQuery file without rows."""
    IN_FLIGHT = "in-flight"
    """It landed moments ago (or its export is under way): its event may still be on its way."""
    # --- findings: something is wrong ---
    UNRECORDED = "unrecorded"
    """It landed, and retrain never recorded it (its event was lost)."""
    STRANDED = "stranded"
    """Its content is held by a run that ended without succeeding and did not give it back."""
    UNHELD = "unheld"
    """It was sealed, but no run holds its content and none gave it back."""
    UNTRAINED = "untrained"
    """A run that succeeded holds its content, but set this version aside whole: it never trained."""
    ORPHANED = "orphaned"
    """Its content is held by a run the ledger does not have."""
    OFF_MANIFEST = "off-manifest"
    """A run that started holds its content, and the run's manifest (what it reads) does not list it."""

    @property
    def finding(self) -> bool:
        return self in FINDINGS


FINDINGS = frozenset(
    {
        Account.UNRECORDED,
        Account.STRANDED,
        Account.UNHELD,
        Account.UNTRAINED,
        Account.ORPHANED,
        Account.OFF_MANIFEST,
    }
)


@dataclass(frozen=True)
class Entry:
    """One object version and where it stands."""

    uri: str
    generation: int
    dataset: str | None
    """Its dataset (None: its folder is not a dataset name)."""
    account: Account
    run_id: str | None = None
    """The run its content is with (trained, held, given back, stranded)."""
    detail: str = ""
    content_hash: str = ""
    """The content it arrived with ("" when it never arrived)."""

    @property
    def action(self) -> str:
        """What to do about it ("" when nothing needs doing)."""
        run = self.run_id or "RUN"
        return {
            Account.RETURNED: f"`retrain run --retry {run}` trains it",
            Account.REFUSED: f"`retrain run --retry {run}` trains it on the champion, if you decide so",
            Account.UNRECORDED: "`retrain audit --repair` records its arrival (as its event would have)",
            Account.STRANDED: f"`retrain audit --repair` gives it back (then `retrain run --retry {run}`)",
            Account.UNHELD: "`retrain audit --repair` makes it arrive again; the next seal takes it",
            Account.UNTRAINED: f"`retrain audit --repair` gives back what run {run} could not read",
            Account.ORPHANED: "a ledger fault: report it; the content entry names no run",
            Account.OFF_MANIFEST: f"a ledger fault: report it; `retrain cancel {run}`, then retry it",
        }.get(self.account, "")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "account": str(self.account), "action": self.action}


@dataclass
class AuditReport:
    """Every object version checked, and when."""

    entries: list[Entry] = field(default_factory=list)
    checked_at: str = field(default_factory=now_iso)

    @property
    def findings(self) -> list[Entry]:
        return [e for e in self.entries if e.account.finding]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for e in self.entries:
            out[str(e.account)] += 1
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked_at": self.checked_at,
            "objects": len(self.entries),
            "counts": self.counts(),
            "findings": [e.to_dict() for e in self.findings],
            "waiting": [e.to_dict() for e in self.entries if e.account == Account.RETURNED],
        }


@dataclass(frozen=True)
class Landed:
    """The objects in the buckets, by dataset: what the ledger is checked against."""

    by_dataset: dict[str | None, list[ObjectInfo]]
    exports_under_way: tuple[str, ...] = ()
    """Prefixes of BigQuery exports that have not finished: their files are not arrivals yet."""


def landed(settings: Settings, store: ObjectStore, exports_under_way: Iterable[str] = ()) -> Landed:
    """Every object version under the landing prefix and in the artifacts bucket's BigQuery folder."""
    by_dataset: dict[str | None, list[ObjectInfo]] = defaultdict(list)
    landing = f"gs://{settings.landing_bucket}/"
    for info in store.list_objects(landing + settings.landing_prefix, versions=True):
        by_dataset[settings.dataset_of_object(info.uri[len(landing) :])].append(info)
    exported = f"{settings.artifacts_uri}/{BIGQUERY_FOLDER}"
    for info in store.list_objects(exported, versions=True):
        head = info.uri[len(exported) :].partition("/")[0]
        by_dataset[head if is_dataset_name(head) else None].append(info)
    return Landed(dict(by_dataset), tuple(d.split("*", 1)[0] for d in exports_under_way))


def classify(
    settings: Settings,
    records: DatasetRecords,
    objects: list[ObjectInfo],
    rejections: Mapping[tuple[str, int], Rejection],
    manifests: Mapping[str, RunManifest | None],
    now: datetime,
    exports_under_way: tuple[str, ...] = (),
) -> list[Entry]:
    """Where each object version of one dataset stands (pure: the records and listings are read before)."""
    books = _Books.read(settings, records, objects, rejections, manifests, now, exports_under_way)
    out = [books.where(key) for key in sorted(set(books.live) | set(books.arrivals))]
    return out + books.held_unseen({(e.uri, e.generation) for e in out})


#: An object version: (its gs:// URI, its generation).
_Key = tuple[str, int]


@dataclass
class _Books:
    """One dataset's records indexed for the audit's questions about each object version."""

    settings: Settings
    records: DatasetRecords
    rejections: Mapping[_Key, Rejection]
    exports_under_way: tuple[str, ...]
    grace_before: datetime
    """An object updated after this may still have its finalize event on the way."""
    runs: dict[str, Run]
    holders: dict[str, Holding]
    """Content hash -> the entry of the run that holds it."""
    returned_by: dict[str, str]
    """Content hash -> the run that gave it back last."""
    arrivals: dict[_Key, list[str]]
    """Version -> its arrival times."""
    hash_of: dict[_Key, str]
    live: dict[_Key, ObjectInfo]
    off_manifest: dict[_Key, str]
    """Held by a started run whose manifest lacks it -> why."""

    @classmethod
    def read(
        cls,
        settings: Settings,
        records: DatasetRecords,
        objects: list[ObjectInfo],
        rejections: Mapping[_Key, Rejection],
        manifests: Mapping[str, RunManifest | None],
        now: datetime,
        exports_under_way: tuple[str, ...],
    ) -> _Books:
        runs = {r.run_id: r for r in records.runs}
        returned_by: dict[str, str] = {}
        for run_id in sorted(records.returned, key=lambda r: runs[r].created_at if r in runs else ""):
            for version in records.returned[run_id]:
                returned_by[version.content_hash] = run_id
        arrivals: dict[_Key, list[str]] = defaultdict(list)
        hash_of: dict[_Key, str] = {}
        for a in records.arrivals:
            key = (a.version.uri, a.version.generation)
            arrivals[key].append(a.arrived_at)
            hash_of[key] = hash_of.get(key) or a.version.content_hash
        off_manifest: dict[_Key, str] = {}
        for h in records.holdings:
            if h.run_id in manifests:
                manifest = manifests[h.run_id]
                key = (h.version.uri, h.version.generation)
                if manifest is None:
                    off_manifest[key] = "its run has no manifest"
                elif key not in {(v.uri, v.generation) for v in manifest.objects}:
                    off_manifest[key] = "its run's manifest does not list it"
        return cls(
            settings,
            records,
            rejections,
            exports_under_way,
            now - timedelta(seconds=settings.audit_grace_s),
            runs,
            {h.version.content_hash: h for h in records.holdings},
            returned_by,
            arrivals,
            hash_of,
            {(o.uri, int(o.generation or 0)): o for o in objects},
            off_manifest,
        )

    def entry(self, key: _Key, account: Account, run_id: str | None = None, detail: str = "") -> Entry:
        return Entry(key[0], key[1], self.records.dataset, account, run_id, detail, self.hash_of.get(key, ""))

    def where(self, key: _Key) -> Entry:
        uri, _ = key
        if uri.rsplit("/", 1)[-1] == self.settings.seal_marker:
            return self.entry(key, Account.MARKER)
        if key in self.rejections:
            return self.entry(key, Account.REJECTED, detail=self.rejections[key].reason)
        if key not in self.arrivals:
            return self._not_arrived(key)
        holding = self.holders.get(self.hash_of[key])
        if holding is not None:
            return self._held(key, holding)
        return self._not_held(key)

    def _not_arrived(self, key: _Key) -> Entry:
        uri, info = key[0], self.live.get(key)
        if info is not None and info.size == 0 and "/" + BIGQUERY_FOLDER in uri:
            return self.entry(key, Account.EMPTY)
        recent = info is not None and info.updated is not None and info.updated > self.grace_before
        if recent or any(uri.startswith(p) for p in self.exports_under_way):
            return self.entry(key, Account.IN_FLIGHT)
        return self.entry(key, Account.UNRECORDED, detail="no arrival recorded")

    def _held(self, key: _Key, holding: Holding) -> Entry:
        """Its content is held by a run (this version's or another's with the same bytes)."""
        run = self.runs.get(holding.run_id)
        own = (holding.version.uri, holding.version.generation) == key
        if run is None:
            return self.entry(key, Account.ORPHANED, holding.run_id, f"content {self.hash_of[key]}")
        if own and key in self.off_manifest:
            return self.entry(key, Account.OFF_MANIFEST, run.run_id, self.off_manifest[key])
        if run.status == RunStatus.SUCCEEDED and own and key in _unread(run):
            return self.entry(key, Account.UNTRAINED, run.run_id, "set aside whole by its tokenize job")
        if run.status.terminal and run.status != RunStatus.SUCCEEDED and not run.promoted:
            return self.entry(key, Account.STRANDED, run.run_id, f"run {run.run_id} ended {run.status}")
        if not own:
            return self.entry(key, Account.DUPLICATE, run.run_id, f"same content as {holding.version.uri}")
        if run.refused:
            return self.entry(key, Account.REFUSED, run.run_id, run.eval.reason if run.eval else "")
        return self.entry(key, Account.HELD if not run.status.terminal else Account.TRAINED, run.run_id)

    def _not_held(self, key: _Key) -> Entry:
        """It arrived and no run holds its content: not sealed yet, or given back."""
        last_cut = self.records.last_cut
        if last_cut is None or max(self.arrivals[key]) > last_cut:
            return self.entry(key, Account.PENDING)
        giver = self.runs.get(self.returned_by.get(self.hash_of[key], ""))
        if giver is None:
            return self.entry(key, Account.UNHELD, detail="sealed; its content is in no run")
        if self.live.get(key) is None:
            return self.entry(key, Account.WITHDRAWN, giver.run_id, "gone since it arrived")
        if giver.status == RunStatus.SUCCEEDED:
            if key in _unread(giver):
                return self.entry(key, Account.SET_ASIDE, giver.run_id)
            if not giver.refused:  # a refused run's content went back whole (`retrain run --retry`)
                return self.entry(
                    key, Account.UNHELD, giver.run_id, f"run {giver.run_id} could not read its copy"
                )
        return self.entry(key, Account.RETURNED, giver.run_id, f"run {giver.run_id} ended {giver.status}")

    def held_unseen(self, reported: set[_Key]) -> list[Entry]:
        """Content held through a version neither the bucket nor an arrival shows."""
        out = []
        for h in self.records.holdings:
            key = (h.version.uri, h.version.generation)
            run = self.runs.get(h.run_id)
            if key in reported:
                continue
            if run is None:
                out.append(self.entry(key, Account.ORPHANED, h.run_id, f"content {h.version.content_hash}"))
            elif key in self.off_manifest:
                out.append(self.entry(key, Account.OFF_MANIFEST, h.run_id, self.off_manifest[key]))
            elif run.status in (RunStatus.FAILED, RunStatus.CANCELLED) and not run.promoted:
                out.append(self.entry(key, Account.STRANDED, h.run_id, f"run {h.run_id} ended {run.status}"))
        return out


def _unread(run: Run) -> set[_Key]:
    """The versions a run's tokenize job set aside whole."""
    return {q.version for q in run.quarantined_objects}


def _manifest(settings: Settings, store: ObjectStore, run: Run) -> RunManifest | None:
    """The run's manifest at the version its start wrote (the one its tokenize job read)."""
    uri = f"{settings.artifacts_uri}/{manifest_object(run.run_id)}"
    try:
        return RunManifest.parse(store.read_bytes(uri, run.manifest_generation))
    except (FileNotFoundError, ValueError):
        return None


def audit_once(
    settings: Settings, ledger: Ledger, store: ObjectStore, dataset: str | None = None
) -> AuditReport:
    """One pass over every dataset (or ``dataset``): the buckets listed first, then the ledger."""
    report = AuditReport()
    now = datetime.now(UTC)
    objects = landed(settings, store, (j.destination for j in ledger.pending_exports()))
    rejections = {(r.version.uri, r.version.generation): r for r in ledger.rejections()}
    names = {n for n in objects.by_dataset if n} | set(ledger.datasets())
    for name in sorted(names):
        if dataset is not None and name != dataset:
            continue
        records = ledger.dataset_records(name)
        started = {h.run_id for h in records.holdings} & {
            r.run_id for r in records.runs if r.status != RunStatus.PENDING or r.execution
        }
        manifests = {r.run_id: _manifest(settings, store, r) for r in records.runs if r.run_id in started}
        # every object a run set aside, also those past the 100 its record names
        runs = [replace(r, quarantined_objects=set_aside(settings, store, r)) for r in records.runs]
        records = replace(records, runs=runs)
        report.entries += classify(
            settings,
            records,
            objects.by_dataset.get(name, []),
            rejections,
            manifests,
            now,
            objects.exports_under_way,
        )
    if dataset is None:
        for info in objects.by_dataset.get(None, []):
            key = (info.uri, int(info.generation or 0))
            account = Account.REJECTED if key in rejections else Account.UNRECORDED
            detail = rejections[key].reason if key in rejections else "its folder is not a dataset name"
            report.entries.append(Entry(info.uri, key[1], None, account, None, detail))
    return report


def audit(
    settings: Settings,
    ledger: Ledger,
    store: ObjectStore,
    dataset: str | None = None,
    settle_s: float = 0.0,
) -> AuditReport:
    """An audit whose findings held for ``settle_s``: while something is found, read everything again
    (once a second) until nothing is, or the findings stay the same past ``settle_s``."""
    report = audit_once(settings, ledger, store, dataset)
    deadline = time.monotonic() + settle_s
    while report.findings and time.monotonic() < deadline:
        time.sleep(1.0)
        report = audit_once(settings, ledger, store, dataset)
    return report


def repair(report: AuditReport, settings: Settings, ledger: Ledger, store: ObjectStore) -> list[Entry]:
    """Do what each mechanical finding's action says (unrecorded: record the arrival; stranded: give the
    content back; unheld: arrive again; untrained: give back what was not read); the entries repaired."""
    from retrain.steps import give_back_unread

    repaired: list[Entry] = []
    runs: dict[str, Run | None] = {}

    def run_of(run_id: str | None) -> Run | None:
        if run_id and run_id not in runs:
            runs[run_id] = ledger.get_run(run_id)
        return runs.get(run_id or "")

    for e in report.findings:
        if e.account == Account.UNRECORDED:
            info = store.stat(e.uri, e.generation or None)
            bucket, name = e.uri.removeprefix("gs://").split("/", 1)
            arrival = ObjectArrival(
                f"audit:{report.checked_at}",
                bucket,
                name,
                e.generation,
                info.size,
                info.md5_hash or "",
                now_iso(),
            )
            if e.dataset is None:
                ledger.record_rejection(arrival.version, "its folder is not a dataset name")
            else:
                ledger.record_arrival(arrival, e.dataset, arrival.content_hash)
        elif e.account == Account.STRANDED and (run := run_of(e.run_id)) is not None:
            ledger.give_back(run)
        elif e.account == Account.UNTRAINED and (run := run_of(e.run_id)) is not None:
            give_back_unread(settings, ledger, store, run)
        elif e.account == Account.UNHELD and e.dataset is not None:
            size = store.stat(e.uri, e.generation or None).size
            version = ObjectVersion(e.uri, e.generation, size, e.content_hash)
            ledger.arrive_again(e.dataset, version, f"audit {report.checked_at}")
        else:
            continue
        repaired.append(e)
    return repaired


def log_report(report: AuditReport) -> None:
    """One line for the whole audit; one more per finding (what is wrong and what to do)."""
    level = logging.ERROR if report.findings else logging.INFO
    log.log(level, "audit: %d object version(s): %s", len(report.entries), report.counts())
    for e in report.findings:
        log.error("audit: %s#%s is %s (%s): %s", e.uri, e.generation, e.account, e.detail, e.action)
