"""Cloud Functions (gen2) entry points: small and explicit; the logic lives in ``retrain.ingest``.

A malformed or foreign event is logged and acknowledged (returning normally), so the platform does
not redeliver it forever; a transient failure (ledger or API unavailable) raises, so it retries.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from functools import cache

import functions_framework
from cloudevents.http import CloudEvent

from retrain import config
from retrain.adapters.ledger import FirestoreLedger
from retrain.adapters.workflows import WorkflowsExecutions
from retrain.domain.events import Rejected
from retrain.ingest import Ingest

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
log = logging.getLogger("retrain.functions")


@cache
def ingest() -> Ingest:
    """One Ingest per instance: clients are reused across invocations."""
    s = config.load()
    return Ingest(s, FirestoreLedger(s.project), WorkflowsExecutions(s.project, s.region, s.workflow))


@functions_framework.cloud_event
def on_object_finalized(event: CloudEvent) -> None:
    """Eventarc: google.cloud.storage.object.v1.finalized on the landing bucket."""
    try:
        outcome = ingest().on_object_finalized(event.get_attributes(), event.get_data())
    except Rejected as e:
        log.warning("rejected event %s: %s", event.get("id"), e.reason)
        return
    log.info("event %s: %s %s", event.get("id"), outcome.action, outcome.detail)


@functions_framework.cloud_event
def on_jobset_event(event: CloudEvent) -> None:
    """Pub/Sub (jobset-events): a JobSet reached a terminal state; wake its workflow execution."""
    try:
        data = event.get_data() or {}
        raw = base64.b64decode(data["message"]["data"], validate=True)
        message = json.loads(raw)
        if not isinstance(message, dict):
            raise Rejected("message is not a JSON object")
        outcome = ingest().on_jobset_event(message)
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        log.warning("rejected JobSet message %s: malformed (%s)", event.get("id"), e)
        return
    except Rejected as e:
        log.warning("rejected JobSet message %s: %s", event.get("id"), e.reason)
        return
    log.info("JobSet message %s: %s %s", event.get("id"), outcome.action, outcome.detail)
