"""Helpers of the trainer tests: tiny Megatron datasets, the real CLIs as subprocesses, a GCS emulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from retrain.megatron import IndexedDatasetWriter

REPO = Path(__file__).resolve().parents[2]


def write_dataset(
    prefix: Path, documents: Sequence[Sequence[int]], dtype: type[np.generic] = np.uint16
) -> Path:
    """PREFIX.bin/.idx holding one sequence per document."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(str(prefix) + ".bin", "wb") as f:
        w = IndexedDatasetWriter(f, dtype)
        for doc in documents:
            w.add_document([doc])
    Path(str(prefix) + ".idx").write_bytes(w.index_bytes())
    return prefix


def pattern_documents(n_docs: int = 20, length: int = 200, period: int = 16) -> list[list[int]]:
    """Counting 0..period-1 over and over: a pattern a tiny model learns in a few dozen steps."""
    return [[(i + d) % period for i in range(length)] for d in range(n_docs)]


def random_documents(n_docs: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(20, 300))).tolist() for _ in range(n_docs)]


def child_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RETRAIN_", "WORLD_SIZE", "RANK", "NODE_RANK", "MASTER_"))
    }
    env.pop("LOCAL_WORLD_SIZE", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_module(
    module: str, *args: object, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=REPO,
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_jsonl(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def gcs_emulator(gcs_host: str) -> str:
    """The session's GCS emulator with bucket "b"; STORAGE_EMULATOR_HOST is set here and for children."""
    from retrain.adapters import objects

    client = objects.storage_client()
    if client.lookup_bucket("b") is None:
        client.create_bucket("b")
    return gcs_host
