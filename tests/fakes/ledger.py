"""The ledger in memory: :class:`retrain.ports.Ledger` as ``retrain.adapters.ledger`` keeps it in Firestore.

What it keeps of the Firestore ledger (``tests/test_ledger.py`` runs its port-level tests against both):

- an arrival is recorded once per object version (bucket, name, generation), whatever its event id;
- a seal cuts the dataset's timeline at its own commit time, so each arrival lands in exactly one
  batch; a content hash some run holds (trained, live or pending) adds nothing; a dataset has at most
  one pending run, which seals join until its start is claimed;
- a start claim takes the dataset's live slot unless a live run holds it, is not taken again while
  fresh, and binds plans and executions only under its token;
- a run that did not succeed gives its content back once; an export moves its table's watermark once.

Every call is atomic (one lock): it plays the sequential behaviour Firestore's transactions and
preconditions give the adapter, not Firestore's contention.  Documents are stored as Firestore holds them
(JSON values, copied in and out), and queries answer in the order Firestore's do (by document id) where
the adapter does not sort.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from typing import Any

# The Firestore layout's document ids and stored shapes, and its one rule for a batch's first object by
# content: one definition each, here and in the adapter.
from retrain.adapters.ledger.base import (
    _arrival_fields,
    _arrival_shard,
    _export_job,
    _first_by_content,
    _key,
    _watermark,
)
from retrain.domain.events import ObjectArrival, ObjectVersion
from retrain.domain.runs import (
    BatchState,
    Champion,
    Pending,
    Run,
    RunStatus,
    Trigger,
    execution_id,
    iso,
    new_run_id,
    now_iso,
    parse_iso,
    read_trigger,
    snapshot_id,
)
from retrain.domain.transitions import RunChange
from retrain.ports import (
    ArrivalOutcome,
    ArrivalStatus,
    DatasetRecords,
    ExportJob,
    Holding,
    RecordedArrival,
    Rejection,
    SealOutcome,
    SealPreview,
    SealVerdict,
    StartClaim,
    StartVerdict,
    Watermark,
)


def _stored(value: Any) -> Any:
    """``value`` as a document holds it: a copy, sequences as arrays (lists), maps as maps."""
    if isinstance(value, dict):
        return {str(k): _stored(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_stored(v) for v in value]
    return value


class InMemoryLedger:
    """Every part of the ledger port, in dictionaries under one lock."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._last_stamp = datetime.now(UTC)
        self._datasets: dict[str, dict[str, Any]] = {}
        self._promotions: dict[tuple[str, str], dict[str, Any]] = {}
        self._arrivals: dict[str, dict[str, dict[str, Any]]] = {}
        self._seals: dict[str, list[tuple[datetime, str]]] = {}
        self._batches: dict[str, dict[str, Any]] = {}
        self._contents: dict[str, dict[str, dict[str, Any]]] = {}
        self._returned: dict[str, dict[str, dict[str, Any]]] = {}
        self._slots: dict[str, str] = {}
        self._runs: dict[str, dict[str, Any]] = {}
        self._rejections: dict[str, dict[str, Any]] = {}
        self._marks: dict[str, dict[str, Any]] = {}
        self._exports: dict[str, dict[str, Any]] = {}

    # -- what tests set up, as stack_support.overwrite_run does on Firestore ---------------------------

    def overwrite_run(self, run_id: str, fields: dict[str, Any]) -> None:
        """Set a run record's fields by name (a test's setup: what the workflow's ``record`` writes)."""
        self._patch_run(run_id, fields)

    def put_run(self, run: Run) -> None:
        """Store a run record as it is (a test's setup)."""
        with self._lock:
            self._runs[run.run_id] = _stored(run.to_dict())

    # -- time and shared reads ------------------------------------------------------------------------

    def _stamp(self) -> datetime:
        """A commit time: strictly later than every earlier one."""
        with self._lock:
            self._last_stamp = max(datetime.now(UTC), self._last_stamp + timedelta(microseconds=1))
            return self._last_stamp

    def _ensure_dataset(self, dataset: str) -> dict[str, Any]:
        return self._datasets.setdefault(dataset, {"created_at": now_iso()})

    def _last_cut(self, dataset: str, before: tuple[datetime, str] | None = None) -> datetime | None:
        cuts = [c for c in self._seals.get(dataset, []) if before is None or c < before]
        return max(cuts)[0] if cuts else None

    def _window(
        self, dataset: str, after: datetime | None, through: datetime | None = None
    ) -> list[dict[str, Any]]:
        arrivals = self._arrivals.get(dataset, {})
        return [
            dict(arrivals[key])
            for key in sorted(arrivals, key=lambda k: (_arrival_shard(k), k))  # shard by shard
            if (after is None or arrivals[key]["arrived_at"] > after)
            and (through is None or arrivals[key]["arrived_at"] <= through)
        ]

    def _held_by(self, run: Run) -> list[dict[str, Any]]:
        entries = self._contents.get(run.dataset, {})
        return [dict(entries[k]) for k in sorted(entries) if entries[k].get("run_id") == run.run_id]

    def _patch_run(self, run_id: str, fields: dict[str, Any], stamped: bool = True) -> None:
        """Firestore's ``update`` (the document must exist), stamped ``updated_at`` as the adapter's
        writes are (all but the start claim's)."""
        with self._lock:
            if run_id not in self._runs:
                raise KeyError(f"no run record {run_id}")
            self._runs[run_id].update(_stored({**fields, **({"updated_at": now_iso()} if stamped else {})}))

    def _add_arrival(
        self, dataset: str, key: str, fields: dict[str, Any], overwrite: bool, at: datetime | None = None
    ) -> bool:
        """An arrival document stamped ``at`` (one commit's writes share its time), else now."""
        arrivals = self._arrivals.setdefault(dataset, {})
        if key in arrivals and not overwrite:
            return False
        arrivals[key] = {**_stored(fields), "arrived_at": at or self._stamp()}
        return True

    # -- ArrivalLog -----------------------------------------------------------------------------------

    def record_arrival(self, arrival: ObjectArrival, dataset: str, content_hash: str) -> ArrivalOutcome:
        with self._lock:
            self._ensure_dataset(dataset)
            fields = _arrival_fields(arrival, content_hash)
            new = self._add_arrival(dataset, _key(arrival.identity), fields, overwrite=False)
            return ArrivalOutcome(ArrivalStatus.NEW if new else ArrivalStatus.DUPLICATE)

    def record_rejection(self, version: ObjectVersion, reason: str) -> None:
        with self._lock:
            fields = {**version.to_dict(), "reason": reason[:1000], "at": now_iso()}
            self._rejections[_key(f"{version.uri}#{version.generation}")] = _stored(fields)

    def rejections(self) -> list[Rejection]:
        with self._lock:
            docs = [dict(self._rejections[k]) for k in sorted(self._rejections)]
        return [
            Rejection(ObjectVersion.parse(d), str(d.get("reason", "")), str(d.get("at", ""))) for d in docs
        ]

    def datasets(self) -> list[str]:
        with self._lock:
            return sorted(self._datasets)

    def dataset_records(self, dataset: str) -> DatasetRecords:
        with self._lock:
            cut = self._last_cut(dataset)
            arrivals = [
                RecordedArrival(ObjectVersion.parse(d), iso(d["arrived_at"]))
                for d in self._window(dataset, None)
            ]
            runs = [
                Run.from_dict(_stored(self._runs[r]))
                for r in sorted(self._runs)
                if self._runs[r].get("dataset") == dataset
            ]
            returned = {
                r.run_id: [
                    ObjectVersion.parse(d) for _, d in sorted(self._returned.get(r.run_id, {}).items())
                ]
                for r in runs
                if r.content_returned or r.returned_untrained
            }
            entries = self._contents.get(dataset, {})
            holdings = [
                Holding(ObjectVersion.parse(entries[k]), str(entries[k].get("run_id", "")))
                for k in sorted(entries)
            ]
            return DatasetRecords(dataset, iso(cut) if cut else None, arrivals, holdings, runs, returned)

    def pending(self, dataset: str | None = None) -> list[Pending]:
        with self._lock:
            out = []
            for name in [dataset] if dataset else sorted(self._datasets):
                stamps = [a["arrived_at"] for a in self._window(name, self._last_cut(name))]
                if stamps:
                    out.append(Pending(name, len(stamps), iso(min(stamps)), iso(max(stamps))))
            return out

    # -- Batches --------------------------------------------------------------------------------------

    def seal(self, dataset: str, trigger: Trigger, retry_of: str | None = None) -> SealOutcome:
        with self._lock:
            if not self._window(dataset, self._last_cut(dataset)):
                return SealOutcome(None, SealVerdict.NOTHING_PENDING, "nothing pending")
            batch_id, through = uuid.uuid4().hex, self._stamp()
            self._seals.setdefault(dataset, []).append((through, batch_id))
            self._batches[batch_id] = {
                "dataset": dataset,
                "state": str(BatchState.SEALED),
                "through": through,
                "sealed_at": now_iso(),
                "trigger": str(trigger),
                "retry_of": retry_of,
            }
            return self.materialize(batch_id)

    def materialize(self, batch_id: str) -> SealOutcome:
        with self._lock:
            batch = self._batches.get(batch_id, {})
            dataset = str(batch.get("dataset"))
            if batch.get("state") == str(BatchState.SEALED) and "after" not in batch:
                batch["after"] = self._last_cut(dataset, (batch["through"], batch_id))
            if batch.get("state") != str(BatchState.SEALED):
                done = self.get_run(str(batch["run_id"])) if batch.get("run_id") else None
                verdict = SealVerdict.ALREADY_SEALED if done else SealVerdict.NOTHING_NEW
                return SealOutcome(done, verdict, "already sealed", skipped=int(batch.get("skipped", 0)))
            arrivals = self._window(dataset, batch["after"], batch["through"])
            if not arrivals:
                batch.update({"state": str(BatchState.DUPLICATE), "new_objects": 0, "skipped": 0})
                return SealOutcome(None, SealVerdict.NOTHING_PENDING, "nothing pending")
            held = self._contents.setdefault(dataset, {})
            new = {h: v for h, v in _first_by_content(arrivals).items() if _key(h) not in held}
            added = list(new.values())
            run: Run | None = None
            if added:
                trigger, retried = read_trigger(batch.get("trigger"))
                run = self._pending_run(dataset, batch_id, trigger, batch.get("retry_of") or retried)
                for h, version in new.items():
                    entry = {"content_hash": h, **version.to_dict(), "run_id": run.run_id, "at": now_iso()}
                    held[_key(h)] = _stored(entry)
            skipped = len(arrivals) - len(added)
            batch.update(
                {
                    "state": str(BatchState.STARTED if added else BatchState.DUPLICATE),
                    "new_objects": len(added),
                    "skipped": skipped,
                    **({"run_id": run.run_id} if run else {}),
                }
            )
            if run is None:
                return SealOutcome.nothing_new(skipped)
            return SealOutcome(self.get_run(run.run_id), SealVerdict.SEALED, "sealed", tuple(added), skipped)

    def _pending_run(self, dataset: str, batch_id: str, trigger: Trigger, retry_of: str | None) -> Run:
        current = self._slots.get(dataset)
        run = self.get_run(current) if current else None
        if run is not None and not run.status.terminal:
            return run
        fresh = Run(new_run_id(dataset), dataset, trigger, batch_id=batch_id, retry_of=retry_of)
        self._runs[fresh.run_id] = _stored(fresh.to_dict())
        self._slots[dataset] = fresh.run_id
        return fresh

    def preview(self, dataset: str) -> SealPreview:
        with self._lock:
            arrivals = self._window(dataset, self._last_cut(dataset))
            held = self._contents.get(dataset, {})
            new = tuple(v for h, v in _first_by_content(arrivals).items() if _key(h) not in held)
            pending = self.pending_run(dataset)
            objects = self.run_objects(pending) if pending else ()
            return SealPreview(dataset, new, len(arrivals) - len(new), pending, objects)

    def pending_run(self, dataset: str) -> Run | None:
        with self._lock:
            current = self._slots.get(dataset)
            run = self.get_run(current) if current else None
            return run if run is not None and not run.status.terminal else None

    def batches_in(self, state: BatchState) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {**batch, "batch_id": batch_id}
                for batch_id, batch in sorted(self._batches.items())
                if batch["state"] == str(state)
            ]

    # -- Holdings -------------------------------------------------------------------------------------

    def run_objects(self, run: Run) -> tuple[ObjectVersion, ...]:
        with self._lock:
            entries = (
                list(self._returned.get(run.run_id, {}).values())
                if run.content_returned
                else self._held_by(run)
            )
            return tuple(sorted(ObjectVersion.parse(d) for d in entries))

    def give_back(self, run: Run, versions: Collection[ObjectVersion] | None = None) -> int:
        with self._lock:
            current = self.get_run(run.run_id)
            if current is None or current.content_returned:
                return 0
            entries = self._held_by(run)
            if versions is not None:
                wanted = set(versions)
                entries = [e for e in entries if ObjectVersion.parse(e) in wanted]
            kept = self._returned.setdefault(run.run_id, {})
            for entry in entries:
                key = _key(str(entry["content_hash"]))
                kept[key] = self._contents[run.dataset].pop(key)
            if versions is None:
                self._patch_run(run.run_id, {"content_returned": True})
            elif entries:
                self._patch_run(run.run_id, {"returned_untrained": current.returned_untrained + len(entries)})
            return len(entries)

    def versions_of(self, dataset: str, content_hash: str) -> list[ObjectVersion]:
        with self._lock:
            found = [a for a in self._window(dataset, None) if a.get("content_hash") == content_hash]
        return [ObjectVersion.parse(a) for a in sorted(found, key=lambda a: a["arrived_at"], reverse=True)]

    def _again(
        self, dataset: str, version: ObjectVersion, event_id: str, why: str, at: datetime | None = None
    ) -> None:
        bucket, name = version.uri.removeprefix("gs://").split("/", 1)
        arrival = ObjectArrival(event_id, bucket, name, version.generation, version.size, "", now_iso())
        fields = _arrival_fields(arrival, version.content_hash)
        self._add_arrival(dataset, _key(f"{arrival.identity}:{why}"), fields, overwrite=True, at=at)

    def arrive_again(self, dataset: str, version: ObjectVersion, why: str) -> None:
        with self._lock:
            self._again(dataset, version, why, why)

    def requeue(self, run: Run) -> int:
        with self._lock:
            kept = self._returned.get(run.run_id, {})
            versions = [ObjectVersion.parse(kept[k]) for k in sorted(kept)]
            at = self._stamp()
            for version in versions:
                self._again(run.dataset, version, f"requeued:{run.run_id}", f"given back by {run.run_id}", at)
            return len(versions)

    # -- ExportBook -----------------------------------------------------------------------------------

    def export_mark(self, table: str) -> Watermark:
        with self._lock:
            return _watermark(self._marks.get(table, {}))

    def begin_export(self, job: ExportJob) -> bool:
        with self._lock:
            if self._marks.get(job.table, {}).get("value") != job.after or job.table in self._exports:
                return False
            self._exports[job.table] = _stored(dataclasses.asdict(job))
            return True

    def want_export(self, table: str) -> bool:
        with self._lock:
            if table not in self._exports:
                return False
            self._exports[table]["wanted"] = True
            return True

    def end_backlog(self, table: str, value: Any) -> None:
        with self._lock:
            mark = self._marks.get(table)
            if (mark or {}).get("value") == value:
                self._marks.setdefault(table, {})["backlog"] = False

    def mark_backlog(self, table: str, retry_after: str = "") -> None:
        with self._lock:
            self._marks.setdefault(table, {}).update(
                {"table": table, "backlog": True, "retry_after": retry_after}
            )

    def pending_export(self, table: str) -> ExportJob | None:
        with self._lock:
            doc = self._exports.get(table)
            return _export_job(doc) if doc is not None else None

    def pending_exports(self) -> list[ExportJob]:
        with self._lock:
            return [_export_job(self._exports[t]) for t in sorted(self._exports, key=_key)]

    def finish_export(self, job: ExportJob, arrivals: list[ObjectArrival]) -> bool:
        with self._lock:
            self._ensure_dataset(job.dataset)
            under_way = self._exports.get(job.table, {})
            if under_way.get("job_id") != job.job_id:
                return False
            taken = self._arrivals.get(job.dataset, {})
            if any(_key(a.identity) in taken for a in arrivals):  # the transaction's create fails whole
                raise ValueError(f"an arrival of export {job.job_id} was recorded before")
            backlog = job.capped or bool(under_way.get("wanted"))
            fields = {"table": job.table, "value": job.through, "job_id": job.job_id, "at": now_iso()}
            self._marks[job.table] = _stored({**fields, "objects": len(arrivals), "backlog": backlog})
            at = self._stamp()
            for arrival in arrivals:
                fields = _arrival_fields(arrival, arrival.content_hash)
                self._add_arrival(job.dataset, _key(arrival.identity), fields, overwrite=False, at=at)
            del self._exports[job.table]
            return True

    def abandon_export(self, job: ExportJob, reason: str, retry_after: str) -> bool:
        with self._lock:
            if self._exports.get(job.table, {}).get("job_id") != job.job_id:
                return False
            failures = self.export_mark(job.table).failures + 1
            failure = {"job_id": job.job_id, "reason": reason[:1000], "at": now_iso()}
            fields = {"table": job.table, "last_failure": failure, "failures": failures}
            self._marks.setdefault(job.table, {}).update(
                _stored({**fields, "backlog": True, "retry_after": retry_after})
            )
            del self._exports[job.table]
            return True

    # -- RunStore -------------------------------------------------------------------------------------

    def claim_start(self, run: Run, stale_after_s: float) -> StartClaim:
        now = datetime.now(UTC)
        token = uuid.uuid4().hex
        with self._lock:
            current = self._runs.get(run.run_id)
            state = self._datasets.get(run.dataset, {})
            standing = _standing(run.run_id, current, state, now, stale_after_s, self._runs)
            if standing is not None:
                return StartClaim(standing, ())
            live = {"active_run": run.run_id, "active_since": now_iso()}
            self._datasets.setdefault(run.dataset, {}).update(live)
            if self._slots.get(run.dataset) == run.run_id:
                del self._slots[run.dataset]
            self._patch_run(run.run_id, {"start_claimed_at": iso(now), "start_claim": token}, stamped=False)
            objects = self.run_objects(run)
            if not objects:
                del self._runs[run.run_id]
                return StartClaim(StartVerdict.EMPTY, ())
            snap = snapshot_id(str(e["content_hash"]) for e in self._held_by(run))
            self._patch_run(run.run_id, {"objects": len(objects), "snapshot": snap})
            return StartClaim(StartVerdict.CLAIMED, objects, snap, token)

    def record_claimed(self, run_id: str, claim: str, change: RunChange) -> bool:
        with self._lock:
            current = self._runs.get(run_id, {})
            if (
                current.get("start_claim") != claim
                or current.get("execution")
                or current.get("status", str(RunStatus.PENDING)) != str(RunStatus.PENDING)
            ):
                return False
            self._patch_run(run_id, change.fields())
            return True

    def attach_execution(self, run_id: str, claim: str, execution: str) -> dict[str, Any] | None:
        with self._lock:
            current = self._runs.get(run_id, {})
            plan = current.get("plan")
            if current.get("start_claim") != claim or not isinstance(plan, dict):
                return None
            try:
                status = RunStatus(current.get("status") or "pending")
            except ValueError:
                return None
            bound = current.get("execution")
            if bound:
                same = execution_id(bound) == execution_id(execution)
                return _stored(plan) if same and not status.terminal else None
            if status != RunStatus.PENDING:
                return None
            self._patch_run(run_id, {"execution": execution})
            return _stored(plan)

    def record(self, run_id: str, change: RunChange) -> None:
        self._patch_run(run_id, change.fields())

    def request_cancel(self, run_id: str, requested_by: str, reason: str) -> bool:
        with self._lock:
            current = self.get_run(run_id)
            if current is None or current.status.terminal:
                return False
            if not current.cancel_requested_by:
                self._patch_run(run_id, {"cancel_requested_by": requested_by, "cancel_reason": reason})
            return True

    def get_run(self, run_id: str) -> Run | None:
        with self._lock:
            doc = self._runs.get(run_id)
            return Run.from_dict(_stored(doc)) if doc is not None else None

    def plan_of(self, run_id: str) -> dict[str, Any] | None:
        with self._lock:
            plan = self._runs.get(run_id, {}).get("plan")
            return _stored(plan) if isinstance(plan, dict) else None

    def runs_in(self, *statuses: RunStatus) -> list[Run]:
        wanted = {str(s) for s in statuses}
        return self._runs_sorted(lambda d: d.get("status") in wanted)

    def unsettled(self) -> list[Run]:
        wanted = {str(RunStatus.FAILED), str(RunStatus.CANCELLED)}
        return self._runs_sorted(
            lambda d: d.get("status") in wanted and d.get("content_returned", ...) is False
        )

    def unobserved_release(self) -> list[Run]:
        ended = {str(RunStatus.SUCCEEDED), str(RunStatus.FAILED), str(RunStatus.CANCELLED)}
        # an equality filter on null matches a field that holds null, never one that is missing
        return self._runs_sorted(
            lambda d: d.get("status") in ended and "nodes_at_end" in d and d["nodes_at_end"] is None
        )

    def list_runs(self, limit: int = 100) -> list[Run]:
        return self._runs_sorted(lambda d: "created_at" in d)[-limit:] if limit > 0 else []

    def runs_budgeted_in(self, month: str) -> list[Run]:
        with self._lock:
            return [
                Run.from_dict(_stored(self._runs[r]))
                for r in sorted(self._runs)
                if self._runs[r].get("budget_month") == month
            ]

    def _runs_sorted(self, where: Any) -> list[Run]:
        with self._lock:
            found = [Run.from_dict(_stored(d)) for _, d in sorted(self._runs.items()) if where(d)]
        return sorted(found, key=lambda r: r.created_at)

    # -- Champions ------------------------------------------------------------------------------------

    def champion(self, dataset: str) -> Champion | None:
        with self._lock:
            value = self._datasets.get(dataset, {}).get("champion")
            return Champion.from_dict(value) if value else None

    def promote(self, dataset: str, champion: Champion) -> bool:
        with self._lock:
            if (dataset, champion.run_id) in self._promotions:
                return True
            record = self._datasets.setdefault(dataset, {})
            entry = {**champion.to_dict(), "previous": record.get("champion"), "at": now_iso()}
            self._promotions[(dataset, champion.run_id)] = _stored(entry)
            record["champion"] = _stored(champion.to_dict())
            return True


def _standing(
    run_id: str,
    current: dict[str, Any] | None,
    state: dict[str, Any],
    now: datetime,
    stale_after_s: float,
    runs: dict[str, dict[str, Any]],
) -> StartVerdict | None:
    """Why the run cannot be claimed now (started or gone, its start claimed while fresh, queued behind
    its dataset's live run), or None."""
    if not current or current.get("execution"):
        return StartVerdict.STARTED
    claimed = parse_iso(current.get("start_claimed_at"))
    if claimed is not None and (now - claimed).total_seconds() < stale_after_s:
        return StartVerdict.STARTING
    active = state.get("active_run")
    holder = runs.get(active) if active and active != run_id else None
    if holder and not RunStatus(holder.get("status", "pending")).terminal:
        return StartVerdict.QUEUED
    return None
