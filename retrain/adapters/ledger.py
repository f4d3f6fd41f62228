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
from google.cloud.firestore_v1.base_query import FieldFilter

from retrain.domain.events import ObjectArrival
from retrain.domain.runs import BatchState, Run, RunStatus, new_run_id, now_iso, snapshot_id
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
        return self.materialize(batch_id)

    def materialize(self, batch_id: str) -> SealOutcome:
        """Turn a sealed batch into its run; idempotent, so a sweeper can finish a seal a crash cut short."""
        batch_ref = self.db.collection("batches").document(batch_id)
        batch = batch_ref.get().to_dict() or {}
        dataset, trigger = str(batch.get("dataset")), str(batch.get("trigger", "sweeper"))
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
            tx.update(batch_ref, {"state": str(BatchState.STARTED), "run_id": run.run_id})
            return "new", run.run_id

        outcome, run_id = claim(self.db.transaction())
        if outcome == "duplicate":
            return SealOutcome(None, f"snapshot {snap_id[:12]} already trained by run {run_id}", uris)
        if outcome == "done":
            existing_run = self.get_run(str(run_id)) if run_id else None
            return SealOutcome(existing_run, "already sealed", uris)
        return SealOutcome(run, "sealed", uris)

    def batch_objects(self, batch_id: str) -> tuple[str, ...]:
        objects = self.db.collection("batches").document(batch_id).collection("objects").stream()
        return tuple(sorted(str((d.to_dict() or {})["uri"]) for d in objects))

    def batches_in(self, state: BatchState) -> list[dict[str, Any]]:
        """Batches in one state, each with its ``batch_id`` (few at a time: open or stuck ones)."""
        docs = self.db.collection("batches").where(filter=FieldFilter("state", "==", str(state))).stream()
        return [{**(d.to_dict() or {}), "batch_id": d.id} for d in docs]

    def claim_start(self, run: Run) -> bool:
        """One run at a time per dataset: take the dataset's slot for ``run`` unless a live run holds it."""
        dataset_ref = self.db.collection("datasets").document(run.dataset)

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
