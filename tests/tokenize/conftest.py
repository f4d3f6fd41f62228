"""Fixtures for the tokenization tests: small corpus documents, hand-packed Megatron bytes, a GCS emulator."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CORPUS = Path(os.environ.get("RETRAIN_SHARED", ROOT.parent / "shared")) / "corpus"
BUCKET = "retrain-test"


def corpus_documents(max_bytes: int = 120_000, doc_bytes: int = 3000) -> list[str]:
    """Paragraphs of the shared corpus grouped into documents of a few KB (a small, fixed sample)."""
    texts = []
    for f in sorted(CORPUS.glob("*.txt")):
        texts.append(f.read_text(encoding="utf-8")[20_000 : 20_000 + max_bytes // 4])
        if sum(map(len, texts)) >= max_bytes:
            break
    docs, cur = [], ""
    for t in texts:
        for para in t.split("\n\n"):
            cur += para + "\n\n"
            if len(cur) >= doc_bytes:
                docs.append(cur)
                cur = ""
    if cur:
        docs.append(cur)
    # Tricky texts: unicode, whitespace runs, a literal end-of-text marker (ordinary text for GPT-2).
    docs += ["naïve café — 東京 🙂", "  leading  and trailing  ", "<|endoftext|> is just text here", "x"]
    return docs


def write_jsonl(path: Path, docs: Sequence[str], key: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({key: d, "id": len(d)}) + "\n")
    return path


def megatron_bytes(doc_ids: Sequence[Sequence[int]], eod: int | None = 50256) -> tuple[bytes, bytes]:
    """(.bin, .idx) packed by hand from the spec: uint16 (code 8), one sequence per non-empty document."""
    lengths, docs_index, data = [], [0], b""
    for ids in doc_ids:
        ids = list(ids) + ([eod] if ids and eod is not None else [])
        if ids:
            data += struct.pack(f"<{len(ids)}H", *ids)
            lengths.append(len(ids))
        docs_index.append(len(lengths))
    pointers, off = [], 0
    for n in lengths:
        pointers.append(off)
        off += 2 * n
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    idx += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(docs_index))
    idx += struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(docs_index)}q", *docs_index)
    return data, idx


def read_pair(prefix: str | Path) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


@pytest.fixture(scope="session")
def gpt2():
    from retrain_tokenize import load_gpt2_tokenizer

    return load_gpt2_tokenizer()


@pytest.fixture(scope="session")
def gcs_emulator(gcs_host: str) -> str:
    """Bucket BUCKET in the session's GCS emulator (STORAGE_EMULATOR_HOST is set)."""
    from retrain.adapters import objects

    objects.storage_client().create_bucket(BUCKET)
    return f"gs://{BUCKET}"
