"""The run events topic on Pub/Sub (:class:`retrain.ports.RunEvents`), and a reader for ``retrain events``.

Cloud and emulator differ only by endpoint (``PUBSUB_EMULATOR_HOST``)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from retrain.contracts import RunEvent
from retrain.domain.errors import Rejected

log = logging.getLogger("retrain.events")

#: How long a reader's subscription outlives a reader that died without deleting it: Pub/Sub's
#: shortest expiration ("The minimum allowed value for expiration_policy.ttl is 1 day",
#: cloud.google.com/pubsub/docs/subscription-properties#expiration_period).
READER_TTL_S = 24 * 3600


class PubSubRunEvents:
    """Publishes run events to ``topic`` (its full id, ``projects/P/topics/T``)."""

    def __init__(self, project: str, topic: str, timeout_s: float = 30) -> None:
        self.project, self.topic, self.timeout_s = project, topic, timeout_s
        self._client: Any = None

    def publish(self, event: RunEvent) -> None:
        from google.cloud import pubsub_v1  # type: ignore[attr-defined]

        try:
            if self._client is None:
                self._client = pubsub_v1.PublisherClient()
            future = self._client.publish(self.topic, event.data(), **event.attributes(self.project))
            future.result(timeout=self.timeout_s)
        except Exception as e:  # the state change stands; the event is what is lost (and logged)
            log.warning("run event %s not published to %s: %s", event.id, self.topic, e)


def read_events(
    topic: str,
    since: datetime,
    follow: bool,
    idle_s: float = 3.0,
    stopped: Callable[[], bool] = lambda: False,
) -> Iterator[RunEvent]:
    """The run events published to ``topic`` since ``since`` (as far back as the topic retains them:
    a new subscription seeks there, Pub/Sub's replay of a topic's retained messages,
    cloud.google.com/pubsub/docs/replay-overview), then, with ``follow``, each one as it comes.

    Without ``follow`` it ends once nothing came for ``idle_s``; either way once ``stopped()``.  The
    reader's own subscription is made for it and deleted after; one it could not delete expires after
    READER_TTL_S.  A message that is not a run event is skipped with a warning."""
    from google.cloud import pubsub_v1  # type: ignore[attr-defined]
    from google.protobuf import duration_pb2, timestamp_pb2

    subscriber = pubsub_v1.SubscriberClient()
    name = topic.replace("/topics/", "/subscriptions/") + f"-reader-{uuid.uuid4().hex[:8]}"
    subscriber.create_subscription(
        request={
            "name": name,
            "topic": topic,
            "ack_deadline_seconds": 60,
            "expiration_policy": {"ttl": duration_pb2.Duration(seconds=READER_TTL_S)},
        }
    )
    try:
        at = timestamp_pb2.Timestamp()
        at.FromDatetime(since)
        subscriber.seek(request={"subscription": name, "time": at})
        quiet_since, seen = time.monotonic(), set()
        while not stopped() and (follow or time.monotonic() - quiet_since < idle_s):
            try:
                response = subscriber.pull(request={"subscription": name, "max_messages": 100}, timeout=5)
            except Exception:  # nothing to pull within the call's deadline
                continue
            received = list(response.received_messages)
            if received:
                quiet_since = time.monotonic()
                subscriber.acknowledge(
                    request={"subscription": name, "ack_ids": [r.ack_id for r in received]}
                )
            for item in sorted(received, key=lambda r: r.message.publish_time):
                try:
                    event = RunEvent.parse(bytes(item.message.data), dict(item.message.attributes))
                except Rejected as e:
                    log.warning("skipped a message of %s that is not a run event: %s", topic, e)
                    continue
                if event.id not in seen:  # delivered at least once: told once
                    seen.add(event.id)
                    yield event
    finally:
        try:
            subscriber.delete_subscription(request={"subscription": name})
        except Exception as e:
            log.warning("could not delete %s (it expires in a day): %s", name, e)
