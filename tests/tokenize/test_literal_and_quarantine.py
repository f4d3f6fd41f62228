"""A run's objects are read as named and as they were: names are literal (never patterns), each object is
read at its generation (or, once that is gone, at the generation holding the same bytes now), and one
bad object is set aside with its reason while the others are tokenized (against gcp-storage-emulator,
which answers a gone generation with 404 as Cloud Storage does)."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import corpus_documents

from retrain.adapters import objects
from retrain.domain.events import ObjectVersion
from retrain_tokenize import tokenize_incremental
from retrain_tokenize.options import TokenizeOptions

NAMES = ["a[1].jsonl", "b*.jsonl", "c?.jsonl", "d e.jsonl", "é-ü.jsonl", "数据.jsonl"]

pytestmark = pytest.mark.integration  # the Cloud Storage emulator, a process


def _write(uri: str, data: bytes) -> ObjectVersion:
    """Write ``data`` and return the version as the ledger records its arrival (with its content hash)."""
    objects.write_bytes(uri, data)
    info = objects.stat(uri)
    return ObjectVersion(uri, int(info.generation or 0), info.size, f"md5:{info.md5_hash}:jsonl")


def test_any_name_gcs_accepts_is_read_literally_at_its_generation(gcs_emulator: str) -> None:
    docs = corpus_documents(max_bytes=12_000)
    versions = [
        _write(
            f"{gcs_emulator}/landing/{name}",
            "".join(json.dumps({"text": f"{i} {d}"}) + "\n" for d in docs[:3]).encode(),
        )
        for i, name in enumerate(NAMES)
    ]
    # a pattern-looking name must not pull in its neighbours: a decoy it would match as a glob
    objects.write_bytes(f"{gcs_emulator}/landing/bX.jsonl", b'{"text": "never read"}\n')
    report = tokenize_incremental([], f"{gcs_emulator}/shards", pinned=versions)
    assert [s["object"] for s in report["shards"]] == [v.uri for v in versions]
    assert report["documents"] == 3 * len(NAMES) == report["input_records"] and report["quarantined"] == 0
    assert report["quarantined_objects"] == []


def test_an_object_overwritten_after_it_arrived_is_set_aside_not_read(gcs_emulator: str) -> None:
    first = _write(f"{gcs_emulator}/landing/changing.jsonl", b'{"text": "the bytes that arrived"}\n')
    good = _write(f"{gcs_emulator}/landing/steady.jsonl", b'{"text": "steady"}\n')
    objects.write_bytes(first.uri, b'{"text": "other bytes, written later"}\n')  # a new generation
    pinned = tokenize_incremental([], f"{gcs_emulator}/shards-pinned", pinned=[first, good])
    (changed,) = pinned["quarantined_objects"]
    assert changed["object"] == first.uri and changed["reason"] == "object_changed"
    assert f"generation {first.generation}" in changed["detail"]
    assert [s["object"] for s in pinned["shards"]] == [good.uri] and pinned["documents"] == 1


def test_the_same_bytes_uploaded_again_are_read_at_their_new_generation(gcs_emulator: str) -> None:
    """A folder synced twice: the recorded generation is gone, the object holds the same bytes again."""
    body = b'{"text": "synced twice"}\n'
    first = _write(f"{gcs_emulator}/landing/synced.jsonl", body)
    again = _write(first.uri, body)  # a new generation, identical bytes
    assert again.generation != first.generation
    report = tokenize_incremental([], f"{gcs_emulator}/shards-synced", pinned=[first])
    assert report["quarantined_objects"] == []
    (shard,) = report["shards"]
    assert (shard["object"], shard["generation"], shard["documents"]) == (first.uri, first.generation, 1)


def test_two_generations_of_one_name_are_two_inputs(gcs_emulator: str) -> None:
    """Both versions of a name a run holds are accounted for: the one still there is read, the one gone
    (other bytes now) is set aside with its reason, never silently folded into the other."""
    old = _write(f"{gcs_emulator}/landing/twice.jsonl", b'{"text": "old"}\n')
    new = _write(old.uri, b'{"text": "new"}\n{"text": "newer"}\n')
    report = tokenize_incremental([], f"{gcs_emulator}/shards-twice", pinned=[old, new])
    (gone,) = report["quarantined_objects"]
    assert (gone["generation"], gone["reason"]) == (old.generation, "object_changed")
    (read,) = report["shards"]
    assert (read["generation"], read["documents"]) == (new.generation, 2)


def _parquet(rows: list[str]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": rows}), buf, compression="zstd")
    return buf.getvalue()


def test_a_mislabelled_parquet_and_a_decompression_bomb_are_quarantined_the_rest_trains(
    gcs_emulator: str,
) -> None:
    good = _write(f"{gcs_emulator}/mixed/good.jsonl", b'{"text": "one"}\n{"text": "two"}\n')
    fine = _write(f"{gcs_emulator}/mixed/fine.parquet", _parquet(["three", "four", "five"]))
    liar = _write(f"{gcs_emulator}/mixed/liar.parquet", b'{"text": "I am JSON, not Parquet"}\n')
    bomb_bytes = _parquet(["x" * 2_000_000] * 4)  # 8 MB of pages in a few KB
    bomb = _write(f"{gcs_emulator}/mixed/bomb.parquet", bomb_bytes)
    assert len(bomb_bytes) < 100_000
    report = tokenize_incremental(
        [],
        f"{gcs_emulator}/shards-mixed",
        TokenizeOptions(max_decompressed_bytes=1_000_000),
        pinned=[good, fine, liar, bomb],
    )
    reasons = {q["object"]: q["reason"] for q in report["quarantined_objects"]}
    assert reasons == {liar.uri: "unreadable", bomb.uri: "decompressed_too_large"}
    detail = {q["object"]: q["detail"] for q in report["quarantined_objects"]}
    assert "not a Parquet file" in detail[liar.uri] and "> max 1000000" in detail[bomb.uri]
    assert [s["object"] for s in report["shards"]] == [good.uri, fine.uri]
    assert report["documents"] == 5 and report["input_records"] == report["documents"] + report["quarantined"]


def _one_value_repeated(rows: int, size: int) -> bytes:
    """Parquet of ``rows`` rows holding one ``size``-byte string: dictionary-encoded (pyarrow's default),
    the value is stored once however many rows repeat it."""
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": ["x" * size] * rows}), buf, compression="zstd")
    return buf.getvalue()


def _encoded(table: pa.Table, **options: object) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, **options)  # type: ignore[arg-type]
    return buf.getvalue()


def test_no_encoding_can_hide_what_a_parquet_object_decodes_to(gcs_emulator: str) -> None:
    """200 rows of one 1 MiB string are a file of a few hundred bytes whose footer says about 1 MiB,
    whether the value is dictionary-encoded (pyarrow's default, or a dictionary-typed column) or
    prefix-compressed (DELTA_BYTE_ARRAY): each passed a 2 MiB limit, then 200 MiB of documents were built
    and tokenized.  Counted as decoded, each is set aside whole; the object beside them trains."""
    good = _write(f"{gcs_emulator}/dict/good.jsonl", b'{"text": "fine"}\n')
    values = ["x" * (1 << 20)] * 200
    bombs = {
        "repeated.parquet": _one_value_repeated(200, 1 << 20),
        "typed.parquet": _encoded(
            pa.table({"text": pa.array(values).dictionary_encode()}), compression="zstd"
        ),
        "delta.parquet": _encoded(
            pa.table({"text": values}),
            use_dictionary=False,
            column_encoding={"text": "DELTA_BYTE_ARRAY"},
            compression="zstd",
        ),
    }
    written = []
    for name, data in bombs.items():
        footer = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0).total_byte_size
        assert len(data) < 2_000 and footer < 2 << 20, name  # what the footer alone lets through
        written.append(_write(f"{gcs_emulator}/dict/{name}", data))
    report = tokenize_incremental(
        [],
        f"{gcs_emulator}/shards-dict",
        TokenizeOptions(max_decompressed_bytes=2 << 20),
        pinned=[good, *written],
    )
    reasons = {q["object"]: q["reason"] for q in report["quarantined_objects"]}
    assert reasons == {v.uri: "decompressed_too_large" for v in written}
    assert all("values decode to over" in q["detail"] for q in report["quarantined_objects"])
    assert [s["object"] for s in report["shards"]] == [good.uri] and report["documents"] == 1


def test_a_parquet_object_whose_pages_do_not_decode_is_set_aside_not_the_run(gcs_emulator: str) -> None:
    good = _write(f"{gcs_emulator}/corrupt/good.jsonl", b'{"text": "fine"}\n')
    data = bytearray(_encoded(pa.table({"text": [f"row {i} " * 50 for i in range(200)]}), compression="zstd"))
    data[8:40] = bytes(32)  # inside the first page; the footer at the end is intact
    assert pq.ParquetFile(io.BytesIO(bytes(data))).metadata.num_rows == 200
    broken = _write(f"{gcs_emulator}/corrupt/broken.parquet", bytes(data))
    report = tokenize_incremental([], f"{gcs_emulator}/shards-corrupt", pinned=[good, broken])
    (set_aside,) = report["quarantined_objects"]
    assert (set_aside["object"], set_aside["reason"]) == (broken.uri, "unreadable")
    assert "its pages do not decode" in set_aside["detail"]
    assert [s["object"] for s in report["shards"]] == [good.uri]


def test_rows_over_the_document_limit_are_quarantined_without_being_built(gcs_emulator: str) -> None:
    """Within the object's limit, each row too large is quarantined with an excerpt and counted (input =
    written + quarantined); the rows are sized from the dictionary, never built whole."""
    rows = _one_value_repeated(40, 1 << 20)
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": ["small one", "small two"]}), buf)
    mixed = _write(f"{gcs_emulator}/dict/mixed.parquet", rows)
    small = _write(f"{gcs_emulator}/dict/small.parquet", buf.getvalue())
    report = tokenize_incremental(
        [],
        f"{gcs_emulator}/shards-rows",
        TokenizeOptions(max_document_bytes=512 << 10),
        pinned=[mixed, small],
    )
    assert report["quarantine_reasons"] == {"too_large": 40} and report["documents"] == 2
    assert report["input_records"] == 42 == report["documents"] + report["quarantined"]
    assert report["quarantined_objects"] == []
