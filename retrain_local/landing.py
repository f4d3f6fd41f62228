"""Dropping data into the local landing bucket, and the finalize CloudEvent that GCS would emit.

gcp-storage-emulator has no notifications, so after each upload the event is made here, shaped as
Eventarc delivers it: binary content mode, ``ce-*`` headers (percent-encoded as the CloudEvents HTTP
binding says, so any object name travels), and the object's GCS JSON resource (StorageObjectData) as
the body; it is delivered as Eventarc delivers it (``retrain_local.eventarc``): now, or again until the
function takes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.adapters import objects
from retrain.config import Settings
from retrain.domain.datasets import DATASET_RULE, is_dataset_name
from retrain.domain.errors import Rejected
from retrain.domain.events import GCS_FINALIZED, GCS_SOURCE_PREFIX, check_object_name, encode_header_value
from retrain.domain.runs import now_iso
from retrain_local import eventarc

DATA_SUFFIXES = (".txt", ".text", ".jsonl", ".parquet")
log = logging.getLogger(__name__)


def finalized_event(resource: dict[str, Any]) -> tuple[dict[str, str], bytes]:
    """Headers and body of an Eventarc ``object.v1.finalized`` CloudEvent for a GCS object resource.

    The id is derived from (bucket, name, generation): a redelivery of the same finalize has the same id.
    """
    bucket, name, generation = resource["bucket"], resource["name"], str(resource["generation"])
    event_id = str(int(hashlib.sha256(f"{bucket}/{name}#{generation}".encode()).hexdigest()[:15], 16))
    headers = {
        "ce-specversion": "1.0",
        "ce-id": event_id,
        "ce-source": GCS_SOURCE_PREFIX + bucket,
        "ce-type": GCS_FINALIZED,
        "ce-subject": encode_header_value(f"objects/{name}"),
        "ce-time": resource.get("updated") or now_iso(),
        "content-type": "application/json; charset=utf-8",
    }
    return headers, json.dumps(resource).encode()


def upload(local: Path | bytes, uri: str) -> dict[str, Any]:
    """Upload a file (or bytes) and return its GCS resource (what the finalize event carries)."""
    from google.api_core.exceptions import NotFound

    bucket, name = objects.split_gs(uri)
    blob = objects.storage_client().bucket(bucket).blob(name)
    if isinstance(local, bytes):
        blob.upload_from_string(local)
    else:
        blob.upload_from_filename(str(local))
    # every version purged by another writer right after the upload: the upload's answer stands
    with contextlib.suppress(NotFound):
        blob.reload()
    return dict(blob._properties)


def data_files(paths: Iterable[Path]) -> list[Path]:
    """Files to drop: the given files, and the data files inside given folders, in name order."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in DATA_SUFFIXES)
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return out


@dataclass
class Dropped:
    """What a drop did: the objects uploaded, and how many of their events wait for redelivery."""

    uris: list[str] = field(default_factory=list)
    queued: int = 0


def announce(settings: Settings, function_url: str, resource: dict[str, Any]) -> bool:
    """Deliver an object's finalize event as Eventarc does: now, or (when the function does not take it)
    by the stack's redelivery loop; True when delivered now."""
    headers, body = finalized_event(resource)
    status = eventarc.post(function_url, headers, body)
    if 200 <= status < 300:
        return True
    log.warning("%s: the function answered %d; queued for redelivery", resource.get("name"), status)
    eventarc.enqueue(settings.project, headers, body)
    return False


def check_dataset(settings: Settings, dataset: str | None) -> None:
    """The function's rule for a dataset folder, checked before anything is uploaded: ValueError."""
    if dataset is not None and not is_dataset_name(dataset):
        raise ValueError(f"{dataset!r} is not a valid dataset name ({DATASET_RULE})")


def drop(
    settings: Settings,
    function_url: str,
    files: list[Path],
    *,
    dataset: str | None = None,
    seal: bool = True,
    progress: Callable[[str], None] = lambda _: None,
) -> Dropped:
    """Upload files to the landing bucket, announce their events, then (by default) the seal marker's.
    ValueError before anything is uploaded for a dataset or a file name the function would refuse."""
    check_dataset(settings, dataset)
    prefix = settings.landing_prefix + (f"{dataset}/" if dataset else "")
    for path in files:
        try:
            check_object_name(prefix + path.name)
        except Rejected as e:
            raise ValueError(f"{path.name}: {e.reason}") from None
    out = Dropped()
    for i, path in enumerate(files, 1):
        uri = f"gs://{settings.landing_bucket}/{prefix}{path.name}"
        delivered = announce(settings, function_url, upload(path, uri))
        out.uris.append(uri)
        out.queued += not delivered
        note = "" if delivered else " (the function did not answer: queued for redelivery)"
        progress(f"dropped {i}/{len(files)}: {path.name} ({path.stat().st_size / 1e6:.2f} MB){note}")
    if seal:
        marker = f"gs://{settings.landing_bucket}/{prefix}{settings.seal_marker}"
        delivered = announce(settings, function_url, upload(b"", marker))
        out.queued += not delivered
        progress(f"sealed with {settings.seal_marker}" + ("" if delivered else " (queued for redelivery)"))
    return out
