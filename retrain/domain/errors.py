"""The two ways handling an event can fail, and what the platform should do about each."""

from __future__ import annotations


class Rejected(Exception):
    """An event that is malformed or not ours: acknowledge it (never redeliver) and log the reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Retry(Exception):
    """A transient failure (a race lost, data not listed yet, a dependency answering 5xx): fail the
    delivery so that the platform redelivers it with backoff."""
