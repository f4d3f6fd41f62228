"""Objects by URI: ``gs://bucket/name`` through the real GCS client, or a plain local path.

The GCS client honours ``STORAGE_EMULATOR_HOST``, so the cloud and the local emulator differ only by
endpoint.  Local paths exist so that the same jobs (tokenize, train) run on files a user points at.

Against the emulator a caller presents who it is as it would to Google, as a bearer token
(``retrain.adapters.credentials``), which the local stack's storage front checks against infra/'s IAM
(``retrain_local.storage_front``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

from google.api_core.exceptions import NotFound, PreconditionFailed

from retrain.adapters import credentials
from retrain.ports import ObjectChanged, ObjectInfo

GS = "gs://"


def is_gcs(uri: str) -> bool:
    return uri.startswith(GS)


def split_gs(uri: str) -> tuple[str, str]:
    """``gs://b/a/c`` -> ``("b", "a/c")``; raises ValueError on anything else."""
    if not is_gcs(uri):
        raise ValueError(f"not a gs:// URI: {uri!r}")
    bucket, _, name = uri[len(GS) :].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}")
    return bucket, name


def join(base: str, *parts: str) -> str:
    """Join URI or path segments with single slashes."""
    out = base.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


@lru_cache(maxsize=16)
def _client(emulator: str | None, project: str | None, token: str | None = None) -> Any:
    from google.cloud import storage  # type: ignore[attr-defined]

    if emulator:
        from google.auth.credentials import AnonymousCredentials
        from google.oauth2.credentials import Credentials

        creds = Credentials(token) if token else AnonymousCredentials()
        return storage.Client(project=project or "local", credentials=creds)
    return storage.Client(project=project)


