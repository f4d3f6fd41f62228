"""Firestore's permission check, in front of the Firestore emulator.

Firestore's client, pointed at an emulator, always sends ``Authorization: Bearer owner``, so a caller
cannot present a token of its own: each identity is given its own endpoint instead
(:meth:`FirestoreFront.endpoint`, the ``FIRESTORE_EMULATOR_HOST`` of that identity's processes), and
every call arriving there is checked for the permissions Google lists for its method
(cloud.google.com/firestore/docs/security/iam, "Required permissions for API methods"):

=============================================  ===================================================
BatchGetDocuments, GetDocument                 ``datastore.entities.get``
ListDocuments, RunQuery, RunAggregationQuery   ``datastore.entities.get``, ``datastore.entities.list``
ListCollectionIds, PartitionQuery              ``datastore.entities.list``
BeginTransaction, Rollback                     ``datastore.databases.get``
Commit, BatchWrite (each write)                update with ``exists: false``: ``.create``; with
                                               ``exists: true`` or an update time: ``.update``; with
                                               no precondition: ``.create`` and ``.update``;
                                               delete: ``.delete``
CreateDocument / UpdateDocument / DeleteDocument  ``.create`` / ``.update`` / ``.delete``
=============================================  ===================================================

A refused call fails as Firestore fails it, ``PERMISSION_DENIED`` ("Missing or insufficient
permissions."), with who lacked what appended; anything else is relayed to the emulator unchanged.
"""

from __future__ import annotations

from typing import Any

from retrain_local.grpc_front import GrpcFront
from retrain_local.iam import Kind, Resource
from retrain_local.identities import Guard

READS = {
    "GetDocument": ("datastore.entities.get",),
    "BatchGetDocuments": ("datastore.entities.get",),
    "ListDocuments": ("datastore.entities.get", "datastore.entities.list"),
    "RunQuery": ("datastore.entities.get", "datastore.entities.list"),
    "RunAggregationQuery": ("datastore.entities.get", "datastore.entities.list"),
    "ListCollectionIds": ("datastore.entities.list",),
    "PartitionQuery": ("datastore.entities.list",),
    "BeginTransaction": ("datastore.databases.get",),
    "Rollback": ("datastore.databases.get",),
    "CreateDocument": ("datastore.entities.create",),
    "UpdateDocument": ("datastore.entities.update",),
    "DeleteDocument": ("datastore.entities.delete",),
}
STREAMING = {"BatchGetDocuments", "RunQuery", "RunAggregationQuery"}


def write_permissions(write: Any) -> set[str]:
    """What one ``google.firestore.v1.Write`` needs."""
    if write._pb.HasField("delete"):
        return {"datastore.entities.delete"}
    precondition = write._pb.current_document if write._pb.HasField("current_document") else None
    if precondition is not None and precondition.HasField("exists"):
        return {"datastore.entities.update" if precondition.exists else "datastore.entities.create"}
    if precondition is not None and precondition.HasField("update_time"):
        return {"datastore.entities.update"}
    return {"datastore.entities.create", "datastore.entities.update"}


def permissions(method: str, request: bytes) -> set[str]:
    """What a call of ``method`` (``Commit``, ``RunQuery``, ...) with this request needs; KeyError for a
    method the front does not know."""
    if method in ("Commit", "BatchWrite"):
        from google.cloud.firestore_v1.types import BatchWriteRequest, CommitRequest

        parsed = (CommitRequest if method == "Commit" else BatchWriteRequest).deserialize(request)
        out: set[str] = set()
        for write in parsed.writes:
            out |= write_permissions(write)
        return out
    return set(READS[method])


class FirestoreFront(GrpcFront):
    """Firestore's checked endpoints: every document of the project's database is one resource."""

    SERVICE = "/google.firestore.v1.Firestore/"
    STREAMING = frozenset(STREAMING)

    def __init__(self, upstream: str, guard: Guard, project: str) -> None:
        super().__init__(upstream, guard)
        self.database = Resource(Kind.PROJECT, project)

    def needed(self, method: str, request: bytes) -> list[tuple[str, Resource]]:
        # Listen and Write are not relayed (retrain calls neither): KeyError, refused
        return [(permission, self.database) for permission in permissions(method, request)]

    def refusal(self, reason: str) -> str:
        return f"Missing or insufficient permissions. ({reason})"

    def upstream_metadata(self, metadata: list[tuple[str, str]]) -> list[tuple[str, str]]:
        kept = [(k, v) for k, v in metadata if k != "authorization"]
        return [*kept, ("authorization", "Bearer owner")]
