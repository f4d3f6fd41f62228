"""Poison messages end in the dead-letter topic: the real Pub/Sub emulator pushing to the real
functions-framework server, through the subscription the local stack (and Terraform) configures."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.cloud import pubsub_v1  # type: ignore[attr-defined]

from retrain.local import delivery
from retrain.local.emulators import free_port
from retrain.local.stack import function_server

pytestmark = pytest.mark.emulators


@pytest.fixture
def relay(tmp_path: Path, pubsub_host: str, firestore_host: str) -> Iterator[tuple[str, str]]:
    """The JobSet relay function; its workflow endpoint is down, so every real relay fails (500)."""
    down = f"http://127.0.0.1:{free_port()}"
    env = {"FIRESTORE_EMULATOR_HOST": firestore_host, "RETRAIN_WORKFLOWS_ENDPOINT": down}
    proc, url = function_server("on_jobset_event", tmp_path / "relay.log", env)
    proc.start()
    yield url, down
    proc.stop()


def test_a_message_the_function_keeps_failing_on_is_dead_lettered_and_bad_ones_are_not(
    relay: tuple[str, str],
) -> None:
    url, down = relay
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    project = f"dl-{uuid.uuid4().hex[:8]}"
    topic = publisher.topic_path(project, "jobset-events")
    dead = publisher.topic_path(project, "dead-letter")
    delivery.push_subscription(subscriber, publisher, topic, f"{url}/{topic}", dead)
    inbox = delivery.dead_letter_subscription(subscriber, publisher, dead)

    callback = (
        f"{down}/v1/projects/retrain-local/locations/us-central1/workflows/retrain/executions/e1/callbacks/c1"
    )
    poison = {"run_id": "r1", "state": "Completed", "callback_url": callback}
    publisher.publish(topic, json.dumps(poison).encode()).result(timeout=30)
    publisher.publish(topic, b'{"state": "Completed"}').result(timeout=30)  # malformed: acknowledged at once

    def pull() -> list[Any]:
        request = {"subscription": inbox, "max_messages": 10, "return_immediately": True}
        return list(subscriber.pull(request=request, timeout=10).received_messages)

    deadline, received = time.monotonic() + 60, []
    while not received and time.monotonic() < deadline:
        time.sleep(0.5)
        received = pull()
    assert len(received) == 1, "the poison message never reached the dead-letter topic"
    message = received[0].message
    assert json.loads(message.data) == poison
    assert message.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] == str(
        delivery.MAX_DELIVERY_ATTEMPTS
    )
    subscriber.acknowledge(request={"subscription": inbox, "ack_ids": [received[0].ack_id]})
    time.sleep(3)  # nothing else follows: the malformed message was acknowledged, not retried
    assert not subscriber.pull(
        request={"subscription": inbox, "max_messages": 10}, timeout=10
    ).received_messages


def test_re_pointing_an_existing_subscription_moves_its_endpoint(pubsub_host: str) -> None:
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    project = f"dl-{uuid.uuid4().hex[:8]}"
    topic, dead = publisher.topic_path(project, "ticks"), publisher.topic_path(project, "dead")
    name = delivery.push_subscription(subscriber, publisher, topic, "http://127.0.0.1:1/old", dead)
    delivery.push_subscription(subscriber, publisher, topic, "http://127.0.0.1:1/new", dead)
    assert subscriber.get_subscription(subscription=name).push_config.push_endpoint.endswith("/new")
