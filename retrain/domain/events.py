"""Turning an incoming CloudEvent into a validated arrival, or a rejection with a reason.

Delivery is at-least-once and event fields come from outside, so nothing here trusts them: the type,
source and bucket must be the ones configured, object names are checked before they are used in any
path or query, and anything unexpected becomes :class:`Rejected` (acknowledged, logged, never
retried) rather than an exception the platform would redeliver forever.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from retrain.domain.errors import Rejected

GCS_FINALIZED = "google.cloud.storage.object.v1.finalized"
GCS_SOURCE_PREFIX = "//storage.googleapis.com/projects/_/buckets/"

# GCS's own limits: names are 1-1024 bytes of UTF-8; bucket names 3-63 chars (222 with dots).
MAX_NAME_BYTES = 1024
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True, order=True)
class ObjectVersion:
    """One version of one object: what a run trains on, read exactly as it was when it arrived."""

    uri: str
    """``gs://bucket/name``, the name taken literally (never a pattern)."""
    generation: int
    """GCS's generation of that version (0: not known, read whatever is there)."""
    size: int = field(default=0, compare=False)
    """Its size in bytes, as its finalize event said."""
    content_hash: str = field(default="", compare=False)
    """Its content identity as it arrived (:attr:`ObjectArrival.content_hash`; "": not known): when the
    generation is gone but the object holds the same bytes again (the same file uploaded twice), the
    tokenize job reads the object's current generation instead."""

    @property
    def md5(self) -> str:
        """The md5 (base64, as GCS gives it) its content hash carries; "" when it carries none."""
        kind, _, rest = self.content_hash.partition(":")
        return rest.rsplit(":", 1)[0] if kind == "md5" else ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"uri": self.uri, "generation": self.generation, "size": self.size}
        if self.content_hash:
            out["content_hash"] = self.content_hash
        return out

    @classmethod
    def parse(cls, value: Any) -> ObjectVersion:
        """From its dict; ValueError naming what is wrong."""
        if not isinstance(value, dict) or not isinstance(value.get("uri"), str):
            raise ValueError(f"not an object version: {value!r}")
        content_hash = value.get("content_hash") or ""
        if not isinstance(content_hash, str):
            raise ValueError(f"not an object version: {value!r}")
        try:
            return cls(
                value["uri"], int(value.get("generation") or 0), int(value.get("size") or 0), content_hash
            )
        except (TypeError, ValueError):
            raise ValueError(f"not an object version: {value!r}") from None


@dataclass(frozen=True)
class ObjectArrival:
    """A finalized object in the landing bucket, as far as retrain cares."""

    event_id: str
    bucket: str
    name: str
    generation: int
    size: int
    md5_hash: str
    time: str

    @property
    def uri(self) -> str:
        return f"gs://{self.bucket}/{self.name}"

    @property
    def identity(self) -> str:
        """(bucket, name, generation): re-delivery of the same object version has the same identity."""
        return f"{self.bucket}/{self.name}#{self.generation}"

    @property
    def version(self) -> ObjectVersion:
        return ObjectVersion(self.uri, self.generation, self.size, self.content_hash)

    @property
    def content_hash(self) -> str:
        """What snapshots are made of: the object's md5 and how it is read (same bytes as the same format,
        same hash, whatever the name); an object without one (a composite upload) stands for itself."""
        if not self.md5_hash:
            return f"object:{self.identity}"
        return f"md5:{self.md5_hash}:{object_format(self.name)}"


def check_object_name(name: object) -> str:
    """Return ``name`` if it is safe to use as an object name, else raise Rejected."""
    if not isinstance(name, str) or not name:
        raise Rejected("object name missing or not a string")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise Rejected(f"object name longer than {MAX_NAME_BYTES} bytes")
    if _CONTROL_RE.search(name):
        raise Rejected("object name contains control characters")
    if name.startswith("/") or any(part in ("..", ".") for part in name.split("/")):
        raise Rejected("object name contains '.' or '..' segments or a leading '/'")
    if name.endswith("/"):
        raise Rejected("object name ends with '/': a folder placeholder, not data")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise Rejected("object name is not valid UTF-8") from None
    return name


def encode_header_value(value: str) -> str:
    """A CloudEvents attribute as an HTTP header value: percent-encoded UTF-8 outside printable ASCII,
    and space, double quote and percent (CloudEvents HTTP protocol binding, "HTTP Header Values")."""
    out = []
    for byte in value.encode("utf-8"):
        out.append(chr(byte) if 0x21 <= byte <= 0x7E and byte not in b'"%' else f"%{byte:02X}")
    return "".join(out)


def _field(data: Mapping[str, Any], key: str) -> Any:
    if key not in data:
        raise Rejected(f"event data has no {key!r}")
    return data[key]


def event_id_of(attributes: Mapping[str, Any], expected_type: str) -> str:
    """The CloudEvent's id, once its type is the one this handler serves (the dedup key's other half)."""
    if attributes.get("type") != expected_type:
        raise Rejected(f"unexpected event type {str(attributes.get('type'))[:200]!r}")
    event_id = attributes.get("id")
    if not isinstance(event_id, str) or not event_id or len(event_id) > 512:
        raise Rejected("event id missing or invalid")
    return event_id


def parse_gcs_finalized(attributes: Mapping[str, Any], data: Any) -> ObjectArrival:
    """Validate an Eventarc ``object.v1.finalized`` CloudEvent (attributes + StorageObjectData)."""
    event_id = event_id_of(attributes, GCS_FINALIZED)
    if not isinstance(data, Mapping):
        raise Rejected("event data is not a JSON object")
    bucket = _field(data, "bucket")
    if not isinstance(bucket, str) or not _BUCKET_RE.match(bucket):
        raise Rejected("bucket missing or not a valid bucket name")
    source = attributes.get("source")
    if source != GCS_SOURCE_PREFIX + bucket:
        raise Rejected(f"event source {source!r} does not match bucket {bucket!r}")
    name = check_object_name(_field(data, "name"))
    try:
        generation = int(_field(data, "generation"))
        size = int(data.get("size", 0))
    except (TypeError, ValueError):
        raise Rejected("generation or size is not an integer") from None
    if generation <= 0 or size < 0:
        raise Rejected("generation must be positive and size non-negative")
    md5 = data.get("md5Hash") or ""
    if not isinstance(md5, str) or len(md5) > 64:
        raise Rejected("md5Hash is not a short string")
    time = str(attributes.get("time") or data.get("updated") or "")
    return ObjectArrival(event_id, bucket, name, generation, size, md5, time)


def object_format(name: str) -> str:
    """How an object's bytes are read, by its name: ``jsonl`` (.jsonl/.ndjson/.json), ``parquet``
    (.parquet/.pq) or ``text`` (the whole object one document).  The same bytes under another format
    are other documents, so content identity includes it."""
    lower = name.lower()
    if lower.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if lower.endswith((".parquet", ".pq")):
        return "parquet"
    return "text"
