"""A run of any size trains: 2,000 objects in one batch through the whole local stack reach `succeeded`
with every document counted, a bounded command, record and handover, and every node back at zero."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from stack_support import (
    assert_accounted,
    assert_nothing_left,
    finish,
    module_stack,
    new_dataset,
    wait_for_run,
)

from retrain.adapters import objects
from retrain.adapters.ledger import FirestoreLedger
from retrain.domain.runs import RunStatus
from retrain_local.landing import drop
from retrain_local.stack import LocalStack
from retrain_tokenize import packs

pytestmark = [pytest.mark.e2e, pytest.mark.emulators, pytest.mark.envtest]

OBJECTS = 2000
MAX_ARG_STRLEN = 131_072
"""Linux's limit on one argument (include/uapi/linux/binfmts.h: 32 pages); the twin's pods exec their
command for real, so the kernel itself refuses a longer one here as on a GPU node."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # The deployment's 300 s quiet period (5 s locally): eight writers uploading 2,000 files through the
    # stack on two shared cores can pause longer than 5 s, and the sweeper would rightly cut two batches.
    yield from module_stack(tmp_path_factory, quiet_period_s=60.0)


@pytest.mark.long
@pytest.mark.timeout(1800)  # some 10 minutes locally: every object is read, hashed and tokenized
def test_two_thousand_small_objects_train_in_one_run(stack: LocalStack, tmp_path: Path) -> None:
    files = []
    for i in range(OBJECTS):
        f = tmp_path / f"note-{i:04d}.txt"
        f.write_text(f"note {i}: " + " ".join(f"w{(i * 7 + j) % 997}" for j in range(40 + i % 60)))
        files.append(f)
    dataset = new_dataset()
    # one batch, as the user meant it: the hourly seal (every minute locally) would cut the drop
    stack.paused_jobs.add("seal")
    chunks = [files[i::8] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:  # eight writers, no seal: one batch
        for done in [
            pool.submit(drop, stack.settings, stack.endpoints.ingest_function, c, dataset=dataset, seal=False)
            for c in chunks
        ]:
            assert done.result().queued == 0
    drop(stack.settings, stack.endpoints.ingest_function, [], dataset=dataset)  # then the seal
    stack.paused_jobs.discard("seal")
    run = finish(stack, wait_for_run(stack, dataset, timeout_s=300), timeout_s=1800)
    assert run.status == RunStatus.SUCCEEDED, run
    assert run.objects == OBJECTS and run.documents == OBJECTS and run.quarantined_objects == []
    assert run.nodes_at_end == 0
    assert_nothing_left(stack)
    # the trainer read a bounded number of datasets, each a pack of many objects' shards
    assert 2 <= len(run.blend) <= 2 * packs.MAX_PACKS
    assert all("/shards/pack-" in p for p in run.blend[1::2])
    assert max(len(a.encode()) for a in run.command) < MAX_ARG_STRLEN // 10
    report_uri = f"{stack.settings.artifacts_uri}/runs/{run.run_id}/tokenize_report.json"
    report = json.loads(objects.read_bytes(report_uri))
    # every shard trains in exactly one pack, but the dataset's eval set: its first run carves one
    held = report["held_out"]
    assert held["shards"] == min(
        stack.settings.hold_out_max_objects, int(OBJECTS * stack.settings.hold_out_fraction)
    )
    assert sum(p["shards"] for p in report["packs"]) + held["shards"] == OBJECTS
    assert run.eval_set == held["data_prefix"] and run.eval_set not in run.blend
    assert len(objects.read_bytes(report_uri)) < 64 * 1024  # the workflow reads it into a variable
    # every variable of its execution together stayed far under Workflows' 512 KB
    assert run.execution is not None  # done: finish() waited for its last steps, after the record's end
    peak = stack.executions.peak_memory(run.execution)
    assert peak is not None and peak < 128 * 1024, peak
    # the run's record stays far under Firestore's 1 MiB
    record = FirestoreLedger(stack.settings.project).get_run(run.run_id)
    assert record is not None and len(json.dumps(record.to_dict(), default=str)) < 64 * 1024
    assert_accounted(stack)
