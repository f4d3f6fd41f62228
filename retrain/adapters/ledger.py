"""The ledger on Firestore: arrivals, batches, snapshots and run records.

Layout (one collection per concept):
  datasets/{dataset}                          the live run, the champion (the checkpoint runs continue from)
  datasets/{dataset}/promotions/{run_id}      one per promotion: the new champion and the one it replaced
  datasets/{dataset}/arrivalsNN/{sha1(b/n#g)} one per object version (NN: one of ARRIVAL_SHARDS shards)
  datasets/{dataset}/contents/{sha1(hash)}    one per content hash: the run that trains (or trained) it
  batches/{batch_id}                          a sealed window of arrivals, and what became of it
  runs/{run_id}                               the run record
  watermarks/{sha1(table)}                    how far a watched BigQuery table has been exported

Coalescing: a dataset has at most one live run and one pending run.  A seal puts the content hashes
of its batch that no run holds yet into ``contents/`` under the pending run (creating it when there is
none); content some run already holds (trained, live or pending) adds nothing, so identical bytes under
any name, in any grouping, train once.  A seal that brings nothing new makes no run.  The pending run's
object list is fixed when it starts: every ``contents/`` entry naming it.  Each entry is written in a
transaction that checks the run is still the dataset's pending run, and starting a run clears that in
a transaction on the same document, so no entry can join a run after its list was read.

Arrivals are sharded (``arrivals00`` .. ``arrivals15`` by the first byte of their key): "If a
collection contains documents with sequential indexed values, Cloud Firestore limits the write rate to
500 writes per second" (firebase.google.com/docs/firestore/solutions/shard-timestamp), and
``arrived_at`` is such a value; as separate collections each shard keeps its automatic single-field
index, so a dataset sustains ARRIVAL_SHARDS x 500 = 8,000 arrivals/s with no composite index to deploy.

Storm-proof by construction: recording an arrival is one commit that *creates* one document keyed
by the object version's identity (bucket, name, generation) and touches nothing shared, so a burst of
arrivals never contends on a hot document.  A redelivered event names the same object version (a
finalize event's id is per object version), so it fails the create exactly like the same version
announced under another event id: both are duplicates, with no second document to write.

An arrival's batch is decided by time, not by a pointer: each arrival carries its commit timestamp,
and a seal cuts the dataset's timeline at its own commit timestamp, so batch k is exactly the arrivals
committed in (cut[k-1], cut[k]] -- every arrival lands in one batch, whatever the interleaving.
The client honours FIRESTORE_EMULATOR_HOST, so the emulator and the cloud differ only by endpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import random
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

import grpc
from google.api_core import exceptions
from google.api_core.exceptions import AlreadyExists, Conflict, FailedPrecondition
from google.api_core.gapic_v1 import routing_header
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter
from google.cloud.firestore_v1.types import common, document, write
from google.cloud.firestore_v1.types import firestore as api

from retrain.domain.events import ObjectArrival, ObjectVersion
from retrain.domain.runs import (
    BatchState,
    Champion,
    Pending,
    Run,
    RunStatus,
    execution_id,
    iso,
    new_run_id,
    now_iso,
    snapshot_id,
)
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

T = TypeVar("T")

ARRIVED_AT = "arrived_at"
THROUGH = "through"
#: Arrival collections per dataset; each takes Firestore's ~500 writes/s for a sequentially indexed field.
ARRIVAL_SHARDS = 16
#: Content entries written per transaction (well under Firestore's 500 writes per commit).
CONTENT_CHUNK = 400
#: Attempts of the transactions every seal of a dataset makes on its document (they contend by design).
CONTENDED_ATTEMPTS = 20
#: Rounds of CONTENDED_ATTEMPTS a contended transaction makes, with random backoff between them.
CONTENDED_ROUNDS = 5

# Raw protobuf classes behind the client's proto-plus types (see FirestoreLedger._create_stamped).
_Write, _Document, _Value = write.Write.pb(), document.Document.pb(), document.Value.pb()
_Transform, _Precondition = write.DocumentTransform.FieldTransform.pb(), common.Precondition.pb()
_CommitRequest = api.CommitRequest.pb()
COMMIT_DEADLINE_S = 60.0
RETRIED_COMMIT_ERRORS = (exceptions.ResourceExhausted, exceptions.ServiceUnavailable)


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


def _value(v: str | int) -> Any:
    return _Value(string_value=v) if isinstance(v, str) else _Value(integer_value=v)


class FirestoreLedger:
    """:class:`retrain.ports.Ledger` on Firestore (native mode)."""

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

    # --- arrivals ---

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

    def record_arrival(self, arrival: ObjectArrival, dataset: str, content_hash: str) -> ArrivalOutcome:
        """One create: a redelivered event or a re-announced object version fails it, a duplicate."""
        self._ensure_dataset(dataset)
        key = _key(arrival.identity)
        path = f"datasets/{dataset}/{_arrival_shard(key)}/{key}"  # self._arrivals(dataset, key), as text
        try:
            self._create_stamped(path, _arrival_fields(arrival, content_hash), ARRIVED_AT)
        except (AlreadyExists, Conflict):
            return ArrivalOutcome(ArrivalStatus.DUPLICATE)
        return ArrivalOutcome(ArrivalStatus.NEW)

    def _create_stamped(self, path: str, fields: Mapping[str, str | int], stamp: str) -> None:
        """``document(path).create({**fields, stamp: SERVER_TIMESTAMP})``: the same Commit request and
        metadata, built as raw protobuf and sent on the client's own channel.  It is a storm's hot path:
        through the client's proto-plus wrappers and api_core's call stack a create costs the function
        about 1.2 ms of CPU, this way about 0.4 ms (single-threaded against the emulator).  Retries
        follow the client's default for Commit (google/cloud/firestore_v1/services/firestore/
        transports/base.py: ResourceExhausted and ServiceUnavailable, 0.1 s growing by 1.3 with jitter,
        60 s in all);
        a retried create that had landed answers ALREADY_EXISTS, which is the outcome it had."""
        database = self.db._database_string
        create = _Write(
            update=_Document(
                name=f"{database}/documents/{path}", fields={k: _value(v) for k, v in fields.items()}
            ),
            update_transforms=[_Transform(field_path=stamp, set_to_server_value=_Transform.REQUEST_TIME)],
            current_document=_Precondition(exists=False),
        )
        request = _CommitRequest(database=database, writes=[create])
        if self._commit is None:
            # The transport's channel carries the credentials; the stub skips proto-plus both ways.
            channel = self.db._firestore_api._transport.grpc_channel
            self._commit = channel.unary_unary(
                "/google.firestore.v1.Firestore/Commit", request_serializer=_CommitRequest.SerializeToString
            )
            self._commit_metadata = (
                *self.db._rpc_metadata,
                routing_header.to_grpc_metadata((("database", database),)),
            )
        metadata = self._commit_metadata
        delay, deadline = 0.1, time.monotonic() + COMMIT_DEADLINE_S
        while True:
            try:
                self._commit(request, timeout=max(0.001, deadline - time.monotonic()), metadata=metadata)
                return
            except grpc.RpcError as e:
                error = exceptions.from_grpc_error(e)
                # api_core's backoff: a random sleep up to twice the delay (instances must not retry
                # in step), within the deadline
                sleep = min(random.uniform(0.0, 2 * delay), 60.0)
                if not isinstance(error, RETRIED_COMMIT_ERRORS) or time.monotonic() + sleep > deadline:
                    raise error from None
            time.sleep(sleep)
            delay = min(delay * 1.3, 60.0)

    def record_rejection(self, version: ObjectVersion, reason: str) -> None:
        """``rejections/{sha1(uri#generation)}``: one per refused object version (redelivered: rewritten)."""
        fields = {**version.to_dict(), "reason": reason[:1000], "at": now_iso()}
        self.db.collection("rejections").document(_key(f"{version.uri}#{version.generation}")).set(fields)

    def rejections(self) -> list[Rejection]:
        return [
            Rejection(ObjectVersion.parse(d), str(d.get("reason", "")), str(d.get("at", "")))
            for d in (snap.to_dict() or {} for snap in self.db.collection("rejections").stream())
        ]

    def datasets(self) -> list[str]:
        return [d.id for d in self.db.collection("datasets").stream()]

    def dataset_records(self, dataset: str) -> DatasetRecords:
        """The dataset's records, read cut first and holdings last: a seal that lands meanwhile shows its
        arrivals as pending (after the cut read) or as held (entries read after), never as neither."""
        cut = self._last_cut(dataset)
        arrivals = [
            RecordedArrival(ObjectVersion.parse(d.to_dict() or {}), iso(d.get(ARRIVED_AT)))
            for shard in self._arrival_shards(dataset)
            for d in shard.stream()
        ]
        runs = [
            Run.from_dict(d.to_dict() or {})
            for d in self.db.collection("runs").where(filter=FieldFilter("dataset", "==", dataset)).stream()
        ]
        returned = {
            r.run_id: [ObjectVersion.parse(d.to_dict() or {}) for d in self._returned(r.run_id).stream()]
            for r in runs
            if r.content_returned or r.returned_untrained
        }
        holdings = [
            Holding(ObjectVersion.parse(d), str(d.get("run_id", "")))
            for d in (snap.to_dict() or {} for snap in self._contents(dataset).stream())
        ]
        return DatasetRecords(dataset, iso(cut) if cut else None, arrivals, holdings, runs, returned)

    def _add_arrival(self, writes: Any, arrival: ObjectArrival, dataset: str, content_hash: str) -> None:
        key = _key(arrival.identity)
        ref = self._arrivals(dataset, key).document(key)
        writes.create(ref, {**_arrival_fields(arrival, content_hash), ARRIVED_AT: firestore.SERVER_TIMESTAMP})

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

    def pending(self, dataset: str | None = None) -> list[Pending]:
        """Datasets with arrivals not yet sealed: how many, the first and the last (for the sweeper)."""
        names = [dataset] if dataset else [d.id for d in self.db.collection("datasets").stream()]
        out = []
        for name in names:
            cut = self._last_cut(name)
            count, first, last = 0, None, None
            for window in self._window(name, cut):
                n = int(window.count().get()[0][0].value)
                if not n:
                    continue
                count += n
                (head,) = window.order_by(ARRIVED_AT).limit(1).stream()
                (tail,) = window.order_by(ARRIVED_AT, direction=firestore.Query.DESCENDING).limit(1).stream()
                first = min(filter(None, (first, head.get(ARRIVED_AT))))
                last = max(filter(None, (last, tail.get(ARRIVED_AT))))
            if count and first is not None and last is not None:
                out.append(Pending(name, count, iso(first), iso(last)))
        return out

    # --- batches ---

    def _seals(self, dataset: str) -> firestore.CollectionReference:
        return self._dataset(dataset).collection("seals")

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

    def seal(self, dataset: str, trigger: str) -> SealOutcome:
        """Cut the dataset's timeline now: what arrived since the last cut becomes a batch, whose new
        content joins the dataset's pending run.

        Lock-free: a seal is one blind create of ``seals/{id}`` (with its batch) stamped with its commit
        time; its window
        is (the previous seal's time, its own], the previous seal being the latest one ordered before it
        by (time, id).  Any seal committed before it is visible once it has committed, so concurrent
        seals cut the timeline into disjoint windows and every arrival lands in exactly one."""
        before = self._last_cut(dataset)
        if not any(list(w.limit(1).stream()) for w in self._window(dataset, before)):
            return SealOutcome(None, SealVerdict.NOTHING_PENDING, "nothing pending")
        # The cut and its batch in one atomic commit, both stamped with that commit's time: a crash
        # can never leave a cut without the batch that owns its window.
        batch_id = uuid.uuid4().hex
        writes = self.db.batch()
        cut = {"dataset": dataset, THROUGH: firestore.SERVER_TIMESTAMP}
        writes.create(self._seals(dataset).document(batch_id), cut)
        writes.create(
            self.db.collection("batches").document(batch_id),
            {
                "dataset": dataset,
                "state": str(BatchState.SEALED),
                THROUGH: firestore.SERVER_TIMESTAMP,
                "sealed_at": now_iso(),
                "trigger": trigger,
            },
        )
        writes.commit()
        return self.materialize(batch_id)

    def _batch_arrivals(self, batch: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        for window in self._window(str(batch["dataset"]), batch.get("after"), batch["through"]):
            yield from (d.to_dict() or {} for d in window.stream())

    def materialize(self, batch_id: str) -> SealOutcome:
        """Put a sealed batch's new content into its dataset's pending run (created when there is none);
        idempotent, so a sweeper can finish a seal a crash cut short."""
        batch_ref = self.db.collection("batches").document(batch_id)
        batch = batch_ref.get().to_dict() or {}
        dataset, trigger = str(batch.get("dataset")), str(batch.get("trigger", "sweeper"))
        if batch.get("state") == str(BatchState.SEALED) and "after" not in batch:
            # where the window starts: the previous cut, ordered by (commit time, id)
            batch["after"] = self._last_cut(dataset, (batch[THROUGH], batch_id))
            batch_ref.update({"after": batch["after"]})
        if batch.get("state") != str(BatchState.SEALED):  # done already, by us or a sweeper
            done = self.get_run(str(batch["run_id"])) if batch.get("run_id") else None
            verdict = SealVerdict.ALREADY_SEALED if done else SealVerdict.NOTHING_NEW
            return SealOutcome(done, verdict, "already sealed", skipped=int(batch.get("skipped", 0)))
        arrivals = list(self._batch_arrivals(batch))
        first = _first_by_content(arrivals)
        if not arrivals:  # a concurrent seal cut the same window first
            batch_ref.update({"state": str(BatchState.DUPLICATE), "new_objects": 0, "skipped": 0})
            return SealOutcome(None, SealVerdict.NOTHING_PENDING, "nothing pending")
        run: Run | None = None
        added: list[ObjectVersion] = []
        held = self._held(dataset, list(first))
        todo = {h: version for h, version in first.items() if h not in held}
        while todo:
            run = self._pending_run(dataset, trigger, batch_id)
            chunk = dict(list(todo.items())[:CONTENT_CHUNK])
            joined, stale = self._join(run, chunk)
            if stale:  # the pending run started meanwhile: the rest goes to the next pending run
                continue
            added += joined
            for h in chunk:
                todo.pop(h)
        skipped = len(arrivals) - len(added)
        state = BatchState.STARTED if added else BatchState.DUPLICATE
        fields = {"state": str(state), "new_objects": len(added), "skipped": skipped}
        if added and run is not None:
            fields["run_id"] = run.run_id
        batch_ref.update(fields)
        if not added:
            return SealOutcome(
                None,
                SealVerdict.NOTHING_NEW,
                f"nothing new: {skipped} object(s) skipped, their content trained before or is in the "
                "live or pending run",
                skipped=skipped,
            )
        return SealOutcome(
            self.get_run(run.run_id) if run else None, SealVerdict.SEALED, "sealed", tuple(added), skipped
        )

    def preview(self, dataset: str) -> SealPreview:
        """What :meth:`seal` would do now, read-only: the arrivals since the last cut, less the content
        some run holds already, and the pending run they would join."""
        arrivals = [
            d.to_dict() or {} for w in self._window(dataset, self._last_cut(dataset)) for d in w.stream()
        ]
        first = _first_by_content(arrivals)
        held = self._held(dataset, list(first))
        new = tuple(version for h, version in first.items() if h not in held)
        pending = self.pending_run(dataset)
        return SealPreview(
            dataset,
            new,
            skipped=len(arrivals) - len(new),
            pending_run=pending,
            pending_objects=self.run_objects(pending) if pending else (),
        )

    def _slot(self, dataset: str) -> firestore.DocumentReference:
        """``datasets/{d}/slots/pending``: names the dataset's pending run while there is one."""
        return self._dataset(dataset).collection("slots").document("pending")

    def pending_run(self, dataset: str) -> Run | None:
        """The dataset's pending run (the one later seals join), if any."""
        snap = self._slot(dataset).get()
        run = self.get_run(str(snap.get("run_id"))) if snap.exists else None
        return run if run is not None and not run.status.terminal else None

    def _pending_run(self, dataset: str, trigger: str, batch_id: str) -> Run:
        """The dataset's pending run, created (as ``trigger`` made it) when there is none.  Creating it
        is one atomic write of the run and the slot with the slot's create precondition, so concurrent
        seals agree on one pending run without locking anything."""
        slot = self._slot(dataset)
        while True:
            snap = slot.get()
            if snap.exists:
                run = self.get_run(str(snap.get("run_id")))
                if run is not None and not run.status.terminal:
                    return run
            fresh = Run(run_id=new_run_id(dataset), dataset=dataset, trigger=trigger, batch_id=batch_id)
            writes = self.db.batch()
            writes.set(self.db.collection("runs").document(fresh.run_id), fresh.to_dict())
            if snap.exists:  # a slot naming a run that is gone or ended before it started: replace it
                writes.update(
                    slot,
                    {"run_id": fresh.run_id},
                    option=self.db.write_option(last_update_time=snap.update_time),
                )
            else:
                writes.create(slot, {"run_id": fresh.run_id})
            try:
                writes.commit()
            except (AlreadyExists, Conflict, FailedPrecondition):
                continue  # another seal made one first: join it
            return fresh

    def _join(self, run: Run, content: Mapping[str, ObjectVersion]) -> tuple[list[ObjectVersion], bool]:
        """Give ``run`` the content (hash -> object) no run holds yet, in one transaction that checks it
        is still its dataset's pending run; (the objects added, whether the run had started).

        The content entries are read outside the transaction and created blindly inside it (a create
        fails if another seal made the entry first, and the chunk is tried again), so concurrent seals
        never hold read locks they would need to upgrade."""
        slot = self._slot(run.dataset)
        refs = {h: self._contents(run.dataset).document(_key(h)) for h in content}

        @firestore.transactional
        def join(tx: firestore.Transaction, held: set[str]) -> tuple[list[ObjectVersion], bool]:
            current = slot.get(transaction=tx)
            if not current.exists or current.get("run_id") != run.run_id:
                return [], True
            added = []
            for h, ref in refs.items():
                if ref.id not in held:
                    entry = {"content_hash": h, **content[h].to_dict(), "run_id": run.run_id, "at": now_iso()}
                    tx.create(ref, entry)
                    added.append(content[h])
            return added, False

        while True:
            held = {snap.id for snap in self.db.get_all(list(refs.values())) if snap.exists}
            try:
                return self._contended(join, held)
            except (AlreadyExists, Conflict):
                continue  # a concurrent seal gave some of this content to the run first

    def _contended(self, body: Callable[..., T], *args: Any) -> T:
        """Run the transactional ``body(tx, *args)`` that every seal of a dataset runs on the same documents.

        The client retries an aborted transaction at once, CONTENDED_ATTEMPTS times (its
        base_transaction._EXCEED_ATTEMPTS_TEMPLATE); when as many seals still hold the lock (a loaded
        emulator answers "Transaction lock timeout"), back off at random and go again, CONTENDED_ROUNDS
        times, rather than fail the seal."""
        rounds = 0
        while True:
            rounds += 1
            try:
                return body(self.db.transaction(max_attempts=CONTENDED_ATTEMPTS), *args)
            except ValueError as e:
                if not str(e).startswith("Failed to commit transaction") or rounds >= CONTENDED_ROUNDS:
                    raise
                time.sleep(random.uniform(0.0, 0.2 * 2**rounds))

    def _held(self, dataset: str, hashes: list[str]) -> set[str]:
        """The content hashes some run of ``dataset`` holds already (trained, live or pending)."""
        held: set[str] = set()
        for i in range(0, len(hashes), CONTENT_CHUNK):
            chunk = {_key(h): h for h in hashes[i : i + CONTENT_CHUNK]}
            refs = [self._contents(dataset).document(k) for k in chunk]
            held.update(chunk[snap.id] for snap in self.db.get_all(refs) if snap.exists)
        return held

    def run_objects(self, run: Run) -> tuple[ObjectVersion, ...]:
        """The objects a run trains: every content entry that names it (one object per content)."""
        entries = self._returned(run.run_id) if run.content_returned else self._held_by(run)
        return tuple(sorted(ObjectVersion.parse(d.to_dict() or {}) for d in entries.stream()))

    def give_back(self, run: Run, versions: Collection[ObjectVersion] | None = None) -> int:
        """A run that did not succeed gives its content back: each content entry it holds goes (so
        identical bytes dropped again are new again) and is kept under the run as ``runs/{run}/objects``
        (what it trained on, for its record and for :meth:`requeue`).  Nothing is re-queued: a run that
        failed is retried on purpose (``retrain run --retry``), never in a loop.  With ``versions``, only
        their content goes back (the objects a run that trained the rest could not read), and the run
        keeps the rest.  Idempotent; how many objects it gave back."""
        current = self.get_run(run.run_id)
        if current is None or current.content_returned:
            return 0
        entries = list(self._held_by(run).stream())
        if versions is not None:
            wanted = set(versions)
            entries = [e for e in entries if ObjectVersion.parse(e.to_dict() or {}) in wanted]
        kept = self._returned(run.run_id)

        def move(writes: firestore.WriteBatch, snap: Any) -> None:
            writes.set(kept.document(snap.id), snap.to_dict() or {})
            writes.delete(snap.reference)

        self._commit_in_batches(entries, move)
        if versions is None:
            self.update_run(run.run_id, {"content_returned": True})
        elif entries:
            self.update_run(run.run_id, {"returned_untrained": current.returned_untrained + len(entries)})
        return len(entries)

    def versions_of(self, dataset: str, content_hash: str) -> list[ObjectVersion]:
        """Every object version that arrived in ``dataset`` with ``content_hash``, newest first."""
        found = []
        for shard in self._arrival_shards(dataset):
            query = shard.where(filter=FieldFilter("content_hash", "==", content_hash))
            found += [(d.get(ARRIVED_AT), ObjectVersion.parse(d.to_dict() or {})) for d in query.stream()]
        return [version for _, version in sorted(found, key=lambda f: f[0], reverse=True)]

    def _again(
        self, dataset: str, version: ObjectVersion, event_id: str, why: str
    ) -> tuple[Any, dict[str, Any]]:
        """The arrival document of ``version`` arriving again, stamped at its commit, once per ``why``."""
        bucket, name = version.uri.removeprefix("gs://").split("/", 1)
        arrival = ObjectArrival(event_id, bucket, name, version.generation, version.size, "", now_iso())
        key = _key(f"{arrival.identity}:{why}")
        fields = {**_arrival_fields(arrival, version.content_hash), ARRIVED_AT: firestore.SERVER_TIMESTAMP}
        return self._arrivals(dataset, key).document(key), fields

    def arrive_again(self, dataset: str, version: ObjectVersion, why: str) -> None:
        """``version`` arrives again, stamped now (the next seal takes it), once per ``why``."""
        ref, fields = self._again(dataset, version, why, why)
        ref.set(fields)

    def requeue(self, run: Run) -> int:
        """The objects a run gave back arrive again (at the versions it held, stamped now), so the next
        seal takes them into a run.  Idempotent (one arrival per object and run); how many."""
        versions = [ObjectVersion.parse(snap.to_dict() or {}) for snap in self._returned(run.run_id).stream()]

        def arrive(writes: firestore.WriteBatch, version: ObjectVersion) -> None:
            writes.set(
                *self._again(run.dataset, version, f"requeued:{run.run_id}", f"given back by {run.run_id}")
            )

        self._commit_in_batches(versions, arrive)
        return len(versions)

    def _commit_in_batches(self, items: list[Any], add: Callable[[firestore.WriteBatch, Any], None]) -> None:
        """``add`` each item's writes (at most two) to a batch, committed every CONTENT_CHUNK // 2 items."""
        for i in range(0, len(items), CONTENT_CHUNK // 2):
            writes = self.db.batch()
            for item in items[i : i + CONTENT_CHUNK // 2]:
                add(writes, item)
            writes.commit()

    def _held_by(self, run: Run) -> Any:
        """The query for the content entries ``run`` holds."""
        return self._contents(run.dataset).where(filter=FieldFilter("run_id", "==", run.run_id))

    def _returned(self, run_id: str) -> firestore.CollectionReference:
        return self.db.collection("runs").document(run_id).collection("objects")

    def _run_hashes(self, run: Run) -> list[str]:
        return [str((d.to_dict() or {})["content_hash"]) for d in self._held_by(run).stream()]

    def batches_in(self, state: BatchState) -> list[dict[str, Any]]:
        """Batches in one state, each with its ``batch_id`` (few at a time: stuck ones)."""
        docs = self.db.collection("batches").where(filter=FieldFilter("state", "==", str(state))).stream()
        return [{**(d.to_dict() or {}), "batch_id": d.id} for d in docs]

    # --- BigQuery exports ---

    def _mark_ref(self, table: str) -> firestore.DocumentReference:
        return self.db.collection("watermarks").document(_key(table))

    def _export_ref(self, table: str) -> firestore.DocumentReference:
        return self.db.collection("exports").document(_key(table))

    def watermark(self, table: str) -> Any:
        """How far ``table`` has been exported (None: never)."""
        return self.export_mark(table).value

    def export_mark(self, table: str) -> Watermark:
        return _watermark(self._mark_ref(table).get().to_dict() or {})

    def begin_export(self, job: ExportJob) -> bool:
        """Record ``job`` as ``job.table``'s export under way, before it starts; False (nothing written)
        when another export is under way or moved the watermark from ``job.after`` first."""
        mark, ref = self._mark_ref(job.table), self._export_ref(job.table)

        @firestore.transactional
        def begin(tx: firestore.Transaction) -> bool:
            if (mark.get(transaction=tx).to_dict() or {}).get("value") != job.after:
                return False
            if ref.get(transaction=tx).exists:
                return False
            tx.create(ref, dataclasses.asdict(job))
            return True

        return bool(begin(self.db.transaction()))

    def pending_export(self, table: str) -> ExportJob | None:
        doc = self._export_ref(table).get()
        return _export_job(doc.to_dict() or {}) if doc.exists else None

    def pending_exports(self) -> list[ExportJob]:
        return [_export_job(d.to_dict() or {}) for d in self.db.collection("exports").stream()]

    def want_export(self, table: str) -> bool:
        """Note that ``table`` was written while its export is under way: once that one is finished, the
        next tick exports what came after it.  False when no export is under way (any more)."""
        try:
            self._export_ref(table).update({"wanted": True})
        except exceptions.NotFound:
            return False
        return True

    def end_backlog(self, table: str, value: Any) -> None:
        """Nothing waits above ``value``: unless the watermark moved on meanwhile, no export is due."""
        mark = self._mark_ref(table)

        @firestore.transactional
        def end(tx: firestore.Transaction) -> None:
            if (mark.get(transaction=tx).to_dict() or {}).get("value") == value:
                tx.set(mark, {"backlog": False}, merge=True)

        end(self.db.transaction())

    def mark_backlog(self, table: str, retry_after: str = "") -> None:
        """Rows wait above ``table``'s watermark: the tick exports them (not before ``retry_after``, when
        they are stamped too recently to export yet)."""
        self._mark_ref(table).set({"table": table, "backlog": True, "retry_after": retry_after}, merge=True)

    def finish_export(self, job: ExportJob, arrivals: list[ObjectArrival]) -> bool:
        """Record the objects ``job`` wrote and move the watermark to ``job.through``, atomically; False
        (nothing written) when ``job`` is no longer its table's export (another invocation finished it)."""
        self._ensure_dataset(job.dataset)
        mark, ref = self._mark_ref(job.table), self._export_ref(job.table)

        @firestore.transactional
        def finish(tx: firestore.Transaction) -> bool:
            under_way = ref.get(transaction=tx).to_dict() or {}
            if under_way.get("job_id") != job.job_id:
                return False
            backlog = job.capped or bool(under_way.get("wanted"))
            fields = {"table": job.table, "value": job.through, "job_id": job.job_id, "at": now_iso()}
            tx.set(mark, {**fields, "objects": len(arrivals), "backlog": backlog})  # failures forgotten
            for arrival in arrivals:
                self._add_arrival(tx, arrival, job.dataset, arrival.content_hash)
            tx.delete(ref)
            return True

        return bool(finish(self.db.transaction()))

    def abandon_export(self, job: ExportJob, reason: str, retry_after: str) -> bool:
        """Forget ``job`` (it failed, or ran past its deadline): the watermark stays, the table is due
        again after ``retry_after``, and the failure is counted and kept with its reason.  False when
        ``job`` is no longer its table's export (another invocation finished or forgot it)."""
        mark, ref = self._mark_ref(job.table), self._export_ref(job.table)

        @firestore.transactional
        def abandon(tx: firestore.Transaction) -> bool:
            if (ref.get(transaction=tx).to_dict() or {}).get("job_id") != job.job_id:
                return False
            failures = _watermark(mark.get(transaction=tx).to_dict() or {}).failures + 1
            failure = {"job_id": job.job_id, "reason": reason[:1000], "at": now_iso()}
            fields = {"table": job.table, "last_failure": failure, "failures": failures}
            tx.set(mark, {**fields, "backlog": True, "retry_after": retry_after}, merge=True)
            tx.delete(ref)
            return True

        return bool(abandon(self.db.transaction()))

    # --- runs ---

    def claim_start(self, run: Run, stale_after_s: float) -> StartClaim:
        """Take the dataset's live slot for ``run`` unless another live run holds it, and fix its object
        list.  A run whose start is already claimed is not claimed again for ``stale_after_s`` (its
        starter may still be at work; after that it is taken to have crashed)."""
        dataset_ref = self._dataset(run.dataset)
        run_ref = self.db.collection("runs").document(run.run_id)
        now = datetime.now(UTC)

        slot = self._slot(run.dataset)

        @firestore.transactional
        def take(tx: firestore.Transaction) -> str:
            state = dataset_ref.get(transaction=tx).to_dict() or {}
            current = run_ref.get(transaction=tx).to_dict() or {}
            pending = slot.get(transaction=tx)
            if not current or current.get("execution"):
                return "started"
            claimed = current.get("start_claimed_at")
            if (
                claimed
                and (now - datetime.fromisoformat(claimed.replace("Z", "+00:00"))).total_seconds()
                < stale_after_s
            ):
                return "starting"
            active = state.get("active_run")
            if active and active != run.run_id:
                holder = self.db.collection("runs").document(active).get(transaction=tx).to_dict()
                if holder and not RunStatus(holder.get("status", "pending")).terminal:
                    return "queued"
            tx.set(dataset_ref, {"active_run": run.run_id, "active_since": now_iso()}, merge=True)
            if pending.exists and pending.get("run_id") == run.run_id:
                tx.delete(slot)  # later seals make the next pending run
            tx.update(run_ref, {"start_claimed_at": iso(now), "start_claim": token})
            return "claimed"

        token = uuid.uuid4().hex
        verdict = self._contended(take)
        if verdict != "claimed":
            return StartClaim(StartVerdict(verdict), ())
        objects = self.run_objects(run)
        if not objects:  # its only content went to another run in a race: nothing to train
            self.db.collection("runs").document(run.run_id).delete()
            return StartClaim(StartVerdict.EMPTY, ())
        snap = snapshot_id(self._run_hashes(run))
        self.update_run(run.run_id, {"objects": len(objects), "snapshot": snap})
        return StartClaim(StartVerdict.CLAIMED, objects, snap, token)

    def update_claimed(self, run_id: str, claim: str, fields: Mapping[str, Any]) -> bool:
        run_ref = self.db.collection("runs").document(run_id)

        @firestore.transactional
        def update(tx: firestore.Transaction) -> bool:
            current = run_ref.get(transaction=tx).to_dict() or {}
            if (
                current.get("start_claim") != claim
                or current.get("execution")
                or current.get("status", str(RunStatus.PENDING)) != str(RunStatus.PENDING)
            ):
                return False
            tx.update(run_ref, {**fields, "updated_at": now_iso()})
            return True

        return bool(self._contended(update))

    def runs_in(self, *statuses: RunStatus) -> list[Run]:
        """Runs in the given states, oldest first."""
        query = self.db.collection("runs").where(
            filter=FieldFilter("status", "in", [str(s) for s in statuses])
        )
        return sorted((Run.from_dict(d.to_dict() or {}) for d in query.stream()), key=lambda r: r.created_at)

    def unsettled(self) -> list[Run]:
        """Runs that ended without succeeding and still hold their content (their finish step, which gives
        it back, did not run or failed), oldest first.  Two equality filters per query: Firestore merges
        its single-field indexes for them, no composite index needed."""
        return self._runs_where((RunStatus.FAILED, RunStatus.CANCELLED), "content_returned", False)

    def unobserved_release(self) -> list[Run]:
        """Ended runs whose record has no ``nodes_at_end`` (their execution was lost, or ended before it
        could observe the release), oldest first."""
        statuses = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)
        return self._runs_where(statuses, "nodes_at_end", None)

    def _runs_where(self, statuses: tuple[RunStatus, ...], field_path: str, value: Any) -> list[Run]:
        """Runs in one of ``statuses`` whose ``field_path`` equals ``value``, oldest first: one query per
        status, two equality filters each (Firestore merges its single-field indexes for them)."""
        runs = self.db.collection("runs")
        found = []
        for status in statuses:
            query = runs.where(filter=FieldFilter("status", "==", str(status))).where(
                filter=FieldFilter(field_path, "==", value)
            )
            found += [Run.from_dict(d.to_dict() or {}) for d in query.stream()]
        return sorted(found, key=lambda r: r.created_at)

    def attach_execution(self, run_id: str, claim: str, execution: str) -> dict[str, Any] | None:
        run_ref = self.db.collection("runs").document(run_id)

        @firestore.transactional
        def attach(tx: firestore.Transaction) -> dict[str, Any] | None:
            current = run_ref.get(transaction=tx).to_dict() or {}
            plan = current.get("plan")
            if current.get("start_claim") != claim or not isinstance(plan, dict):
                return None
            bound = current.get("execution")
            try:
                status = RunStatus(current.get("status") or "pending")
            except ValueError:  # a status this release does not know: not one to begin in
                return None
            if bound:  # its own again (a retried begin, or Ingest after begin): while the run lives
                same = execution_id(bound) == execution_id(execution)
                return dict(plan) if same and not status.terminal else None
            if status != RunStatus.PENDING:
                return None
            tx.update(run_ref, {"execution": execution, "updated_at": now_iso()})
            return dict(plan)

        return self._contended(attach)

    def update_run(self, run_id: str, fields: Mapping[str, Any]) -> None:
        self.db.collection("runs").document(run_id).update({**fields, "updated_at": now_iso()})

    def request_cancel(self, run_id: str, requested_by: str, reason: str) -> bool:
        run_ref = self.db.collection("runs").document(run_id)

        @firestore.transactional
        def request(tx: firestore.Transaction) -> bool:
            snap = run_ref.get(transaction=tx)
            if not snap.exists:
                return False
            current = Run.from_dict(snap.to_dict() or {})
            if current.status.terminal:
                return False
            if not current.cancel_requested_by:
                fields = {"cancel_requested_by": requested_by, "cancel_reason": reason}
                tx.update(run_ref, {**fields, "updated_at": now_iso()})
            return True

        return bool(self._contended(request))

    def get_run(self, run_id: str) -> Run | None:
        snap = self.db.collection("runs").document(run_id).get()
        return Run.from_dict(snap.to_dict() or {}) if snap.exists else None

    # --- champions: the checkpoint each dataset's next run continues from ---

    def champion(self, dataset: str) -> Champion | None:
        """The dataset's champion (``datasets/{d}.champion``), None before its first promotion."""
        value = (self._dataset(dataset).get().to_dict() or {}).get("champion")
        return Champion.from_dict(value) if value else None

    def promote(self, dataset: str, champion: Champion) -> bool:
        """Make ``champion`` the dataset's champion, with its own entry ``datasets/{d}/promotions/{run}``.
        Idempotent: a run promoted before (a retried step) is not promoted again."""
        dataset_ref = self._dataset(dataset)
        entry = dataset_ref.collection("promotions").document(champion.run_id)

        @firestore.transactional
        def put(tx: firestore.Transaction) -> bool:
            if entry.get(transaction=tx).exists:
                return True
            previous = (dataset_ref.get(transaction=tx).to_dict() or {}).get("champion")
            tx.create(entry, {**champion.to_dict(), "previous": previous, "at": now_iso()})
            tx.set(dataset_ref, {"champion": champion.to_dict()}, merge=True)
            return True

        return bool(put(self.db.transaction()))

    def runs_budgeted_in(self, month: str) -> list[Run]:
        """One equality filter on ``budget_month`` (its single-field index): a month's started runs of
        every dataset, which callers filter by dataset."""
        query = self.db.collection("runs").where(filter=FieldFilter("budget_month", "==", month))
        return [Run.from_dict(d.to_dict() or {}) for d in query.stream()]

    def list_runs(self, limit: int = 100) -> list[Run]:
        docs = self.db.collection("runs").order_by("created_at").limit_to_last(limit).get()
        return [Run.from_dict(d.to_dict() or {}) for d in docs]
