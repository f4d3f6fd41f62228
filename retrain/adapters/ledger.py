"""The ledger on Firestore: arrivals, batches, snapshots and run records.

Layout (one collection per concept):
  datasets/{dataset}                          the dataset's seal cut-off and its live run
  datasets/{dataset}/arrivals/{sha1(b/n#g)}   one per object version, with the event that announced it
  batches/{batch_id}                          a sealed window of arrivals, and what became of it
  snapshots/{snapshot_id}                     the run that trained a snapshot (identical data never retrains)
  runs/{run_id}                               the run record
  watermarks/{sha1(table)}                    how far a watched BigQuery table has been exported

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
import hashlib
import os
import uuid
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

from google.api_core.exceptions import AlreadyExists, Conflict
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter
from google.cloud.firestore_v1.types import common, document, write
from google.cloud.firestore_v1.types import firestore as api

from retrain.domain.events import ObjectArrival
from retrain.domain.runs import BatchState, Pending, Run, RunStatus, iso, new_run_id, now_iso, snapshot_id
from retrain.ports import ArrivalOutcome, ArrivalStatus, SealOutcome, SealVerdict

ARRIVED_AT = "arrived_at"

# Raw protobuf classes behind the client's proto-plus types (see FirestoreLedger._create_stamped).
_Write, _Document, _Value = write.Write.pb(), document.Document.pb(), document.Value.pb()
_Transform, _Precondition = write.DocumentTransform.FieldTransform.pb(), common.Precondition.pb()
_CommitRequest = api.CommitRequest.pb()


def _key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _arrival_fields(arrival: ObjectArrival, content_hash: str) -> dict[str, str | int]:
    return {
        "uri": arrival.uri,
        "generation": arrival.generation,
        "size": arrival.size,
        "content_hash": content_hash,
        "time": arrival.time,
        "event_id": arrival.event_id,
    }


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

    # --- arrivals ---

    def _dataset(self, dataset: str) -> firestore.DocumentReference:
        return self.db.collection("datasets").document(dataset)

    def _arrivals(self, dataset: str) -> firestore.CollectionReference:
        return self._dataset(dataset).collection("arrivals")

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
        ref = self._arrivals(dataset).document(_key(arrival.identity))
        try:
            self._create_stamped(ref, _arrival_fields(arrival, content_hash), ARRIVED_AT)
        except (AlreadyExists, Conflict):
            return ArrivalOutcome(ArrivalStatus.DUPLICATE)
        return ArrivalOutcome(ArrivalStatus.NEW)

    def _create_stamped(
        self, ref: firestore.DocumentReference, fields: Mapping[str, str | int], stamp: str
    ) -> None:
        """``ref.create({**fields, stamp: SERVER_TIMESTAMP})``: the same Commit request, built as raw
        protobuf.  It is a storm's hot path: through the client's proto-plus wrappers a create costs the
        function about 1.2 ms of CPU, this way 0.7 ms (measured single-threaded against the emulator)."""
        database = self.db._database_string
        create = _Write(
            update=_Document(
                name=f"{database}/documents/{ref.path}", fields={k: _value(v) for k, v in fields.items()}
            ),
            update_transforms=[_Transform(field_path=stamp, set_to_server_value=_Transform.REQUEST_TIME)],
            current_document=_Precondition(exists=False),
        )
        request = _CommitRequest(database=database, writes=[create])
        self.db._firestore_api.commit(request=request, metadata=self.db._rpc_metadata)

    def _add_arrival(self, writes: Any, arrival: ObjectArrival, dataset: str, content_hash: str) -> None:
        ref = self._arrivals(dataset).document(_key(arrival.identity))
        writes.create(ref, {**_arrival_fields(arrival, content_hash), ARRIVED_AT: firestore.SERVER_TIMESTAMP})

    def _window(self, dataset: str, after: datetime | None, through: datetime | None = None) -> Any:
        q: Any = self._arrivals(dataset)
        if after is not None:
            q = q.where(filter=FieldFilter(ARRIVED_AT, ">", after))
        if through is not None:
            q = q.where(filter=FieldFilter(ARRIVED_AT, "<=", through))
        return q

    def pending(self, dataset: str | None = None) -> list[Pending]:
        """Datasets with arrivals not yet sealed: how many, the first and the last (for the sweeper)."""
        names = [dataset] if dataset else [d.id for d in self.db.collection("datasets").stream()]
        out = []
        for name in names:
            cut = (self._dataset(name).get().to_dict() or {}).get("sealed_through")
            window = self._window(name, cut)
            first = list(window.order_by(ARRIVED_AT).limit(1).stream())
            if not first:
                continue
            (last,) = window.order_by(ARRIVED_AT, direction=firestore.Query.DESCENDING).limit(1).stream()
            count = window.count().get()[0][0].value
            out.append(Pending(name, int(count), iso(first[0].get(ARRIVED_AT)), iso(last.get(ARRIVED_AT))))
        return out

    # --- batches ---

    def seal(self, dataset: str, trigger: str) -> SealOutcome:
        """Cut the dataset's timeline now: what arrived since the last cut becomes a batch and its run."""
        dataset_ref = self._dataset(dataset)
        batch_ref = self.db.collection("batches").document(uuid.uuid4().hex)

        @firestore.transactional
        def cut(tx: firestore.Transaction) -> bool:
            previous = (dataset_ref.get(transaction=tx).to_dict() or {}).get("sealed_through")
            if not list(tx.get(self._window(dataset, previous).limit(1))):
                return False
            tx.set(dataset_ref, {"sealed_through": firestore.SERVER_TIMESTAMP}, merge=True)
            tx.set(
                batch_ref,
                {
                    "dataset": dataset,
                    "state": str(BatchState.SEALED),
                    "after": previous,
                    "through": firestore.SERVER_TIMESTAMP,
                    "sealed_at": now_iso(),
                    "trigger": trigger,
                },
            )
            return True

        if not cut(self.db.transaction()):
            return SealOutcome(None, SealVerdict.NOTHING_PENDING, "nothing pending")
        return self.materialize(batch_ref.id)

    def _batch_arrivals(self, batch: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        window = self._window(str(batch["dataset"]), batch.get("after"), batch["through"])
        return (d.to_dict() or {} for d in window.stream())

    def materialize(self, batch_id: str) -> SealOutcome:
        """Turn a sealed batch into its run; idempotent, so a sweeper can finish a seal a crash cut short."""
        batch_ref = self.db.collection("batches").document(batch_id)
        batch = batch_ref.get().to_dict() or {}
        dataset, trigger = str(batch.get("dataset")), str(batch.get("trigger", "sweeper"))
        arrivals = list(self._batch_arrivals(batch))
        uris = tuple(sorted(a["uri"] for a in arrivals))
        snap_id = snapshot_id(a["content_hash"] for a in arrivals)
        run = Run(
            run_id=new_run_id(dataset),
            dataset=dataset,
            trigger=trigger,
            batch_id=batch_id,
            snapshot=snap_id,
            objects=len(uris),
        )
        snapshot_ref = self.db.collection("snapshots").document(snap_id)
        run_ref = self.db.collection("runs").document(run.run_id)

        @firestore.transactional
        def claim(tx: firestore.Transaction) -> tuple[str, str | None]:
            state = batch_ref.get(transaction=tx).to_dict() or {}
            if state.get("state") != str(BatchState.SEALED):  # done already, by us or a sweeper
                return "done", state.get("run_id") or state.get("same_as")
            existing = snapshot_ref.get(transaction=tx)
            if existing.exists:
                tx.update(batch_ref, {"state": str(BatchState.DUPLICATE), "same_as": existing.get("run_id")})
                return "duplicate", str(existing.get("run_id"))
            tx.set(snapshot_ref, {"run_id": run.run_id, "at": now_iso()})
            tx.set(run_ref, run.to_dict())
            tx.update(
                batch_ref, {"state": str(BatchState.STARTED), "run_id": run.run_id, "objects": len(uris)}
            )
            return "new", run.run_id

        outcome, run_id = claim(self.db.transaction())
        if outcome == "duplicate":
            return SealOutcome(
                None,
                SealVerdict.ALREADY_TRAINED,
                f"snapshot {snap_id[:12]} already trained by run {run_id}",
                uris,
            )
        if outcome == "done":
            existing_run = self.get_run(str(run_id)) if run_id else None
            return SealOutcome(existing_run, SealVerdict.ALREADY_SEALED, "already sealed", uris)
        return SealOutcome(run, SealVerdict.SEALED, "sealed", uris)

    def batch_objects(self, batch_id: str) -> tuple[str, ...]:
        batch = self.db.collection("batches").document(batch_id).get().to_dict() or {}
        return tuple(sorted(str(a["uri"]) for a in self._batch_arrivals(batch)))

    def batches_in(self, state: BatchState) -> list[dict[str, Any]]:
        """Batches in one state, each with its ``batch_id`` (few at a time: stuck ones)."""
        docs = self.db.collection("batches").where(filter=FieldFilter("state", "==", str(state))).stream()
        return [{**(d.to_dict() or {}), "batch_id": d.id} for d in docs]

    # --- BigQuery exports ---

    def watermark(self, table: str) -> Any:
        """How far ``table`` has been exported (None: never)."""
        return (self.db.collection("watermarks").document(_key(table)).get().to_dict() or {}).get("value")

    def record_export(
        self, table: str, after: Any, through: Any, arrival: ObjectArrival, dataset: str, content_hash: str
    ) -> bool:
        """Advance ``table``'s watermark from ``after`` to ``through`` and record the export's object,
        atomically; False (nothing written) when another export moved the watermark first."""
        self._ensure_dataset(dataset)
        ref = self.db.collection("watermarks").document(_key(table))

        @firestore.transactional
        def advance(tx: firestore.Transaction) -> bool:
            if (ref.get(transaction=tx).to_dict() or {}).get("value") != after:
                return False
            tx.set(ref, {"table": table, "value": through, "object": arrival.uri, "at": now_iso()})
            self._add_arrival(tx, arrival, dataset, content_hash)
            return True

        return bool(advance(self.db.transaction()))

    # --- runs ---

    def claim_start(self, run: Run) -> bool:
        """One run at a time per dataset: take the dataset's slot for ``run`` unless a live run holds it."""
        dataset_ref = self._dataset(run.dataset)

        @firestore.transactional
        def take(tx: firestore.Transaction) -> bool:
            active = (dataset_ref.get(transaction=tx).to_dict() or {}).get("active_run")
            if active and active != run.run_id:
                holder = self.db.collection("runs").document(active).get(transaction=tx).to_dict()
                if holder and not RunStatus(holder.get("status", "pending")).terminal:
                    return False
            tx.set(dataset_ref, {"active_run": run.run_id, "active_since": now_iso()}, merge=True)
            return True

        return bool(take(self.db.transaction()))

    def runs_in(self, *statuses: RunStatus) -> list[Run]:
        """Runs in the given states, oldest first."""
        query = self.db.collection("runs").where(
            filter=FieldFilter("status", "in", [str(s) for s in statuses])
        )
        return sorted((Run.from_dict(d.to_dict() or {}) for d in query.stream()), key=lambda r: r.created_at)

    def attach_execution(self, run_id: str, execution: str) -> None:
        self.update_run(run_id, {"execution": execution})

    def update_run(self, run_id: str, fields: Mapping[str, Any]) -> None:
        self.db.collection("runs").document(run_id).update({**fields, "updated_at": now_iso()})

    def get_run(self, run_id: str) -> Run | None:
        snap = self.db.collection("runs").document(run_id).get()
        return Run.from_dict(snap.to_dict() or {}) if snap.exists else None

    def list_runs(self, limit: int = 100) -> list[Run]:
        docs = self.db.collection("runs").order_by("created_at").limit_to_last(limit).get()
        return [Run.from_dict(d.to_dict() or {}) for d in docs]
