"""Structured logs, as Cloud Logging reads them, and the conditions that page an operator.

A Cloud Run function's line of serialized JSON becomes a structured entry: ``severity`` becomes the
entry's severity, ``message`` its display text and the other fields its ``jsonPayload``
(cloud.google.com/run/docs/logging, "Writing structured logs").  Every line retrain's functions write is
one such object: ``severity``, ``message``, ``component``, ``logger``, and where they apply ``run_id``,
``dataset``, ``alert`` (an :class:`Alert`), ``run_event`` (a :class:`retrain.contracts.RunEvent`'s
data) and ``run_summary`` (an ended run's numbers, :data:`SUMMARY`, which the dashboard charts).  The
workflow writes the same ``run_event`` entries with ``sys.log``'s ``json`` (``workflows/retrain.yaml``'s
``announce``).  ``infra/app/monitoring.tf``'s alert policies match these
fields; ``tests/test_monitoring.py`` keeps each filter naming a field and a value the code writes.
"""

from __future__ import annotations

import json
import logging
import sys
from enum import StrEnum
from typing import Any


class Alert(StrEnum):
    """A condition an operator is paged for, logged as ``jsonPayload.alert`` (WARNING) by the code that
    finds it; each has an alert policy in ``infra/app/monitoring.tf`` saying what to do."""

    CAPACITY_WAIT = "capacity_wait"
    """A run has waited for DWS capacity longer than ``alert_capacity_wait_s`` (the sweeper, each tick)."""
    IDLE_NODES = "idle_nodes"
    """GPU nodes are up with no live run, longer than ``alert_idle_nodes_s`` (the reaper, each tick)."""
    COST_OVER_ESTIMATE = "cost_over_estimate"
    """A run's cost passed its estimate by more than ``alert_cost_factor`` (its finish step)."""
    BUDGET = "budget"
    """A run starts whose estimate takes its dataset past ``alert_budget_fraction`` of its monthly
    budget (its start; one that would pass the budget is refused instead)."""


#: An ended run's numbers, logged once by its finish step as ``run_summary`` (and ``status``).
SUMMARY = ("tokens", "cost_usd", "gpu_node_seconds", "idle_node_seconds", "waited_for_capacity_s")

#: Python's levels as Cloud Logging's LogSeverity names them.
SEVERITY = {
    logging.DEBUG: "DEBUG",
    logging.INFO: "INFO",
    logging.WARNING: "WARNING",
    logging.ERROR: "ERROR",
    logging.CRITICAL: "CRITICAL",
}
#: The ``extra=`` fields a log call may give, copied into the entry.
FIELDS = ("run_id", "dataset", "alert", "run_event", "run_summary")


class JsonLines(logging.Formatter):
    """One JSON object per record (see the module's docstring)."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "severity": SEVERITY.get(record.levelno, "DEFAULT"),
            "message": record.getMessage(),
            "component": self.component,
            "logger": record.name,
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = str(value) if isinstance(value, StrEnum) else value
        if record.exc_info:
            entry["message"] += "\n" + self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(component: str, level: int = logging.INFO) -> None:
    """Every record of this process as a JSON line on stderr (Cloud Run reads stdout and stderr alike),
    for ``component`` (``functions`` ...)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
