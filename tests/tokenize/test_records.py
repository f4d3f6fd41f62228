"""Reading splits (no Beam): every line read exactly once whatever the split size; bad records kept."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retrain_tokenize import records
from retrain_tokenize.records import Batch, Rejected, Split, SplitStats


def _all_lines(data: bytes, split: int, max_len: int = 1000) -> list[tuple[int, bytes, int]]:
    out = []
    for start in range(0, max(len(data), 1), split):
        out += list(records._lines(io.BytesIO(data), start, min(start + split, len(data)), max_len))
    return out


@pytest.mark.parametrize("data", [b"a\nbb\n\nccc\ndddd", b"a\nbb\n\nccc\n", b"\n\n\n", b"x", b""])
def test_lines_each_once_for_every_split_size(data):
    whole = [(o, line, n) for o, line, n in _all_lines(data, 10**6)]
    expect, pos = [], 0
    for line in data.split(b"\n")[: -1 if data.endswith(b"\n") or not data else None]:
        expect.append((pos, line, len(line)))
        pos += len(line) + 1
    assert whole == expect
    for split in range(1, len(data) + 2):
        assert _all_lines(data, split) == expect, split


def test_too_long_line_is_skipped_with_its_true_length():
    data = b"ok\n" + b"y" * 5000 + b"\nafter\n"
    got = list(records._lines(io.BytesIO(data), 0, len(data), max_len=100))
    assert [(o, n) for o, _, n in got] == [(0, 2), (3, 5000), (5004, 5)]
    assert got[1][1].startswith(b"yyy") and got[2][1] == b"after"


BAD_LINES = [
    (b'{"text": "good one"}', None),
    (b"{not json", records.INVALID_JSON),
    (b'"a string"', records.INVALID_JSON),
    (b'{"text": "bad \xff\xfe utf8"}', records.INVALID_UTF8),
    (b'{"body": "no text key"}', records.MISSING_KEY),
    (b'{"text": 42}', records.NOT_A_STRING),
    (b'{"text": null}', records.NOT_A_STRING),
    (b'{"text": ""}', records.EMPTY_TEXT),
    (b'{"text": "lone \\ud800 surrogate"}', records.INVALID_UNICODE),
    (b"   ", records.BLANK_LINE),
    (b'{"text": "' + b"z" * 300 + b'"}', records.TOO_LARGE),
    (b'{"text": "good two"}', None),
]


def bad_jsonl() -> bytes:
    return b"".join(line + b"\n" for line, _ in BAD_LINES)


def test_read_split_quarantines_each_kind(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(bad_jsonl())
    items = list(
        records.read_split(Split(3, str(path), "jsonl", 0, path.stat().st_size), max_document_bytes=200)
    )
    batches = [i for i in items if isinstance(i, Batch)]
    rejected = [i for i in items if isinstance(i, Rejected)]
    (stats,) = [i for i in items if isinstance(i, SplitStats)]
    assert [t for b in batches for t in b.texts[0]] == ["good one", "good two"]
    assert [r.reason for r in rejected] == [r for _, r in BAD_LINES if r]
    assert [r.line_in_split for r in rejected] == [i for i, (_, r) in enumerate(BAD_LINES) if r]
    assert stats.records == len(BAD_LINES) == 2 + len(rejected)
    assert all(r.input_index == 3 for r in rejected)


def test_keep_empty_and_multiple_keys(tmp_path):
    path = tmp_path / "k.jsonl"
    path.write_text(json.dumps({"text": "", "title": "t"}) + "\n" + json.dumps({"text": "a"}) + "\n")
    items = list(
        records.read_split(
            Split(0, str(path), "jsonl", 0, path.stat().st_size), ("text", "title"), keep_empty=True
        )
    )
    assert [i.texts for i in items if isinstance(i, Batch)] == [[[""], ["t"]]]
    assert [i.reason for i in items if isinstance(i, Rejected)] == [records.MISSING_KEY]


def test_text_and_parquet(tmp_path):
    txt = tmp_path / "doc.txt"
    txt.write_text("one document\n\nwith paragraphs\n")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe")
    pqf = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["r0", None, "", "r3"]}), pqf, row_group_size=2)

    def read(p, fmt):
        return list(records.read_split(Split(0, str(p), fmt, 0, p.stat().st_size)))

    assert [i.texts for i in read(txt, "text") if isinstance(i, Batch)] == [
        [["one document\n\nwith paragraphs\n"]]
    ]
    assert [i.reason for i in read(bad, "text") if isinstance(i, Rejected)] == [records.INVALID_UTF8]
    items = read(pqf, "parquet")
    assert [t for i in items if isinstance(i, Batch) for t in i.texts[0]] == ["r0", "r3"]
    assert [(i.row, i.reason) for i in items if isinstance(i, Rejected)] == [
        (1, records.NOT_A_STRING),
        (2, records.EMPTY_TEXT),
    ]
    assert records.detect_format("a/b.JSONL") == "jsonl" and records.detect_format("x.pq") == "parquet"
