"""A permission check in front of an emulator's gRPC service, one endpoint per identity.

A client library pointed at an emulator presents no identity of its own (Firestore's always sends
``Authorization: Bearer owner``; Pub/Sub's sends nothing), so each identity is given its own endpoint
(:meth:`GrpcFront.endpoint`, the ``*_EMULATOR_HOST`` of that identity's processes) and every call
arriving there is checked, by :class:`retrain_local.identities.Guard`, for what Google requires of
its method before it is relayed.  A method the front does not know is refused, never relayed unchecked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from retrain_local.iam import Resource
from retrain_local.identities import Guard


class GrpcFront:
    """One checked endpoint per member for one gRPC service (``SERVICE``: ``/package.Service/``),
    relaying to the emulator at ``upstream`` (``host:port``)."""

    SERVICE = ""
    STREAMING: frozenset[str] = frozenset()
    """Its server-streaming methods (relayed as streams); the rest are unary."""
    REFUSAL = "PERMISSION_DENIED"

    def __init__(self, upstream: str, guard: Guard) -> None:
        self.upstream = upstream
        self.guard = guard
        self._channel = grpc.insecure_channel(upstream)
        self._servers: dict[str, tuple[grpc.Server, str]] = {}
        self._lock = threading.Lock()

    def needed(self, method: str, request: bytes) -> list[tuple[str, Resource]]:
        """The (permission, resource) pairs a call of ``method`` with this request needs; KeyError for a
        method the front does not relay."""
        raise NotImplementedError

    def refusal(self, reason: str) -> str:
        """The message the service answers a refused call with."""
        return reason

    def upstream_metadata(self, metadata: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """What the emulator is sent of the caller's metadata."""
        return metadata

    def endpoint(self, member: str) -> str:
        """``host:port`` where calls are ``member``'s (started on first use)."""
        with self._lock:
            if member not in self._servers:
                server = grpc.server(
                    futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="grpc-front")
                )
                server.add_generic_rpc_handlers((self._handler(member),))
                port = server.add_insecure_port("127.0.0.1:0")
                server.start()
                self._servers[member] = (server, f"127.0.0.1:{port}")
            return self._servers[member][1]

    def _refuse(self, member: str, method: str, request: bytes, context: grpc.ServicerContext) -> None:
        try:
            needed = self.needed(method, request)
        except KeyError:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"the local front cannot check {method}")
        for permission, resource in sorted(needed, key=str):
            decision = self.guard.check(member, permission, resource)
            if not decision.allowed:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, self.refusal(decision.reason))

    def _handler(self, member: str) -> grpc.GenericRpcHandler:
        front = self

        def metadata(context: grpc.ServicerContext) -> list[tuple[str, str]]:
            return front.upstream_metadata([(k, v) for k, v in context.invocation_metadata()])

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
                if not path.startswith(front.SERVICE):
                    return None
                method = path.removeprefix(front.SERVICE)
                if method in front.STREAMING:
                    return grpc.unary_stream_rpc_method_handler(relay_stream(path, method))
                return grpc.unary_unary_rpc_method_handler(relay_unary(path, method))

        return Handler()

    def stop(self) -> None:
        with self._lock:
            for server, _ in self._servers.values():
                server.stop(grace=None)
            self._servers.clear()
        self._channel.close()
