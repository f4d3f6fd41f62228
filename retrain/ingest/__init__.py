"""Where an event becomes a run.

Arrivals are recorded in the ledger (deduplicated, contention-free); a seal cuts the dataset's
timeline, and a sealed batch whose snapshot is new becomes one run: its object list is written as the
run's manifest and one workflow execution starts.  A write to a watched BigQuery table is first
exported (its new rows, by a bounded BigQuery job into the artifacts bucket: ``retrain.exports``) and
its files recorded like any arrival.  JobSet completions come back the other way and are relayed to the
waiting execution's callback.

The jobs, a module each: :mod:`.arrivals` (objects and BigQuery exports recorded), :mod:`.starts` (seals;
a run's start: manifest, price, plan, execution; a retry), :mod:`.sweeper` (the timers: the sweeper with
the silent ends and give-backs, the reaper, the audit), :mod:`.relay` (JobSet completions to their
callbacks) and :mod:`.forecast`.  :class:`Ingest` is
every trigger's entry point, over the ports alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from retrain.config import Settings
from retrain.contracts import Forecast, SchedulerJob, SchedulerTick
from retrain.domain.runs import Run, Trigger
from retrain.ingest import forecast as forecasts
from retrain.ingest.arrivals import Arrivals
from retrain.ingest.context import Context, Job
from retrain.ingest.outcomes import Action, Outcome
from retrain.ingest.relay import Relay
from retrain.ingest.starts import Starts
from retrain.ingest.sweeper import Sweeper, record_silent_end
from retrain.ports import Cluster, Ledger, ObjectStore, Orchestrator, RunEvents, Warehouse

__all__ = ["Action", "Ingest", "Outcome", "record_silent_end"]


class Ingest(Job):
    """Every trigger's handler (functions/, the CLI and the sweeper call these), over the ports alone: each
    hands the event to the job it is for."""

    def __init__(
        self,
        settings: Settings,
        ledger: Ledger,
        orchestrator: Orchestrator,
        store: ObjectStore,
        warehouse: Warehouse | None = None,
        cluster: Cluster | None = None,
        events: RunEvents | None = None,
    ) -> None:
        super().__init__(Context(settings, ledger, orchestrator, store, warehouse, cluster, events))
        self.starts = Starts(self.ctx)
        self.arrivals = Arrivals(self.ctx, self.starts)
        self.sweeper = Sweeper(self.ctx, self.starts, self.arrivals)
        self.relay = Relay(self.ctx)

    def on_object_finalized(self, attributes: Mapping[str, Any], data: Any) -> Outcome:
        """A GCS finalize event (:meth:`.Arrivals.on_object_finalized`)."""
        return self.arrivals.on_object_finalized(attributes, data)

    def on_bigquery_event(self, attributes: Mapping[str, Any], data: Any) -> Outcome:
        """A BigQuery audit-log event (:meth:`.Arrivals.on_bigquery_event`)."""
        return self.arrivals.on_bigquery_event(attributes, data)

    def on_scheduler_tick(self, message: Mapping[str, Any]) -> list[Outcome]:
        """A Cloud Scheduler job's tick (:class:`SchedulerTick`): seal, sweeper, reaper or audit."""
        tick = SchedulerTick.parse(message)
        if tick.job == SchedulerJob.SWEEPER:
            return self.sweeper.sweep()
        if tick.job == SchedulerJob.REAPER:
            return [self.sweeper.reap()]
        if tick.job == SchedulerJob.AUDIT:
            return [self.sweeper.audit()]
        return self.starts.seal_pending(tick.dataset, Trigger.SCHEDULER)

    def on_jobset_event(self, message: Mapping[str, Any]) -> Outcome:
        """A JobSet's terminal state from the notifier (:meth:`.Relay.on_jobset_event`)."""
        return self.relay.on_jobset_event(message)

    def dataset_of(self, name: str) -> str:
        """The dataset an object's name puts it in (:meth:`.Arrivals.dataset_of`)."""
        return self.arrivals.dataset_of(name)

    def seal(self, dataset: str, trigger: Trigger) -> Outcome:
        """Seal ``dataset`` and start its run (:meth:`.Starts.seal`)."""
        return self.starts.seal(dataset, trigger)

    def seal_pending(self, dataset: Any, trigger: Trigger) -> list[Outcome]:
        """Seal every dataset with pending data, or only ``dataset`` (:meth:`.Starts.seal_pending`)."""
        return self.starts.seal_pending(dataset, trigger)

    def start(self, run: Run) -> Outcome:
        """Start a pending run, or leave it queued (:meth:`.Starts.start`: manifest, price, plan)."""
        return self.starts.start(run)

    def retry(self, run_id: str) -> Outcome:
        """Run a failed, cancelled or refused run's objects again (:meth:`.Starts.retry`)."""
        return self.starts.retry(run_id)

    def sweep(self, now: datetime | None = None) -> list[Outcome]:
        """What a timer must do, in order (:meth:`.Sweeper.sweep`)."""
        return self.sweeper.sweep(now)

    def reap(self) -> Outcome:
        """Delete what no live run owns in the cluster (:meth:`.Sweeper.reap`)."""
        return self.sweeper.reap()

    def audit(self) -> Outcome:
        """Account for every landed object (:meth:`.Sweeper.audit`)."""
        return self.sweeper.audit()

    def forecast(self, dataset: Any = None) -> list[Forecast]:
        """What sealing now would train and cost (:func:`.forecast.forecast`); nothing is written."""
        return forecasts.forecast(self.ctx, dataset)
