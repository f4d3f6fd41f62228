"""The run events port in memory (:class:`retrain.ports.RunEvents`): what was published, in order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cloudworkflows import ConnectorRegistry, load_workflow
from retrain.contracts import RunEvent

WORKFLOW = Path(__file__).resolve().parents[1] / "workflows" / "retrain.yaml"


class Told:
    def __init__(self) -> None:
        self.events: list[RunEvent] = []

    def publish(self, event: RunEvent) -> None:
        self.events.append(event)

    def of(self, run_id: str | None) -> list[tuple[str, str | None]]:
        """(type, failure) of each event of ``run_id``."""
        return [(str(e.type), e.failure) for e in self.events if e.run_id == run_id]


def announce(type: str, fields: dict[str, Any], connectors: ConnectorRegistry, run_id: str = "ds-r1") -> Any:
    """workflows/retrain.yaml's ``announce`` of ``type`` for a run of dataset ``ds``, run in the
    interpreter with ``connectors`` scripted; what the workflow returns after it."""
    source = yaml.safe_load(WORKFLOW.read_text())
    run = {"run_id": run_id, "dataset": "ds", "project": "p", "events_topic": "projects/p/topics/t"}
    call = {"call": "announce", "args": {"run": run, "type": type, "fields": fields}}
    source["main"] = {"steps": [{"go": call}, {"done": {"return": "announced"}}]}
    return load_workflow(yaml.safe_dump(source)).run(connectors=connectors)
