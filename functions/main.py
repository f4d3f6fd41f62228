"""Cloud Functions (gen2) entry points: small and explicit; the logic lives in ``retrain.ingest``.

A malformed or foreign event (``Rejected``) is logged and acknowledged (returning normally), so the
platform does not redeliver it forever; a transient failure (``Retry``, or the ledger or an API being
unavailable) raises, so the platform redelivers it with backoff.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from functools import cache
from typing import Any

import flask
import functions_framework
import functions_framework.aio
from cloudevents.http import CloudEvent

from retrain import composition, config, logs
from retrain.caller import verified_caller
from retrain.cancel import CancelRefused, Refusal, request_cancel
from retrain.contracts import StepName
from retrain.domain.errors import Rejected
from retrain.domain.runs import RUN_ID_RE, Trigger
from retrain.ingest import Action, Ingest
from retrain.steps import Steps

logs.configure("functions")  # JSON lines: Cloud Logging's structured entries (retrain.logs)
log = logging.getLogger("retrain.functions")


@cache
def ingest() -> Ingest:
    """One Ingest per instance: clients are reused across invocations."""
    return composition.ingest(config.load())


@cache
def steps() -> Steps:
    return composition.steps(config.load())


@functions_framework.aio.cloud_event
def on_object_finalized(event: CloudEvent) -> None:
    """Eventarc: google.cloud.storage.object.v1.finalized on the landing bucket.

    The hot path (a storm of objects is a storm of these), so it is served on the framework's ASGI stack:
    an ``aio``-decorated function makes functions-framework (3.9 and later, "auto-detect ASGI mode for
    @aio decorated functions", its CHANGELOG) serve it with Starlette under uvicorn workers, about half
    the CPU per event of its Flask stack (bench/storm_bench.py's no-op contenders). The body stays
    synchronous: the framework runs it on its executor, and an exception is still a 5xx (redelivery)."""
    try:
        outcome = ingest().on_object_finalized(event.get_attributes(), event.get_data())
    except Rejected as e:
        log.warning("rejected event %s: %s", event.get("id"), e.reason)
        return
    # One line per object at debug level: a storm of 10,000 files should log its seal, not 10,000 lines.
    level = (
        logging.DEBUG
        if outcome.action in (Action.RECORDED, Action.DUPLICATE, Action.IGNORED)
        else logging.INFO
    )
    log.log(level, "event %s: %s %s", event.get("id"), outcome.action, outcome.detail)


@functions_framework.cloud_event
def on_bigquery_event(event: CloudEvent) -> None:
    """Eventarc: BigQuery audit log (InsertJob): a watched table gained rows, or an export finished."""
    try:
        outcome = ingest().on_bigquery_event(event.get_attributes(), event.get_data())
    except Rejected as e:
        log.warning("rejected BigQuery event %s: %s", event.get("id"), e.reason)
        return
    log.info("BigQuery event %s: %s %s", event.get("id"), outcome.action, outcome.detail)


def pubsub_json(event: CloudEvent) -> dict[str, Any]:
    """The JSON object a Pub/Sub CloudEvent carries; Rejected when it carries anything else."""
    try:
        data = event.get_data() or {}
        message = json.loads(base64.b64decode(data["message"]["data"], validate=True) or b"{}")
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        raise Rejected(f"malformed Pub/Sub message ({e})") from None
    if not isinstance(message, dict):
        raise Rejected("message is not a JSON object")
    return message


@functions_framework.cloud_event
def on_jobset_event(event: CloudEvent) -> None:
    """Pub/Sub (jobset-events): a JobSet reached a terminal state; wake its workflow execution."""
    try:
        outcome = ingest().on_jobset_event(pubsub_json(event))
    except Rejected as e:
        log.warning("rejected JobSet message %s: %s", event.get("id"), e.reason)
        return
    log.info("JobSet message %s: %s %s", event.get("id"), outcome.action, outcome.detail)


@functions_framework.cloud_event
def on_scheduler_tick(event: CloudEvent) -> None:
    """Pub/Sub (Scheduler ticks): {"job": "seal" | "sweeper" | "reaper" | "audit"}
    (retrain.contracts.SchedulerTick)."""
    try:
        outcomes = ingest().on_scheduler_tick(pubsub_json(event))
    except Rejected as e:
        log.warning("rejected scheduler tick %s: %s", event.get("id"), e.reason)
        return
    log.info(
        "tick %s: %s", event.get("id"), [f"{o.action} {o.run_id or o.detail}" for o in outcomes] or "nothing"
    )


@functions_framework.http
def run_http(request: flask.Request) -> flask.typing.ResponseReturnValue:
    """The operators' function: POST {"dataset": D} seals D's pending data now (`retrain run`); POST
    {"cancel": RUN, "reason": WHY} stops a run, recorded as cancelled by the caller Cloud Run verified
    (retrain.caller), so an operator needs only run.invoker here to cancel: no ledger write, no callback.

    Authentication is the platform's: the function is internal-only and needs run.invoker.
    """
    if request.method != "POST":
        return {"error": 'POST a JSON object {"dataset": NAME} or {"cancel": RUN, "reason": WHY}'}, 405
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        return {"error": "body must be a JSON object"}, 400
    if "cancel" in body:
        return _cancel(request, body)
    try:
        outcomes = ingest().seal_pending(body.get("dataset"), Trigger.MANUAL)
    except Rejected as e:
        return {"error": e.reason}, 400
    return {"outcomes": [o.__dict__ for o in outcomes]}, 200


#: How each refused cancel answers: a run unknown 404, one that ended 409, one whose workflow has not
#: opened its callback yet 503 (ask again), a bad request 400.
CANCEL_REFUSED = {Refusal.NO_RUN: 404, Refusal.ENDED: 409, Refusal.NOT_STARTED: 503, Refusal.BAD_REQUEST: 400}


def _cancel(request: flask.Request, body: dict[str, Any]) -> flask.typing.ResponseReturnValue:
    run_id, reason = body.get("cancel"), body.get("reason", "")
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id) or not isinstance(reason, str):
        return {
            "error": 'cancel takes {"cancel": RUN_ID, "reason": "why"} (a run id as `retrain runs` shows it)'
        }, 400
    caller = verified_caller(request.headers)
    if caller is None:
        return {"error": "no verified caller: call with a Google ID token (Authorization: Bearer)"}, 401
    service = ingest()
    try:
        cancel = request_cancel(
            service.ledger, service.orchestrator, run_id, reason, requested_by=caller, reap=service.reap
        )
    except CancelRefused as e:
        return {"error": e.reason, "refusal": e.refusal}, CANCEL_REFUSED[e.refusal]
    except RuntimeError as e:  # the run's workflow did not take the callback: it is recorded, retry
        log.exception("run %s: cancel by %s not delivered", run_id, caller)
        return {"error": str(e)}, 502
    log.info("run %s: cancel by %s: %s", run_id, caller, cancel.outcome, extra={"run_id": run_id})
    return {"outcome": cancel.outcome, "detail": cancel.detail, "requested_by": caller}, 200


@functions_framework.http
def run_step(request: flask.Request) -> flask.typing.ResponseReturnValue:
    """The workflow's calls into Python (retrain.steps): POST a StepRequest, get a Handover or Results.

    Internal-only; the workflow's service account is the only invoker (OIDC).  A plan the trainer would
    refuse answers 400 with the reason, any other failure 500 with what failed; the workflow records it.
    A failed ``begin``, ``cancel`` or ``account`` answers 503, which the workflow retries: each is
    idempotent; ``begin`` runs before the workflow's own error handling (nothing is created yet to
    release), ``cancel`` only reads the ledger, where one lost answer would otherwise fail the run, and
    ``account`` only reads the run's plan, where one lost answer would leave the run unpriced.
    """
    if request.method != "POST":
        return {"error": "POST a StepRequest"}, 405
    body = request.get_json(silent=True)
    try:
        return steps().handle(body), 200
    except Rejected as e:
        log.warning("step refused: %s", e.reason)
        return {"error": e.reason}, 400
    except Exception as e:  # the workflow records why (a service's refusal names the permission)
        log.exception("step failed")
        read_only = (StepName.BEGIN, StepName.CANCEL, StepName.ACCOUNT)
        retried = isinstance(body, dict) and body.get("step") in read_only
        return {"error": f"{type(e).__name__}: {e}"}, 503 if retried else 500
