"""The benchmarks still run and still check what they claim, not how fast (that is a bench's job, on a
quiet machine, never a test's): the storm's correctness half at test size, the tokenize bench's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from retrain_local import emulators

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


def bench(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.skipif(bool(emulators.java_emulators_unavailable_reason()), reason="needs the Java emulators")
def test_a_storm_of_duplicated_reordered_events_makes_one_batch_with_every_object_once() -> None:
    """Through the real function and emulators, from concurrent senders: one run, every object once."""
    out = bench("storm_bench.py", "--objects", "1500", "--senders", "12")
    assert "1800 deliveries of 1500 objects" in out.stdout
    assert "sealed: 1 run(s), its manifest holds 1500 objects; every object exactly once: True" in out.stdout


def test_tokenize_bench_runs_every_contender_and_reports_its_ratios() -> None:
    out = bench("tokenize_bench.py", "--repeat", "1", "--trials", "1")
    for line in (
        "pipeline speed / the best bare tokenizer (ceiling):",
        "+1 object (1% of the data)",
        "adding 1% of the data costs",
    ):
        assert line in out.stdout
    # with megatron-core and transformers installed, its bytes were checked equal to ours
    assert "identical to the pipeline's" in out.stdout or "Megatron baseline skipped" in out.stdout


def test_any_size_bench_hands_the_trainer_the_same_bounds_at_every_size() -> None:
    """At test size (100 and 1,000 objects): the argument, answer and record do not grow with objects (the
    bench's times, a few milliseconds here, are the bench's to judge at its own sizes, not a test's)."""
    sizes = ("--sizes", "100,1000", "--repeat", "1", "--total-bytes", "400000")
    out = bench("any_size_bench.py", *sizes, "--judge", "bytes")
    for key in ("answer_bytes", "argument_bytes", "record_bytes"):
        assert f"{key}: 1,000 objects / 100 objects = 1.00x" in out.stdout, out.stdout
    assert "(one entry per object: 124," in out.stdout  # what the argument would be without packs


def test_the_suite_cpu_bench_counts_a_command_by_kind_and_in_the_machine_s_reference_work(
    tmp_path: Path,
) -> None:
    """A command that burns two CPU seconds is counted as what it is, and its CPU is also given in units of
    the reference work timed in the same run (figures from different hours compare by it)."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 2: pass"
    figures = tmp_path / "figures.json"
    out = bench("suite_cpu.py", "--every", "0.2", "--json", str(figures), "--", sys.executable, "-c", burn)
    got = json.loads(figures.read_text())
    assert got["exit"] == 0
    # the samples count every process on the machine (another worker's Python ones too), every 0.2 s (the
    # last 0.2 s may be missed); the command's own tree is counted exactly, its start-up added
    assert got["cpu_s"]["Python (other)"] >= 1.7
    assert 2.0 <= got["command_cpu_s"] < 2.5
    assert 0 < got["reference_cpu_s"] < 30 and got["steal_s"] >= 0
    # the burn kept one core of the machine busy the whole time: a part-minute at least half busy
    (busy,) = got["busy_by_minute"]
    assert (os.cpu_count() or 1) * busy >= 90 and busy <= 100, busy
    assert f"machine busy, minute by minute (%): {busy}; {int(busy >= 90)} of 1 minutes" in out.stdout
    references = sum(got["cpu_s"].values()) / got["reference_cpu_s"]
    assert f"the command took {references:.0f} of it; steal {got['steal_s']:.0f} CPU s" in out.stdout
