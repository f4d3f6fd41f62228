"""A dataset's name: the one rule for every place a name comes in (a landing folder, an event, a Scheduler
tick, the CLI, a run event), because a name becomes a folder under the landing prefix, a Kubernetes label
part and a Firestore document id."""

from __future__ import annotations

import re
from typing import TypeGuard

from retrain.domain.errors import Rejected

DATASET_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
#: What a user is told a name may hold.
DATASET_RULE = "lower-case letters, digits and '-', starting with a letter or digit, at most 40"


def is_dataset_name(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a dataset name (whole-string: a ``$``-anchored ``match`` would take
    ``"news\\n"``)."""
    return isinstance(value, str) and DATASET_RE.fullmatch(value) is not None


def dataset_name(value: object, what: str = "dataset") -> str:
    """``value`` when it is a dataset name; otherwise :class:`Rejected`, saying the rule."""
    if is_dataset_name(value):
        return value
    raise Rejected(f"{what} must be a valid dataset name ({DATASET_RULE})")


def optional_dataset(value: object, what: str = "dataset") -> str | None:
    """``value`` when it is None or a dataset name; otherwise :class:`Rejected`, saying the rule."""
    return None if value is None else dataset_name(value, what)
