"""The training data of a run, without torch: a Megatron blend, its datasets, splits and window sampling.

A blend is what NeMo takes as ``model.data.data_prefix``: prefixes alone (equal weights) or
alternating ``weight prefix weight prefix ...`` (there is no indirection through a file).  Prefixes are
local paths or gs:// URIs; gs:// datasets are downloaded to a temporary folder.  Weights are
normalised, as Megatron does, and each dataset's documents are split into train / validation / test
by ``splits_string`` as Megatron splits them.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from retrain.adapters import objects
from retrain_tokenize import megatron


class DataError(Exception):
    """Training data that cannot be used; ``prefix`` names the dataset when one is to blame."""

    def __init__(self, message: str, prefix: str | None = None) -> None:
        super().__init__(message)
        self.prefix = prefix

    def __str__(self) -> str:
        msg = super().__str__()
        return f"dataset {self.prefix}: {msg}" if self.prefix else msg


def _as_weight(item: Any) -> float | None:
    if isinstance(item, bool):
        return None
    if isinstance(item, int | float):
        return float(item)
    try:
        return float(str(item))
    except ValueError:
        return None


def _strip_suffix(prefix: str) -> str:
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            return prefix[: -len(ext)]
    return prefix


def parse_blend(items: Sequence[Any]) -> list[tuple[float, str]]:
    """``[p1, p2]`` or ``[w1, p1, w2, p2]`` (strings or numbers) -> normalised ``[(weight, prefix)]``."""
    items = list(items)
    if not items:
        raise DataError("the data blend is empty")
    weights = [_as_weight(x) for x in items]
    pairs: list[tuple[float, str]]
    if all(w is None for w in weights):
        pairs = [(1.0, str(p)) for p in items]
    elif (
        len(items) % 2 == 0
        and all(w is not None for w in weights[0::2])
        and all(w is None for w in weights[1::2])
    ):
        pairs = [(float(w or 0.0), str(p)) for w, p in zip(weights[0::2], items[1::2], strict=True)]
    else:
        raise DataError(
            "--data-prefix takes prefixes alone or alternating 'weight prefix' pairs, got "
            + " ".join(map(str, items))
        )
    for w, p in pairs:
        if not np.isfinite(w) or w < 0:
            raise DataError(f"weight {w} is not a finite number >= 0", p)
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise DataError("the blend's weights add up to 0")
    return [(w / total, _strip_suffix(p)) for w, p in pairs]


def split_documents(documents: int, splits_string: str) -> list[tuple[int, int]]:
    """Document ranges [(start, end)] of train, validation and test, cut as megatron-core cuts them:
    the ratios of ``splits_string`` ("900,50,50") normalised and accumulated into book-ends, each end at
    ``round(bound x documents)`` (``parse_and_normalize_split``, ``convert_split_vector_to_split_matrix``
    and ``BlendedMegatronDatasetBuilder``)."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", str(splits_string))]
    parts = [*parts, 0.0, 0.0, 0.0][:3]
    total = sum(parts)
    if total <= 0:
        raise DataError(f"splits_string {splits_string!r} gives every split a zero share")
    bounds = [0.0]
    for p in parts:
        bounds.append(bounds[-1] + p / total)
    return [(round(bounds[i] * documents), round(bounds[i + 1] * documents)) for i in range(3)]


