"""The Workflow Executions REST API's shape over HTTP, callbacks included, served for an
:class:`~cloudworkflows.server.ExecutionsServer` (its gRPC side is :mod:`cloudworkflows.grpc_service`).

Each request is checked for the permission Workflows asks of its method
(https://cloud.google.com/workflows/docs/access-control) before it is served.
"""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    from .server import ExecutionsServer

log = logging.getLogger("cloudworkflows.server")


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], executions: ExecutionsServer) -> None:
        super().__init__(address, _Handler)
        self.executions = executions


def http_server(executions: ExecutionsServer, host: str, port: int) -> ThreadingHTTPServer:
    """The REST side of ``executions``, bound (not yet serving) on ``host``:``port`` (0: any free port)."""
    return _HttpServer((host, port), executions)


def permission(method: str, path: str) -> str:
    """The IAM permission Workflows asks of a request (``path`` after ``/v1/``)."""
    if "/callbacks/" in path:
        return "workflows.callbacks.send"
    if path.endswith(":cancel"):
        return "workflows.executions.cancel"
    if path.endswith("/executions"):
        return "workflows.executions.create" if method == "POST" else "workflows.executions.list"
    return "workflows.executions.get"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # An answer leaves in two writes (headers, body): on a kept-alive connection Nagle's algorithm would
    # hold the body until the client's delayed ack (40 ms on Linux).
    disable_nagle_algorithm = True
    server: _HttpServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)

    def _send(self, code: int, payload: Any) -> None:
        body = json.dumps(payload).encode("utf-8")
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _fail(self, code: int, status: str, message: str) -> None:
        self._send(code, {"error": {"code": code, "message": message, "status": status}})

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _refused(self, permission: str, name: str) -> bool:
        executions = self.server.executions
        if executions.authorize is None:
            return False
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip() or None
        refusal = executions.refusal(token, permission, name)
        if refusal is not None:
            self._fail(403, "PERMISSION_DENIED", refusal)
        return refusal is not None

    def _handle(self, method: str) -> None:
        parsed = urlparse(self.path)
        path = parsed.path
        body = self._body()
        if not path.startswith("/v1/"):
            self._fail(404, "NOT_FOUND", f"no such path {path}")
            return
        rest = path[len("/v1/") :].rstrip("/")
        if self._refused(permission(method, rest), rest):
            return
        if "/callbacks/" in path:
            headers = {k: v for k, v in self.headers.items()}
            if self.server.executions.hub.deliver(path, method, headers, body, parsed.query):
                self._send(200, {})
            else:
                self._fail(404, "NOT_FOUND", f"no callback awaiting {method} at {path}")
            return
        try:
            self._executions(method, rest, body)
        except KeyError as exc:
            self._fail(404, "NOT_FOUND", f"execution {exc.args[0]} not found")

    def _executions(self, method: str, rest: str, body: bytes) -> None:
        executions = self.server.executions
        if method == "POST" and rest.endswith(":cancel"):
            self._send(200, executions.cancel(rest[: -len(":cancel")]))
        elif rest.endswith("/executions") and method == "POST":
            self._create(rest[: -len("/executions")], body)
        elif rest.endswith("/executions") and method == "GET":
            self._send(200, {"executions": executions.list(rest[: -len("/executions")])})
        elif "/executions/" in rest and method == "GET":
            self._send(200, executions.get(rest))
        else:
            self._fail(404, "NOT_FOUND", f"no such resource {rest}")

    def _create(self, parent: str, body: bytes) -> None:
        try:
            request = json.loads(body or b"{}")
            self._send(200, self.server.executions.create(parent, request.get("argument") or ""))
        except KeyError as exc:
            self._fail(404, "NOT_FOUND", f"workflow {exc.args[0]} not found")
        except ValueError as exc:
            self._fail(400, "INVALID_ARGUMENT", str(exc))

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")
