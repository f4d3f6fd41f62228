"""The ledger on Firestore: arrivals, batches, snapshots and run records, changed in transactions.

Layout (one collection per concept):
  events/{event_id}                 seen CloudEvent ids (dedup of redelivery)
  objects/{sha1(bucket/name#gen)}   seen object versions (dedup across event ids)
  datasets/{dataset}                the open batch of each dataset
  batches/{batch_id}                state, counts; objects in batches/{id}/objects/{key}
  snapshots/{snapshot_id}           the run that trained a snapshot (identical data never retrains)
  runs/{run_id}                     the run record
The client honours FIRESTORE_EMULATOR_HOST, so the emulator and the cloud differ only by endpoint.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Mapping
from typing import Any

from google.cloud import firestore

from retrain.domain.events import ObjectArrival
from retrain.domain.runs import BatchState, Run, new_run_id, now_iso, snapshot_id
from retrain.ports import ArrivalOutcome, SealOutcome


def _key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


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

    # --- arrivals and batches ---

    def record_arrival(self, arrival: ObjectArrival, dataset: str, content_hash: str) -> ArrivalOutcome:
        event_ref = self.db.collection("events").document(_key(arrival.event_id))
        object_ref = self.db.collection("objects").document(_key(arrival.identity))
        dataset_ref = self.db.collection("datasets").document(dataset)

        @firestore.transactional
        def txn(tx: firestore.Transaction) -> ArrivalOutcome:
            event_snap, object_snap, dataset_snap = (
                event_ref.get(transaction=tx),
                object_ref.get(transaction=tx),
                dataset_ref.get(transaction=tx),
            )
            if event_snap.exists or object_snap.exists:
                return ArrivalOutcome("duplicate")
            batch_id = (dataset_snap.to_dict() or {}).get("open_batch") if dataset_snap.exists else None
            batch_ref = self.db.collection("batches").document(batch_id or uuid.uuid4().hex)
            if batch_id is None:
                tx.set(
                    batch_ref,
                    {
                        "dataset": dataset,
                        "state": str(BatchState.OPEN),
                        "objects": 0,
                        "created_at": now_iso(),
                    },
                )
                tx.set(dataset_ref, {"open_batch": batch_ref.id, "updated_at": now_iso()}, merge=True)
            tx.set(
                batch_ref.collection("objects").document(_key(arrival.identity)),
                {
                    "uri": arrival.uri,
                    "generation": arrival.generation,
                    "size": arrival.size,
                    "content_hash": content_hash,
                    "time": arrival.time,
                },
            )
            tx.update(batch_ref, {"objects": firestore.Increment(1), "last_arrival_at": now_iso()})
            tx.set(event_ref, {"at": now_iso(), "object": arrival.identity})
            tx.set(object_ref, {"at": now_iso(), "batch": batch_ref.id, "uri": arrival.uri})
            return ArrivalOutcome("new", batch_ref.id)

        return txn(self.db.transaction())

    def seal(self, dataset: str, trigger: str) -> SealOutcome:
        """Close the dataset's open batch and create its run, unless empty or already trained."""
        dataset_ref = self.db.collection("datasets").document(dataset)

        @firestore.transactional
        def close(tx: firestore.Transaction) -> str | None:
            snap = dataset_ref.get(transaction=tx)
            batch_id = (snap.to_dict() or {}).get("open_batch") if snap.exists else None
            if batch_id is None:
                return None
            tx.update(dataset_ref, {"open_batch": None, "updated_at": now_iso()})
            tx.update(
                self.db.collection("batches").document(batch_id),
                {"state": str(BatchState.SEALED), "sealed_at": now_iso(), "trigger": trigger},
            )
            return str(batch_id)

        batch_id = close(self.db.transaction())
        if batch_id is None:
            return SealOutcome(None, "nothing pending")
        batch_ref = self.db.collection("batches").document(batch_id)
        objects = [d.to_dict() for d in batch_ref.collection("objects").stream()]
        uris = tuple(sorted(o["uri"] for o in objects))
        snap_id = snapshot_id(o["content_hash"] for o in objects)
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
        def claim(tx: firestore.Transaction) -> str | None:
            existing = snapshot_ref.get(transaction=tx)
            if existing.exists:
                tx.update(batch_ref, {"state": str(BatchState.DUPLICATE), "same_as": existing.get("run_id")})
                return str(existing.get("run_id"))
            tx.set(snapshot_ref, {"run_id": run.run_id, "at": now_iso()})
            tx.set(run_ref, run.to_dict())
            tx.update(batch_ref, {"state": str(BatchState.STARTED), "run_id": run.run_id})
            return None

        same_as = claim(self.db.transaction())
        if same_as is not None:
            return SealOutcome(None, f"snapshot {snap_id[:12]} already trained by run {same_as}", uris)
        return SealOutcome(run, "sealed", uris)

    # --- runs ---

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

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        snap = self.db.collection("batches").document(batch_id).get()
        return snap.to_dict() if snap.exists else None
