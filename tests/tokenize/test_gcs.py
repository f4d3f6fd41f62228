"""gs:// round trip against gcp-storage-emulator: inputs, shards, reports and outputs in a bucket."""

from __future__ import annotations

import json

import pytest
from conftest import corpus_documents, megatron_bytes

from retrain.adapters import objects
from retrain_tokenize import tokenize_incremental, tokenize_to_prefix
from retrain_tokenize.options import TokenizeOptions

pytestmark = pytest.mark.integration  # the Cloud Storage emulator, a process


def _docs() -> list[str]:
    return corpus_documents(max_bytes=30_000)


def _jsonl(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in docs).encode()


def test_gs_prefix_with_glob_and_ranged_splits(gcs_emulator, gpt2):
    docs = _docs()
    half = len(docs) // 2
    objects.write_bytes(f"{gcs_emulator}/raw/p1.jsonl", _jsonl(docs[:half]))
    objects.write_bytes(f"{gcs_emulator}/raw/p2.jsonl", _jsonl(docs[half:]) + b"{broken\n")
    out = f"{gcs_emulator}/tok/corpus"
    report = tokenize_to_prefix(
        [f"{gcs_emulator}/raw/*.jsonl"], out, TokenizeOptions(workers=2, split_bytes=6_000)
    )
    assert report["documents"] == len(docs) and report["quarantined"] == 1
    want_bin, want_idx = megatron_bytes([gpt2.encode(t).ids for t in docs])
    assert objects.read_bytes(out + "_text_document.bin") == want_bin
    assert objects.read_bytes(out + "_text_document.idx") == want_idx
    q = [json.loads(x) for x in objects.read_bytes(out + "_quarantine.jsonl").decode().splitlines()]
    assert [(x["input"], x["reason"], x["line"]) for x in q] == [
        (f"{gcs_emulator}/raw/p2.jsonl", "invalid_json", len(docs) - half + 1)
    ]
    assert json.loads(objects.read_bytes(out + "_report.json"))["documents"] == len(docs)
    assert not [u for u in objects.list_uris(f"{gcs_emulator}/tok/") if "_tmp" in u]


def test_gs_incremental_round_trip(gcs_emulator, gpt2):
    docs = _docs()
    a, b = f"{gcs_emulator}/landing/a.jsonl", f"{gcs_emulator}/landing/b.txt"
    objects.write_bytes(a, _jsonl(docs[:5]))
    objects.write_bytes(b, docs[6].encode())
    root, rep = f"{gcs_emulator}/shards", f"{gcs_emulator}/reports/run1.json"
    first = tokenize_incremental([a], root, report_uri=rep)
    second = tokenize_incremental([a, b], root)
    assert [s["reused"] for s in second["shards"]] == [True, False]
    written = json.loads(objects.read_bytes(rep))
    assert written == {k: v for k, v in first.items() if k != "shards"}  # the report stays small
    assert json.loads(objects.read_bytes(written["shards_uri"])) == {
        "shards": first["shards"],
        "quarantined_objects": [],
    }
    for shard, texts in zip(second["shards"], [docs[:5], [docs[6]]], strict=True):
        fmt = "jsonl" if shard["object"].endswith(".jsonl") else "text"
        assert shard["data_prefix"].startswith(f"{root}/{fmt}-{shard['sha256']}/data")
        want_bin, want_idx = megatron_bytes([gpt2.encode(t).ids for t in texts])
        assert objects.read_bytes(shard["data_prefix"] + ".bin") == want_bin
        assert objects.read_bytes(shard["data_prefix"] + ".idx") == want_idx
    (pack,) = second["packs"]
    assert second["data_prefix_blend"] == [1.0, pack["data_prefix"]] and pack["written"]
    members = sorted(s["data_prefix"] for s in second["shards"])
    assert objects.read_bytes(pack["data_prefix"] + ".bin") == b"".join(
        objects.read_bytes(m + ".bin") for m in members
    )


