"""The BigQuery emulator in front of the storage emulator.

bqemulator writes the files of ``EXPORT DATA`` statements and extract jobs to a folder
(``BQEMU_GCS_LOCAL_ROOT``, one subfolder per bucket), not to Cloud Storage; on Google the files are in
the bucket by the time the job is reported done.  :class:`ExportsProxy` stands in front of bqemulator
and, before it passes on any answer, uploads the files that appeared in that folder into the storage
emulator (through :mod:`retrain.adapters.objects`): a client that sees a job done finds its files, as
on Google.  Nothing else is changed: requests and answers pass through as they are.
"""

from __future__ import annotations

import errno
import http.client
import logging
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import urlsplit

from retrain.adapters import objects
from retrain_local.http import LoopbackServer
from retrain_local.processes import ManagedProcess, PortTaken, free_port

log = logging.getLogger(__name__)

#: Headers that belong to one connection, not to the message (RFC 9110 section 7.6.1).
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "upgrade", "proxy-connection", "te"}


class _Mirror:
    """Uploads each file of the export folder once per version (size and modification time)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.seen: dict[Path, tuple[int, int]] = {}
        self.lock = threading.Lock()

    def sync(self) -> None:
        with self.lock:
            if not self.root.is_dir():
                return
            for path in sorted(p for p in self.root.rglob("*") if p.is_file()):
                stat = path.stat()
                version = (stat.st_size, stat.st_mtime_ns)
                if self.seen.get(path) == version:
                    continue
                bucket, _, name = path.relative_to(self.root).as_posix().partition("/")
                try:
                    objects.write_bytes(f"gs://{bucket}/{name}", path.read_bytes())
                except Exception:  # a missing bucket, a file at the root: tried again next time
                    log.exception("could not put %s into the storage emulator", path)
                    continue
                self.seen[path] = version


class ExportsProxy:
    """bqemulator behind a proxy that mirrors its export folder into the storage emulator."""

    def __init__(self, emulator: ManagedProcess, upstream: str, export_root: Path) -> None:
        self.emulator = emulator
        self.upstream = urlsplit(upstream)
        self.mirror = _Mirror(export_root)
        self.port = free_port()
        self.server: LoopbackServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        self.emulator.start(timeout_s)
        try:
            self.server = LoopbackServer(self._handler(), self.port)
        except OSError as e:
            self.emulator.stop()
            if e.errno == errno.EADDRINUSE:
                raise PortTaken(f"the exports proxy could not bind {self.port}") from e
            raise
        threading.Thread(target=self.server.serve_forever, name="bigquery-exports-proxy", daemon=True).start()

    def stop(self, grace_s: float = 10.0) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        self.emulator.stop(grace_s)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    self.send_error(411, "send a Content-Length")  # the client libraries always do
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP | {"host"}}
                conn = http.client.HTTPConnection(proxy.upstream.netloc, timeout=300)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    answer = conn.getresponse()
                    payload = answer.read()
                    proxy.mirror.sync()  # the files of every job the answer reports done are in the bucket
                finally:
                    conn.close()
                self.send_response(answer.status, answer.reason)  # (with its own Date and Server)
                for k, v in answer.getheaders():
                    if k.lower() not in _HOP_BY_HOP | {"content-length", "date", "server"}:
                        self.send_header(k, v)
                bodiless = answer.status in (204, 304) or self.command == "HEAD"
                if not bodiless:
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if not bodiless:
                    self.wfile.write(payload)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

            def log_message(self, format: str, *args: object) -> None:
                log.debug(format, *args)

        return Handler
