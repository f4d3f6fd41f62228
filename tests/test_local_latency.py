"""The local stack's servers answer at once.  Its HTTP servers accept each connection without Nagle's
algorithm, which held every answer's body on a kept-alive connection until the client's delayed ack (40
ms on Linux): a Dataflow job reading 2,000 objects through the storage front spent most of its time
waiting.  The storage emulator's metadata flush, which holds the interpreter its requests run in, takes
at most a tenth of its time.  (`python bench/any_size_bench.py --stack 2000` shows both whole.)"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from cloudworkflows import ExecutionsServer
from retrain_local.gcs_emulator import FLUSH_S, FLUSH_SHARE, MAX_FLUSH_PAUSE_S, flush_pause
from retrain_local.http import LoopbackServer


class _Reports(BaseHTTPRequestHandler):
    """Answers whether the connection it serves has TCP_NODELAY, headers and body in two writes."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        nodelay = self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        payload = json.dumps({"nodelay": bool(nodelay)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *_: Any) -> None:
        pass


def test_every_connection_a_loopback_server_accepts_is_without_nagle() -> None:
    server = LoopbackServer(_Reports)
    try:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        answers = []
        for _ in range(3):  # one kept-alive connection, as the Google clients use
            conn.request("GET", "/")
            answers.append(json.loads(conn.getresponse().read()))
        conn.close()
    finally:
        server.shutdown()
        server.server_close()
    assert answers == [{"nodelay": True}] * 3


def test_the_executions_service_answers_without_nagle() -> None:
    """retrain's Workflows interpreter serves its own HTTP (it imports nothing of the local stack)."""
    with ExecutionsServer.holding() as server:
        assert server._httpd.RequestHandlerClass.disable_nagle_algorithm is True


def test_the_storage_emulator_s_metadata_flush_takes_at_most_a_tenth_of_its_time() -> None:
    """Serializing the emulator's metadata holds the interpreter its requests run in: a small state is
    written every half second, one whose write takes 200 ms (some 10 MB: 2,000 objects tokenized) every
    two seconds, so requests wait for it a tenth of the time, not two fifths."""
    assert flush_pause(0.002) == FLUSH_S == 0.5
    assert flush_pause(0.2) == pytest.approx(1.8)
    assert 0.2 / (flush_pause(0.2) + 0.2) == pytest.approx(FLUSH_SHARE)
    assert flush_pause(60.0) == MAX_FLUSH_PAUSE_S == 5.0  # however large: metadata waits 5 s at most