def test_racing_writers_each_keep_their_generation(gcs_host):
    """Cloud Storage keeps every generation of a versioned bucket's object however many writers race on
    its name (32 droppers sealing at once each write the seal marker); the emulator must lose none."""
    from concurrent.futures import ThreadPoolExecutor

    client = objects.storage_client()
    bucket = client.create_bucket("racing-writers")
    bucket.versioning_enabled = True
    bucket.patch()
    writers = 32
    with ThreadPoolExecutor(writers) as pool:
        list(
            pool.map(lambda i: objects.write_bytes("gs://racing-writers/_SEALED", b"%d" % i), range(writers))
        )
    versions = list(client.list_blobs("racing-writers", versions=True))
    assert len(versions) == writers
    assert sorted(
        int(bucket.blob("_SEALED", generation=v.generation).download_as_bytes()) for v in versions
    ) == list(range(writers))


def test_preconditions_hold_as_on_cloud_storage(gcs_host: str) -> None:
    """cloud.google.com/storage/docs/request-preconditions: a write whose ifGenerationMatch (0: no live
    version) or ifMetagenerationMatch does not hold is a 412 and writes nothing; a NotMatch that does not
    hold is a 304 (a 412 where no live version exists).  Out of the box the emulator ignored them: of 16
    writers racing to create one name, every one "won"."""
    from concurrent.futures import ThreadPoolExecutor

    from google.api_core import exceptions

    from retrain.ports import ObjectChanged

    client = objects.storage_client()
    bucket = client.create_bucket("preconditions")
    bucket.versioning_enabled = True
    bucket.patch()
    uri = "gs://preconditions/runs/r1/objects.json"

    def create(i: int) -> tuple[int, int | None] | None:
        try:
            return i, objects.write_bytes(uri, b"%d" % i, if_generation_match=0)
        except ObjectChanged:
            return None

    with ThreadPoolExecutor(16) as pool:
        won = [w for w in pool.map(create, range(16)) if w is not None]
    assert len(won) == 1 and len(list(client.list_blobs("preconditions", versions=True))) == 1
    ((winner, generation),) = won
    assert generation is not None and objects.read_bytes(uri) == b"%d" % winner
    with pytest.raises(ObjectChanged):
        objects.write_bytes(uri, b"late", if_generation_match=generation + 1)
    again = objects.write_bytes(uri, b"next", if_generation_match=generation)
    assert again is not None and again != generation and objects.read_bytes(uri) == b"next"
    big = b"x" * (9 << 20)  # past the client's 8 MiB multipart limit: a resumable upload
    with pytest.raises(ObjectChanged):
        objects.write_bytes(uri, big, if_generation_match=0)
    assert objects.read_bytes(uri) == b"next"
    blob = bucket.blob("runs/r1/objects.json")
    with pytest.raises(exceptions.PreconditionFailed):
        blob.delete(if_generation_match=generation)
    with pytest.raises(exceptions.PreconditionFailed):
        bucket.copy_blob(blob, bucket, "runs/r1/objects.json", if_generation_match=0)
    live = bucket.get_blob("runs/r1/objects.json")
    assert live is not None and live.metageneration == 1
    live.metadata = {"k": "v"}
    with pytest.raises(exceptions.PreconditionFailed):
        live.patch(if_metageneration_match=7)
    unchanged = bucket.get_blob("runs/r1/objects.json")
    assert unchanged is not None and (unchanged.metadata, unchanged.metageneration) == (None, 1)
    with pytest.raises(exceptions.NotModified):
        live.patch(if_metageneration_not_match=1)
    live.patch(if_metageneration_match=1)  # holds: the patch applies
    patched = bucket.get_blob("runs/r1/objects.json")
    assert patched is not None and (patched.metadata, patched.metageneration) == ({"k": "v"}, 2)
    with pytest.raises(exceptions.PreconditionFailed):  # "If no live object exists, the precondition fails"
        bucket.blob("runs/r1/none.json").upload_from_string(b"x", if_generation_not_match=5)
    blob.delete(if_generation_match=again)
    with pytest.raises(FileNotFoundError):
        objects.stat(uri)
    assert objects.read_bytes(uri, generation) == b"%d" % winner  # kept: the bucket is versioned


