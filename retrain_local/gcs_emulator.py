"""gcp-storage-emulator, launched with the two rules of Cloud Storage's generations it does not keep.

Out of the box the emulator keeps one version per object and answers a request for any ``generation``
with the current one, so a reader pinned to a generation that is gone silently gets other bytes.  Here:

- **Object versioning**, for buckets whose ``versioning.enabled`` is set (the deployment's three buckets
  are versioned: infra/platform/storage.tf): overwriting or deleting the live version keeps it as a
  noncurrent version, readable by its generation and listed with ``versions=true``
  (cloud.google.com/storage/docs/object-versioning: "When the live version of an object is replaced or
  deleted, it becomes a noncurrent version"); deleting one ``generation`` removes that version for good
  (how data is withdrawn for good).  Lifecycle rules (the deployment deletes noncurrent versions after
  30 days) are not played: a local stack lives for hours.
- **A write costs the same in a bucket of 20 objects or 20,000.**  The emulator rewrote its whole
  metadata file (every object's resource, indented) on every write: a run of 2,000 small objects, whose
  tokenizing writes some 20,000 objects, spent minutes serializing.  Here the metadata is written behind
  the requests, at most every ``FLUSH_S`` (or, once it has grown so large that writing it takes longer
  than a tenth of that, every ten times as long as the last write took, at most every
  ``MAX_FLUSH_PAUSE_S``: serializing holds the interpreter, and requests wait for it), and on
  SIGTERM/SIGINT before the emulator exits (how the stack stops it; after any flush under way); only a
  SIGKILL of the emulator itself can lose the last interval's metadata.  Requests and the flush's
  snapshot take one lock, so the flush always writes a state some request left.
- **A generation that does not exist is a 404** (objects.get, cloud.google.com/storage/docs/json_api/v1/
  objects/get: ``generation`` "If present, selects a specific revision of this object"), never the
  current version's bytes.
- **Preconditions hold** on the JSON API's writes (uploads, whole or resumable, copy, rewrite and
  compose to their destination, delete, patch): ``ifGenerationMatch`` (0: no live version) and
  ``ifMetagenerationMatch`` that do not hold are a 412, ``ifGenerationNotMatch`` and
  ``ifMetagenerationNotMatch`` that do not hold a 304 (a 412 where no live version exists), and
  nothing is written (cloud.google.com/storage/docs/request-preconditions).  Out of the box the
  emulator ignores them and writes (and starts an upload at metageneration 2).  The XML API's
  ``x-goog-if-generation-match`` is not played.
- **A bucket is created as asked**: ``buckets.insert`` keeps the resource's ``versioning``
  (cloud.google.com/storage/docs/json_api/v1/buckets/insert takes a bucket resource).  Out of the box
  every new bucket was plain, and only a later patch made it keep versions.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import signal
import sys
import threading
import time
from http import HTTPStatus
from typing import Any

from gcp_storage_emulator import storage as emulated
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import buckets, objects

NONCURRENT_DIR = ".noncurrent"
NONCURRENT_META = ".noncurrent-meta"
FLUSH_S = 0.5
"""How long metadata may wait in memory before it is written (see the module docstring)."""
FLUSH_SHARE = 0.1
"""The share of the emulator's time the flush may take (see the module docstring)."""
MAX_FLUSH_PAUSE_S = 5.0
"""The longest metadata may wait in memory, however large it is."""
_FLUSHING = threading.Lock()
"""Held by a flush from its snapshot to its last write: an exit's flush waits for one under way."""
_STATE = threading.RLock()
"""Held by every request and by the flush."""
_dirty: dict[Any, set[str]] = {}  # storage -> the metadata files to write


def _versioned(storage: Any, bucket: str) -> bool:
    return bool(((storage.buckets.get(bucket) or {}).get("versioning") or {}).get("enabled"))


def _content_path(bucket: str, name: str, generation: str) -> str:
    key = hashlib.sha256(f"{bucket}:{name}:{generation}".encode()).hexdigest()
    return f"{NONCURRENT_DIR}/{bucket}/{key}"


