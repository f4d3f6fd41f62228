"""Polling for the twin and the API server to reach a state (they run in threads and processes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(fn: Callable[[], Any], timeout: float = 30.0, every: float = 0.1) -> Any:
    """``fn()``'s first truthy value, polled every ``every`` s; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {fn}")
        time.sleep(every)
