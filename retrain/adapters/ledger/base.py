"""What every part of the Firestore ledger shares: the layout's references, the helpers, the reads several
parts make, and how a contended transaction is retried (the layout: :mod:`retrain.adapters.ledger`)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import os
import random
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, TypeVar

from google.api_core.exceptions import AlreadyExists, Conflict, FailedPrecondition
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter

from retrain.domain.events import ObjectArrival, ObjectVersion
from retrain.domain.runs import Run, now_iso
from retrain.domain.transitions import RunChange
from retrain.ports import ExportJob, Watermark

T = TypeVar("T")

ARRIVED_AT = "arrived_at"
THROUGH = "through"
#: Arrival collections per dataset; each takes Firestore's ~500 writes/s for a sequentially indexed field.
ARRIVAL_SHARDS = 16
#: Content entries written per transaction (well under Firestore's 500 writes per commit).
CONTENT_CHUNK = 400
#: How long a write that concurrent seals make on the same documents (they contend by design) keeps
#: trying before it fails: well inside a function's 60 s.
CONTENDED_BUDGET_S = 40.0
#: The first backoff after an aborted attempt, and the most one grows to (doubling, full jitter).
CONTENDED_BACKOFF_S = (0.05, 2.0)

#: What a write whose preconditions (:meth:`FirestoreBase._unchanged_since`, a create) no longer hold
#: raises: another writer committed first.
LOST_RACE = (AlreadyExists, Conflict, FailedPrecondition)


def _key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _arrival_shard(key: str) -> str:
    """The arrival collection (of ARRIVAL_SHARDS) that holds the arrival keyed ``key``."""
    return f"arrivals{int(key[:2], 16) % ARRIVAL_SHARDS:02d}"


def _arrival_fields(arrival: ObjectArrival, content_hash: str) -> dict[str, str | int]:
    return {
        "uri": arrival.uri,
        "generation": arrival.generation,
        "size": arrival.size,
        "content_hash": content_hash,
        "time": arrival.time,
        "event_id": arrival.event_id,
    }


def _watermark(doc: Mapping[str, Any]) -> Watermark:
    return Watermark(
        value=doc.get("value"),
        backlog=bool(doc.get("backlog")),
        failures=int(doc.get("failures") or 0),
        retry_after=str(doc.get("retry_after") or ""),
    )


def _export_job(doc: Mapping[str, Any]) -> ExportJob:
    return ExportJob(**{f.name: doc[f.name] for f in dataclasses.fields(ExportJob) if f.name in doc})


def _first_by_content(arrivals: list[dict[str, Any]]) -> dict[str, ObjectVersion]:
    """Content hash -> the first object (by name) that has it: identical bytes train once."""
    first: dict[str, ObjectVersion] = {}
    for a in sorted(arrivals, key=lambda a: str(a["uri"])):
        first.setdefault(str(a["content_hash"]), ObjectVersion.parse(a))
    return first


class FirestoreBase:
    """The client and the layout's references; the reads and writes more than one part makes."""

    def __init__(self, project: str, client: firestore.Client | None = None) -> None:
        if client is None:
            if os.environ.get("FIRESTORE_EMULATOR_HOST"):
                from google.auth.credentials import AnonymousCredentials

                client = firestore.Client(project=project, credentials=AnonymousCredentials())
            else:
                client = firestore.Client(project=project)
        self.db = client
        self._known_datasets: set[str] = set()
        self._commit: Callable[..., Any] | None = None
        self._commit_metadata: tuple[tuple[str, str], ...] = ()

    def _dataset(self, dataset: str) -> firestore.DocumentReference:
        return self.db.collection("datasets").document(dataset)

    def _arrivals(self, dataset: str, key: str) -> firestore.CollectionReference:
        """The shard of the arrival whose document key is ``key`` (a hex digest)."""
        return self._dataset(dataset).collection(_arrival_shard(key))

    def _arrival_shards(self, dataset: str) -> list[firestore.CollectionReference]:
        return [self._dataset(dataset).collection(f"arrivals{i:02d}") for i in range(ARRIVAL_SHARDS)]

    def _contents(self, dataset: str) -> firestore.CollectionReference:
        return self._dataset(dataset).collection("contents")

    def _ensure_dataset(self, dataset: str) -> None:
        """Create the dataset's document once (so sweeps can list datasets); cached per process."""
        if dataset in self._known_datasets:
            return
        with contextlib.suppress(AlreadyExists, Conflict):
            self._dataset(dataset).create({"created_at": now_iso()})
        self._known_datasets.add(dataset)

    def _seals(self, dataset: str) -> firestore.CollectionReference:
        return self._dataset(dataset).collection("seals")

    def _slot(self, dataset: str) -> firestore.DocumentReference:
        """``datasets/{d}/slots/pending``: names the dataset's pending run while there is one."""
        return self._dataset(dataset).collection("slots").document("pending")

    def _returned(self, run_id: str) -> firestore.CollectionReference:
        return self.db.collection("runs").document(run_id).collection("objects")

    def _held_by(self, run: Run) -> Any:
        """The query for the content entries ``run`` holds."""
        return self._contents(run.dataset).where(filter=FieldFilter("run_id", "==", run.run_id))

    def _run_hashes(self, run: Run) -> list[str]:
        return [str((d.to_dict() or {})["content_hash"]) for d in self._held_by(run).stream()]

    def _mark_ref(self, table: str) -> firestore.DocumentReference:
        return self.db.collection("watermarks").document(_key(table))

    def _export_ref(self, table: str) -> firestore.DocumentReference:
        return self.db.collection("exports").document(_key(table))

    def _last_cut(self, dataset: str, before: tuple[datetime, str] | None = None) -> datetime | None:
        """The commit time of the dataset's latest seal (or of the latest one ordered before
        ``before`` = (time, seal id)); None when there is none."""
        q: Any = self._seals(dataset)
        if before is not None:
            q = q.where(filter=FieldFilter(THROUGH, "<=", before[0]))
        for snap in q.order_by(THROUGH, direction=firestore.Query.DESCENDING).limit(50).stream():
            at = snap.get(THROUGH)
            if before is None or (at, snap.id) < before:
                return at
        return None

    def _window(self, dataset: str, after: datetime | None, through: datetime | None = None) -> list[Any]:
        """The arrivals committed in (after, through], one query per shard."""
        out = []
        for shard in self._arrival_shards(dataset):
            q: Any = shard
            if after is not None:
                q = q.where(filter=FieldFilter(ARRIVED_AT, ">", after))
            if through is not None:
                q = q.where(filter=FieldFilter(ARRIVED_AT, "<=", through))
            out.append(q)
        return out

    def _add_arrival(self, writes: Any, arrival: ObjectArrival, dataset: str, content_hash: str) -> None:
        key = _key(arrival.identity)
        ref = self._arrivals(dataset, key).document(key)
        writes.create(ref, {**_arrival_fields(arrival, content_hash), ARRIVED_AT: firestore.SERVER_TIMESTAMP})

    def _contended(self, body: Callable[..., T], *args: Any) -> T:
        """Run the transactional ``body(tx, *args)`` that concurrent calls run on the same documents.

        One attempt per transaction, retried by :meth:`_retried`.  The client's own retry goes again at
        once, trusting its place in line (``retry_transaction``); the emulator keeps no such line: a
        commit waits for every other lock on what it read, so transactions that read together wait each
        other out (its "Transaction lock timeout", 2 s), come back together and deadlock again (eight
        start claims in one transaction each: 100 attempts over 200 s, and seven failed)."""

        def attempt() -> T:
            return body(self.db.transaction(max_attempts=1), *args)

        return self._retried(attempt, lambda e: str(e).startswith("Failed to commit transaction"))

    def _retried(self, attempt: Callable[[], T], retryable: Callable[[Exception], bool]) -> T:
        """``attempt()`` again while it fails ``retryable``, each time after a random wait (full jitter,
        doubling up to CONTENDED_BACKOFF_S's cap), until CONTENDED_BUDGET_S is spent."""
        deadline = time.monotonic() + CONTENDED_BUDGET_S
        first, cap = CONTENDED_BACKOFF_S
        for n in itertools.count():
            try:
                return attempt()
            except Exception as e:
                if not retryable(e) or time.monotonic() >= deadline:
                    raise
            time.sleep(random.uniform(0.0, min(cap, first * 2**n)))
        raise AssertionError("unreachable")

    def _unchanged_since(self, snap: Any) -> Any:
        """A write's precondition: the document is as ``snap`` read it (its update time), so that of
        writers who read the same version exactly one commits, and none holds a lock to decide."""
        return self.db.write_option(last_update_time=snap.update_time)

    def _commit_in_batches(self, items: list[Any], add: Callable[[firestore.WriteBatch, Any], None]) -> None:
        """``add`` each item's writes (at most two) to a batch, committed every CONTENT_CHUNK // 2 items."""
        for i in range(0, len(items), CONTENT_CHUNK // 2):
            writes = self.db.batch()
            for item in items[i : i + CONTENT_CHUNK // 2]:
                add(writes, item)
            writes.commit()

    def get_run(self, run_id: str) -> Run | None:
        snap = self.db.collection("runs").document(run_id).get()
        return Run.from_dict(snap.to_dict() or {}) if snap.exists else None

    def plan_of(self, run_id: str) -> dict[str, Any] | None:
        snap = self.db.collection("runs").document(run_id).get(field_paths=["plan"])
        plan = (snap.to_dict() or {}).get("plan") if snap.exists else None
        return dict(plan) if isinstance(plan, dict) else None

    def record(self, run_id: str, change: RunChange) -> None:
        self._patch_run(run_id, change.fields())

    def _patch_run(self, run_id: str, fields: Mapping[str, Any]) -> None:
        """The one write to a run record: a change's fields (:meth:`record`), or the ledger's own
        bookkeeping (a run's objects and snapshot, the content it gave back)."""
        self.db.collection("runs").document(run_id).update({**fields, "updated_at": now_iso()})

    def run_objects(self, run: Run) -> tuple[ObjectVersion, ...]:
        """The objects a run trains: every content entry that names it (one object per content)."""
        entries = self._returned(run.run_id) if run.content_returned else self._held_by(run)
        return tuple(sorted(ObjectVersion.parse(d.to_dict() or {}) for d in entries.stream()))
