"""What the twin's controllers write into objects' status: RFC 3339 times and conditions, kept the way the
API's conventions keep them (``lastTransitionTime`` moves only when a condition's status changes)."""

from __future__ import annotations

import datetime as dt
from typing import Any


def timestamp() -> str:
    """Now, as the API writes times (RFC 3339, to the second)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    old: list[dict[str, Any]], ctype: str, status: str, reason: str, message: str
) -> list[dict[str, Any]]:
    """``old`` with condition ``ctype`` set (lastTransitionTime kept when the status is unchanged)."""
    out, found = [], False
    for c in old:
        if c.get("type") == ctype:
            found = True
            ltt = c.get("lastTransitionTime") if c.get("status") == status else timestamp()
            c = {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": ltt or timestamp(),
            }
        out.append(c)
    if not found:
        out.append(
            {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": timestamp(),
            }
        )
    return out


def is_true(conds: list[dict[str, Any]], ctype: str) -> bool:
    return any(c.get("type") == ctype and c.get("status") == "True" for c in conds)
