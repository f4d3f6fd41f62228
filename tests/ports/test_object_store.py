"""The ObjectStore port's behaviour, one suite for the in-memory fake (unit tier) and the real adapter,
``retrain.adapters.objects``, on the storage emulator (integration tier): what the fake promises is
what Cloud Storage does, so a test on the fake cannot pass on something GCS refuses.

Sources: cloud.google.com/storage/docs/request-preconditions (``ifGenerationMatch``, 0: no live
version, a 412 otherwise), cloud.google.com/storage/docs/object-versioning (noncurrent versions),
cloud.google.com/storage/docs/json_api/v1/objects (``md5Hash``: base64 of the MD5; a list in
lexicographic order of names).
"""

from __future__ import annotations

import base64
import hashlib
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from fakes.objects import InMemoryObjects

from retrain.adapters import objects
from retrain.ports import ObjectChanged, ObjectInfo, ObjectStore


@dataclass(frozen=True)
class Buckets:
    """A store, and two fresh buckets in it: one plain, one that keeps versions."""

    store: ObjectStore
    plain: str
    versioned: str


def _in_memory() -> Buckets:
    plain, versioned = "plain", "versioned"
    return Buckets(InMemoryObjects(buckets=[plain], versioned=[versioned]), plain, versioned)


def _gcs(request: pytest.FixtureRequest) -> Buckets:
    request.getfixturevalue("gcs_host")
    client = objects.storage_client()
    plain, versioned = f"plain-{uuid.uuid4().hex[:10]}", f"versioned-{uuid.uuid4().hex[:10]}"
    client.create_bucket(plain)
    keeping = client.bucket(versioned)
    keeping.versioning_enabled = True
    client.create_bucket(keeping)
    return Buckets(objects, plain, versioned)  # the module is the adapter


@pytest.fixture(
    params=[
        pytest.param(lambda request: _in_memory(), id="in-memory"),
        pytest.param(_gcs, id="gcs-emulator", marks=pytest.mark.emulators),
    ]
)
def buckets(request: pytest.FixtureRequest) -> Buckets:
    make: Callable[[pytest.FixtureRequest], Buckets] = request.param
    return make(request)


def md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def test_a_write_is_read_back_with_its_generation_size_and_md5(buckets: Buckets) -> None:
    store, uri = buckets.store, f"gs://{buckets.plain}/runs/r1/objects.json"
    generation = store.write_bytes(uri, b'{"objects": []}', "application/json")
    assert isinstance(generation, int) and generation > 0
    assert store.read_bytes(uri) == b'{"objects": []}'
    assert store.read_bytes(uri, generation) == b'{"objects": []}'
    info = store.stat(uri)
    assert (info.uri, info.size, info.generation, info.md5_hash) == (
        uri,
        15,
        generation,
        md5(b'{"objects": []}'),
    )
    assert info.updated is not None
    assert store.stat(uri, generation) == info


def test_what_is_not_there_is_file_not_found(buckets: Buckets) -> None:
    store, uri = buckets.store, f"gs://{buckets.plain}/nothing"
    for absent in (lambda: store.read_bytes(uri), lambda: store.stat(uri), lambda: store.delete(uri)):
        with pytest.raises(FileNotFoundError):
            absent()
    generation = store.write_bytes(uri, b"x")
    assert generation is not None
    with pytest.raises(FileNotFoundError):
        store.read_bytes(uri, generation + 1)  # a generation that never was: a 404, never the live bytes


def test_of_racing_create_only_writers_exactly_one_wins(buckets: Buckets) -> None:
    store, uri = buckets.store, f"gs://{buckets.plain}/runs/r1/objects.json"

    def create(i: int) -> int | None:
        try:
            store.write_bytes(uri, b"%d" % i, if_generation_match=0)
        except ObjectChanged:
            return None
        return i

    with ThreadPoolExecutor(8) as pool:
        won = [i for i in pool.map(create, range(24)) if i is not None]
    assert len(won) == 1 and store.read_bytes(uri) == b"%d" % won[0]


