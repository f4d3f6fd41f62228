"""Cloud Storage's permission check, in front of the local storage emulator.

Every JSON API call names who makes it (a bearer token: the local stand-in of an access token, one per
deployed identity, ``retrain_local.identities``) and is checked against infra/'s IAM
(``retrain_local.iam``) for the permission Google checks it for, on the resource Google checks it on
("IAM permissions for JSON methods", cloud.google.com/storage/docs/access-control/iam-json):

=====================================  =============================================================
objects.list                           ``storage.objects.list`` on the bucket, or on a managed folder
                                       holding the listing's prefix
objects.get (metadata or media)        ``storage.objects.get`` on the object
objects.insert (any upload type)       ``storage.objects.create`` on the object, and
                                       ``storage.objects.delete`` when it overwrites one ("only required
                                       if the request causes an object with the same name to be
                                       overwritten")
objects.delete / objects.patch         ``storage.objects.delete`` / ``storage.objects.update``
objects.rewrite / copy / compose       ``storage.objects.get`` on each source, as insert on the target
managedFolders.insert / get / delete   ``storage.managedFolders.create`` / ``.get`` / ``.delete`` on the
                                       folder (``allowNonEmpty`` also ``.setIamPolicy``)
managedFolders.getIamPolicy / set      ``storage.managedFolders.getIamPolicy`` / ``.setIamPolicy``
buckets.get / buckets.patch            ``storage.buckets.get`` / ``storage.buckets.update``
buckets.insert / buckets.list          ``storage.buckets.create`` / ``storage.buckets.list`` on the project
=====================================  =============================================================

The storage emulator has no managed folders, so the front keeps them itself (:class:`ManagedFolders`):
their names, and the policies ``setIamPolicy`` sets, which join the guard's policy at once (Google's take
"typically 2 minutes, potentially 7 minutes or longer", cloud.google.com/iam/docs/access-change-propagation)
and leave it when the folder is deleted.

A refused call answers as Cloud Storage does, 403 naming the caller, the permission and the resource;
the :class:`retrain_local.identities.Guard` logs it and counts what is used.  A call the front cannot map
is refused, never passed through.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from retrain_local.http import LoopbackServer
from retrain_local.iam import RUNTIME_POLICY, Decision, Kind, Resource, storage_object
from retrain_local.identities import Guard

log = logging.getLogger("retrain.iam")

_OBJECT = re.compile(r"^(?:/storage/v1|/download/storage/v1)?/b/(?P<bucket>[^/]+)/o/(?P<object>.+)$")
_OBJECTS = re.compile(r"^(?:/storage/v1)?/b/(?P<bucket>[^/]+)/o/?$")
_UPLOAD = re.compile(r"^/upload/storage/v1/b/(?P<bucket>[^/]+)/o/?$")
_BUCKET = re.compile(r"^(?:/storage/v1)?/b/(?P<bucket>[^/]+)/?$")
_COPY = re.compile(
    r"^(?:/storage/v1)?/b/(?P<bucket>[^/]+)/o/(?P<object>.+)/(?:rewriteTo|copyTo)/b/(?P<to_bucket>[^/]+)/o/(?P<to>.+)$"
)
#: The JSON API's origin (its discovery document's ``rootUrl``), which the workflow's ``http.*`` calls
#: name; the local stack routes it to this front.
STORAGE_API = "https://storage.googleapis.com"
_MANAGED = re.compile(
    r"^(?:/storage/v1)?/b/(?P<bucket>[^/]+)/managedFolders(?:/(?P<folder>[^/]+)(?P<iam>/iam)?)?/?$"
)
_COMPOSE = re.compile(r"^(?:/storage/v1)?/b/(?P<bucket>[^/]+)/o/(?P<object>.+)/compose$")


@dataclass(frozen=True)
class Need:
    """One permission a call needs, on one resource."""

    permission: str
    resource: Resource


def _upload_name(query: dict[str, list[str]], body: bytes) -> str:
    """The object an upload creates: ``name`` in the query, else in its JSON metadata (a multipart
    upload's first part, or a resumable upload's initiation body)."""
    if query.get("name"):
        return query["name"][0]
    m = re.search(rb'\{.*?"name"\s*:\s*"((?:[^"\\]|\\.)*)"', body, re.S)
    if m is None:
        raise ValueError("an upload that names no object")
    return str(json.loads(b'"' + m.group(1) + b'"'))


def needs(
    method: str, path: str, query: dict[str, list[str]], body: bytes, exists: Callable[[str, str], bool]
) -> list[Need]:
    """What a JSON API call needs; ValueError for a call this front does not know (refused)."""
    if method == "PUT" and _UPLOAD.match(path) and "upload_id" in query:
        return []  # a resumable upload's data: checked when its session was opened
    if method == "POST" and (m := _UPLOAD.match(path)):
        bucket, name = m["bucket"], _upload_name(query, body)
        out = [Need("storage.objects.create", storage_object(bucket, name))]
        if exists(bucket, name):
            out.append(Need("storage.objects.delete", storage_object(bucket, name)))
        return out
    if m := _COPY.match(path):
        out = [Need("storage.objects.get", storage_object(m["bucket"], unquote(m["object"])))]
        target = storage_object(m["to_bucket"], unquote(m["to"]))
        out.append(Need("storage.objects.create", target))
        if exists(m["to_bucket"], unquote(m["to"])):
            out.append(Need("storage.objects.delete", target))
        return out
    if method == "POST" and (m := _COMPOSE.match(path)):
        sources = [s.get("name", "") for s in (json.loads(body or b"{}").get("sourceObjects") or [])]
        out = [Need("storage.objects.get", storage_object(m["bucket"], s)) for s in sources]
        return [*out, Need("storage.objects.create", storage_object(m["bucket"], unquote(m["object"])))]
    if method == "GET" and (m := _OBJECTS.match(path)):
        prefix = (query.get("prefix") or [""])[0]
        return [
            Need(
                "storage.objects.list",
                Resource(Kind.BUCKET, m["bucket"])
                if not prefix
                else Resource(Kind.MANAGED_FOLDER, f"{m['bucket']}/{prefix}"),
            )
        ]
    if m := _OBJECT.match(path):
        target = storage_object(m["bucket"], unquote(m["object"]))
        permission = {
            "GET": "storage.objects.get",
            "DELETE": "storage.objects.delete",
            "PATCH": "storage.objects.update",
        }.get(method)
        if permission:
            return [Need(permission, target)]
    if path.rstrip("/") in ("/storage/v1/b", "/b"):  # buckets.insert / buckets.list, on the project
        permission = {"POST": "storage.buckets.create", "GET": "storage.buckets.list"}.get(method)
        if permission:
            return [Need(permission, Resource(Kind.PROJECT, (query.get("project") or ["_"])[0]))]
    if m := _BUCKET.match(path):
        permission = {"GET": "storage.buckets.get", "PATCH": "storage.buckets.update"}.get(method)
        if permission:
            return [Need(permission, Resource(Kind.BUCKET, m["bucket"]))]
    raise ValueError(f"{method} {path} is not a call the storage front knows")


def error_body(code: int, message: str, reason: str) -> bytes:
    """Cloud Storage's JSON error shape."""
    errors = [{"message": message, "domain": "global", "reason": reason}]
    return json.dumps({"error": {"code": code, "message": message, "errors": errors}}).encode()


