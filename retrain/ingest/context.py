"""What every job of ingest works with: the settings and the ports, shared by reference, so that settings
changed on the handler (the CLI, a test) are the settings of all its jobs."""

from __future__ import annotations

from dataclasses import dataclass

from retrain.config import Settings
from retrain.ports import Cluster, Ledger, ObjectStore, Orchestrator, RunEvents, Warehouse


@dataclass
class Context:
    """The settings and ports of one handler, which its jobs share."""

    settings: Settings
    ledger: Ledger
    orchestrator: Orchestrator
    store: ObjectStore
    warehouse: Warehouse | None = None
    """BigQuery, where a table is watched; None: no table is."""
    cluster: Cluster | None = None
    """The cluster's API (the reaper, a completion's confirmation); None: neither runs here."""
    events: RunEvents | None = None
    """Where run events are published; None: they are not."""


class Job:
    """Ingest or one of its jobs (arrivals, starts, the sweeper, the relay): it reads the shared context's
    settings and ports as its own; only the settings may be replaced (on the handler, for every job)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    @property
    def settings(self) -> Settings:
        return self.ctx.settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self.ctx.settings = settings

    @property
    def ledger(self) -> Ledger:
        return self.ctx.ledger

    @property
    def orchestrator(self) -> Orchestrator:
        return self.ctx.orchestrator

    @property
    def store(self) -> ObjectStore:
        return self.ctx.store

    @property
    def warehouse(self) -> Warehouse | None:
        return self.ctx.warehouse

    @property
    def cluster(self) -> Cluster | None:
        return self.ctx.cluster

    @property
    def events(self) -> RunEvents | None:
        return self.ctx.events
