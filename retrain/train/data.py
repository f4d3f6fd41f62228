"""The training data of a run, without torch: a Megatron blend, its datasets, and window sampling.

A blend is what NeMo takes as ``model.data.data_prefix``: prefixes alone (equal weights) or
alternating ``weight prefix weight prefix ...``.  An item ``@URI`` stands for the blend written in a
JSON object at URI (the tokenize report's ``data_prefix_blend``, or a bare JSON list).  Prefixes are
local paths or gs:// URIs; gs:// datasets are downloaded to a temporary folder.  Weights are
normalised, as Megatron does.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from retrain import megatron
from retrain.adapters import objects

#: GPT-2's BPE vocabulary (ids 0..50256, 50256 being <|endoftext|>).
GPT2_VOCAB = 50257


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


def expand_references(items: Sequence[Any]) -> list[Any]:
    """Replace every ``@URI`` item by the blend stored at URI (a JSON list, or an object's blend)."""
    out: list[Any] = []
    for item in items:
        if isinstance(item, str) and item.startswith("@"):
            uri = item[1:]
            try:
                doc = json.loads(objects.read_bytes(uri))
            except Exception as exc:
                raise DataError(f"cannot read the blend at {uri}: {exc}") from exc
            blend = doc
            if isinstance(doc, dict):
                blend = doc.get("data_prefix_blend", doc.get("data_prefix"))
            if not isinstance(blend, list):
                raise DataError(f"{uri} holds no data_prefix_blend list")
            if not blend:
                raise DataError(f"{uri} has an empty blend: no dataset with tokens to train on")
            out.extend(blend)
        else:
            out.append(item)
    return out


def parse_blend(items: Sequence[Any]) -> list[tuple[float, str]]:
    """``[p1, p2]`` or ``[w1, p1, w2, p2]`` (strings or numbers) -> normalised ``[(weight, prefix)]``."""
    items = expand_references(list(items))
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


@dataclass
class Dataset:
    prefix: str
    weight: float
    data: megatron.IndexedDataset

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the dataset, in order (documents back to back, as Megatron concatenates)."""
        return self.data.data


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


def vocab_size_for(max_token_id: int) -> int:
    """Embedding rows for data whose largest id is ``max_token_id``.

    GPT-2-tokenized data (ids above 50000, none beyond 50256) gets GPT-2's 50257; anything else
    max id + 1 rounded up to a multiple of 64.
    """
    n = max(1, max_token_id + 1)
    if 50000 < n <= GPT2_VOCAB:
        return GPT2_VOCAB
    return -(-n // 64) * 64


class WindowSampler:
    """Contiguous windows of ``seq_len + 1`` tokens drawn across a blend by its weights.

    Batch ``step`` of rank ``rank`` depends only on (seed, step, rank), so a resumed run sees the
    batches an uninterrupted one would have.  A dataset shorter than a window is read circularly.
    """

    def __init__(self, blend: Blend, seq_len: int, seed: int) -> None:
        usable = [d for d in blend.datasets if d.weight > 0]
        for d in usable:
            if d.tokens.size == 0:
                raise DataError("has no tokens but a weight > 0", d.prefix)
        self.datasets = usable
        w = np.array([d.weight for d in usable], dtype=np.float64)
        self.p = w / w.sum()
        self.window = seq_len + 1
        self.seed = seed

    def short_datasets(self) -> list[str]:
        return [d.prefix for d in self.datasets if d.tokens.size < self.window]

    def batch(self, batch_size: int, step: int, rank: int = 0) -> np.ndarray:
        """int64 array [batch_size, seq_len + 1]."""
        rng = np.random.default_rng([self.seed, step, rank])
        which = rng.choice(len(self.datasets), size=batch_size, p=self.p)
        out = np.empty((batch_size, self.window), dtype=np.int64)
        offsets = np.arange(self.window)
        for i, k in enumerate(which):
            toks = self.datasets[k].tokens
            n = toks.size
            if n >= self.window:
                start = int(rng.integers(0, n - self.window + 1))
                out[i] = toks[start : start + self.window]
            else:
                start = int(rng.integers(0, n))
                out[i] = toks[(start + offsets) % n]
        return out


def env_blend() -> list[Any] | None:
    """The blend the JobSet passes in RETRAIN_DATA_PREFIX (a JSON list), if any."""
    raw = os.environ.get("RETRAIN_DATA_PREFIX")
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw.split()
    return value if isinstance(value, list) else [value]


def write_json(uri: str, obj: Any) -> None:
    objects.write_bytes(uri, (json.dumps(obj, indent=1) + "\n").encode("utf-8"), "application/json")
