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

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from retrain.local.iam import Kind, Resource
from retrain.local.identities import Guard

SERVICE = "/google.firestore.v1.Firestore/"

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


class FirestoreFront:
    """One checked endpoint per member, each relaying to the emulator at ``upstream`` (``host:port``)."""

    def __init__(self, upstream: str, guard: Guard, project: str) -> None:
        self.upstream = upstream
        self.guard = guard
        self.database = Resource(Kind.PROJECT, project)
        self._channel = grpc.insecure_channel(upstream)
        self._servers: dict[str, tuple[grpc.Server, str]] = {}
        self._lock = threading.Lock()

    def endpoint(self, member: str) -> str:
        """``host:port`` where calls are ``member``'s (started on first use)."""
        with self._lock:
            if member not in self._servers:
                server = grpc.server(
                    futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="firestore-front")
                )
                server.add_generic_rpc_handlers((self._handler(member),))
                port = server.add_insecure_port("127.0.0.1:0")
                server.start()
                self._servers[member] = (server, f"127.0.0.1:{port}")
            return self._servers[member][1]

    def _refuse(self, member: str, method: str, request: bytes, context: grpc.ServicerContext) -> None:
        try:
            needed = permissions(method, request)
        except KeyError:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"the local Firestore front cannot check {method}"
            )
        for permission in sorted(needed):
            decision = self.guard.check(member, permission, self.database)
            if not decision.allowed:
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"Missing or insufficient permissions. ({decision.reason})",
                )

    def _handler(self, member: str) -> grpc.GenericRpcHandler:
        front = self

        def metadata(context: grpc.ServicerContext) -> list[tuple[str, str]]:
            kept = [(k, v) for k, v in context.invocation_metadata() if k != "authorization"]
            return [*kept, ("authorization", "Bearer owner")]

        def relay_unary(path: str, method: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
            upstream = front._channel.unary_unary(path)

            def call(request: bytes, context: grpc.ServicerContext) -> bytes:
                front._refuse(member, method, request, context)
                try:
                    return bytes(
                        upstream(request, metadata=metadata(context), timeout=context.time_remaining())
                    )
                except grpc.RpcError as e:
                    context.abort(e.code(), e.details() or "")
                    raise  # unreachable: abort raises

            return call

        def relay_stream(path: str, method: str) -> Callable[[bytes, grpc.ServicerContext], Iterator[bytes]]:
            upstream = front._channel.unary_stream(path)

            def call(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
                front._refuse(member, method, request, context)
                try:
                    yield from upstream(request, metadata=metadata(context), timeout=context.time_remaining())
                except grpc.RpcError as e:
                    context.abort(e.code(), e.details() or "")

            return call

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
                path = str(details.method)
                if not path.startswith(SERVICE):
                    return None
                method = path.removeprefix(SERVICE)
                if method in STREAMING:
                    return grpc.unary_stream_rpc_method_handler(relay_stream(path, method))
                if method in READS or method in ("Commit", "BatchWrite"):
                    return grpc.unary_unary_rpc_method_handler(relay_unary(path, method))
                return None  # UNIMPLEMENTED: Listen and Write are not relayed (retrain calls neither)

        return Handler()

    def stop(self) -> None:
        with self._lock:
            for server, _ in self._servers.values():
                server.stop(grace=None)
            self._servers.clear()
        self._channel.close()
