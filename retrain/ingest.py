"""Where an event becomes a run.

Arrivals are recorded in the ledger (deduplicated in a transaction); a seal closes the dataset's open
batch, and a sealed batch whose snapshot is new becomes one run and one workflow execution.  JobSet
completions come back the other way and are relayed to the waiting execution's callback.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from retrain.config import Settings
from retrain.domain.events import Rejected, is_retrain_output, parse_gcs_finalized
from retrain.domain.plan import workflow_argument
from retrain.domain.runs import BatchState, Run, RunStatus, iso
from retrain.ports import Ledger, Orchestrator, SealOutcome

log = logging.getLogger("retrain.ingest")

_DATASET_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


@dataclass(frozen=True)
class Outcome:
    """What handling one event did, for logs and tests: action is one of recorded, duplicate, ignored,
    started, queued, nothing-to-seal, already-trained, recorded-failure, relayed."""

    action: str
    detail: str = ""
    run_id: str | None = None


def record_silent_end(ledger: Ledger, orchestrator: Orchestrator, run: Run) -> Outcome | None:
    """Record as failed a run whose workflow execution ended (a crash, a hard cancel) without
    writing its outcome; None while the execution is active or the record is already final."""
    execution = orchestrator.get(str(run.execution))
    state = execution.get("state")
    if state not in ("SUCCEEDED", "FAILED", "CANCELLED"):
        return None
    current = ledger.get_run(run.run_id)  # re-read: the workflow writes its outcome before it ends
    if current is None or current.status.terminal:
        return None
    error = (execution.get("error") or {}).get("payload")
    reason = f"workflow execution ended {state} without recording an outcome" + (
        f": {error}" if error else ""
    )
    ledger.update_run(run.run_id, {"status": str(RunStatus.FAILED), "reason": reason})
    return Outcome("recorded-failure", reason, run.run_id)


class Ingest:
    def __init__(self, settings: Settings, ledger: Ledger, orchestrator: Orchestrator) -> None:
        self.settings = settings
        self.ledger = ledger
        self.orchestrator = orchestrator

    def dataset_of(self, name: str) -> str:
        """``incoming/<dataset>/...`` names a dataset; files directly under the prefix use the default."""
        rest = name[len(self.settings.landing_prefix) :]
        head, sep, _ = rest.partition("/")
        if not sep:
            return self.settings.dataset
        if not _DATASET_RE.match(head):
            raise Rejected(f"dataset folder {head!r} is not a valid dataset name")
        return head

    def on_object_finalized(self, attributes: Mapping[str, Any], data: Any) -> Outcome:
        """A GCS finalize event: record the object, or seal on the marker. Raises Rejected."""
        arrival = parse_gcs_finalized(attributes, data)
        if arrival.bucket != self.settings.landing_bucket:
            raise Rejected(f"bucket {arrival.bucket!r} is not the landing bucket")
        if not arrival.name.startswith(self.settings.landing_prefix) or is_retrain_output(arrival.name):
            return Outcome("ignored", f"{arrival.name} is not new training data")
        dataset = self.dataset_of(arrival.name)
        if arrival.name.rsplit("/", 1)[-1] == self.settings.seal_marker:
            return self.seal(dataset, trigger="gcs-marker")
        content_hash = f"md5:{arrival.md5_hash}" if arrival.md5_hash else f"object:{arrival.identity}"
        result = self.ledger.record_arrival(arrival, dataset, content_hash)
        if result.status == "duplicate":
            return Outcome("duplicate", arrival.identity)
        return Outcome("recorded", f"{arrival.uri} -> batch {result.batch_id}")

    def seal(self, dataset: str, trigger: str) -> Outcome:
        """Seal the dataset's open batch and start its run (or queue it behind the dataset's live run)."""
        return self._started(self.ledger.seal(dataset, trigger))

    def _started(self, sealed: SealOutcome) -> Outcome:
        if sealed.run is None:
            action = "nothing-to-seal" if sealed.reason == "nothing pending" else "already-trained"
            return Outcome(action, sealed.reason)
        if sealed.run.execution:
            return Outcome("started", sealed.run.execution, sealed.run.run_id)
        return self.start(sealed.run, sealed.objects)

    def start(self, run: Run, objects: tuple[str, ...] | None = None) -> Outcome:
        """Start a run's workflow if its dataset has no live run; otherwise it waits, queued, as pending."""
        if not self.ledger.claim_start(run):
            log.info("run %s queued behind the live run of dataset %s", run.run_id, run.dataset)
            return Outcome("queued", f"dataset {run.dataset} has a live run", run.run_id)
        objects = objects or self.ledger.batch_objects(run.batch_id)
        execution = self.orchestrator.start(workflow_argument(self.settings, run, objects))
        self.ledger.attach_execution(run.run_id, execution)
        log.info("run %s started: %d objects, execution %s", run.run_id, run.objects, execution)
        return Outcome("started", execution, run.run_id)

    def on_scheduler_tick(self, message: Mapping[str, Any]) -> list[Outcome]:
        """Cloud Scheduler: ``{"action": "seal"}`` seals whatever is pending (all datasets, or
        ``dataset``); ``{"action": "sweep"}`` runs the sweeper."""
        action = message.get("action", "seal")
        if action == "sweep":
            return self.sweep()
        if action != "seal":
            raise Rejected(f"unknown scheduler action {action!r}")
        return self.seal_pending(message.get("dataset"), "scheduler")

    def seal_pending(self, dataset: Any, trigger: str) -> list[Outcome]:
        """Seal every dataset's pending data (or only ``dataset``'s): ticks and manual triggers."""
        if dataset is not None and (not isinstance(dataset, str) or not _DATASET_RE.match(dataset)):
            raise Rejected("dataset must be a valid dataset name")
        datasets = sorted({b["dataset"] for b in self.ledger.batches_in(BatchState.OPEN)})
        return [self.seal(d, trigger) for d in datasets if dataset in (None, d)]

    def sweep(self, now: datetime | None = None) -> list[Outcome]:
        """What a timer must do, in order: seal quiet or old batches, finish seals and starts a crash
        cut short, record executions that died without an outcome, and start queued runs."""
        now = now or datetime.now(UTC)
        s = self.settings
        stuck_before, quiet_before, old_before = (
            iso(now - timedelta(seconds=x)) for x in (s.stuck_after_s, s.quiet_period_s, s.max_batch_age_s)
        )
        outcomes: list[Outcome] = []
        for batch in self.ledger.batches_in(BatchState.OPEN):
            if batch.get("last_arrival_at", "") < quiet_before:
                outcomes.append(self.seal(batch["dataset"], "quiet-period"))
            elif batch.get("created_at", "") < old_before:
                outcomes.append(self.seal(batch["dataset"], "max-age"))
        for batch in self.ledger.batches_in(BatchState.SEALED):
            if batch.get("sealed_at", "") < stuck_before:
                outcomes.append(self._started(self.ledger.materialize(batch["batch_id"])))
        live = (RunStatus.TOKENIZING, RunStatus.PROVISIONING, RunStatus.TRAINING, RunStatus.PENDING)
        for run in self.ledger.runs_in(*live):
            if run.execution and (ended := record_silent_end(self.ledger, self.orchestrator, run)):
                outcomes.append(ended)
        for run in self.ledger.runs_in(RunStatus.PENDING):
            # queued behind a finished run, or orphaned by a crash; the newest are still being started
            if not run.execution and run.created_at < stuck_before:
                outcomes.append(self.start(run))
        return outcomes

    def on_jobset_event(self, message: Mapping[str, Any]) -> Outcome:
        """Relay a JobSet terminal state (published by the notifier) to the run's workflow callback."""
        url = message.get("callback_url")
        if not isinstance(url, str) or not url:
            raise Rejected("JobSet event carries no callback URL")
        state = message.get("state")
        if state not in ("Completed", "Failed"):
            raise Rejected(f"JobSet event has unknown state {state!r}")
        keys = ("run_id", "jobset", "state", "reason", "message", "restarts", "start_time", "finish_time")
        payload = {k: message.get(k) for k in keys}
        try:
            status = self.orchestrator.send_callback(url, payload)
        except ValueError as e:
            raise Rejected(str(e)) from None
        if status == 404:
            # The execution is gone (finished, cancelled or timed out): nothing waits, so acknowledge.
            return Outcome("ignored", f"callback {url} no longer exists")
        if status >= 300:
            raise RuntimeError(f"callback {url} answered {status}")  # transient: let the platform retry
        return Outcome("relayed", str(state), str(message.get("run_id")))
