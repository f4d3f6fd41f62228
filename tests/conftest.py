"""Shared fixtures: the real emulators, started once per test session and stopped at its end.

Tests that need something this machine lacks (Java, the Cloud SDK, envtest binaries) skip with the
reason; each test isolates its data with its own Firestore project id.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from retrain.local import emulators

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("RETRAIN_SHARED", REPO.parent / "shared"))
CORPUS = SHARED / "corpus"


@pytest.fixture(scope="session")
def emulator_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("emulators")


def _serve(
    start: Callable[[Path], tuple[emulators.ManagedProcess, str]], state: Path, env_key: str, needs_java: bool
) -> Iterator[str]:
    """Run one emulator for the session, exported to this process through its client variable."""
    reason = emulators.java_emulators_unavailable_reason() if needs_java else None
    if reason:
        pytest.skip(reason)
    proc, host = start(state)
    proc.start()
    old = os.environ.get(env_key)
    os.environ[env_key] = host
    yield host
    if old is None:
        os.environ.pop(env_key, None)
    else:
        os.environ[env_key] = old
    proc.stop()


@pytest.fixture(scope="session")
def firestore_host(emulator_dir: Path) -> Iterator[str]:
    """FIRESTORE_EMULATOR_HOST of a real Firestore emulator."""
    yield from _serve(emulators.firestore, emulator_dir, "FIRESTORE_EMULATOR_HOST", needs_java=True)


@pytest.fixture(scope="session")
def pubsub_host(emulator_dir: Path) -> Iterator[str]:
    """PUBSUB_EMULATOR_HOST of a real Pub/Sub emulator."""
    yield from _serve(emulators.pubsub, emulator_dir, "PUBSUB_EMULATOR_HOST", needs_java=True)


@pytest.fixture(scope="session")
def gcs_host(emulator_dir: Path) -> Iterator[str]:
    """STORAGE_EMULATOR_HOST of gcp-storage-emulator."""
    yield from _serve(emulators.gcs, emulator_dir, "STORAGE_EMULATOR_HOST", needs_java=False)


@pytest.fixture(scope="session")
def bigquery_host(emulator_dir: Path) -> Iterator[str]:
    """BIGQUERY_EMULATOR_HOST of bqemulator: an optional tier, skipped where it is not installed."""
    if emulators.bqemulator_path() is None:
        pytest.skip("bqemulator is not installed (scripts/test installs it in .tools/bqemulator)")
    yield from _serve(emulators.bigquery, emulator_dir, "BIGQUERY_EMULATOR_HOST", needs_java=False)


@pytest.fixture
def project() -> str:
    """A fresh project id: the emulators keep each project's data apart."""
    return f"test-{uuid.uuid4().hex[:10]}"
