"""The local stack's HTTP servers: threaded, on loopback, quiet about clients that hang up.

A client with a pool of kept-alive connections (``requests``, the Google clients) closes them whenever it
likes; the standard library's server prints a traceback for each reset, which says nothing here.
"""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class LoopbackServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` on 127.0.0.1 (a free port unless given), one daemon thread per client."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionResetError | BrokenPipeError):
            return
        super().handle_error(request, client_address)
