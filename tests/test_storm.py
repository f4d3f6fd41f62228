"""The storm benchmark's correctness half, at test size: a burst of duplicated, reordered events from
concurrent senders through the real function and emulators yields one run holding every object once.
(Its speed half is bench/storm_bench.py's business, never a test's.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from retrain.local import emulators

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(bool(emulators.java_emulators_unavailable_reason()), reason="needs the Java emulators")
def test_a_storm_of_duplicated_reordered_events_makes_one_batch_with_every_object_once() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "storm_bench.py"), "--objects", "1500", "--senders", "12"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1800 deliveries of 1500 objects" in out.stdout
    assert "sealed: 1 run(s), its manifest holds 1500 objects; every object exactly once: True" in out.stdout
