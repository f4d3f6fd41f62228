"""Reading input objects into documents, streaming, and quarantining the records that are not documents.

Formats, by object name: ``.jsonl``/``.ndjson``/``.json`` one JSON object per line; ``.parquet``/``.pq``
a column per json key; anything else plain text, the whole object one document.  A JSONL object is
read in byte-range splits (a split owns the lines that *start* inside it), so one large object is
read by many workers and memory stays bounded by a batch, never by the object.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from retrain.adapters import objects
from retrain.contracts import SetAside
from retrain.domain.events import object_format

MiB = 1 << 20
DEFAULT_MAX_DOCUMENT_BYTES = 32 * MiB
DEFAULT_SPLIT_BYTES = 64 * MiB
DEFAULT_BATCH_BYTES = 8 * MiB
EXCERPT_CHARS = 1000
_READ_CHUNK = 4 * MiB

# Quarantine reasons.
INVALID_JSON = "invalid_json"
INVALID_UTF8 = "invalid_utf8"
INVALID_UNICODE = "invalid_unicode"  # lone surrogates (JSON "\ud800"): not encodable as UTF-8
BLANK_LINE = "blank_line"
MISSING_KEY = "missing_key"
NOT_A_STRING = "not_a_string"
EMPTY_TEXT = "empty_text"
TOO_LARGE = "too_large"
# Reasons a whole object is set aside (before or while reading it).
UNREADABLE = str(SetAside.UNREADABLE)
OBJECT_CHANGED = str(SetAside.OBJECT_CHANGED)
DECOMPRESSED_TOO_LARGE = str(SetAside.DECOMPRESSED_TOO_LARGE)
#: A Parquet object whose pages decompress past this is not read (a decompression bomb).
DEFAULT_MAX_DECOMPRESSED_BYTES = 4 << 30


detect_format = object_format


def _has_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Paths, globs, folders, gs:// objects, gs:// globs or gs://…/ prefixes -> object URIs.

    Order: patterns as given, each one's matches in name order.  A pattern that matches nothing fails.
    """
    out: list[str] = []
    for pat in patterns:
        if objects.is_gcs(pat):
            if _has_glob(pat):
                bucket, name = objects.split_gs(pat)
                cut = min(name.index(c) for c in "*?[" if c in name)
                found = [
                    u for u in objects.list_uris(f"gs://{bucket}/{name[:cut]}") if fnmatch.fnmatchcase(u, pat)
                ]
            elif pat.endswith("/"):
                found = list(objects.list_uris(pat))
            else:
                found = [pat] if objects.exists(pat) else []
        elif _has_glob(pat):
            found = sorted(p for p in glob.glob(pat, recursive=True) if os.path.isfile(p))
        elif os.path.isdir(pat):
            found = list(objects.list_uris(pat))
        else:
            found = [pat] if os.path.isfile(pat) else []
        if not found:
            raise FileNotFoundError(f"no input matches {pat!r}")
        out.extend(found)
    return out


def check_object(uri: str, generation: int | None, max_decompressed: int) -> tuple[str, str] | None:
    """(reason, detail) when an object must be set aside whole before reading it, else None: a
    ``.parquet`` that is not Parquet or cannot be decoded, or whose values decode past
    ``max_decompressed`` bytes (the footer's sizes first, then the values themselves)."""
    if detect_format(uri) != "parquet":
        return None
    import pyarrow.parquet as pq

    try:
        with objects.open_read(uri, generation) as f:
            meta = pq.ParquetFile(f).metadata
    except Exception as e:  # pyarrow says ArrowInvalid; any failure to read a footer is the same
        return UNREADABLE, f"not a Parquet file: {type(e).__name__}: {e}"[:500]
    unpacked = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    if unpacked > max_decompressed:
        return DECOMPRESSED_TOO_LARGE, f"its pages decompress to {unpacked} bytes > max {max_decompressed}"
    try:
        decoded = _decoded_bytes(uri, generation, max_decompressed)
    except Exception as e:  # a corrupt page: this object is unreadable, the run's others are not
        return UNREADABLE, f"its pages do not decode: {type(e).__name__}: {e}"[:500]
    if decoded > max_decompressed:
        return (
            DECOMPRESSED_TOO_LARGE,
            f"its text and bytes values decode to over {decoded} bytes > max {max_decompressed}",
        )
    return None


