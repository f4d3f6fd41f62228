"""Pub/Sub push delivery to a function, configured as infra/app/events.tf configures it in the cloud:
a push subscription with a retry policy and a dead-letter topic, so a message a function keeps failing
on ends up in the dead-letter topic instead of being redelivered forever.

The Pub/Sub emulator honours all three (it retries a failed push after 1 s, then backs off within
the retry policy).  Re-creating a subscription that exists keeps its old endpoint, so an existing one is
pointed at the new endpoint explicitly.
"""

from __future__ import annotations

import contextlib
from typing import Any

from google.api_core.exceptions import AlreadyExists

#: Pub/Sub's smallest allowed value; the cloud uses var.push_max_delivery_attempts.
MAX_DELIVERY_ATTEMPTS = 5


def ensure_topic(publisher: Any, topic: str, retention_s: int | None = None) -> None:
    """The topic, made when missing (retaining messages for ``retention_s``, when given)."""
    from google.protobuf import duration_pb2

    request: dict[str, Any] = {"name": topic}
    if retention_s is not None:
        request["message_retention_duration"] = duration_pb2.Duration(seconds=retention_s)
    with contextlib.suppress(AlreadyExists):
        publisher.create_topic(request=request)


def push_subscription(
    subscriber: Any,
    publisher: Any,
    topic: str,
    endpoint: str,
    dead_letter_topic: str,
    *,
    max_delivery_attempts: int = MAX_DELIVERY_ATTEMPTS,
    ack_deadline_s: int = 60,
    name: str | None = None,
) -> str:
    """Create (or re-point) ``topic``'s push subscription to ``endpoint`` (named ``name``, a full
    ``projects/P/subscriptions/S``: by default the topic's id and ``-push``); returns its name."""
    ensure_topic(publisher, topic)
    ensure_topic(publisher, dead_letter_topic)
    name = name or topic.replace("/topics/", "/subscriptions/") + "-push"
    request = {
        "name": name,
        "topic": topic,
        "push_config": {"push_endpoint": endpoint},
        "ack_deadline_seconds": ack_deadline_s,
        "retry_policy": {"minimum_backoff": {"seconds": 1}, "maximum_backoff": {"seconds": 5}},
        "dead_letter_policy": {
            "dead_letter_topic": dead_letter_topic,
            "max_delivery_attempts": max_delivery_attempts,
        },
    }
    try:
        subscriber.create_subscription(request=request)
    except AlreadyExists:
        subscriber.modify_push_config(request={"subscription": name, "push_config": request["push_config"]})
    return name


def dead_letter_subscription(subscriber: Any, publisher: Any, dead_letter_topic: str) -> str:
    """A pull subscription on the dead-letter topic, where an operator inspects (and replays) them."""
    ensure_topic(publisher, dead_letter_topic)
    name = dead_letter_topic.replace("/topics/", "/subscriptions/") + "-pull"
    with contextlib.suppress(AlreadyExists):
        subscriber.create_subscription(request={"name": name, "topic": dead_letter_topic})
    return name
