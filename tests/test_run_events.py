"""Run events: the contract (a CloudEvent in Pub/Sub's binary content mode), the workflow's ``announce``
run in the interpreter against the contract, and who publishes what."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from run_events_support import announce

from cloudworkflows import ConnectorRegistry, load_workflow
from retrain.contracts import RunEvent, RunEventType, WorkflowArgument, field_names
from retrain.domain.errors import Rejected
from retrain.domain.runs import FailureKind, RunStatus

WORKFLOW = Path(__file__).resolve().parents[1] / "workflows" / "retrain.yaml"
PUBLISH = "googleapis.pubsub.v1.projects.topics.publish"
PATCH = "googleapis.firestore.v1.projects.databases.documents.patch"

EVENT = RunEvent(
    RunEventType.FAILED,
    "ds-20261127-150000-abcdef",
    "ds",
    "2026-11-27T15:00:00.000000Z",
    reason="DWS did not provision within 1800 s",
    failure=str(FailureKind.CAPACITY_TIMEOUT),
    cost_usd=0.0,
)


def test_an_event_is_a_cloudevent_in_binary_mode_and_reads_back_as_itself() -> None:
    attributes = EVENT.attributes("proj")
    assert attributes == {
        "ce-specversion": "1.0",
        "ce-id": "ds-20261127-150000-abcdef/failed",
        "ce-type": "dev.retrain.run.v1.failed",
        "ce-source": "//retrain.dev/projects/proj/datasets/ds",
        "ce-subject": "runs/ds-20261127-150000-abcdef",
        "ce-time": "2026-11-27T15:00:00.000000Z",
        "Content-Type": "application/json",
    }
    assert json.loads(EVENT.data())["type"] == "failed"
    assert RunEvent.parse(EVENT.data(), attributes) == EVENT


@pytest.mark.parametrize(
    ("data", "attributes", "says"),
    [
        (b"not json", None, "not JSON"),
        (b"[1]", None, "not a JSON object"),
        (json.dumps({**json.loads(EVENT.data()), "extra": 1}).encode(), None, "unknown field(s) ['extra']"),
        (
            json.dumps({**json.loads(EVENT.data()), "type": "exploded"}).encode(),
            None,
            "unknown run event type",
        ),
        (json.dumps({**json.loads(EVENT.data()), "dataset": "../x"}).encode(), None, "valid dataset name"),
        (json.dumps({**json.loads(EVENT.data()), "cost_usd": "free"}).encode(), None, "['cost_usd']"),
        (EVENT.data(), {**EVENT.attributes("proj"), "ce-id": "other/failed"}, "['ce-id']"),
        (EVENT.data(), {**EVENT.attributes("proj"), "ce-source": "//x/datasets/other"}, "['ce-source']"),
    ],
)
def test_a_message_that_is_not_a_run_event_is_refused_with_the_reason(
    data: bytes, attributes: dict[str, str] | None, says: str
) -> None:
    with pytest.raises(Rejected) as refused:
        RunEvent.parse(data, attributes if attributes is not None else EVENT.attributes("proj"))
    assert says in str(refused.value)


def _record(fields: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """workflows/retrain.yaml's ``record`` run in the interpreter: (the Firestore patches, the
    publishes) it made, both connectors scripted as Google documents them."""
    patches: list[dict[str, Any]] = []
    publishes: list[dict[str, Any]] = []
    registry = ConnectorRegistry()
    registry.register(PATCH, lambda args, _: patches.append(args) or {})
    registry.register(PUBLISH, lambda args, _: publishes.append(args) or {"messageIds": ["1"]})
    source = yaml.safe_load(WORKFLOW.read_text())
    source["main"] = {
        "params": ["a"],
        "steps": [{"go": {"call": "record", "args": {"run": "${a.run}", "fields": "${a.fields}"}}}],
    }
    run = {
        "run_id": "ds-20261127-150000-abcdef",
        "dataset": "ds",
        "project": "proj",
        "events_topic": "projects/proj/topics/retrain-run-events",
    }
    assert set(run) <= field_names(WorkflowArgument)
    load_workflow(yaml.safe_dump(source)).run({"run": run, "fields": fields}, connectors=registry)
    return patches, publishes


def _published(publish: dict[str, Any]) -> RunEvent:
    assert publish["topic"] == "projects/proj/topics/retrain-run-events"
    (message,) = publish["body"]["messages"]
    return RunEvent.parse(base64.b64decode(message["data"]), message["attributes"])


def test_the_workflow_announces_each_status_it_records_as_the_contract_reads_it() -> None:
    patches, publishes = _record(
        {
            "status": "failed",
            "reason": "DWS did not provision within 1800 s",
            "failure": "CapacityTimeout",
            "cost_usd": 0.0,
            "nodes_at_end": 0,
        }
    )
    assert len(patches) == 1 and len(publishes) == 1
    event = _published(publishes[0])
    assert (event.type, event.run_id, event.dataset, event.failure, event.cost_usd, event.reason) == (
        RunEventType.FAILED,
        "ds-20261127-150000-abcdef",
        "ds",
        "CapacityTimeout",
        0.0,
        "DWS did not provision within 1800 s",
    )
    assert event.time.endswith("Z") and event.checkpoint is None


def test_a_record_that_changes_no_status_announces_nothing() -> None:
    patches, publishes = _record({"callback_url": "https://example.invalid/callback"})
    assert len(patches) == 1 and publishes == []


def test_a_publish_that_fails_does_not_fail_the_record() -> None:
    registry = ConnectorRegistry()
    registry.register(PATCH, lambda args, _: {})

    def refuse(args: Any, _: Any) -> Any:
        from cloudworkflows import WorkflowError

        raise WorkflowError({"message": "denied", "code": 403, "tags": ["HttpError"]})

    registry.register(PUBLISH, refuse)
    assert announce("releasing", {}, registry) == "announced"


def _statuses_recorded(node: Any) -> set[str]:
    """Every literal status a ``record`` call of the workflow writes, and every type it announces."""
    found: set[str] = set()
    if isinstance(node, dict):
        args = node.get("args") or {}
        if node.get("call") == "record" and isinstance(args.get("fields"), dict):
            status = args["fields"].get("status")
            if isinstance(status, str) and not status.startswith("${"):
                found.add(status)
        if node.get("call") == "announce" and not str(args.get("type", "")).startswith("${"):
            found.add(str(args["type"]))
        for value in node.values():
            found |= _statuses_recorded(value)
    elif isinstance(node, list):
        for value in node:
            found |= _statuses_recorded(value)
    return found


def test_every_state_the_workflow_announces_is_a_run_event_type() -> None:
    """The workflow's statuses (literal ones, and the outcomes its ``classify`` assigns) and its own
    announcements are all RunEventTypes: a status renamed on one side fails here."""
    source = yaml.safe_load(WORKFLOW.read_text())
    literal = _statuses_recorded(source)
    assert literal == {"tokenizing", "provisioning", "training", "releasing"}
    outcomes = {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED}
    assert literal | set(outcomes) <= {str(t) for t in RunEventType}
    text = WORKFLOW.read_text()
    assert all(f'status: "{s}"' in text for s in outcomes)


# --- through Pub/Sub: the emulator behind the local stack's permission check ------------------------


@pytest.mark.emulators
def test_events_are_published_as_the_account_infra_lets_publish_and_read_back_once_each(
    pubsub_host: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The functions' account publishes (infra grants it roles/pubsub.publisher on the topic); the
    Dataflow account may not, and its event is logged as lost, never raised; `retrain events` reads what
    the topic retains, each event once though it was published twice, skipping a message that is not
    one."""
    import uuid
    from datetime import UTC, datetime, timedelta

    from google.cloud import pubsub_v1  # type: ignore[attr-defined]

    from retrain.adapters.events import PubSubRunEvents, read_events
    from retrain_local.delivery import ensure_topic
    from retrain_local.identities import Deployed, Guard
    from retrain_local.pubsub_front import PubSubFront
    from retrain_ops.deployment import Deployment, local_settings

    deployment = Deployment()
    topic = local_settings({}).events_topic
    ensure_topic(pubsub_v1.PublisherClient(), topic, deployment.topic_retention_s("run_events"))
    since = datetime.now(UTC) - timedelta(seconds=5)
    run = f"ds-{uuid.uuid4().hex[:12]}"
    queued = RunEvent(RunEventType.QUEUED, run, "ds", "2026-11-27T15:00:00Z")
    refused = RunEvent(RunEventType.REFUSED, run, "ds", "2026-11-27T15:00:01Z", "over the cap", "Refused")
    front = PubSubFront(pubsub_host, Guard(Deployed.read(deployment)))
    try:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", front.endpoint(FUNCTIONS))
        functions = PubSubRunEvents("retrain-local", topic)
        for event in (queued, queued, refused):  # at least once: the first one twice
            functions.publish(event)
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", front.endpoint(DATAFLOW))
        PubSubRunEvents("retrain-local", topic).publish(RunEvent(RunEventType.PROMOTED, run, "ds", "x"))
    finally:
        front.stop()
    assert "User not authorized to perform this action." in caplog.text
    assert "retrain-dataflow@retrain-local.iam.gserviceaccount.com does not have pubsub.topics.publish" in (
        caplog.text
    )
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_host)
    pubsub_v1.PublisherClient().publish(topic, b"not an event", **{"ce-id": "x"}).result(timeout=30)
    read = [e for e in read_events(topic, since, follow=False, idle_s=2) if e.run_id == run]
    assert read == [queued, refused]
    assert "is not a run event" in caplog.text


FUNCTIONS = "serviceAccount:retrain-functions@retrain-local.iam.gserviceaccount.com"
DATAFLOW = "serviceAccount:retrain-dataflow@retrain-local.iam.gserviceaccount.com"