def _noncurrent(storage: Any) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """bucket -> name -> generation -> the object resource of each noncurrent version (kept on disk)."""
    if not hasattr(storage, "_noncurrent"):
        try:
            storage._noncurrent = json.loads(storage._store.read_bytes(NONCURRENT_META))
        except FileNotFoundError:
            storage._noncurrent = {}
    return storage._noncurrent


def _keep_live_version(storage: Any, bucket: str, name: str) -> None:
    """The live version of ``name`` becomes noncurrent (its bytes and resource kept by generation)."""
    live = (storage.objects.get(bucket) or {}).get(name)
    if live is None or not _versioned(storage, bucket):
        return
    generation = str(live.get("generation"))
    try:
        content = storage.get_file(bucket, name, show_error=False)
    except NotFound:
        return
    storage._store.write_bytes(_content_path(bucket, name, generation), content)
    kept = {**live, "timeDeleted": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
    _noncurrent(storage).setdefault(bucket, {}).setdefault(name, {})[generation] = kept
    _dirty.setdefault(storage, set()).add(NONCURRENT_META)


def _keeping_versions(method: Any) -> Any:
    def write(self: Any, bucket_name: str, file_name: str, *args: Any, **kwargs: Any) -> Any:
        _keep_live_version(self, bucket_name, file_name)
        return method(self, bucket_name, file_name, *args, **kwargs)

    return write


class _Version:
    """The storage as seen by one request for a noncurrent version: that version is the object."""

    def __init__(self, storage: Any, resource: dict[str, Any], content: bytes) -> None:
        self._storage, self._resource, self._content = storage, resource, content

    def get_file(self, *_: Any, **__: Any) -> bytes:
        return self._content

    def get_file_obj(self, *_: Any) -> dict[str, Any]:
        return self._resource

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


def _by_generation(handler: Any) -> Any:
    def handle(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        wanted = request.query.get("generation")
        if not wanted or request.query.get("softDeleted"):
            return handler(request, response, storage, *args, **kwargs)
        bucket, name, generation = request.params["bucket_name"], request.params["object_id"], str(wanted[0])
        live = (storage.objects.get(bucket) or {}).get(name)
        if live is not None and str(live.get("generation")) == generation:
            return handler(request, response, storage, *args, **kwargs)
        kept = _noncurrent(storage).get(bucket, {}).get(name, {}).get(generation)
        if kept is None:
            response.status = HTTPStatus.NOT_FOUND
            return None
        content = storage._store.read_bytes(_content_path(bucket, name, generation))
        return handler(request, response, _Version(storage, kept, content), *args, **kwargs)

    return handle


def _deleting_a_version(handler: Any) -> Any:
    """DELETE with ``generation`` removes that version for good, live or noncurrent (objects.delete:
    "If present, permanently deletes a specific revision of this object")."""

    def handle(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        wanted = request.query.get("generation")
        if not wanted:
            return handler(request, response, storage, *args, **kwargs)
        bucket, name, generation = request.params["bucket_name"], request.params["object_id"], str(wanted[0])
        live = (storage.objects.get(bucket) or {}).get(name)
        if live is not None and str(live.get("generation")) == generation:
            storage._hard_delete_file(bucket, name)
            return None
        kept = _noncurrent(storage).get(bucket, {}).get(name, {})
        if kept.pop(generation, None) is None:
            response.status = HTTPStatus.NOT_FOUND
            return None
        storage._store.remove_file(_content_path(bucket, name, generation))
        _dirty.setdefault(storage, set()).add(NONCURRENT_META)
        return None

    return handle


def _listing_versions(handler: Any) -> Any:
    def handle(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        versions = (request.query.get("versions") or ["false"])[0].lower() == "true"
        if not versions or request.query.get("delimiter") or request.query.get("matchGlob"):
            return handler(request, response, storage, *args, **kwargs)
        bucket = request.params["bucket_name"]
        prefix = (request.query.get("prefix") or [""])[0]
        try:
            live, _ = storage.get_file_list(bucket, prefix or None)
        except NotFound:
            response.status = HTTPStatus.NOT_FOUND
            return None
        kept = [
            resource
            for name, generations in _noncurrent(storage).get(bucket, {}).items()
            if name.startswith(prefix)
            for resource in generations.values()
        ]
        items = sorted(live + kept, key=lambda o: (o.get("name") or "", int(o.get("generation") or 0)))
        response.json({"kind": "storage#objects", "prefixes": [], "items": items})
        return None

    return handle


def _inserting_as_asked(handler: Any) -> Any:
    def handle(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        asked = request.data or {}
        name, versioning = asked.get("name"), asked.get("versioning")
        new = bool(name) and not storage.get_bucket(name)
        handler(request, response, storage, *args, **kwargs)
        if new and versioning and response.status == HTTPStatus.OK:
            bucket = {**storage.buckets[name], "versioning": versioning}
            storage.create_bucket(name, bucket)
            response.json(bucket)

    return handle


PRECONDITIONS = (
    "ifGenerationMatch",
    "ifGenerationNotMatch",
    "ifMetagenerationMatch",
    "ifMetagenerationNotMatch",
)
_request = threading.local()
"""The preconditions of the request being handled (requests are handled one at a time: _STATE)."""


class _NotMet(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def _check_preconditions(storage: Any, bucket: str, name: str) -> None:
    """Raise _NotMet when the request's preconditions do not hold for the live version of ``name``."""
    conditions: dict[str, int] = getattr(_request, "conditions", {})
    if not conditions:
        return
    live = (storage.objects.get(bucket) or {}).get(name)
    generation = int(live.get("generation") or 0) if live else 0
    metageneration = int(live.get("metageneration") or 1) if live else None
    for key, wanted in conditions.items():
        if key.endswith("NotMatch") and live is None:  # "If no live object exists, the precondition fails"
            raise _NotMet(HTTPStatus.PRECONDITION_FAILED, f"{name}: no live version")
        if key == "ifGenerationMatch" and generation != wanted:
            raise _NotMet(HTTPStatus.PRECONDITION_FAILED, f"{name}: generation {generation}, not {wanted}")
        if key == "ifMetagenerationMatch" and metageneration != wanted:
            raise _NotMet(HTTPStatus.PRECONDITION_FAILED, f"{name}: metageneration {metageneration}")
        if key == "ifGenerationNotMatch" and generation == wanted:
            raise _NotMet(HTTPStatus.NOT_MODIFIED, f"{name}: generation {generation}")
        if key == "ifMetagenerationNotMatch" and metageneration == wanted:
            raise _NotMet(HTTPStatus.NOT_MODIFIED, f"{name}: metageneration {metageneration}")


def _conditional(method: Any) -> Any:
    """A storage create that first checks the request's preconditions: where an upload's object name is
    known only once its body is read (multipart metadata, a resumable session), and compose's."""

    def write(self: Any, bucket_name: str, file_name: str, *args: Any, **kwargs: Any) -> Any:
        _check_preconditions(self, bucket_name, file_name)
        return method(self, bucket_name, file_name, *args, **kwargs)

    return write


def _with_preconditions(handler: Any, target: tuple[str, str] | None = None) -> Any:
    """A write handler whose request's preconditions hold or nothing is written.  With ``target`` (the
    route's bucket and object parameters), they are checked before the handler touches anything (a
    patch changes the stored resource in place before it saves it); else the storage checks them when
    the object is created (a resumable upload's are on the session URL the emulator hands out, so its
    finishing PUT carries them too)."""

    def handle(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            _request.conditions = {k: int(v[0]) for k in PRECONDITIONS if (v := request.query.get(k))}
        except ValueError:
            response.status = HTTPStatus.BAD_REQUEST
            response.json({"error": {"code": 400, "message": "a precondition is not a number"}})
            return None
        try:
            if target is not None:
                _check_preconditions(storage, request.params[target[0]], request.params[target[1]])
            return handler(request, response, storage, *args, **kwargs)
        except _NotMet as e:
            response.status = e.status
            if e.status == HTTPStatus.PRECONDITION_FAILED:
                message = "At least one of the pre-conditions you specified did not hold."
                error = {"message": message, "domain": "global", "reason": "conditionNotMet"}
                response.json({"error": {"code": 412, "message": message, "errors": [error]}})
            return None
        finally:
            _request.conditions = {}

    return handle


def _first_metageneration(make: Any) -> Any:
    """A new object (every upload is a new generation) starts at metageneration 1 (cloud.google.com/
    storage/docs/metadata#generation-number); the emulator applied the upload's own metadata as a patch,
    which made it 2, and a precondition on it would see the wrong number."""

    def made(*args: Any, **kwargs: Any) -> Any:
        resource = make(*args, **kwargs)
        resource["metageneration"] = "1"
        return resource

    return made


def _write_later(storage: Any) -> None:
    """Stands for ``Storage._write_config_to_file``: the metadata is written by :func:`_flush`."""
    _dirty.setdefault(storage, set()).add(".meta")


def _flush() -> float:
    """Write the metadata files requests left dirty: the state is copied under the lock (two dict levels,
    milliseconds), serialized outside it, so requests wait for the copy only.  How long serializing and
    writing took (not waiting for the lock: a request holds it while it answers)."""
    with _FLUSHING:
        with _STATE:
            todo = [(storage, files, _snapshot(storage, files)) for storage, files in _dirty.items()]
            _dirty.clear()
        began = time.monotonic()
        for storage, files, snapshot in todo:
            try:
                for name, data in snapshot.items():
                    storage._store.write_bytes(name, json.dumps(data).encode("utf-8"))
            except RuntimeError:  # a resource changed under the serializer: write it again next time
                with _STATE:
                    _dirty.setdefault(storage, set()).update(files)
        return time.monotonic() - began


def _snapshot(storage: Any, files: set[str]) -> dict[str, Any]:
    def copy(tree: dict[str, Any]) -> dict[str, Any]:
        return {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}

    out: dict[str, Any] = {}
    if ".meta" in files:  # the fields Storage._write_config_to_file writes, and _read_config_from_file reads
        out[".meta"] = {
            "buckets": copy(storage.buckets),
            "objects": copy(storage.objects),
            "resumable": copy(storage.resumable),
            "bucket_iam_policies": copy(storage.bucket_iam_policies),
            "soft_deleted": copy(storage.soft_deleted),
        }
    if NONCURRENT_META in files:
        out[NONCURRENT_META] = {b: copy(names) for b, names in _noncurrent(storage).items()}
    return out


def flush_pause(last_flush_s: float) -> float:
    """How long to wait before the next flush, given how long the last one took to write."""
    return min(MAX_FLUSH_PAUSE_S, max(FLUSH_S, last_flush_s * (1 - FLUSH_SHARE) / FLUSH_SHARE))


def _flushing() -> None:
    pause = FLUSH_S
    while True:
        time.sleep(pause)
        pause = flush_pause(_flush())


def _locked(handle: Any) -> Any:
    def locked(*args: Any, **kwargs: Any) -> Any:
        with _STATE:
            return handle(*args, **kwargs)

    return locked


def _exit_flushed(signum: int, _frame: Any) -> None:
    _flush()
    sys.exit(128 + signum)


def main() -> None:
    emulated.Storage._write_config_to_file = _write_later
    threading.Thread(target=_flushing, name="metadata-flush", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_flushed)
    emulated.Storage.create_file = _conditional(_keeping_versions(emulated.Storage.create_file))
    emulated.Storage.delete_file = _keeping_versions(emulated.Storage.delete_file)
    objects._make_object_resource = _first_metageneration(objects._make_object_resource)
    buckets.insert = _inserting_as_asked(buckets.insert)
    objects.get = _by_generation(objects.get)
    objects.download = _by_generation(objects.download)
    objects.ls = _listing_versions(objects.ls)
    the_object, the_destination = ("bucket_name", "object_id"), ("dest_bucket_name", "dest_object_id")
    objects.delete = _with_preconditions(_deleting_a_version(objects.delete), the_object)
    objects.patch = _with_preconditions(objects.patch, the_object)
    objects.copy = _with_preconditions(objects.copy, the_destination)
    objects.rewrite = _with_preconditions(objects.rewrite, the_destination)
    for write in ("insert", "upload_partial", "compose"):
        setattr(objects, write, _with_preconditions(getattr(objects, write)))
    from gcp_storage_emulator import server  # its routes bind the handlers above: imported after them
    from gcp_storage_emulator.__main__ import main as emulator

    server.Router.handle = _locked(server.Router.handle)

    emulator()


if __name__ == "__main__":
    main()
