"""The run events port in memory (:class:`retrain.ports.RunEvents`): what was published, in order."""

from __future__ import annotations

from retrain.contracts import RunEvent


class Told:
    def __init__(self) -> None:
        self.events: list[RunEvent] = []

    def publish(self, event: RunEvent) -> None:
        self.events.append(event)

    def of(self, run_id: str | None) -> list[tuple[str, str | None]]:
        """(type, failure) of each event of ``run_id``."""
        return [(str(e.type), e.failure) for e in self.events if e.run_id == run_id]
