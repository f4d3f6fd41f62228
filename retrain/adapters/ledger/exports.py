"""A watched BigQuery table's exports (:class:`retrain.ports.ExportBook`): the watermark and the job in
flight, moved in transactions."""

from __future__ import annotations

import dataclasses
from typing import Any

from google.api_core import exceptions
from google.cloud import firestore

from retrain.adapters.ledger.base import FirestoreBase, _export_job, _watermark
from retrain.domain.events import ObjectArrival
from retrain.domain.runs import now_iso
from retrain.ports import ExportJob, Watermark


class ExportRecords(FirestoreBase):
    """Watermarks and exports under way."""

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
