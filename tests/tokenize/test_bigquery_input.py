"""bq://project.dataset.table as a tokenizer input, against the BigQuery emulator (optional tier):
exported, then read like a JSONL file, with the same bytes, quarantine and incremental reuse."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from conftest import corpus_documents, megatron_bytes, read_pair

from retrain.adapters.warehouse import BigQueryWarehouse
from retrain_tokenize import tokenize_incremental, tokenize_to_prefix
from retrain_tokenize.cli import main as tokenize_main
from retrain_tokenize.options import TokenizeOptions
from retrain_tokenize.tables import table_of

pytestmark = pytest.mark.emulators


@pytest.fixture
def table(bigquery_host: str) -> tuple[str, list[str]]:
    """A fresh table of documents, with one row whose text is NULL and one whose text is empty."""
    from google.cloud import bigquery

    w = BigQueryWarehouse("books")
    dataset = f"d{uuid.uuid4().hex[:8]}"
    w.client.create_dataset(dataset)
    name = f"books.{dataset}.pages"
    schema = [bigquery.SchemaField("id", "INT64"), bigquery.SchemaField("text", "STRING")]
    w.client.create_table(bigquery.Table(name, schema=schema))
    docs = corpus_documents(max_bytes=20_000)
    rows = [{"id": i, "text": t} for i, t in enumerate(docs)] + [
        {"id": -1, "text": None},
        {"id": -2, "text": ""},
    ]
    assert w.client.insert_rows_json(name, rows) == []
    return name, docs


def test_a_table_tokenizes_to_the_bytes_of_its_documents(
    table: tuple[str, list[str]], gpt2, tmp_path: Path
) -> None:
    name, docs = table
    report = tokenize_to_prefix([f"bq://{name}"], str(tmp_path / "pages"), TokenizeOptions(workers=2))
    assert report["input_records"] == len(docs) + 2
    assert (report["documents"], report["quarantined"]) == (len(docs), 2)  # NULL and "" quarantined
    assert report["tables"][f"bq://{name}"]["rows"] == len(docs) + 2
    assert read_pair(tmp_path / "pages_text_document") == megatron_bytes([gpt2.encode(t).ids for t in docs])
    reasons = [
        json.loads(line)["reason"] for line in (tmp_path / "pages_quarantine.jsonl").read_text().splitlines()
    ]
    assert sorted(reasons) == ["empty_text", "not_a_string"]
    assert not list(tmp_path.glob("pages_tmp*/**/*.jsonl"))  # the staged export is cleaned up


def test_an_unchanged_table_reuses_its_shard(table: tuple[str, list[str]], tmp_path: Path) -> None:
    name, docs = table
    root = str(tmp_path / "shards")
    first = tokenize_incremental([f"bq://{name}"], root)
    again = tokenize_incremental([f"bq://{name}"], root)
    assert [s["reused"] for s in first["shards"]] == [False]
    assert [s["reused"] for s in again["shards"]] == [True] and again["shards"][0]["object"] == f"bq://{name}"
    assert again["documents"] == len(docs)


def test_bad_table_uris_and_missing_tables_are_clear_errors(
    bigquery_host: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "x")
    assert tokenize_main(["bq://not-a-table", "--output-prefix", out]) == 1
    assert "is not bq://project.dataset.table" in capsys.readouterr().err
    assert tokenize_main(["bq://books.nowhere.none", "--output-prefix", out]) == 1
    assert "retrain tokenize: error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("uri", "project"),
    [("bq://books.lib.shelf", "books"), ("bq://example.com:books.lib.shelf-1", "example.com:books")],
)
def test_a_table_uri_names_the_project_that_pays_for_its_export(uri: str, project: str) -> None:
    assert table_of(uri) == (project, uri.removeprefix("bq://"))


@pytest.mark.parametrize(
    "uri", ["bq://books.lib", "gs://books.lib.shelf", "bq://Books.lib.shelf", "bq://b.l.s/x"]
)
def test_anything_else_is_not_a_table(uri: str) -> None:
    with pytest.raises(ValueError, match=r"is not bq://project\.dataset\.table"):
        table_of(uri)
