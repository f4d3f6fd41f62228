"""The run records and champions (:class:`retrain.ports.RunStore`, :class:`retrain.ports.Champions`): a
start's claim, the execution bound under it, each run's fields."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from google.api_core.exceptions import Aborted
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter

from retrain.adapters.ledger.base import LOST_RACE, FirestoreBase
from retrain.domain.runs import Champion, Run, RunStatus, execution_id, iso, now_iso, snapshot_id
from retrain.domain.transitions import RunChange
from retrain.ports import StartClaim, StartVerdict


def _standing(
    run_id: str,
    current: dict[str, Any],
    state: dict[str, Any],
    now: datetime,
    stale_after_s: float,
    read_run: Callable[[str], Any],
) -> str | None:
    """Why run ``run_id`` (its record ``current``; its dataset's record ``state``) cannot be claimed now,
    as a start verdict's value, or None when it can: started (or gone), its start claimed less than
    ``stale_after_s`` ago, or queued behind its dataset's live run (read with ``read_run``)."""
    if not current or current.get("execution"):
        return "started"
    claimed = current.get("start_claimed_at")
    if (
        claimed
        and (now - datetime.fromisoformat(claimed.replace("Z", "+00:00"))).total_seconds() < stale_after_s
    ):
        return "starting"
    active = state.get("active_run")
    if active and active != run_id:
        holder = read_run(active).to_dict()
        if holder and not RunStatus(holder.get("status", "pending")).terminal:
            return "queued"
    return None


class RunRecords(FirestoreBase):
    """Run records and champions."""

    def claim_start(self, run: Run, stale_after_s: float) -> StartClaim:
        """Take the dataset's live slot for ``run`` unless another live run holds it, and fix its object
        list.  A run whose start is already claimed is not claimed again for ``stale_after_s`` (its
        starter may still be at work; after that it is taken to have crashed).

        Every seal of a storm claims (29 at once in the synced folder's test), so the claim locks
        nothing: it reads the run, its dataset and the dataset's pending slot, and writes them in one
        batch whose preconditions are the update times it read.  Of concurrent claims one commits; the
        others read again and find the start claimed.  A write that meets a lock a transaction elsewhere
        holds on what it writes is aborted, and tried again the same way.  (In one transaction each,
        claims that read together deadlocked on the emulator's read locks: 31 of 32 failed in a probe.)"""
        dataset_ref = self._dataset(run.dataset)
        run_ref = self.db.collection("runs").document(run.run_id)
        slot = self._slot(run.dataset)
        runs = self.db.collection("runs")
        now = datetime.now(UTC)
        token = uuid.uuid4().hex

        def attempt() -> str:
            current, state, pending = run_ref.get(), dataset_ref.get(), slot.get()
            standing = _standing(
                run.run_id,
                current.to_dict() or {},
                state.to_dict() or {},
                now,
                stale_after_s,
                lambda a: runs.document(a).get(),
            )
            if standing:  # these verdicts write nothing; "queued" is started by the holder's end's sweep
                return standing
            writes = self.db.batch()
            live = {"active_run": run.run_id, "active_since": now_iso()}
            if state.exists:
                writes.update(dataset_ref, live, option=self._unchanged_since(state))
            else:
                writes.create(dataset_ref, live)
            if pending.exists and pending.get("run_id") == run.run_id:
                writes.delete(slot, option=self._unchanged_since(pending))  # later seals make the next
            claim = {"start_claimed_at": iso(now), "start_claim": token}
            writes.update(run_ref, claim, option=self._unchanged_since(current))
            writes.commit()
            return "claimed"

        verdict = self._retried(attempt, lambda e: isinstance(e, (*LOST_RACE, Aborted)))
        if verdict != "claimed":
            return StartClaim(StartVerdict(verdict), ())
        objects = self.run_objects(run)
        if not objects:  # its only content went to another run in a race: nothing to train
            self.db.collection("runs").document(run.run_id).delete()
            return StartClaim(StartVerdict.EMPTY, ())
        snap = snapshot_id(self._run_hashes(run))
        self._patch_run(run.run_id, {"objects": len(objects), "snapshot": snap})
        return StartClaim(StartVerdict.CLAIMED, objects, snap, token)

    def record_claimed(self, run_id: str, claim: str, change: RunChange) -> bool:
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
            tx.update(run_ref, {**change.fields(), "updated_at": now_iso()})
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