#: Rows per Parquet batch, read and sized before any row is built: few, because a batch holds its rows'
#: values decoded (a dictionary-encoded value repeated by every row is one copy per row), at most this
#: many times ``max_document_bytes``.
PARQUET_BATCH_ROWS = 16


def _decoded_bytes(uri: str, generation: int | None, limit: int) -> int:
    """The bytes the text and bytes columns decode to, batch by batch (stops once past ``limit``).  The
    footer's sizes are the encoded pages': a dictionary value counts once however many rows repeat it,
    a prefix-compressed (DELTA_BYTE_ARRAY) column counts its suffixes.  700 rows of one 8 MiB string
    are a 120 KB file whose footer says 3.7 GB; they decode to 5.9 GB."""
    import pyarrow.parquet as pq

    total = 0
    with objects.open_read(uri, generation) as f:
        pf = pq.ParquetFile(f)
        columns = [field.name for field in pf.schema_arrow if _is_text_or_bytes(field.type)]
        if not columns:
            return 0
        for rb in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            total += sum(int(_row_bytes(rb.column(name)).sum()) for name in columns)
            if total > limit:
                break
    return total


def _row_bytes(column: Any) -> Any:
    """Each row's value size in bytes (0 for null or a value that is not text or bytes), as a numpy
    array, without materialising a value: a dictionary column's sizes are its dictionary's, by index."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not _is_text_or_bytes(column.type):
        return np.zeros(len(column), dtype=np.int64)
    if pa.types.is_dictionary(column.type):
        lengths = pc.binary_length(column.dictionary).take(column.indices)
    else:
        lengths = pc.binary_length(column)
    return lengths.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def sha256_of(uri: str, generation: int | None = None) -> str:
    """sha256 of an object's bytes, streamed."""
    h = hashlib.sha256()
    with objects.open_read(uri, generation) as f:
        for chunk in objects.chunks(f, _READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Split:
    """A part of one input: a byte range of a JSONL object, or a whole text / Parquet object."""

    input_index: int
    uri: str
    fmt: str
    start: int
    end: int
    generation: int | None = None
    """The object version read (None: whatever is there)."""


def plan_splits(
    input_index: int,
    uri: str,
    size: int,
    split_bytes: int = DEFAULT_SPLIT_BYTES,
    generation: int | None = None,
) -> list[Split]:
    fmt = detect_format(uri)
    if fmt != "jsonl" or size <= split_bytes:
        return [Split(input_index, uri, fmt, 0, size, generation)]
    return [
        Split(input_index, uri, fmt, s, min(s + split_bytes, size), generation)
        for s in range(0, size, split_bytes)
    ]


@dataclass
class Batch:
    """Consecutive documents of one input; ``texts[k]`` is the column of json key ``k``."""

    input_index: int
    first_offset: int  # byte offset (JSONL, text) or row (Parquet) of the first document: the order key
    texts: list[list[str]]
    nbytes: int = 0

    @property
    def documents(self) -> int:
        return len(self.texts[0]) if self.texts else 0


@dataclass
class Rejected:
    """A quarantined record; ``line`` is counted from the split's start (resolved by the writer)."""

    input_index: int
    offset: int
    reason: str
    detail: str
    excerpt: str
    record_bytes: int
    split_start: int = 0
    line_in_split: int | None = None
    row: int | None = None

    def to_json(self, uri: str, line: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {"input": uri, "reason": self.reason, "detail": self.detail}
        if line is not None:
            out["line"] = line
        if self.row is not None:
            out["row"] = self.row
        else:
            out["offset"] = self.offset
        out["record_bytes"] = self.record_bytes
        out["record"] = self.excerpt
        return out


@dataclass
class SplitStats:
    input_index: int
    start: int
    records: int = 0
    lines: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


def _excerpt(raw: bytes | str) -> str:
    if isinstance(raw, bytes):
        raw = raw[: EXCERPT_CHARS * 4].decode("utf-8", errors="backslashreplace")
    return raw[:EXCERPT_CHARS]


def _encodable(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Reader:
    """Yields Batch / Rejected items for one split, then its SplitStats."""

    def __init__(
        self,
        split: Split,
        json_keys: Sequence[str],
        max_document_bytes: int,
        batch_bytes: int,
        keep_empty: bool,
    ) -> None:
        self.split = split
        self.keys = list(json_keys)
        self.max = max_document_bytes
        self.batch_bytes = batch_bytes
        self.keep_empty = keep_empty
        self.stats = SplitStats(split.input_index, split.start)
        self._batch: Batch | None = None

    # --- batching -------------------------------------------------------------------------------
    def _add(self, offset: int, texts: list[str], nbytes: int) -> Batch | None:
        if self._batch is None:
            self._batch = Batch(self.split.input_index, offset, [[] for _ in self.keys])
        for col, t in zip(self._batch.texts, texts, strict=True):
            col.append(t)
        self._batch.nbytes += nbytes
        if self._batch.nbytes >= self.batch_bytes:
            return self._flush()
        return None

    def _flush(self) -> Batch | None:
        b, self._batch = self._batch, None
        return b

    def _reject(
        self,
        offset: int,
        reason: str,
        detail: str,
        raw: bytes | str,
        nbytes: int,
        line: int | None = None,
        row: int | None = None,
    ) -> Rejected:
        self.stats.reasons[reason] = self.stats.reasons.get(reason, 0) + 1
        return Rejected(
            self.split.input_index, offset, reason, detail, _excerpt(raw), nbytes, self.split.start, line, row
        )

    def _check_values(self, values: list[Any]) -> tuple[str, str] | None:
        for key, v in zip(self.keys, values, strict=True):
            if v is _MISSING:
                return MISSING_KEY, f"no {key!r} key"
            if not isinstance(v, str):
                return NOT_A_STRING, f"{key!r} is {type(v).__name__}, not a string"
            if not v and not self.keep_empty:
                return EMPTY_TEXT, f"{key!r} is empty"
            if not _encodable(v):
                return INVALID_UNICODE, f"{key!r} holds a lone surrogate"
        return None

    # --- formats --------------------------------------------------------------------------------
    def items(self) -> Iterator[Batch | Rejected | SplitStats]:
        fmt = self.split.fmt
        it = self._jsonl() if fmt == "jsonl" else self._parquet() if fmt == "parquet" else self._text()
        for item in it:
            if item is not None:
                yield item
        last = self._flush()
        if last is not None:
            yield last
        yield self.stats

    def _jsonl(self) -> Iterator[Batch | Rejected | None]:
        with objects.open_read(self.split.uri, self.split.generation) as f:
            for line_no, (offset, raw, nbytes) in enumerate(
                _lines(f, self.split.start, self.split.end, self.max)
            ):
                self.stats.lines += 1
                self.stats.records += 1
                if nbytes > self.max:
                    yield self._reject(
                        offset, TOO_LARGE, f"{nbytes} bytes > max {self.max}", raw, nbytes, line_no
                    )
                    continue
                if not raw.strip():
                    yield self._reject(offset, BLANK_LINE, "blank line", raw, nbytes, line_no)
                    continue
                try:
                    s = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield self._reject(offset, INVALID_UTF8, str(e), raw, nbytes, line_no)
                    continue
                try:
                    obj = json.loads(s)
                except ValueError as e:
                    yield self._reject(offset, INVALID_JSON, str(e), s, nbytes, line_no)
                    continue
                if not isinstance(obj, dict):
                    yield self._reject(
                        offset,
                        INVALID_JSON,
                        f"a JSON {type(obj).__name__}, not an object",
                        s,
                        nbytes,
                        line_no,
                    )
                    continue
                values = [obj.get(k, _MISSING) for k in self.keys]
                bad = self._check_values(values)
                if bad:
                    yield self._reject(offset, bad[0], bad[1], s, nbytes, line_no)
                    continue
                yield self._add(offset, values, nbytes)

    def _text(self) -> Iterator[Batch | Rejected | None]:
        self.stats.records = 1
        self.stats.lines = 1
        with objects.open_read(self.split.uri, self.split.generation) as f:
            raw = f.read(self.max + 1)
            if len(raw) > self.max:
                nbytes = len(raw) + sum(map(len, objects.chunks(f, _READ_CHUNK)))
                yield self._reject(0, TOO_LARGE, f"{nbytes} bytes > max {self.max}", raw, nbytes, 0)
                return
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield self._reject(0, INVALID_UTF8, str(e), raw, len(raw), 0)
            return
        bad = self._check_values([text] * len(self.keys))
        if bad:
            yield self._reject(0, bad[0], bad[1], text, len(raw), 0)
            return
        yield self._add(0, [text] * len(self.keys), len(raw))

    def _parquet(self) -> Iterator[Batch | Rejected | None]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.stats.lines = 0
        with objects.open_read(self.split.uri, self.split.generation) as f:
            pf = pq.ParquetFile(f)
            present = [k for k in self.keys if k in pf.schema_arrow.names]
            # Few rows per batch, each sized before it is built (check_object bounded the whole object).
            row = 0
            for rb in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=present or None):
                cols: list[pa.Array | None] = [rb.column(k) if k in present else None for k in self.keys]
                sizes = sum((_row_bytes(c) for c in cols if c is not None), np.zeros(rb.num_rows, np.int64))
                for i in range(rb.num_rows):
                    self.stats.records += 1
                    nbytes = int(sizes[i])
                    too_large = nbytes > self.max
                    read = _value_start if too_large else _as_py
                    values = [_MISSING if c is None else read(c[i]) for c in cols]
                    record = json.dumps(
                        dict(zip(self.keys, [None if v is _MISSING else v for v in values], strict=True)),
                        default=str,
                    )[: EXCERPT_CHARS * 2]
                    if too_large:
                        yield self._reject(
                            row, TOO_LARGE, f"{nbytes} bytes > max {self.max}", record, nbytes, row=row
                        )
                    elif bad := self._check_values(values):
                        yield self._reject(row, bad[0], bad[1], record, nbytes, row=row)
                    else:
                        yield self._add(row, values, nbytes)
                    row += 1


def _is_text_or_bytes(kind: Any) -> bool:
    """Whether values of Arrow type ``kind`` are text or bytes (a dictionary of them included)."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return bool(
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    )


def _as_py(scalar: Any) -> Any:
    return scalar.as_py()


def _value_start(scalar: Any) -> Any:
    """The start of a value too large to keep, for the quarantine record (the value is never built)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(scalar.type):
        scalar = scalar.value
    if scalar is None or not scalar.is_valid or not _is_text_or_bytes(scalar.type):
        return None if scalar is None else scalar.as_py()
    if pa.types.is_string(scalar.type) or pa.types.is_large_string(scalar.type):
        return pc.utf8_slice_codeunits(scalar, 0, EXCERPT_CHARS).as_py()
    return pc.binary_slice(scalar, 0, EXCERPT_CHARS).as_py()


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


def _lines(f: IO[bytes], start: int, end: int, max_len: int) -> Iterator[tuple[int, bytes, int]]:
    """(offset, line without its newline, its length) for each line starting in [start, end).

    A line over ``max_len`` bytes is not kept: its first bytes come back (for the quarantine excerpt)
    with its true length, and the rest is skipped without buffering it.
    """
    buf = bytearray()
    reads = objects.chunks(f, _READ_CHUNK)  # a generator: it reads nothing before the first next()
    if start > 0:
        f.seek(start - 1)
        pos = start - 1
        while True:  # the line in progress at start-1 belongs to the previous split
            chunk = next(reads, b"")
            if not chunk:
                return
            nl = chunk.find(b"\n")
            if nl >= 0:
                pos += nl + 1
                buf += chunk[nl + 1 :]
                break
            pos += len(chunk)
    else:
        pos = 0
    i = 0
    eof = False
    while pos < end:
        nl = buf.find(b"\n", i)
        if nl < 0 and not eof and len(buf) - i <= max_len:
            chunk = next(reads, b"")
            if chunk:
                del buf[:i]
                i = 0
                buf += chunk
            else:
                eof = True
            continue
        if nl >= 0:
            n = nl - i
            yield pos, bytes(buf[i:nl]), n
            pos += n + 1
            i = nl + 1
            continue
        if eof:
            if i < len(buf):
                yield pos, bytes(buf[i:]), len(buf) - i
            return
        # Over max_len without a newline: skip to the end of this line.
        head = bytes(buf[i : i + EXCERPT_CHARS * 4])
        n = len(buf) - i
        buf.clear()
        i = 0
        while True:
            chunk = next(reads, b"")
            if not chunk:
                yield pos, head, n
                return
            nl = chunk.find(b"\n")
            if nl >= 0:
                n += nl
                buf += chunk[nl + 1 :]
                yield pos, head, n
                pos += n + 1
                break
            n += len(chunk)


def read_split(
    split: Split,
    json_keys: Sequence[str] = ("text",),
    *,
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    keep_empty: bool = False,
) -> Iterator[Batch | Rejected | SplitStats]:
    """Every Batch and Rejected record of one split, then its SplitStats."""
    return _Reader(split, json_keys, max_document_bytes, batch_bytes, keep_empty).items()
