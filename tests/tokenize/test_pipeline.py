"""End to end through Beam (FnApiRunner): exact Megatron bytes, determinism, quarantine, formats."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import corpus_documents, megatron_bytes, read_pair, write_jsonl
from test_records import BAD_LINES, bad_jsonl

from retrain.adapters import objects
from retrain_tokenize import megatron, pipeline, tokenize_to_prefix
from retrain_tokenize.cli import main as cli_main
from retrain_tokenize.options import TokenizeOptions


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return corpus_documents()


def _tokenize_counting_parts(src: Path, out: Path, options: TokenizeOptions, inline_shard_bytes: int):
    """``tokenize_to_prefix`` with ``INLINE_SHARD_BYTES`` set; its report and the temporary part
    objects it wrote."""
    written: list[str] = []
    write = objects.write_bytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "INLINE_SHARD_BYTES", inline_shard_bytes)
        mp.setattr(objects, "write_bytes", lambda uri, *a, **k: written.append(uri) or write(uri, *a, **k))
        report = tokenize_to_prefix([str(src)], str(out), options)
    return report, [u for u in written if f"/{out.name}_tmp/" in u]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, docs):
    """The same JSONL with the default splits and batches, its ids carried in the parts' elements (a small
    shard), and with tiny ones (many parts), each part's ids through a temporary object (as a shard over
    ``INLINE_SHARD_BYTES`` does)."""
    d = tmp_path_factory.mktemp("runs")
    src = write_jsonl(d / "good.jsonl", docs)
    size = src.stat().st_size
    one, one_parts = _tokenize_counting_parts(src, d / "w1" / "out", TokenizeOptions(workers=1), size)
    assert one_parts == []
    tiny = TokenizeOptions(workers=2, split_bytes=7_000, batch_bytes=5_000)
    two, two_parts = _tokenize_counting_parts(src, d / "w2" / "out", tiny, size - 1)
    assert len(two_parts) >= size // 7_000, "a part per batch, at least one a split"
    return d, one, two


def test_exact_bytes_against_hand_packed_spec(runs, docs, gpt2):
    d, one, _ = runs
    expected = megatron_bytes([gpt2.encode(t).ids for t in docs])
    assert read_pair(d / "w1" / "out_text_document") == expected
    assert one["documents"] == len(docs) and one["quarantined"] == 0
    assert one["tokens"] == megatron.read(d / "w1" / "out_text_document").tokens
    assert one["input_records"] == len(docs) and one["bytes"] == (d / "good.jsonl").stat().st_size
    assert (d / "w1" / "out_quarantine.jsonl").read_bytes() == b""
    assert not list((d / "w1").glob("*_tmp*")), "temporary parts left behind"


def test_deterministic_across_splits_batches_and_part_transports(runs):
    d, one, two = runs
    assert read_pair(d / "w1" / "out_text_document") == read_pair(d / "w2" / "out_text_document")
    assert not list((d / "w2").glob("*_tmp*")), "temporary parts left behind"
    assert {k: one[k] for k in ("documents", "tokens")} == {k: two[k] for k in ("documents", "tokens")}


@pytest.mark.integration
def test_same_bytes_as_megatron_core_builder(runs, docs, gpt2, tmp_path):
    """Optional tier: Megatron-LM's own IndexedDatasetBuilder, fed as preprocess_data.py feeds it."""
    try:
        import numpy as np
        from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    except Exception as e:  # torch or megatron-core missing
        pytest.skip(
            f"megatron.core not importable ({type(e).__name__}: {e}); pip install --no-deps megatron-core"
        )
    d, _, _ = runs
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for text in docs:  # preprocess_data.Encoder.encode + --append-eod, one sentence per document
        ids = gpt2.encode(text).ids
        lens = [len(ids)] if ids else []
        if ids:
            ids.append(50256)
            lens[-1] += 1
        builder.add_document(ids, lens)
    builder.finalize(str(tmp_path / "ref.idx"))
    assert read_pair(d / "w1" / "out_text_document") == read_pair(tmp_path / "ref")
    ds = IndexedDataset(str(d / "w1" / "out_text_document"))
    assert len(ds) == len(docs) and list(ds[0][:2]) == gpt2.encode(docs[0]).ids[:2]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Several inputs of each format, each kind of bad record, one run with workers=2."""
    d = tmp_path_factory.mktemp("mixed")
    (d / "a.jsonl").write_bytes(bad_jsonl())
    (d / "b.txt").write_text("A whole plain-text file is one document.\n")
    (d / "c.txt").write_bytes(b"caf\xe9 latin-1, not utf-8")
    (d / "d.txt").write_text("")
    pq.write_table(pa.table({"text": ["row zero", None, "row two"]}), d / "e.parquet")
    inputs = [str(d / "a.jsonl"), str(d / "*.txt"), str(d / "e.parquet")]
    report = tokenize_to_prefix(
        inputs, str(d / "out" / "mix"), TokenizeOptions(workers=2, max_document_bytes=200)
    )
    return d, report


def test_quarantine_counts_and_reasons(mixed, gpt2):
    d, report = mixed
    bad_kinds = [r for _, r in BAD_LINES if r]
    # a.jsonl: 2 good; b.txt good; c.txt invalid utf8; d.txt empty; e.parquet 2 good + 1 null
    assert report["documents"] == 2 + 1 + 2
    assert report["quarantined"] == len(bad_kinds) + 3
    assert report["input_records"] == report["documents"] + report["quarantined"] == len(BAD_LINES) + 3 + 3
    q = [json.loads(line) for line in (d / "out" / "mix_quarantine.jsonl").read_text().splitlines()]
    assert len(q) == report["quarantined"]
    assert [x["reason"] for x in q] == [*bad_kinds, "invalid_utf8", "empty_text", "not_a_string"]
    assert [x["line"] for x in q[: len(bad_kinds)]] == [i + 1 for i, (_, r) in enumerate(BAD_LINES) if r]
    assert all(x["input"].endswith(("a.jsonl", "c.txt", "d.txt", "e.parquet")) and x["detail"] for x in q)
    assert q[-1]["row"] == 1
    assert sum(report["quarantine_reasons"].values()) == report["quarantined"]
    # documents keep input order across formats
    texts = ["good one", "good two", "A whole plain-text file is one document.\n", "row zero", "row two"]
    assert read_pair(d / "out" / "mix_text_document") == megatron_bytes([gpt2.encode(t).ids for t in texts])


def test_keep_empty_writes_empty_documents_like_megatron(tmp_path, gpt2):
    src = tmp_path / "e.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b", "", "c"]))
    out = tmp_path / "o"
    argv = [str(src), "--output-prefix", str(out), "--keep-empty", "--workers", "1", "--append-eod"]
    assert cli_main(argv) == 0
    expected = megatron_bytes([gpt2.encode("a b").ids, [], gpt2.encode("c").ids])
    assert read_pair(f"{out}_text_document") == expected
    ds = megatron.read(f"{out}_text_document")
    assert list(ds.document_indices) == [0, 1, 1, 2]


def test_cli_rejects_bad_usage(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main([str(tmp_path / "x.jsonl")])  # no --output-prefix / --shard-root
    assert cli_main([str(tmp_path / "missing-*.jsonl"), "--output-prefix", str(tmp_path / "o")]) == 1
    assert "no input matches" in capsys.readouterr().err
    assert not Path(f"{tmp_path}/o_report.json").exists()
