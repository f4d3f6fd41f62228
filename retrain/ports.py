"""The small interfaces the domain needs from the outside world.

Each has one real adapter in ``retrain.adapters`` (the cloud and the emulators differ only by
endpoint); the Workflows executions API, which has no emulator, has a local twin in
``retrain.workflows.server`` reached through the same REST shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from retrain.domain.events import ObjectArrival
from retrain.domain.runs import BatchState, Run, RunStatus


@dataclass(frozen=True)
class ArrivalOutcome:
    """What recording an arrival did: ``new`` joined ``batch_id``; ``duplicate`` was seen before."""

    status: str
    batch_id: str | None = None


@dataclass(frozen=True)
class SealOutcome:
    """What sealing did: ``run`` is the new run to start, or None with a reason."""

    run: Run | None
    reason: str
    objects: tuple[str, ...] = ()


class Ledger(Protocol):
    """Durable, transactional record of arrivals, batches and runs (Firestore)."""

    def record_arrival(self, arrival: ObjectArrival, dataset: str, content_hash: str) -> ArrivalOutcome: ...

    def seal(self, dataset: str, trigger: str) -> SealOutcome: ...

    def materialize(self, batch_id: str) -> SealOutcome: ...

    def batch_objects(self, batch_id: str) -> tuple[str, ...]: ...

    def batches_in(self, state: BatchState) -> list[dict[str, Any]]: ...

    def claim_start(self, run: Run) -> bool: ...

    def runs_in(self, *statuses: RunStatus) -> list[Run]: ...

    def attach_execution(self, run_id: str, execution: str) -> None: ...

    def update_run(self, run_id: str, fields: Mapping[str, Any]) -> None: ...

    def get_run(self, run_id: str) -> Run | None: ...

    def list_runs(self, limit: int = 100) -> list[Run]: ...


class Orchestrator(Protocol):
    """Starts and signals executions of the retrain workflow (Cloud Workflows)."""

    def start(self, argument: Mapping[str, Any]) -> str: ...

    def get(self, execution: str) -> dict[str, Any]: ...

    def send_callback(self, url: str, payload: Mapping[str, Any]) -> int: ...
