"""Seals and coalescing (:class:`retrain.ports.Batches`): a lock-free cut, and the batch's new content joined
to the pending run."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from google.api_core.exceptions import AlreadyExists, Conflict
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter

from retrain.adapters.ledger.base import (
    CONTENT_CHUNK,
    LOST_RACE,
    THROUGH,
    FirestoreBase,
    _first_by_content,
    _key,
)
from retrain.domain.events import ObjectVersion
from retrain.domain.runs import BatchState, Run, Trigger, new_run_id, now_iso, read_trigger
from retrain.ports import SealOutcome, SealPreview, SealVerdict


class BatchRecords(FirestoreBase):
    """Seals, and the pending run a batch joins."""

    def seal(self, dataset: str, trigger: Trigger, retry_of: str | None = None) -> SealOutcome:
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
                "trigger": str(trigger),
                "retry_of": retry_of,
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
        dataset = str(batch.get("dataset"))
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
            trigger, retried = read_trigger(batch.get("trigger"))
            run = self._pending_run(dataset, batch_id, trigger, batch.get("retry_of") or retried)
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
            return SealOutcome.nothing_new(skipped)
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

    def pending_run(self, dataset: str) -> Run | None:
        """The dataset's pending run (the one later seals join), if any."""
        snap = self._slot(dataset).get()
        run = self.get_run(str(snap.get("run_id"))) if snap.exists else None
        return run if run is not None and not run.status.terminal else None

    def _pending_run(self, dataset: str, batch_id: str, trigger: Trigger, retry_of: str | None) -> Run:
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
            fresh = Run(new_run_id(dataset), dataset, trigger, batch_id=batch_id, retry_of=retry_of)
            writes = self.db.batch()
            writes.set(self.db.collection("runs").document(fresh.run_id), fresh.to_dict())
            if snap.exists:  # a slot naming a run that is gone or ended before it started: replace it
                writes.update(
                    slot,
                    {"run_id": fresh.run_id},
                    option=self._unchanged_since(snap),
                )
            else:
                writes.create(slot, {"run_id": fresh.run_id})
            try:
                writes.commit()
            except LOST_RACE:
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

    def _held(self, dataset: str, hashes: list[str]) -> set[str]:
        """The content hashes some run of ``dataset`` holds already (trained, live or pending)."""
        held: set[str] = set()
        for i in range(0, len(hashes), CONTENT_CHUNK):
            chunk = {_key(h): h for h in hashes[i : i + CONTENT_CHUNK]}
            refs = [self._contents(dataset).document(k) for k in chunk]
            held.update(chunk[snap.id] for snap in self.db.get_all(refs) if snap.exists)
        return held

    def batches_in(self, state: BatchState) -> list[dict[str, Any]]:
        """Batches in one state, each with its ``batch_id`` (few at a time: stuck ones)."""
        docs = self.db.collection("batches").where(filter=FieldFilter("state", "==", str(state))).stream()
        return [{**(d.to_dict() or {}), "batch_id": d.id} for d in docs]
