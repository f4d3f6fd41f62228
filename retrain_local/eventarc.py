"""Eventarc's twin for the landing bucket: finalize CloudEvents delivered to on_object_finalized, and
delivered again until the function takes them.

gcp-storage-emulator has no notifications, so ``retrain drop`` makes each upload's event itself and
posts it, shaped as Eventarc delivers it (binary content mode: ``ce-*`` headers, the object's resource
as the body).  Eventarc retries a delivery the function does not acknowledge (an error, a timeout, the
function down) with exponential backoff (10 s growing to 600 s) for the 24 hours it keeps a message,
then gives up; so does this twin, its clock sped up by LOCAL_TIME_FACTOR.  A delivery that fails on the
first attempt goes to a Pub/Sub topic of the emulator (published with an ordering key, so the events
of one drop keep their order), and the stack's delivery loop takes it from there: oldest first, each
one POSTed until the function answers 2xx, with backoff between attempts; past the maximum age it goes
to the dead-letter topic.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import requests

from retrain_ops.deployment import LOCAL_TIME_FACTOR

log = logging.getLogger("retrain.eventarc")

#: The topic of events waiting for redelivery, and its subscription.
TOPIC = "eventarc-landing-redelivery"
ORDERING_KEY = "landing"
#: "The default delay starts at a minimum of 10 seconds and increases with each subsequent failure, up to
#: a maximum of 600 seconds. Eventarc sets the default message retention duration to 24 hours."
#: (cloud.google.com/eventarc/docs/retry-events), locally sped up by LOCAL_TIME_FACTOR.
MIN_BACKOFF_S, MAX_BACKOFF_S = 10 / LOCAL_TIME_FACTOR, 600 / LOCAL_TIME_FACTOR
MAX_AGE_S = 24 * 3600 / LOCAL_TIME_FACTOR
#: How long one pull of the redelivery loop waits for an event (the emulator holds it open until then).
PULL_TIMEOUT_S = 5.0


def post(function_url: str, headers: Mapping[str, str], body: bytes, timeout_s: float = 60) -> int:
    """One delivery attempt; the HTTP status (599 when the function could not be reached)."""
    try:
        return int(
            requests.post(function_url, headers=dict(headers), data=body, timeout=timeout_s).status_code
        )
    except requests.RequestException:
        return 599


def topic_path(project: str) -> str:
    return f"projects/{project}/topics/{TOPIC}"


def enqueue(project: str, headers: Mapping[str, str], body: bytes) -> None:
    """Hand an undelivered event to the twin (the stack's delivery loop delivers it)."""
    from google.cloud import pubsub_v1  # type: ignore[attr-defined]

    from retrain_local.delivery import ensure_topic

    publisher = pubsub_v1.PublisherClient(
        publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True)
    )
    ensure_topic(publisher, topic_path(project))
    publisher.publish(topic_path(project), body, ordering_key=ORDERING_KEY, **dict(headers)).result(
        timeout=30
    )


class Redelivery:
    """The stack's delivery loop for events that missed their first attempt."""

    def __init__(self, project: str, function_url: str, dead_letter_topic: str) -> None:
        self.project = project
        self.function_url = function_url
        self.dead_letter_topic = dead_letter_topic
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.delivered = 0
        self.dead_lettered = 0

    def start(self) -> Redelivery:
        from google.cloud import pubsub_v1  # type: ignore[attr-defined]

        from retrain_local.delivery import ensure_topic

        self._publisher = pubsub_v1.PublisherClient()
        self._subscriber = pubsub_v1.SubscriberClient()
        ensure_topic(self._publisher, topic_path(self.project))
        ensure_topic(self._publisher, self.dead_letter_topic)
        self.subscription = topic_path(self.project).replace("/topics/", "/subscriptions/")
        with contextlib.suppress(Exception):  # exists already (a restarted stack on the same emulator)
            self._subscriber.create_subscription(
                request={
                    "name": self.subscription,
                    "topic": topic_path(self.project),
                    "enable_message_ordering": True,
                    "ack_deadline_seconds": 60,
                }
            )
        self._thread = threading.Thread(target=self._loop, name="eventarc-redelivery", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop delivering; a pull under way is cancelled (closing the channel ends it at once, where the
        loop would otherwise wait out its 5 s).  An event whose delivery it cuts short stays unacknowledged
        in the subscription: delivered again, as Eventarc's at-least-once delivery would."""
        self._stop.set()
        with contextlib.suppress(Exception):
            self._subscriber.close()
        if self._thread:
            self._thread.join(30)

    def _loop(self) -> None:
        backoff = MIN_BACKOFF_S
        while not self._stop.is_set():
            try:
                response = self._subscriber.pull(
                    request={"subscription": self.subscription, "max_messages": 20}, timeout=PULL_TIMEOUT_S
                )
            except Exception:  # nothing to pull (DeadlineExceeded) or the emulator going away
                self._stop.wait(0.5)
                continue
            try:
                backoff = self._deliver_all(list(response.received_messages), backoff)
            except Exception:
                if self._stop.is_set():  # stop() closed the channel under it: the unacknowledged stay
                    return
                raise

    def _deliver_all(self, received: list[Any], backoff: float) -> float:
        """Deliver a pull's events in order; the backoff for the next round."""
        for i, item in enumerate(received):
            if self._deliver(item):
                backoff = MIN_BACKOFF_S
                continue
            # Not taken: this one and the rest go back, in order, after a backoff.
            self._subscriber.modify_ack_deadline(
                request={
                    "subscription": self.subscription,
                    "ack_ids": [r.ack_id for r in received[i:]],
                    "ack_deadline_seconds": 0,
                }
            )
            self._stop.wait(backoff)
            return min(backoff * 2, MAX_BACKOFF_S)
        return backoff

    def _deliver(self, item: Any) -> bool:
        """True when the event is done with (delivered, or dead-lettered past the maximum age)."""
        message = item.message
        headers = dict(message.attributes)
        status = post(self.function_url, headers, bytes(message.data))
        done = 200 <= status < 300
        age = time.time() - message.publish_time.timestamp()
        if not done and age > MAX_AGE_S:
            self._publisher.publish(self.dead_letter_topic, bytes(message.data), **headers).result(timeout=30)
            self.dead_lettered += 1
            log.warning("event %s dead-lettered after %.0f s of failed deliveries", headers.get("ce-id"), age)
            done = True
        elif done:
            self.delivered += 1
            log.info("event %s delivered after %.1f s", headers.get("ce-id"), age)
        if done:
            self._subscriber.acknowledge(
                request={"subscription": self.subscription, "ack_ids": [item.ack_id]}
            )
        return done
