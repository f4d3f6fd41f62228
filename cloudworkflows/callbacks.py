"""Callback endpoints (``events.create_callback_endpoint`` / ``events.await_callback``).

A hub owns the endpoints of every local execution. HTTP requests that arrive before the workflow
awaits them are queued, as Workflows does, so a fast job cannot lose its completion callback.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlparse

from .clock import Clock, RealClock
from .errors import ExecutionCancelled, error


@dataclass
class _Endpoint:
    execution: str
    method: str
    path: str
    queue: deque[dict[str, Any]] = field(default_factory=deque)


def _decode(body: bytes, headers: dict[str, str]) -> Any:
    if not body:
        return None
    ctype = next((v for k, v in headers.items() if k.lower() == "content-type"), "").lower()
    text = body.decode("utf-8", "replace")
    if "json" in ctype or not ctype:
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


class CallbackHub:
    """Creates callback URLs under ``base_url`` and hands delivered requests to awaiting steps."""

    def __init__(self, base_url: str, clock: Clock | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.clock: Clock = clock or RealClock()
        """The time awaits count their timeouts in, and deliveries are stamped with: the executions'."""
        self._cond = threading.Condition()
        self._endpoints: dict[str, _Endpoint] = {}

    def create_endpoint(self, execution_name: str, method: str = "POST") -> dict[str, Any]:
        path = f"/v1/{execution_name.strip('/')}/callbacks/{uuid.uuid4().hex}"
        with self._cond:
            self._endpoints[path] = _Endpoint(execution_name, method.upper(), path)
        return {"url": f"{self.base_url}{path}"}

    def deliver(
        self,
        path: str,
        method: str,
        headers: dict[str, str],
        body_bytes: bytes,
        query: dict[str, Any] | str | None = None,
    ) -> bool:
        """Queue one HTTP request for its endpoint; False when unknown or the method is wrong."""
        parsed = urlparse(path)
        clean = parsed.path.rstrip("/")
        if isinstance(query, str):
            qmap: dict[str, Any] = parse_qs(query)
        elif query is None:
            qmap = parse_qs(parsed.query)
        else:
            qmap = dict(query)
        with self._cond:
            ep = self._endpoints.get(clean)
            if ep is None or ep.method != method.upper():
                return False
            ep.queue.append(
                {
                    "http_request": {
                        "body": _decode(body_bytes, headers),
                        "headers": dict(headers),
                        "method": method.upper(),
                        "query": qmap,
                        "url": clean,
                    },
                    "received_time": datetime.fromtimestamp(self.clock.now(), UTC)
                    .isoformat(timespec="microseconds")
                    .replace("+00:00", "Z"),
                    "type": "HTTP",
                }
            )
            self._cond.notify_all()
        return True

    def await_callback(
        self, callback: dict[str, Any], timeout: float, cancel: threading.Event | None = None
    ) -> dict[str, Any]:
        """Block until a request for ``callback['url']`` arrives; TimeoutError after ``timeout`` s."""
        path = urlparse(str(callback.get("url", ""))).path.rstrip("/")
        deadline = self.clock.monotonic() + timeout
        with self._cond:
            ep = self._endpoints.get(path)
            if ep is None:
                raise error("ValueError", f"unknown callback endpoint {callback.get('url')!r}")
            while not ep.queue:
                if cancel is not None and cancel.is_set():
                    raise ExecutionCancelled()
                remaining = deadline - self.clock.monotonic()
                if remaining <= 0:
                    raise error("TimeoutError", f"timed out after {timeout:g}s waiting for a callback")
                self.clock.pause(self._cond, remaining)
            return ep.queue.popleft()

    def release(self, execution_name: str) -> None:
        """Forget an execution's endpoints once it has finished; later requests get 404."""
        with self._cond:
            for path in [p for p, ep in self._endpoints.items() if ep.execution == execution_name]:
                del self._endpoints[path]

    def endpoints(self, execution_name: str) -> list[str]:
        with self._cond:
            return [
                f"{self.base_url}{p}" for p, ep in self._endpoints.items() if ep.execution == execution_name
            ]
