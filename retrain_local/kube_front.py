"""The cluster's control plane as GKE fronts it: a Google identity's token in, a Kubernetes user out.

GKE authenticates a caller's Google access token and hands the Kubernetes API server the account's
email as the username; it then authorizes with IAM *or* RBAC ("Identity and Access Management (IAM)
and Kubernetes RBAC work in concert ... an entity needs permissions at either level",
cloud.google.com/kubernetes-engine/docs/concepts/access-control).  Locally this front does the same in
front of the envtest kube-apiserver (which runs with ``--authorization-mode=RBAC``): it maps a local
token to its member (``retrain_local.identities.Guard``), relays the call with the control plane's
admin token and ``Impersonate-User: <email>``, so RBAC (the Roles of ``k8s/``) decides; the project's
owner holds ``container.*`` through IAM, and is relayed as the administrator.  Kubernetes service
accounts (the notifier, the trainer) reach the API server directly with their own tokens, as pods do.

It serves TLS with the API server's own certificate (issued for 127.0.0.1), so clients trust it with the
cluster CA the GKE API reports.  Watches are refused (400): none of its callers watch.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import requests

from retrain_local.http import LoopbackServer
from retrain_local.identities import Guard

log = logging.getLogger("retrain.iam")


def status(code: int, reason: str, message: str) -> bytes:
    """A Kubernetes ``Status`` object, the API's error shape."""
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason}
    return json.dumps({**body, "code": code}).encode()


class KubeFront:
    """HTTPS front of a kube-apiserver that maps local Google tokens to Kubernetes users."""

    def __init__(self, upstream: str, admin_token: str, ca_file: str, guard: Guard, pki: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self.guard = guard
        self.ca_file = ca_file
        self._pki = pki
        self._session = requests.Session()
        self._session.headers["Authorization"] = f"Bearer {admin_token}"
        self._server: LoopbackServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return f"https://127.0.0.1:{self._server.server_port}"

    def user_of(self, token: str | None) -> tuple[str | None, str | None]:
        """(the Kubernetes user to impersonate, or None for the administrator; a refusal message)."""
        member = self.guard.member(token)
        if member is None:
            return None, "Unauthorized: the token is no local identity's"
        if member in self.guard.owners or not self.guard.enforce:  # RETRAIN_LOCAL_IAM=off: RBAC off too
            return None, None
        return member.partition(":")[2], None

    def start(self) -> KubeFront:
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip() or None
                user, refused = front.user_of(token)
                if refused:
                    log.warning("GKE front: %s %s refused: %s", self.command, self.path, refused)
                    self._answer(
                        401, {"Content-Type": "application/json"}, status(401, "Unauthorized", refused)
                    )
                    return
                if "watch=true" in self.path or "watch=1" in self.path:
                    message = "the local GKE front relays no watches"
                    self._answer(
                        400, {"Content-Type": "application/json"}, status(400, "BadRequest", message)
                    )
                    return
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() in ("content-type", "accept") or k.lower().startswith("x-")
                }
                if user is not None:
                    headers["Impersonate-User"] = user
                answer = front._session.request(
                    self.command,
                    front.upstream + self.path,
                    data=body,
                    headers=headers,
                    timeout=120,
                    verify=front.ca_file,  # explicit: REQUESTS_CA_BUNDLE would win over the session's
                )
                if answer.status_code == 403:
                    log.warning("RBAC refused %s: %s %s", user, self.command, self.path)
                self._answer(
                    answer.status_code,
                    {"Content-Type": answer.headers.get("Content-Type", "")},
                    answer.content,
                )

            def _answer(self, code: int, headers: dict[str, Any], payload: bytes) -> None:
                self.send_response(code)
                for k, v in headers.items():
                    if v:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _relay

            def log_message(self, *_: Any) -> None:
                pass

        server = LoopbackServer(Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self._pki / "apiserver.crt", self._pki / "apiserver.key")
        server.socket = context.wrap_socket(server.socket, server_side=True)
        self._server = server
        threading.Thread(target=server.serve_forever, name="gke-front", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._session.close()
