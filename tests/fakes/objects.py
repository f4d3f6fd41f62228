"""Cloud Storage in memory: :class:`retrain.ports.ObjectStore` as a bucket keeps objects.

What it keeps of Cloud Storage (``tests/ports/test_object_store.py`` holds it to
``retrain.adapters.objects`` on the storage emulator):

- every write makes a new generation; ``ifGenerationMatch`` (0: no live version) that does not hold
  writes nothing (cloud.google.com/storage/docs/request-preconditions);
- in a versioned bucket an overwritten or deleted live version stays, noncurrent, readable by its
  generation and listed with ``versions``; in any other bucket it is gone
  (cloud.google.com/storage/docs/object-versioning);
- ``md5Hash`` is the base64 of the content's MD5; listings come in name order.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from retrain.adapters.objects import split_gs
from retrain.ports import ObjectChanged, ObjectInfo


@dataclass(frozen=True)
class _Version:
    data: bytes
    generation: int
    updated: datetime

    def info(self, uri: str) -> ObjectInfo:
        md5 = base64.b64encode(hashlib.md5(self.data).digest()).decode()
        return ObjectInfo(uri, len(self.data), self.generation, md5, self.updated)


class InMemoryObjects:
    """Buckets of objects by ``gs://`` URI.  Thread-safe: concurrent writers race as they do on GCS."""

    def __init__(self, buckets: Iterable[str] = (), versioned: Iterable[str] = ()) -> None:
        self._versioned = set(versioned)
        self._buckets = set(buckets) | self._versioned
        self._live: dict[tuple[str, str], _Version] = {}
        self._noncurrent: dict[tuple[str, str], dict[int, _Version]] = {}
        # GCS generations are microsecond timestamps: increasing, never reused.
        self._generations = itertools.count(int(datetime.now(UTC).timestamp() * 1e6))
        self._lock = threading.Lock()

    def create_bucket(self, bucket: str, versioned: bool = False) -> None:
        with self._lock:
            self._buckets.add(bucket)
            if versioned:
                self._versioned.add(bucket)

    def _key(self, uri: str) -> tuple[str, str]:
        bucket, name = split_gs(uri)
        if bucket not in self._buckets:
            raise FileNotFoundError(f"no bucket {bucket!r}")
        return bucket, name

    def _version(self, uri: str, generation: int | None) -> _Version:
        key = self._key(uri)
        live = self._live.get(key)
        if generation is None or (live is not None and live.generation == generation):
            found = live
        else:
            found = self._noncurrent.get(key, {}).get(generation)
        if found is None:
            at = f" at generation {generation}" if generation else ""
            raise FileNotFoundError(f"no object {uri}{at}")
        return found

    def _retire(self, key: tuple[str, str]) -> None:
        """The live version of ``key`` goes: noncurrent in a versioned bucket, else for good."""
        live = self._live.pop(key, None)
        if live is not None and key[0] in self._versioned:
            self._noncurrent.setdefault(key, {})[live.generation] = live

    def read_bytes(self, uri: str, generation: int | None = None) -> bytes:
        with self._lock:
            return self._version(uri, generation).data

    def write_bytes(
        self,
        uri: str,
        data: bytes,
        content_type: str = "application/octet-stream",
        if_generation_match: int | None = None,
    ) -> int | None:
        with self._lock:
            key = self._key(uri)
            live = self._live.get(key)
            if if_generation_match is not None and (live.generation if live else 0) != if_generation_match:
                raise ObjectChanged(f"{uri} is not at generation {if_generation_match}")
            self._retire(key)
            version = _Version(bytes(data), next(self._generations), datetime.now(UTC))
            self._live[key] = version
            return version.generation

    def delete(self, uri: str) -> None:
        with self._lock:
            key = self._key(uri)
            if key not in self._live:
                raise FileNotFoundError(f"no object {uri}")
            self._retire(key)

    def stat(self, uri: str, generation: int | None = None) -> ObjectInfo:
        with self._lock:
            return self._version(uri, generation).info(uri)

    def list_objects(self, prefix: str, versions: bool = False) -> Iterator[ObjectInfo]:
        bucket, name = split_gs(prefix)
        with self._lock:
            self._key(prefix)
            found = [
                v.info(f"gs://{b}/{n}")
                for (b, n), v in self._live.items()
                if b == bucket and n.startswith(name)
            ]
            if versions:
                found += [
                    v.info(f"gs://{b}/{n}")
                    for (b, n), kept in self._noncurrent.items()
                    if b == bucket and n.startswith(name)
                    for v in kept.values()
                ]
        return iter(sorted(found, key=lambda o: (o.uri, o.generation or 0)))
