"""What handling one event did: the action (an enum, never prose) and its detail."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Action(StrEnum):
    """What handling one event did."""

    RECORDED = "recorded"
    """An arrival was recorded in its dataset's open batch."""
    DUPLICATE = "duplicate"
    """The event, or that object version, was seen before."""
    IGNORED = "ignored"
    """Not training data, or nothing waits for it (acknowledged)."""
    STARTED = "started"
    """A run's workflow execution started."""
    QUEUED = "queued"
    """A run waits behind its dataset's live run."""
    NOTHING_TO_SEAL = "nothing-to-seal"
    """A seal found no arrival since the last one."""
    NOTHING_NEW = "nothing-new"
    """A watched table has no row after its watermark."""
    EXPORTING = "exporting"
    """A watched table's new rows are being exported by a BigQuery job; the next write or tick
    finishes it."""
    EXPORT_FAILED = "export-failed"
    """A watched table's export job failed, was refused or ran past its deadline; its rows go with the
    next one."""
    EXPORT_DEFERRED = "export-deferred"
    """A watched table's next export waits (the tick starts it): a backoff after failures, or rows
    stamped too recently to take yet."""
    EMPTY = "empty"
    """A run whose objects are all empty ended at once, succeeded with nothing to train: no job, no
    capacity (their content counts as trained: empty bytes dropped again start nothing)."""
    ALREADY_TRAINED = "already-trained"
    """Nothing new: every object's content trained before or is in the live or pending run."""
    REFUSED = "refused"
    """The trainer would refuse the run as planned, or it is over the cost cap (its record says why):
    no capacity was requested."""
    ERROR = "error"
    """Handling this item failed (logged); the round went on, and the next one retries it."""
    RECORDED_FAILURE = "recorded-failure"
    """A run whose execution ended without an outcome was recorded as failed."""
    RECORDED_SUCCESS = "recorded-success"
    """A run whose execution was lost after its results were recorded was recorded as succeeded."""
    GAVE_BACK = "gave-back"
    """A run that ended without succeeding gave back the content it still held (its finish step had not)."""
    RELAYED = "relayed"
    """A JobSet completion reached its run's callback."""
    AUDITED = "audited"
    """The audit ran (the detail counts where every object stands)."""
    REAPED = "reaped"
    """The reaper ran (the detail says what it deleted and which GPU nodes are up)."""


@dataclass(frozen=True)
class Outcome:
    """What handling one event did, for logs, the CLI and tests."""

    action: Action
    detail: str = ""
    run_id: str | None = None
