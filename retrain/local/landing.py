"""Dropping data into the local landing bucket, and the finalize CloudEvent that GCS would emit.

gcp-storage-emulator has no notifications, so after each upload the local stack posts the event
itself, shaped as Eventarc delivers it: binary content mode, ``ce-*`` headers, and the object's GCS
JSON resource (StorageObjectData) as the body.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import requests

from retrain.adapters import objects
from retrain.config import Settings
from retrain.domain.events import GCS_FINALIZED, GCS_SOURCE_PREFIX
from retrain.domain.runs import now_iso

DATA_SUFFIXES = (".txt", ".text", ".jsonl", ".parquet")


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
        "ce-subject": f"objects/{name}",
        "ce-time": resource.get("updated") or now_iso(),
        "content-type": "application/json; charset=utf-8",
    }
    return headers, json.dumps(resource).encode()


def post_event(function_url: str, headers: dict[str, str], body: bytes) -> None:
    resp = requests.post(function_url, headers=headers, data=body, timeout=60)
    if resp.status_code >= 300:
        raise RuntimeError(f"function answered {resp.status_code}: {resp.text[:500]}")


def upload(local: Path | bytes, uri: str) -> dict[str, Any]:
    """Upload a file (or bytes) and return its GCS resource (what the finalize event carries)."""
    bucket, name = objects.split_gs(uri)
    blob = objects.storage_client().bucket(bucket).blob(name)
    if isinstance(local, bytes):
        blob.upload_from_string(local)
    else:
        blob.upload_from_filename(str(local))
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


def drop(
    settings: Settings,
    function_url: str,
    files: list[Path],
    *,
    dataset: str | None = None,
    seal: bool = True,
    progress: Callable[[str], None] = lambda _: None,
) -> list[str]:
    """Upload files to the landing bucket, emit their events, then (by default) the seal marker's."""
    prefix = settings.landing_prefix + (f"{dataset}/" if dataset else "")
    uris = []
    for i, path in enumerate(files, 1):
        uri = f"gs://{settings.landing_bucket}/{prefix}{path.name}"
        post_event(function_url, *finalized_event(upload(path, uri)))
        uris.append(uri)
        progress(f"dropped {i}/{len(files)}: {path.name} ({path.stat().st_size / 1e6:.2f} MB)")
    if seal:
        marker = f"gs://{settings.landing_bucket}/{prefix}{settings.seal_marker}"
        post_event(function_url, *finalized_event(upload(b"", marker)))
        progress(f"sealed with {settings.seal_marker}")
    return uris
