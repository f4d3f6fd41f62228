"""Error values and Python exceptions of the Workflows interpreter.

Workflows errors are *values* (usually maps with ``message`` and ``tags``) that ``try/except`` can
catch; :class:`WorkflowError` carries such a value through Python. Load-time problems and
cancellation are deliberately *not* WorkflowErrors, so no ``except`` step can swallow them.
"""

from __future__ import annotations

import json
from typing import Any


class WorkflowError(Exception):
    """A Workflows runtime error; ``value`` is the error value as the workflow sees it."""

    def __init__(self, value: Any) -> None:
        self.value = value
        super().__init__(format_error(value))

    def __str__(self) -> str:
        return format_error(self.value)

    @property
    def tags(self) -> list[str]:
        if isinstance(self.value, dict) and isinstance(self.value.get("tags"), list):
            return [str(t) for t in self.value["tags"]]
        return []


class ResourceLimitExceeded(WorkflowError):
    """``ResourceLimitError`` raised by the runtime itself: "When raised internally, this type of error
    cannot be caught and causes immediate execution failure" (the error tags table,
    cloud.google.com/workflows/docs/access-execution-results), so no ``try`` retries or catches it."""

    def __init__(self, message: str) -> None:
        super().__init__({"message": message, "tags": ["ResourceLimitError"]})


class WorkflowSyntaxError(Exception):
    """The definition is not valid Workflows syntax (a deployment error in the cloud)."""

    def __init__(self, message: str, step: str | None = None, line: int | None = None) -> None:
        self.step = step
        self.line = line
        where = []
        if step is not None:
            where.append(f"step {step!r}")
        if line is not None:
            where.append(f"line {line}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class ExecutionCancelled(Exception):
    """Raised inside a running execution when it is cancelled; never visible to ``except`` steps."""


def format_error(value: Any) -> str:
    """Workflows reports error payloads as JSON; a raised plain string is shown as itself."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=False, default=_bytes_default)
    except (TypeError, ValueError):
        return repr(value)


def _bytes_default(obj: Any) -> Any:
    if isinstance(obj, bytes | bytearray):
        return obj.decode("utf-8", "replace")
    return repr(obj)


def error(tag: str, message: str, **extra: Any) -> WorkflowError:
    """Build a tagged error the way the runtime raises them (``{"message", "tags"}``)."""
    value: dict[str, Any] = {"message": message, "tags": [tag]}
    value.update(extra)
    return WorkflowError(value)


def type_error(message: str) -> WorkflowError:
    return error("TypeError", message)


def value_error(message: str) -> WorkflowError:
    return error("ValueError", message)


def key_error(message: str) -> WorkflowError:
    return error("KeyError", message)


def index_error(message: str) -> WorkflowError:
    return error("IndexError", message)


def http_error(
    code: int,
    message: str | None = None,
    body: Any = None,
    headers: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The error map an HTTP call (or connector) raises for a non-2xx response."""
    return {
        "message": message if message is not None else f"HTTP server responded with error code {code}",
        "code": code,
        "headers": dict(headers or {}),
        "body": body,
        "tags": ["HttpError"],
    }