def denial(d: Decision) -> bytes:
    """Cloud Storage's 403 body: who lacks which permission on what."""
    who = d.member.partition(":")[2] or d.member
    what = "bucket" if d.resource.kind in (Kind.BUCKET, Kind.MANAGED_FOLDER) else "object"
    target = d.resource.name.removeprefix("projects/_/buckets/")
    message = (
        f"{who} does not have {d.permission} access to the Google Cloud Storage {what}. "
        f"Permission '{d.permission}' denied on resource (or it may not exist). ({target})"
    )
    return error_body(403, message, "forbidden")


class ManagedFolders:
    """Cloud Storage's managed folders of the local buckets, and their IAM policies (the JSON API's
    ``managedFolders`` resource: storage.v1 discovery document; cloud.google.com/storage/docs/json_api/v1/
    managedFolder).  A folder's name is a path ending in ``/`` ("Managed folder names must end with /",
    cloud.google.com/storage/docs/managed-folders); its policy reaches every object under that path."""

    def __init__(self, guard: Guard, has_objects: Callable[[str, str], bool]) -> None:
        self.guard = guard
        self.has_objects = has_objects
        self._lock = threading.Lock()
        self._folders: dict[tuple[str, str], dict[str, Any]] = {}
        self._policies: dict[tuple[str, str], dict[str, Any]] = {}

    def answer(
        self,
        member: str,
        method: str,
        bucket: str,
        folder: str | None,
        iam: bool,
        query: dict[str, list[str]],
        body: bytes,
    ) -> tuple[int, bytes]:
        """The status and JSON body of one managedFolders call, checked as ``member``."""
        if folder is None:
            if method != "POST":
                return 400, error_body(400, f"{method} on managedFolders is not supported here", "invalid")
            try:
                name = str(json.loads(body or b"{}")["name"])
            except (ValueError, KeyError, TypeError):
                return 400, error_body(400, "a managed folder's name is required", "required")
            return self._insert(member, bucket, name if name.endswith("/") else name + "/")
        name = unquote(folder)
        name = name if name.endswith("/") else name + "/"
        need = {
            ("GET", False): "storage.managedFolders.get",
            ("DELETE", False): "storage.managedFolders.delete",
            ("GET", True): "storage.managedFolders.getIamPolicy",
            ("PUT", True): "storage.managedFolders.setIamPolicy",
        }.get((method, iam))
        if need is None:
            return 400, error_body(
                400, f"{method} {'iam ' if iam else ''}on a managed folder is not supported here", "invalid"
            )
        resource = Resource(Kind.MANAGED_FOLDER, f"{bucket}/{name}")
        wanted = [need]
        if method == "DELETE" and (query.get("allowNonEmpty") or ["false"])[0] == "true":
            # "To use allowNonEmpty, the user must also have the storage.managedFolders.setIamPolicy
            # permission" (cloud.google.com/storage/docs/json_api/v1/managedFolder/delete)
            wanted.append("storage.managedFolders.setIamPolicy")
        for permission in wanted:
            decision = self.guard.check(member, permission, resource)
            if not decision.allowed:
                return 403, denial(decision)
        # Emptiness is read before the lock (an HTTP call to the emulator): a delete racing an upload is
        # decided by whichever the emulator saw first, as on Cloud Storage.
        emptiness_matters = method == "DELETE" and len(wanted) == 1
        not_empty = emptiness_matters and self.has_objects(bucket, name)
        with self._lock:
            if (bucket, name) not in self._folders:
                return 404, error_body(404, f"The managed folder {name} does not exist.", "notFound")
            if method == "GET" and not iam:
                return 200, json.dumps(self._folders[bucket, name]).encode()
            if method == "GET":
                return 200, json.dumps(
                    self._policies.get((bucket, name), self._empty_policy(bucket, name))
                ).encode()
            if method == "PUT":
                return self._set_policy(member, bucket, name, body)
            if not_empty:
                # "A managed folder is not empty if it contains objects or other managed folders"
                return 409, error_body(409, f"The managed folder {name} is not empty.", "conflict")
            del self._folders[bucket, name]
            self._policies.pop((bucket, name), None)
            self.guard.policy.set_policy(resource, [], RUNTIME_POLICY)
        return 204, b""

    def _insert(self, member: str, bucket: str, name: str) -> tuple[int, bytes]:
        resource = Resource(Kind.MANAGED_FOLDER, f"{bucket}/{name}")
        decision = self.guard.check(member, "storage.managedFolders.create", resource)
        if not decision.allowed:
            return 403, denial(decision)
        with self._lock:
            if (bucket, name) in self._folders:
                return 409, error_body(409, f"The managed folder {name} already exists.", "conflict")
            folder = {
                "kind": "storage#managedFolder",
                "id": f"{bucket}/{name}",
                "bucket": bucket,
                "name": name,
                "metageneration": "1",
            }
            self._folders[bucket, name] = folder
        return 200, json.dumps(folder).encode()

    @staticmethod
    def _empty_policy(bucket: str, name: str) -> dict[str, Any]:
        return {
            "kind": "storage#policy",
            "resourceId": f"projects/_/buckets/{bucket}/managedFolders/{name}",
            "version": 1,
            "bindings": [],
            "etag": "CAE=",
        }

    def _set_policy(self, member: str, bucket: str, name: str, body: bytes) -> tuple[int, bytes]:
        """``setIamPolicy`` (PUT ``.../managedFolders/NAME/iam``): the policy replaces the folder's, and an
        ``etag`` that is not the current one is refused (412 ``conditionNotMet``, as Cloud Storage refuses a
        stale read-modify-write).  A binding with a condition is refused: this front does not hold
        conditional grants on folders (never silently made unconditional)."""
        try:
            policy = json.loads(body or b"{}")
            bindings = policy.get("bindings") or []
            if any(not isinstance(b.get("members"), list) for b in bindings):
                raise TypeError("members is a list")
            grants = [(str(b["role"]), str(m)) for b in bindings for m in b["members"]]
        except (ValueError, KeyError, TypeError, AttributeError):
            return 400, error_body(400, "a policy is {bindings: [{role, members: [...]}], etag?}", "invalid")
        if any("condition" in b for b in bindings):
            return 400, error_body(400, "conditional grants on a managed folder are not held here", "invalid")
        current = self._policies.get((bucket, name), self._empty_policy(bucket, name))
        if policy.get("etag") not in (None, current["etag"]):
            return 412, error_body(
                412, "The policy's etag is not the managed folder's current one.", "conditionNotMet"
            )
        bad = [m for _, m in grants if not m.partition(":")[2]]  # allUsers, allAuthenticatedUsers: never
        if bad:  # on buckets that enforce public access prevention, as infra's do
            return 400, error_body(400, f"Invalid member(s): {', '.join(bad)}", "invalid")
        resource = Resource(Kind.MANAGED_FOLDER, f"{bucket}/{name}")
        try:
            self.guard.policy.set_policy(resource, grants, f"{RUNTIME_POLICY} by {member}: {resource.name}")
        except KeyError as e:
            return 400, error_body(400, f"Role not supported: {e}", "invalid")
        generation = int.from_bytes(base64.b64decode(current["etag"]), "big") + 1
        answer = {
            **current,
            "bindings": [
                {"role": r, "members": sorted(m for rr, m in grants if rr == r)}
                for r in sorted({r for r, _ in grants})
            ],
            "etag": base64.b64encode(generation.to_bytes(4, "big")).decode(),
        }
        self._policies[bucket, name] = answer
        return 200, json.dumps(answer).encode()