def test_what_the_emulator_took_survives_its_stop_and_restart(tmp_path, monkeypatch):
    """The emulator writes its metadata behind the requests (a write costs the same in a full bucket): a
    stop (SIGTERM, as the stack stops it) still leaves every object and noncurrent version for the next
    start, however soon after the writes it comes."""
    from retrain_local import emulators
    from retrain_local.processes import start_on_a_free_port

    proc, host = start_on_a_free_port(lambda port: emulators.gcs(tmp_path, port))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
    client = objects.storage_client()
    bucket = client.create_bucket("kept-across-restarts")
    bucket.versioning_enabled = True
    bucket.patch()
    for i in range(300):
        objects.write_bytes(f"gs://kept-across-restarts/o/{i:03d}", b"%d" % i)
    objects.write_bytes("gs://kept-across-restarts/o/000", b"overwritten")
    proc.stop()  # at once: the last writes are at most one flush pause old (FLUSH_S, this small)
    proc, host = start_on_a_free_port(lambda port: emulators.gcs(tmp_path, port))
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
        names = [b.name for b in objects.storage_client().list_blobs("kept-across-restarts")]
        assert names == [f"o/{i:03d}" for i in range(300)]
        assert objects.read_bytes("gs://kept-across-restarts/o/299") == b"299"
        versions = list(
            objects.storage_client().list_blobs("kept-across-restarts", prefix="o/000", versions=True)
        )
        assert sorted(
            objects.read_bytes("gs://kept-across-restarts/o/000", int(v.generation)) for v in versions
        ) == [
            b"0",
            b"overwritten",
        ]
    finally:
        proc.stop()


def test_a_manifest_is_read_at_the_generation_its_run_started_with(gcs_host: str) -> None:
    """``--manifest gs://B/runs/R/objects.json#G`` (what the workflow passes: the generation Ingest.start
    wrote) reads that version: a rewrite of ``runs/`` afterwards (a writer of another run) changes nothing
    the run trains; where the bucket keeps no versions, the rewritten manifest is refused, never read."""
    from retrain.contracts import RunManifest
    from retrain.domain.events import ObjectVersion
    from retrain_tokenize.cli import read_manifest

    client = objects.storage_client()
    versioned = client.create_bucket("versioned-artifacts")
    versioned.versioning_enabled = True  # as infra/platform/storage.tf keeps the artifacts bucket
    versioned.patch()  # (as the local stack sets it: the emulator keeps only what a patch says)
    client.create_bucket("unversioned-artifacts")
    ours = RunManifest("r", "d", "b", "s", [ObjectVersion("gs://land/incoming/d/ours.txt", 7)]).to_json()
    forged = RunManifest("r", "d", "b", "s", [ObjectVersion("gs://land/incoming/d/forged.txt", 9)]).to_json()
    for bucket in ("versioned-artifacts", "unversioned-artifacts"):
        uri = f"gs://{bucket}/runs/r/objects.json"
        started = objects.write_bytes(uri, ours, "application/json")
        assert started == objects.stat(uri).generation
        assert objects.write_bytes(uri, forged, "application/json") != started  # rewritten after the start
        pinned = f"{uri}#{started}"
        if bucket == "versioned-artifacts":
            assert [o.uri for o in read_manifest(pinned).objects] == ["gs://land/incoming/d/ours.txt"]
        else:
            with pytest.raises(
                SystemExit, match="the manifest was replaced or deleted after its run started"
            ):
                read_manifest(pinned)
        assert [o.uri for o in read_manifest(uri).objects] == [
            "gs://land/incoming/d/forged.txt"
        ]  # unpinned: the latest


