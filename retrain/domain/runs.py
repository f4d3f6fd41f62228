"""Batches and runs: what a run is, the states it moves through, and a snapshot's identity.

A batch collects arrivals for one dataset until it is sealed; a sealed batch becomes exactly one run
unless its snapshot (the hash of its objects' content hashes) has trained before.  The run record is
what every later reader (the CLI, the reaper, a person) relies on, so its fields are fixed here.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any


class RunStatus(StrEnum):
    PENDING = "pending"
    TOKENIZING = "tokenizing"
    PROVISIONING = "provisioning"
    TRAINING = "training"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)


class BatchState(StrEnum):
    """A batch exists once sealed; until then its arrivals are simply :class:`Pending`."""

    SEALED = "sealed"
    STARTED = "started"
    DUPLICATE = "duplicate"


@dataclass(frozen=True)
class Pending:
    """A dataset's arrivals since its last seal: what the sweeper judges quiet or old enough to seal."""

    dataset: str
    objects: int
    first_arrival_at: str
    last_arrival_at: str


def iso(t: datetime) -> str:
    """The ledger's timestamp format: UTC, fixed width, so timestamps sort as text."""
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now_iso() -> str:
    return iso(datetime.now(UTC))


def new_run_id(dataset: str) -> str:
    """Sortable by time, unique, and a valid Kubernetes label value / DNS label part."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{dataset[:20]}-{stamp}-{uuid.uuid4().hex[:6]}".lower()


def snapshot_id(content_hashes: Iterable[str]) -> str:
    """Identity of a data snapshot: order-free hash of its objects' content hashes.

    Identical data re-uploaded under new names or generations has the same snapshot id.
    """
    h = hashlib.sha256()
    for digest in sorted(set(content_hashes)):
        h.update(digest.encode())
        h.update(b"\n")
    return h.hexdigest()


@dataclass
class Run:
    """The record every run leaves behind."""

    run_id: str
    dataset: str
    trigger: str
    status: RunStatus = RunStatus.PENDING
    batch_id: str = ""
    snapshot: str = ""
    objects: int = 0
    documents: int = 0
    tokens: int = 0
    quarantined: int = 0
    nodes: int = 0
    gpu_node_seconds: float = 0.0
    gpu_hours: float = 0.0
    cost_usd: float = 0.0
    nodes_at_end: int | None = None
    checkpoint: str | None = None
    reason: str | None = None
    execution: str | None = None
    callback_url: str | None = None
    created_at: str = field(default_factory=now_iso)
    updated_at: str = field(default_factory=now_iso)
    finished_at: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = str(self.status)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Run:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        known["status"] = RunStatus(known.get("status", "pending"))
        return cls(**known)