class StorageFront:
    """An HTTP front of the storage emulator that checks every call as Cloud Storage would."""

    def __init__(self, upstream: str, guard: Guard) -> None:
        self.upstream = upstream.rstrip("/")
        self.guard = guard
        self.folders = ManagedFolders(guard, self._has_objects)
        self._server: LoopbackServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_port}"

    @property
    def host(self) -> str:
        return self.url.removeprefix("http://")

    def _exists(self, bucket: str, name: str) -> bool:
        url = f"{self.upstream}/storage/v1/b/{bucket}/o/{quote(name, safe='')}"
        try:
            with urllib.request.urlopen(url, timeout=30):
                return True
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return False
            raise

    def _has_objects(self, bucket: str, prefix: str) -> bool:
        url = f"{self.upstream}/storage/v1/b/{bucket}/o?prefix={quote(prefix, safe='')}&maxResults=1"
        with urllib.request.urlopen(url, timeout=30) as answer:
            return bool(json.loads(answer.read()).get("items"))

    def managed_folders(
        self, token: str | None, method: str, target: str, body: bytes
    ) -> tuple[int, bytes] | None:
        """The answer to a managedFolders call (None: the call is not one)."""
        split = urlsplit(target)
        m = _MANAGED.match(split.path)
        if m is None:
            return None
        member = self.guard.member(token)
        if member is None:
            return 401, error_body(
                401, "Anonymous caller does not have access (no local identity).", "required"
            )
        query = parse_qs(split.query)
        return self.folders.answer(member, method, m["bucket"], m["folder"], bool(m["iam"]), query, body)

    def refusal(self, token: str | None, method: str, target: str, body: bytes) -> tuple[int, bytes] | None:
        """None when the call may go on; else the status and body Cloud Storage would answer."""
        member = self.guard.member(token)
        if member is None:
            message = (
                "Anonymous caller does not have access to the Google Cloud Storage API (no local identity)."
            )
            log.warning("storage front: %s %s without a known token", method, target)
            return 401, error_body(401, message, "required")
        split = urlsplit(target)
        try:
            wanted = needs(method, split.path, parse_qs(split.query), body, self._exists)
        except ValueError as e:
            log.warning("storage front: refused %s %s for %s: %s", method, split.path, member, e)
            return 403, error_body(
                403, f"the local storage front refuses a call it cannot check: {e}", "forbidden"
            )
        for need in wanted:
            if need.permission == "storage.objects.list" and need.resource.kind == Kind.MANAGED_FOLDER:
                # checked on the bucket; a listing whose prefix lies in a managed folder is allowed by a
                # grant on that folder too ("you can grant roles/storage.objectViewer on the managed
                # folder that contains the objects", cloud.google.com/storage/docs/listing-objects)
                bucket = Resource(Kind.BUCKET, need.resource.bucket)
                decision = self.guard.check(member, need.permission, bucket, need.resource)
            else:
                decision = self.guard.check(member, need.permission, need.resource)
            if not decision.allowed:
                return 403, denial(decision)
        return None

    def start(self) -> StorageFront:
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip() or None
                folders = front.managed_folders(token, self.command, self.path, body)
                if folders is not None:
                    self._answer(folders[0], {"Content-Type": "application/json; charset=UTF-8"}, folders[1])
                    return
                refused = front.refusal(token, self.command, self.path, body)
                if refused is not None:
                    self._answer(refused[0], {"Content-Type": "application/json; charset=UTF-8"}, refused[1])
                    return
                skip = ("host", "authorization", "content-length")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                request = urllib.request.Request(
                    front.upstream + self.path,
                    data=body if length else None,
                    headers=headers,
                    method=self.command,
                )
                try:
                    with urllib.request.urlopen(request, timeout=300) as answer:
                        status, answer_headers, payload = answer.status, dict(answer.headers), answer.read()
                except urllib.error.HTTPError as e:
                    status, answer_headers, payload = e.code, dict(e.headers), e.read()
                self._answer(status, answer_headers, payload)

            def _answer(self, status: int, headers: dict[str, Any], payload: bytes) -> None:
                self.send_response(status)
                hop = ("content-length", "transfer-encoding", "connection", "server", "date")
                for k, v in headers.items():
                    if k.lower() not in hop:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

            def log_message(self, *_: Any) -> None:
                pass

        self._server = LoopbackServer(Handler)
        threading.Thread(target=self._server.serve_forever, name="storage-front", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