def test_only_a_numeric_suffix_of_a_gs_uri_names_a_generation() -> None:
    assert objects.split_generation("gs://b/runs/r/objects.json#123") == ("gs://b/runs/r/objects.json", 123)
    assert objects.split_generation("gs://b/a#b.txt") == ("gs://b/a#b.txt", None)
    assert objects.split_generation("/local/m.json#5") == ("/local/m.json#5", None)


@pytest.mark.parametrize("size", [0, 3, 4, 8, 9])
def test_a_cloud_storage_object_read_in_chunks_is_read_whole(gcs_emulator, size):
    """``objects.chunks`` ends at a short read: the Cloud Storage client's reader gives one only at the
    object's end, so every byte comes back, whether the size is a multiple of the chunk or not."""
    uri = f"{gcs_emulator}/chunks/{size}.bin"
    objects.write_bytes(uri, bytes(range(size)))
    with objects.open_read(uri) as f:
        assert b"".join(objects.chunks(f, 4)) == bytes(range(size))


def test_a_small_object_costs_its_shard_few_storage_requests(gcs_emulator, monkeypatch):
    """Every storage request of a run of small objects is a round trip, most of them one after another
    on the job's one local worker (the 2,000-object run spent 134 s tokenizing): a small object's ids
    travel in the pipeline's elements, not through a temporary object written, read and deleted; its
    bytes are read twice (hashed, then tokenized), each in one request; its shard's .bin is one upload."""
    import collections
    import re
    import urllib.parse

    import requests

    root, n = f"{gcs_emulator}/few-requests", 12
    names = [f"{root}/in/note-{i:02d}.txt" for i in range(n)]
    for i, uri in enumerate(names):
        objects.write_bytes(uri, f"note {i}: small and new".encode())
    asked: collections.Counter[tuple[str, str, str]] = collections.Counter()
    request = requests.Session.request

    def counted(self, method, url, *args, **kwargs):
        kind = "media" if "/download/" in url or "/upload/" in url else "json"
        name = urllib.parse.unquote(url.rsplit("/o/", 1)[-1].split("?")[0]) if "/o/" in url else ""
        asked[(method, kind, re.sub(r"[0-9a-f]{64}", "SHA", name.removeprefix("few-requests/")))] += 1
        return request(self, method, url, *args, **kwargs)

    monkeypatch.setattr(requests.Session, "request", counted)
    report = tokenize_incremental([f"{root}/in/"], f"{root}/shards")
    assert report["documents"] == n and len(report["packs"]) == 1
    assert not [k for k in asked if k[0] == "DELETE"], asked  # no temporary part
    for i in range(n):
        assert asked[("GET", "media", f"in/note-{i:02d}.txt")] == 2, asked
    # Uploads name their object in the body. Per object: its hash's index entry, its shard's .bin, .idx,
    # quarantine and report, each in one request; per run: the tokenizer's two files, the pack's .idx and
    # description, and its .bin streamed (a resumable upload: a POST, then a PUT).
    assert asked[("PUT", "media", "")] == 1, asked
    assert asked[("POST", "media", "")] == 5 * n + 5, asked
    shard = "shards/text-SHA/data"
    assert {k: v for k, v in asked.items() if k[2].startswith(shard)} == {
        ("GET", "media", f"{shard}_report.json"): 2 * n,  # none yet (the plan); then the one written
        ("GET", "json", f"{shard}_report.json"): n,  # the writer's: not written by a retried bundle
        ("GET", "media", f"{shard}_text_document.idx"): n,  # the pack's
        ("GET", "media", f"{shard}_text_document.bin"): n,
    }, asked
    named = sum(v for (_, _, name), v in asked.items() if name.startswith(("in/", "shards/_index/", shard)))
    assert named + 5 * n == 14 * n, asked  # 19 a small object before
