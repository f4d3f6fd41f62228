"""Content identity (:class:`retrain.ports.Holdings`): what a run holds, given back, arriving again."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter

from retrain.adapters.ledger.base import ARRIVED_AT, FirestoreBase, _arrival_fields, _key
from retrain.domain.events import ObjectArrival, ObjectVersion
from retrain.domain.runs import Run, now_iso


class HoldingRecords(FirestoreBase):
    """The content entries a run holds, and what it gives back."""

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
            self._patch_run(run.run_id, {"content_returned": True})
        elif entries:
            self._patch_run(run.run_id, {"returned_untrained": current.returned_untrained + len(entries)})
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
