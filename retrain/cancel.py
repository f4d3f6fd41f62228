"""Stopping a run on an operator's word: what ``retrain cancel`` and the ``run_http`` function's
``{"cancel": RUN}`` both do.

The cancel is the ledger's (who asked, and why), and the run's callback only wakes its workflow, which
reads the ledger, stops the run and releases every GPU itself: a callback the ledger does not back stops
nothing.  The first request recorded stands (a second one, by anyone, changes neither name nor reason).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from retrain.contracts import CallbackPayload, CompletionState
from retrain.domain.errors import ExecutionLost, Rejected
from retrain.ports import Ledger, Orchestrator

#: The most an operator's reason may hold (it is recorded on the run and shown in its events).
MAX_REASON = 500


class Refusal(StrEnum):
    """Why a cancel was not taken."""

    NO_RUN = "no_run"
    ENDED = "ended"
    NOT_STARTED = "not_started"
    """Its workflow has not opened its callback yet: ask again in a moment."""
    BAD_REQUEST = "bad_request"


class CancelRefused(Rejected):
    """A cancel not taken, and why (:class:`Refusal`)."""

    def __init__(self, refusal: Refusal, reason: str) -> None:
        super().__init__(reason)
        self.refusal = refusal


class CancelOutcome(StrEnum):
    REQUESTED = "requested"
    """Recorded, and the run's workflow woken: it releases its capacity and ends as cancelled."""
    LOST = "lost"
    """The run's execution no longer existed: the run is recorded failed and its capacity reaped."""


@dataclass(frozen=True)
class Cancel:
    outcome: CancelOutcome
    detail: str
    """What happened, for the operator."""


def request_cancel(
    ledger: Ledger,
    orchestrator: Orchestrator,
    run_id: str,
    reason: str,
    *,
    requested_by: str,
    reap: Callable[[], Any] | None = None,
) -> Cancel:
    """Ask ``run_id`` to stop, as ``requested_by`` (a verified identity where one is known).
    :class:`CancelRefused` (why, and the reason) for a run that does not exist, ended, or has no workflow
    yet, or a reason past :data:`MAX_REASON`; RuntimeError when its workflow does not take the callback.
    A run whose execution no longer exists is recorded failed ("execution lost") and what it left in the
    cluster is reaped (``reap``), instead of refusing: nothing else would stop it."""
    from retrain.ingest import record_silent_end

    if len(reason) > MAX_REASON:
        raise CancelRefused(Refusal.BAD_REQUEST, f"a reason holds at most {MAX_REASON} characters")
    run = ledger.get_run(run_id)
    if run is None:
        raise CancelRefused(Refusal.NO_RUN, f"no run {run_id}")
    if run.status.terminal:
        raise CancelRefused(Refusal.ENDED, f"run {run_id} already ended: {run.status}")
    if not run.callback_url or not run.execution:
        raise CancelRefused(
            Refusal.NOT_STARTED, f"run {run_id} has not started its workflow yet; try again in a moment"
        )
    try:
        orchestrator.get(run.execution)
    except ExecutionLost:
        record_silent_end(ledger, orchestrator, run)
        detail = f"run {run_id}'s execution no longer exists: recorded as failed"
        if reap is not None:
            try:
                reap()
            except Exception as e:  # the record stands; the reaper's next pass takes what is left
                return Cancel(CancelOutcome.LOST, f"{detail}; its capacity is left to the reaper ({e})")
        return Cancel(CancelOutcome.LOST, f"{detail}, its capacity reaped")
    # The record first: the workflow stops the run only on a cancel the ledger holds (who asked, and why,
    # are read there), and the callback wakes it to look.
    if not ledger.request_cancel(run_id, requested_by, reason):
        raise CancelRefused(Refusal.ENDED, f"run {run_id} ended before the cancel was recorded")
    payload = CallbackPayload(CompletionState.CANCELLED, run_id=run_id).to_dict()
    code = orchestrator.send_callback(run.callback_url, payload)
    if code >= 300:
        raise RuntimeError(f"the run's workflow did not take the cancel (HTTP {code})")
    return Cancel(
        CancelOutcome.REQUESTED,
        f"cancel requested for {run_id}; the run releases its capacity and ends as cancelled",
    )
