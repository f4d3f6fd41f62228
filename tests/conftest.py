"""Shared fixtures: the real emulators, started once per test session and stopped at its end.

Tests that need something this machine lacks (Java, the Cloud SDK, envtest binaries) skip with the
reason; each test isolates its data with its own Firestore project id.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from retrain.local import emulators

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("RETRAIN_SHARED", REPO.parent / "shared"))
CORPUS = SHARED / "corpus"


def _set_env(key: str, value: str) -> str | None:
    old = os.environ.get(key)
    os.environ[key] = value
    return old


def _restore_env(key: str, old: str | None) -> None:
    if old is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = old


@pytest.fixture(scope="session")
def emulator_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("emulators")


@pytest.fixture(scope="session")
def firestore_host(emulator_dir: Path) -> Iterator[str]:
    """FIRESTORE_EMULATOR_HOST of a real Firestore emulator (set in this process's environment)."""
    reason = emulators.java_emulators_unavailable_reason()
    if reason:
        pytest.skip(reason)
    proc, host = emulators.firestore(emulator_dir)
    proc.start()
    old = _set_env("FIRESTORE_EMULATOR_HOST", host)
    yield host
    _restore_env("FIRESTORE_EMULATOR_HOST", old)
    proc.stop()


@pytest.fixture(scope="session")
def pubsub_host(emulator_dir: Path) -> Iterator[str]:
    reason = emulators.java_emulators_unavailable_reason()
    if reason:
        pytest.skip(reason)
    proc, host = emulators.pubsub(emulator_dir)
    proc.start()
    old = _set_env("PUBSUB_EMULATOR_HOST", host)
    yield host
    _restore_env("PUBSUB_EMULATOR_HOST", old)
    proc.stop()


@pytest.fixture(scope="session")
def gcs_host(emulator_dir: Path) -> Iterator[str]:
    proc, host = emulators.gcs(emulator_dir)
    proc.start()
    old = _set_env("STORAGE_EMULATOR_HOST", host)
    yield host
    _restore_env("STORAGE_EMULATOR_HOST", old)
    proc.stop()


@pytest.fixture
def project() -> str:
    """A fresh project id: the emulators keep each project's data apart."""
    return f"test-{uuid.uuid4().hex[:10]}"
