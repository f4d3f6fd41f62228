"""Megatron "mmap" indexed datasets (.bin/.idx), the format NeMo GPT pre-training reads as data_prefix.

Layout (see shared/specs/megatron-indexed-dataset.md): PREFIX.bin holds every sequence's token ids
back to back; PREFIX.idx holds a header, sequence lengths (int32), byte pointers (int64) and document
indices (int64).  Megatron's reader does not check the .bin size or the pointers, so the writer here
derives both from the lengths and the reader here checks them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1

#: dtype codes as Megatron numbers them.
DTYPE_CODES: dict[type[np.generic], int] = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int) -> type[np.generic]:
    """Megatron's ``DType.optimal_dtype``: uint16 below 65500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair that Megatron would misread."""


def encode_index(
    dtype: type[np.generic], lengths: Sequence[int] | np.ndarray, document_indices: Sequence[int] | np.ndarray
) -> bytes:
    """The bytes of PREFIX.idx for sequences of ``lengths`` grouped by ``document_indices``."""
    lens = np.asarray(lengths, dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lens), dtype=np.int64)
    if len(lens) > 1:
        np.cumsum(lens[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    header = MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", DTYPE_CODES[dtype])
    header += struct.pack("<Q", len(lens)) + struct.pack("<Q", len(docs))
    return header + lens.tobytes() + pointers.tobytes() + docs.tobytes()


class IndexedDatasetWriter:
    """Streams documents into PREFIX.bin and writes PREFIX.idx on close (Megatron's builder, one pass).

    Memory is bounded by the index (12 bytes a sequence), never by the token data.
    """

    def __init__(self, bin_file: BinaryIO, dtype: type[np.generic]) -> None:
        self._bin = bin_file
        self.dtype = dtype
        self.lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_document(self, sequences: Iterable[Sequence[int] | np.ndarray]) -> None:
        """One document made of one or more sequences (one, unless sentences are split)."""
        for seq in sequences:
            arr = np.asarray(seq, dtype=self.dtype)
            self._bin.write(arr.tobytes())
            self.lengths.append(int(arr.size))
        self.document_indices.append(len(self.lengths))

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def documents(self) -> int:
        return len(self.document_indices) - 1

    def index_bytes(self) -> bytes:
        return encode_index(self.dtype, self.lengths, self.document_indices)


@dataclass(frozen=True)
class IndexedDataset:
    """A read view of one .bin/.idx pair, validated as a strict reader would."""

    dtype: type[np.generic]
    lengths: np.ndarray
    pointers: np.ndarray
    document_indices: np.ndarray
    data: np.ndarray  # every token, flat

    def __len__(self) -> int:
        return int(self.lengths.size)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // np.dtype(self.dtype).itemsize
        return self.data[start : start + int(self.lengths[i])]

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def documents(self) -> int:
        return int(self.document_indices.size) - 1


@dataclass(frozen=True)
class Index:
    """What a PREFIX.idx says, without its .bin: the dtype, sequence lengths and document indices."""

    dtype: type[np.generic]
    lengths: np.ndarray
    document_indices: np.ndarray

    @property
    def bin_bytes(self) -> int:
        """The size its .bin must have."""
        return int(self.lengths.astype(np.int64).sum()) * np.dtype(self.dtype).itemsize


def decode_index(idx: bytes) -> Index:
    """Parse and check an index on its own (header, counts, pointers, document indices)."""
    d = decode(idx, None)
    return Index(d.dtype, d.lengths, d.document_indices)


def merge_indexes(indexes: Sequence[Index]) -> bytes:
    """The index of the datasets' .bin files concatenated in this order: megatron-core's
    ``IndexedDatasetBuilder.add_index`` (megatron/core/datasets/indexed_dataset.py), which appends the
    lengths and each later document index offset by the sequences before it, its leading 0 dropped."""
    if not indexes:
        raise IndexedDatasetError("nothing to merge")
    dtypes = {i.dtype for i in indexes}
    if len(dtypes) > 1:
        raise IndexedDatasetError(f"cannot merge datasets of different dtypes {sorted(map(str, dtypes))}")
    lengths = np.concatenate([i.lengths for i in indexes])
    docs, offset = [np.zeros(1, dtype=np.int64)], 0
    for i in indexes:
        docs.append(i.document_indices[1:].astype(np.int64) + offset)
        offset += int(i.lengths.size)
    return encode_index(indexes[0].dtype, lengths, np.concatenate(docs))


def decode(idx: bytes, bin_data: bytes | memoryview | np.ndarray | None) -> IndexedDataset:
    """Parse and check a pair: magic, version, dtype, counts, pointers and .bin size (the index alone when
    ``bin_data`` is None: then ``data`` is empty)."""
    if idx[:9] != MAGIC:
        raise IndexedDatasetError("bad magic: not a Megatron mmap index")
    (version,) = struct.unpack_from("<Q", idx, 9)
    if version != VERSION:
        raise IndexedDatasetError(f"unsupported index version {version}")
    code = idx[17]
    if code not in CODE_DTYPES:
        raise IndexedDatasetError(f"unknown dtype code {code}")
    dtype = CODE_DTYPES[code]
    seq_count, doc_count = struct.unpack_from("<QQ", idx, 18)
    offset = 34
    expected = offset + 4 * seq_count + 8 * seq_count + 8 * doc_count
    if len(idx) != expected:
        raise IndexedDatasetError(f"index is {len(idx)} bytes, header says {expected}")
    lengths = np.frombuffer(idx, dtype=np.int32, count=seq_count, offset=offset)
    pointers = np.frombuffer(idx, dtype=np.int64, count=seq_count, offset=offset + 4 * seq_count)
    docs = np.frombuffer(idx, dtype=np.int64, count=doc_count, offset=offset + 12 * seq_count)
    itemsize = np.dtype(dtype).itemsize
    want = np.zeros(seq_count, dtype=np.int64)
    if seq_count > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=want[1:])
    if not np.array_equal(want, pointers):
        raise IndexedDatasetError("sequence pointers are not the running sum of lengths")
    if doc_count == 0 or docs[0] != 0 or docs[-1] != seq_count or np.any(np.diff(docs) < 0):
        raise IndexedDatasetError("document indices must rise from 0 to the sequence count")
    if bin_data is None:
        return IndexedDataset(dtype, lengths, pointers, docs, np.zeros(0, dtype=dtype))
    data = np.frombuffer(bin_data, dtype=dtype)
    if data.size != int(lengths.astype(np.int64).sum()):
        raise IndexedDatasetError(f".bin holds {data.size} tokens, index says {int(lengths.sum())}")
    return IndexedDataset(dtype, lengths, pointers, docs, data)


def read(prefix: str | Path) -> IndexedDataset:
    """Read a local PREFIX.bin/PREFIX.idx pair (memory-mapped .bin)."""
    prefix = str(prefix)
    idx = Path(prefix + ".idx").read_bytes()
    bin_path = Path(prefix + ".bin")
    data: np.ndarray | bytes
    data = np.memmap(bin_path, dtype=np.uint8, mode="r") if bin_path.stat().st_size else b""
    return decode(idx, data)
