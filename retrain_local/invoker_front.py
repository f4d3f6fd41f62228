"""Cloud Run's invoker check, in front of one local function.

A gen2 function is a Cloud Run service deployed with ``ingress_settings = ALLOW_INTERNAL_ONLY`` and no
public invoker: Cloud Run serves a request only when its OIDC token's account holds
``run.routes.invoke`` on the service (cloud.google.com/run/docs/securing/managing-access).  Who that
account is depends on who calls:

- ``/_eventarc``: Eventarc delivering a trigger's event, as the trigger's ``service_account_email``,
  which also needs ``eventarc.events.receiveEvent`` on the project; for Cloud Storage events the
  bucket's notifications are published by Cloud Storage's service agent, which needs
  ``pubsub.topics.publish`` (cloud.google.com/eventarc/docs/run/create-trigger-storage-gcloud);
- ``/_push/<topic>``: Pub/Sub pushing a message, as the ``oidc_token.service_account_email`` of that
  topic's push subscription in infra/app/events.tf;
- anything else: a direct call, as whoever the bearer token is (the workflow's ``http.post`` with
  ``auth: OIDC``).

A refused request answers 403, as Cloud Run does, and is logged by the guard.  A direct call goes on
with its caller's ID token, as Cloud Run hands it to the container: its claims (``email``,
``email_verified``, ``exp``) and Google's mark where a signature was ("Google removes the token
signature", cloud.google.com/run/docs/troubleshooting#signature-removed), which is what
:func:`retrain.caller.verified_caller` reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler
from typing import Any

import requests

from retrain.caller import SERVERLESS_AUTHORIZATION, forwarded_id_token
from retrain_local.http import LoopbackServer
from retrain_local.iam import Decision, Kind, Resource
from retrain_local.identities import Guard

log = logging.getLogger("retrain.iam")

STORAGE_AGENT_PUBLISHES = "pubsub.topics.publish"


class InvokerFront:
    """An HTTP front of one function (``upstream``) that checks every caller for ``run.routes.invoke``."""

    def __init__(
        self,
        upstream: str,
        service: str,
        guard: Guard,
        *,
        trigger_member: str | None = None,
        storage_agent: str | None = None,
        push_members: Mapping[str, str] | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.service = Resource(Kind.SERVICE, service)
        self.guard = guard
        self.trigger_member = trigger_member
        self.storage_agent = storage_agent
        self.push_members = dict(push_members or {})
        self._server: LoopbackServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_port}"

    def refusal(self, path: str, token: str | None) -> Decision | str | None:
        """None when the call may go on; else the refused decision (or why no identity was found)."""
        project = Resource(Kind.PROJECT, self.guard.deployed.project)
        if path.startswith("/_eventarc"):
            if self.trigger_member is None:
                return f"{self.service.key} has no Eventarc trigger"
            checks = [(self.trigger_member, "eventarc.events.receiveEvent", project)]
            if self.storage_agent:
                checks.insert(0, (self.storage_agent, STORAGE_AGENT_PUBLISHES, project))
            member = self.trigger_member
        elif path.startswith("/_push/"):
            topic = path.removeprefix("/_push/").split("/", 1)[0].split("?", 1)[0]
            if topic not in self.push_members:
                return f"infra/ declares no push subscription of topic {topic} to {self.service.key}"
            member, checks = self.push_members[topic], []
        else:
            found = self.guard.member(token)
            if found is None:
                return "the request carries no local identity's token"
            member, checks = found, []
        for who, permission, resource in [*checks, (member, "run.routes.invoke", self.service)]:
            decision = self.guard.check(who, permission, resource)
            if not decision.allowed:
                return decision
        return None

    def forwarded_token(self, path: str, token: str | None) -> str | None:
        """What the function sees in the header Cloud Run checked, for a direct call that passed (None for
        Eventarc's and Pub/Sub's deliveries): its caller's ID token, as Cloud Run passes it on."""
        if path.startswith(("/_eventarc", "/_push/")):
            return None
        member = self.guard.member(token)
        if member is None:
            return None
        now = int(time.time())
        claims = {
            "iss": "https://accounts.google.com",
            "aud": self.url,
            "email": member.partition(":")[2] or member,
            "email_verified": True,
            "iat": now,
            "exp": now + 3600,
        }
        return "Bearer " + forwarded_id_token(claims)

    def start(self) -> InvokerFront:
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                # Cloud Run checks X-Serverless-Authorization when present, else Authorization
                # (cloud.google.com/run/docs/authenticating/service-to-service); the other goes on as sent
                checked = (
                    SERVERLESS_AUTHORIZATION
                    if self.headers.get(SERVERLESS_AUTHORIZATION)
                    else "Authorization"
                )
                token = (self.headers.get(checked) or "").removeprefix("Bearer ").strip() or None
                refused = front.refusal(self.path, token)
                if refused is not None:
                    why = refused.reason if isinstance(refused, Decision) else refused
                    if not isinstance(refused, Decision):
                        log.warning("Cloud Run %s refused %s: %s", front.service.key, self.path, why)
                    text = f"Your client does not have permission to get URL {self.path} from this server."
                    self._answer(403, "text/plain; charset=utf-8", f"{text} ({why})".encode())
                    return
                skip = ("host", checked.lower(), "content-length", "connection")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                if (identity := front.forwarded_token(self.path, token)) is not None:
                    headers[checked] = identity
                try:
                    answer = requests.request(
                        self.command, front.upstream + self.path, data=body, headers=headers, timeout=3600
                    )
                except requests.RequestException as e:  # the instance is down: Cloud Run's 503
                    self._answer(503, "text/plain; charset=utf-8", f"Service Unavailable ({e})".encode())
                    return
                self._answer(answer.status_code, answer.headers.get("Content-Type", ""), answer.content)

            def _answer(self, code: int, content_type: str, payload: bytes) -> None:
                self.send_response(code)
                if content_type:
                    self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _relay

            def log_message(self, *_: Any) -> None:
                pass

        self._server = LoopbackServer(Handler)
        threading.Thread(
            target=self._server.serve_forever, name=f"run-{self.service.key}", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
