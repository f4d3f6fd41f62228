"""The ways handling an event can fail, and what should be done about each."""

from __future__ import annotations


class Rejected(Exception):
    """An event that is malformed or not ours: acknowledge it (never redeliver) and log the reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Retry(Exception):
    """A transient failure (a race lost, data not listed yet, a dependency answering 5xx): fail the
    delivery so that the platform redelivers it with backoff."""


class PlanError(ValueError):
    """A run planned so that its trainer would refuse it (impossible batch arithmetic, an override its
    configuration does not have, data it cannot read): refused before any capacity is requested; the
    message says why and goes into the run record."""


class ExecutionLost(LookupError):
    """A run's workflow execution no longer exists (the Executions API answers 404): nothing will ever
    record its outcome or release its capacity, so the sweeper does both."""