@dataclass
class Dataset:
    prefix: str
    weight: float
    data: megatron.IndexedDataset

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the dataset, in order (documents back to back, as Megatron concatenates)."""
        return self.data.data

    def document_tokens(self, start: int, end: int) -> np.ndarray:
        """The tokens of documents [start, end), back to back."""
        docs = self.data.document_indices
        seq = self.data.pointers
        lengths = self.data.lengths
        if end <= start:
            return self.tokens[:0]
        first_seq, last_seq = int(docs[start]), int(docs[end])
        itemsize = np.dtype(self.data.dtype).itemsize
        lo = int(seq[first_seq]) // itemsize if first_seq < len(seq) else self.tokens.size
        hi = (int(seq[last_seq - 1]) // itemsize + int(lengths[last_seq - 1])) if last_seq > first_seq else lo
        return self.tokens[lo:hi]


@dataclass
class Blend:
    datasets: list[Dataset]
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    @property
    def weights(self) -> np.ndarray:
        return np.array([d.weight for d in self.datasets], dtype=np.float64)

    @property
    def tokens(self) -> int:
        return sum(d.data.tokens for d in self.datasets)

    @property
    def documents(self) -> int:
        return sum(d.data.documents for d in self.datasets)

    def max_token_id(self) -> int:
        """The largest token id in any dataset of the blend (-1 when there are none)."""
        return max((int(d.tokens.max()) for d in self.datasets if d.tokens.size), default=-1)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def read_dataset(prefix: str, workdir: str | None) -> megatron.IndexedDataset:
    """Read and check one PREFIX.bin/.idx pair; gs:// pairs are downloaded to ``workdir`` first."""
    local = prefix
    try:
        if objects.is_gcs(prefix):
            assert workdir is not None
            bucket, name = objects.split_gs(prefix)
            local = os.path.join(workdir, bucket, name)
            for ext in (".idx", ".bin"):
                if not objects.exists(prefix + ext):
                    raise DataError(f"{prefix + ext} does not exist", prefix)
                objects.download_file(prefix + ext, local + ext)
        else:
            for ext in (".idx", ".bin"):
                if not Path(prefix + ext).is_file():
                    raise DataError(f"{prefix + ext} does not exist", prefix)
        return megatron.read(local)
    except DataError:
        raise
    except megatron.IndexedDatasetError as exc:
        raise DataError(f"not a valid Megatron dataset: {exc}", prefix) from exc
    except Exception as exc:  # unreadable: bad sizes, I/O, GCS errors
        raise DataError(f"cannot read {prefix}.bin/.idx: {type(exc).__name__}: {exc}", prefix) from exc


def load_blend(items: Sequence[Any]) -> Blend:
    """Parse the blend and read every dataset in it (raises DataError naming the bad one)."""
    pairs = parse_blend(items)
    tmp = (
        tempfile.TemporaryDirectory(prefix="retrain-data-")
        if any(objects.is_gcs(p) for _, p in pairs)
        else None
    )
    blend = Blend([], tmp)
    try:
        for weight, prefix in pairs:
            blend.datasets.append(Dataset(prefix, weight, read_dataset(prefix, tmp.name if tmp else None)))
    except BaseException:
        blend.close()
        raise
    return blend


@dataclass(frozen=True)
class Stream:
    """One dataset's tokens of one split, drawn with the dataset's weight."""

    prefix: str
    weight: float
    tokens: np.ndarray


def split_streams(blend: Blend, splits_string: str, split: int) -> list[Stream]:
    """Each dataset's documents of ``split`` (0 train, 1 validation, 2 test) as a stream; datasets
    whose split holds no token are left out."""
    out = []
    for d in blend.datasets:
        start, end = split_documents(d.data.documents, splits_string)[split]
        tokens = d.document_tokens(start, end)
        if d.weight > 0 and tokens.size:
            out.append(Stream(d.prefix, d.weight, tokens))
    return out


class WindowSampler:
    """Contiguous windows of ``seq_len + 1`` tokens drawn across streams by their weights.

    Batch ``step`` of rank ``rank`` (micro-batch ``micro``) depends only on (seed, step, rank, micro),
    so a resumed run sees the batches an uninterrupted one would have.  A stream shorter than a window
    is read circularly.
    """

    def __init__(self, streams: Sequence[Stream], seq_len: int, seed: int) -> None:
        if not streams:
            raise DataError("no dataset has tokens to draw from")
        self.streams = list(streams)
        w = np.array([s.weight for s in self.streams], dtype=np.float64)
        self.p = w / w.sum()
        self.window = seq_len + 1
        self.seed = seed

    def short_streams(self) -> list[str]:
        return [s.prefix for s in self.streams if s.tokens.size < self.window]

    def batch(self, batch_size: int, step: int, rank: int = 0, micro: int = 0) -> np.ndarray:
        """int64 array [batch_size, seq_len + 1]."""
        rng = np.random.default_rng([self.seed, step, rank, micro])
        which = rng.choice(len(self.streams), size=batch_size, p=self.p)
        out = np.empty((batch_size, self.window), dtype=np.int64)
        offsets = np.arange(self.window)
        for i, k in enumerate(which):
            toks = self.streams[k].tokens
            n = toks.size
            if n >= self.window:
                start = int(rng.integers(0, n - self.window + 1))
                out[i] = toks[start : start + self.window]
            else:
                start = int(rng.integers(0, n))
                out[i] = toks[(start + offsets) % n]
        return out