def test_a_write_conditioned_on_a_generation_that_is_not_live_writes_nothing(buckets: Buckets) -> None:
    store, uri = buckets.store, f"gs://{buckets.plain}/manifest"
    first = store.write_bytes(uri, b"one")
    assert first is not None
    with pytest.raises(ObjectChanged):
        store.write_bytes(uri, b"stale", if_generation_match=first + 1)
    with pytest.raises(ObjectChanged):
        store.write_bytes(uri, b"again", if_generation_match=0)
    assert store.read_bytes(uri) == b"one" and store.stat(uri).generation == first
    second = store.write_bytes(uri, b"two", if_generation_match=first)
    assert second is not None and second != first
    assert store.read_bytes(uri) == b"two"
    with pytest.raises(ObjectChanged):
        store.write_bytes(uri, b"late", if_generation_match=first)  # the writer that read "one"


def test_a_listing_is_every_object_under_the_prefix_in_name_order(buckets: Buckets) -> None:
    store, root = buckets.store, f"gs://{buckets.plain}"
    names = ["incoming/b.txt", "incoming/a.txt", "incoming/sub/c.txt", "incomingx/d.txt", "other/e.txt"]
    for name in names:
        store.write_bytes(f"{root}/{name}", name.encode())
    listed = list(store.list_objects(f"{root}/incoming/"))
    assert [o.uri for o in listed] == [f"{root}/incoming/{n}" for n in ("a.txt", "b.txt", "sub/c.txt")]
    assert [(o.size, o.md5_hash) for o in listed] == [
        (len(n), md5(n.encode())) for n in ("incoming/a.txt", "incoming/b.txt", "incoming/sub/c.txt")
    ]
    assert [o.uri for o in store.list_objects(f"{root}/incoming")] == [
        f"{root}/incoming/{n}" for n in ("a.txt", "b.txt", "sub/c.txt")
    ] + [f"{root}/incomingx/d.txt"]
    store.delete(f"{root}/incoming/b.txt")
    assert [o.uri for o in store.list_objects(f"{root}/incoming/")] == [
        f"{root}/incoming/a.txt",
        f"{root}/incoming/sub/c.txt",
    ]


def test_hundreds_of_objects_list_whole(buckets: Buckets) -> None:
    """Past one page of a listing (the fake has none; the real client pages)."""
    store, root = buckets.store, f"gs://{buckets.plain}/many"
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: store.write_bytes(f"{root}/{i:04d}", b"%d" % i), range(300)))
    listed = list(store.list_objects(f"{root}/"))
    assert [o.uri for o in listed] == [f"{root}/{i:04d}" for i in range(300)]


def test_a_versioned_bucket_keeps_what_was_overwritten_or_deleted(buckets: Buckets) -> None:
    store, uri = buckets.store, f"gs://{buckets.versioned}/runs/r1/objects.json"
    first = store.write_bytes(uri, b"first")
    second = store.write_bytes(uri, b"second")
    assert first is not None and second is not None
    assert (store.read_bytes(uri), store.read_bytes(uri, first)) == (b"second", b"first")
    assert store.stat(uri, first).size == 5

    def versions() -> list[tuple[str, int | None]]:
        return sorted(
            (o.uri, o.generation) for o in store.list_objects(f"gs://{buckets.versioned}/runs/", True)
        )

    assert versions() == sorted([(uri, first), (uri, second)])
    assert [o.generation for o in store.list_objects(f"gs://{buckets.versioned}/runs/")] == [second]
    store.delete(uri)
    with pytest.raises(FileNotFoundError):
        store.read_bytes(uri)
    assert list(store.list_objects(f"gs://{buckets.versioned}/runs/")) == []
    assert store.read_bytes(uri, second) == b"second" and versions() == sorted([(uri, first), (uri, second)])
    third = store.write_bytes(uri, b"third", if_generation_match=0)  # no live version: a create holds
    assert third is not None and store.read_bytes(uri) == b"third"


def test_a_plain_bucket_keeps_only_the_live_version(buckets: Buckets) -> None:
    store, uri = buckets.store, f"gs://{buckets.plain}/runs/r1/objects.json"
    first = store.write_bytes(uri, b"first")
    store.write_bytes(uri, b"second")
    assert first is not None
    with pytest.raises(FileNotFoundError):
        store.read_bytes(uri, first)
    listed: list[ObjectInfo] = list(store.list_objects(f"gs://{buckets.plain}/runs/", True))
    assert [o.uri for o in listed] == [uri]
