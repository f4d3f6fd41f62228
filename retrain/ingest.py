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
from typing import Any

from retrain.config import Settings
from retrain.domain.events import Rejected, is_retrain_output, parse_gcs_finalized
from retrain.domain.plan import workflow_argument
from retrain.ports import Ledger, Orchestrator

log = logging.getLogger("retrain.ingest")

_DATASET_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


@dataclass(frozen=True)
class Outcome:
    """What handling one event did, for logs and tests: action is one of
    recorded, duplicate, ignored, sealed, nothing-to-seal, already-trained, relayed."""

    action: str
    detail: str = ""
    run_id: str | None = None


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
        """Seal the dataset's open batch and start its run."""
        sealed = self.ledger.seal(dataset, trigger)
        if sealed.run is None:
            action = "nothing-to-seal" if sealed.reason == "nothing pending" else "already-trained"
            return Outcome(action, sealed.reason)
        run = sealed.run
        execution = self.orchestrator.start(workflow_argument(self.settings, run, sealed.objects))
        self.ledger.attach_execution(run.run_id, execution)
        log.info("run %s started: %d objects, execution %s", run.run_id, run.objects, execution)
        return Outcome("sealed", execution, run.run_id)

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
