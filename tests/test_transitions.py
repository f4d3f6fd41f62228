"""Python's writes to a run record (:mod:`retrain.domain.transitions`) read back as the typed record:
each change sets only fields :class:`retrain.domain.runs.Run` declares (or the plan its begin step reads),
and a record holding them reads them back as the values written."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from retrain.domain import transitions
from retrain.domain.runs import (
    Evaluation,
    FailureKind,
    ObjectSetAside,
    Run,
    RunStatus,
    TrainingMetrics,
    Trigger,
    read_trigger,
)
from retrain.domain.transitions import (
    HandedOver,
    ManifestRewritten,
    NothingToTrain,
    ReleaseObserved,
    RunChange,
    RunEnd,
    RunPlanned,
    TrainingResults,
)

METRICS = TrainingMetrics(120, 20, 2.5, float("nan"), 960, 983040, 3.1)
VERDICT = Evaluation(2.4, 2.6, "ds-1", "this run's validation data", True, "better")
CHANGES: list[RunChange] = [
    RunPlanned({"run_id": "ds-2"}, "run-ds-2", "nemo-24.12", "gs://b/ckpt", 100, 12.5, 50.0, "2026-11", 7),
    ManifestRewritten(),
    HandedOver("nemo-24.12", "nvcr.io/nvidia/nemo:24.12", ["python", "pretrain.py"], [1, "gs://b/x"], None),
    TrainingResults("gs://b/run/checkpoints/last", METRICS, VERDICT),
    TrainingResults(None, None, None, "no TensorBoard events under gs://b/run"),
    RunEnd(RunStatus.FAILED, "over the cap", FailureKind.REFUSED, nodes_at_end=0),
    NothingToTrain(3, 11),
    ReleaseObserved("2026-11-28T10:00:00Z"),
]


def test_every_kind_of_change_is_exercised() -> None:
    assert {type(c) for c in CHANGES} == set(typing.get_args(transitions.RunChange))


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: type(c).__name__)
def test_a_change_sets_only_fields_the_run_record_declares(change: RunChange) -> None:
    declared = {f.name for f in dataclasses.fields(Run)} | {"plan"}
    assert set(change.fields()) <= declared, set(change.fields()) - declared


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: type(c).__name__)
def test_a_record_reads_a_change_back_as_written(change: RunChange) -> None:
    written = change.fields()
    run = Run.from_dict({"run_id": "ds-2", "dataset": "ds", "trigger": "manual", **written})
    for name, value in written.items():
        if name == "plan":
            continue
        read = getattr(run, name)
        if value is None:
            assert read is None, name
        elif name == "metrics":
            assert read == TrainingMetrics.from_dict(value) and read.steps == METRICS.steps
            assert read.val_loss is None  # NaN is not JSON: the record holds None
        elif name == "eval":
            assert read == VERDICT
        elif name in ("status", "failure"):
            assert str(read) == value
        else:
            assert read == value, name


def test_results_without_a_verdict_leave_the_first_one_and_without_gaps_leave_the_reason() -> None:
    """A retried results step judges nothing (the champion is its own checkpoint): the first verdict
    stays; a complete result leaves the record's reason as it was."""
    fields = TrainingResults("gs://b/c", METRICS).fields()
    assert "eval" not in fields and "reason" not in fields
    assert TrainingResults(None, None, missing="no checkpoint").fields()["reason"] == "no checkpoint"


def test_an_empty_run_ends_succeeded_with_no_node_asked_for() -> None:
    run = Run.from_dict(
        {"run_id": "r", "dataset": "ds", "trigger": "manual", **NothingToTrain(2, 5).fields()}
    )
    assert (run.status, run.nodes_at_end, run.objects, run.manifest_generation) == (
        RunStatus.SUCCEEDED,
        0,
        2,
        5,
    )
    assert run.finished_at == run.work_ended_at and run.failure is None
    assert run.reason == "nothing to train: its 2 object(s) are empty"


def test_a_retry_recorded_as_earlier_releases_did_and_an_unknown_trigger_still_read() -> None:
    older = Run.from_dict({"run_id": "ds-3", "dataset": "ds", "trigger": "retry of ds-1"})
    assert (older.trigger, older.retry_of) == (Trigger.RETRY, "ds-1")
    newer = Run.from_dict({"run_id": "ds-4", "dataset": "ds", "trigger": "pubsub-push"})
    assert newer.trigger == Trigger.OTHER
    now = Run.from_dict({"run_id": "ds-5", "dataset": "ds", "trigger": "retry", "retry_of": "ds-2"})
    assert (now.trigger, now.retry_of) == (Trigger.RETRY, "ds-2")
    assert read_trigger("retry") == (Trigger.RETRY, None)  # a bare retry names no run
    assert read_trigger(None) == (Trigger.OTHER, None) and read_trigger("manual") == (Trigger.MANUAL, None)


def test_a_retry_says_which_run_it_re_runs() -> None:
    retry = Run.from_dict({"run_id": "ds-6", "dataset": "ds", "trigger": "retry", "retry_of": "ds-2"})
    assert retry.triggered_by == "retry of ds-2"
    assert Run.from_dict({"run_id": "ds-7", "dataset": "ds", "trigger": "manual"}).triggered_by == "manual"


def test_objects_set_aside_read_back_typed_from_what_the_workflow_records() -> None:
    """The workflow copies the tokenize report's ``quarantined_objects`` into the record as JSON; a reader
    gets :class:`ObjectSetAside` back, and writing it again writes the same JSON."""
    written = [
        {"object": "gs://land/a.parquet", "generation": 7, "reason": "unreadable", "detail": "not Parquet"},
        {"object": "gs://land/b.txt", "generation": None, "reason": "object_changed", "detail": ""},
    ]
    run = Run.from_dict({"run_id": "r", "dataset": "d", "trigger": "manual", "quarantined_objects": written})
    assert run.quarantined_objects == [
        ObjectSetAside("gs://land/a.parquet", 7, "unreadable", "not Parquet"),
        ObjectSetAside("gs://land/b.txt", None, "object_changed"),
    ]
    versions = [q.version for q in run.quarantined_objects]
    assert versions == [("gs://land/a.parquet", 7), ("gs://land/b.txt", 0)]
    assert run.to_dict()["quarantined_objects"] == written