def storage_client() -> Any:
    """A GCS client for the current environment (emulator when STORAGE_EMULATOR_HOST is set, presenting
    this caller's local identity)."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    token = credentials.local_token() if emulator else None
    return _client(emulator, os.environ.get("GOOGLE_CLOUD_PROJECT"), token)


def _blob(uri: str, generation: int | None = None) -> Any:
    bucket, name = split_gs(uri)
    return storage_client().bucket(bucket).blob(name, generation=generation)


def read_bytes(uri: str, generation: int | None = None) -> bytes:
    """The object's bytes (of ``generation`` exactly, when given); FileNotFoundError when there is no
    such object or version (GCS's 404 included)."""
    if is_gcs(uri):
        try:
            return bytes(_blob(uri, generation).download_as_bytes())
        except NotFound:
            raise FileNotFoundError(
                f"no object {uri}" + (f" at generation {generation}" if generation else "")
            ) from None
    return Path(uri).read_bytes()


def open_read(uri: str, generation: int | None = None) -> IO[bytes]:
    """A streaming reader (of ``generation`` exactly, when given; local files have none): memory stays
    bounded by the buffer, not the object."""
    if is_gcs(uri):
        return _blob(uri, generation).open("rb")
    return open(uri, "rb")


def chunks(reader: IO[bytes], size: int) -> Iterator[bytes]:
    """A reader's bytes from where it stands, ``size`` at a time, ending at the first short read.

    A short read is the end for both readers ``open_read`` returns (a ranged download of an object
    answers with less than the range only at its end), and asking again would cost a Cloud Storage
    reader one more request, answered 416 (google-cloud-storage's ``fileio.BlobReader.read``): one
    round trip more for every object read to its end."""
    while chunk := reader.read(size):
        yield chunk
        if len(chunk) < size:
            return


def write_bytes(
    uri: str,
    data: bytes,
    content_type: str = "application/octet-stream",
    if_generation_match: int | None = None,
) -> int | None:
    """Writes the object whole; its new generation (a local file has none: None).  With
    ``if_generation_match``, only while the live version is that generation, 0 meaning none is live
    (cloud.google.com/storage/docs/request-preconditions: a 412 otherwise): ObjectChanged when not."""
    if is_gcs(uri):
        blob = _blob(uri)
        try:
            blob.upload_from_string(data, content_type=content_type, if_generation_match=if_generation_match)
        except PreconditionFailed:
            raise ObjectChanged(f"{uri} is not at generation {if_generation_match}") from None
        return int(blob.generation)
    path = Path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # one per writer
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp = Path(name)
    if if_generation_match == 0:  # a local file's "generation" is its mtime: 0 is "no such file"
        try:
            os.link(tmp, path)  # atomic, and refused where the name exists
        except FileExistsError:
            raise ObjectChanged(f"{uri} exists") from None
        finally:
            tmp.unlink()
        return None
    if if_generation_match is not None and (
        not path.exists() or path.stat().st_mtime_ns != if_generation_match
    ):
        tmp.unlink()
        raise ObjectChanged(f"{uri} is not at generation {if_generation_match}")
    tmp.replace(path)
    return None


def split_generation(uri: str) -> tuple[str, int | None]:
    """``gs://BUCKET/OBJECT#GENERATION`` (Cloud Storage's notation for one version of an object,
    cloud.google.com/storage/docs/object-versioning) as the URI and the generation; a URI without the
    suffix as itself and None."""
    base, sep, tail = uri.rpartition("#")
    if is_gcs(uri) and sep and tail.isdigit():
        return base, int(tail)
    return uri, None


@contextmanager
def open_write(uri: str, content_type: str = "application/octet-stream") -> Iterator[IO[bytes]]:
    """A streaming writer; the object appears only when the block completes, and not if it raises."""
    if is_gcs(uri):
        with _blob(uri).open("wb", ignore_flush=True, content_type=content_type) as gf:
            yield gf
        return
    path = Path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def delete(uri: str) -> None:
    """Deletes the object's live version (kept as a noncurrent version in a versioned bucket);
    FileNotFoundError when there is none (GCS's 404).  A local file that is gone is no error."""
    if is_gcs(uri):
        try:
            _blob(uri).delete()
        except NotFound:
            raise FileNotFoundError(f"no object {uri}") from None
    else:
        Path(uri).unlink(missing_ok=True)


def remove_tree(uri: str) -> None:
    """Every object under a prefix (a folder, locally)."""
    if is_gcs(uri):
        for u in list(list_uris(uri.rstrip("/") + "/")):
            delete(u)
    else:
        shutil.rmtree(uri, ignore_errors=True)


def upload_file(local: str | Path, uri: str) -> None:
    if is_gcs(uri):
        _blob(uri).upload_from_filename(str(local))
        return
    Path(uri).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(local, uri)


def download_file(uri: str, local: str | Path) -> None:
    Path(local).parent.mkdir(parents=True, exist_ok=True)
    if is_gcs(uri):
        _blob(uri).download_to_filename(str(local))
        return
    shutil.copyfile(uri, local)


def exists(uri: str) -> bool:
    if is_gcs(uri):
        return bool(_blob(uri).exists())
    return Path(uri).exists()


def stat(uri: str, generation: int | None = None) -> ObjectInfo:
    """Size, generation and md5 of the object (of ``generation`` exactly, when given); FileNotFoundError
    when there is no such object or version."""
    if is_gcs(uri):
        bucket, name = split_gs(uri)
        blob = storage_client().bucket(bucket).get_blob(name, generation=generation)
        if blob is None:
            raise FileNotFoundError(uri + (f" at generation {generation}" if generation else ""))
        return ObjectInfo(uri, int(blob.size or 0), blob.generation, blob.md5_hash, blob.updated)
    st = Path(uri).stat()
    return ObjectInfo(uri, st.st_size, st.st_mtime_ns)


def list_objects(prefix: str, versions: bool = False) -> Iterator[ObjectInfo]:
    """Every object under a prefix (a folder, locally), in name order, with its generation and md5; with
    ``versions``, the noncurrent versions a versioned bucket keeps too."""
    if is_gcs(prefix):
        bucket, name = split_gs(prefix)
        for blob in storage_client().list_blobs(bucket, prefix=name, versions=versions):
            yield ObjectInfo(
                f"{GS}{bucket}/{blob.name}", int(blob.size or 0), blob.generation, blob.md5_hash, blob.updated
            )
        return
    root = Path(prefix)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for p in files:
        st = p.stat()
        yield ObjectInfo(str(p), st.st_size, st.st_mtime_ns, updated=datetime.fromtimestamp(st.st_mtime, UTC))


def list_uris(prefix: str) -> Iterator[str]:
    """Every object under a prefix (a folder, locally), in name order."""
    return (o.uri for o in list_objects(prefix))
