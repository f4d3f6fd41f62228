"""The fault suite: one component killed or one message lost while a run is under way, through the whole
local stack.  Whatever happens, the run ends in a state that tells the truth, the pool is at zero nodes,
no JobSet or ProvisioningRequest is left, and every object is trained once or eligible again.

``pytest -m faults -s`` prints one line per fault (what happened, how long GPUs were held): docs/faults.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from stack_support import (
    assert_nothing_left,
    assert_released,
    drop_lines,
    finish,
    new_dataset,
    replace_under_its_name,
    unique_lines,
    wait_for_run,
    wait_for_status,
)

from retrain.adapters.ledger import FirestoreLedger
from retrain.adapters.workflows import WorkflowsExecutions
from retrain.cancel import request_cancel
from retrain.domain.runs import FailureKind, Run
from retrain.k8s.render import jobset_name
from retrain_local.cluster import Faults
from retrain_local.stack import LocalStack
from retrain_ops.cli import operator_identity

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.emulators, pytest.mark.envtest]


def report(fault: str, run: Run, started: float) -> None:
    print(
        f"\nFAULT {fault}: {run.status} after {time.monotonic() - started:.0f} s; GPU node-seconds "
        f"{run.gpu_node_seconds:.1f} (idle {run.idle_node_seconds:.1f}); nodes at end {run.nodes_at_end}"
    )


def test_notifier_down_the_completion_is_never_published(stack: LocalStack, tmp_path: Path) -> None:
    """No message: the training wait reads the JobSet itself every completion_check_s."""
    started = time.monotonic()
    with stack.notifier_down():
        run = finish(stack, drop_lines(stack, tmp_path / "a.jsonl", unique_lines(), new_dataset()))
    assert_released(stack, run, "succeeded")
    assert run.reason is None and run.checkpoint
    report("notifier down (completion never published)", run, started)


def test_relay_function_down_when_the_completion_is_published(stack: LocalStack, tmp_path: Path) -> None:
    started = time.monotonic()
    with stack.function_down("on_jobset_event"):
        run = finish(stack, drop_lines(stack, tmp_path / "a.jsonl", unique_lines(), new_dataset()))
    assert_released(stack, run, "succeeded")
    report("relay function down (completion undeliverable)", run, started)


def test_a_file_dropped_while_the_object_function_is_down_trains_once_it_is_back(
    stack: LocalStack, tmp_path: Path
) -> None:
    """数据.jsonl: a non-Latin name, percent-encoded in the CloudEvent's headers; the Eventarc twin
    redelivers the events the dead function did not take, with Eventarc's backoff."""
    started = time.monotonic()
    dataset = new_dataset()
    path = tmp_path / "数据.jsonl"
    path.write_text("\n".join(unique_lines()) + "\n")
    from retrain_local.landing import drop

    with stack.function_down("on_object_finalized"):
        dropped = drop(stack.settings, stack.endpoints.ingest_function, [path], dataset=dataset)
        assert dropped.queued == 2  # the file's event and the seal marker's
    run = finish(stack, wait_for_run(stack, dataset, timeout_s=180))
    assert_released(stack, run, "succeeded")
    objects = FirestoreLedger(stack.settings.project).run_objects(run)
    assert [o.uri for o in objects] == [f"gs://{stack.settings.landing_bucket}/incoming/{dataset}/数据.jsonl"]
    report("object function down during a drop (数据.jsonl)", run, started)


def test_a_pod_that_crashes_once_resumes_and_the_run_succeeds(stack: LocalStack, tmp_path: Path) -> None:
    started = time.monotonic()
    stack.twin.faults = Faults(crash_pod_once=True)
    run = finish(stack, drop_lines(stack, tmp_path / "a.jsonl", unique_lines(), new_dataset()))
    assert_released(stack, run, "succeeded")
    assert run.metrics is not None and run.metrics.steps == stack.settings.steps_per_run
    report("training pod crashes once (JobSet restart)", run, started)


def test_cancelled_in_training_its_content_is_eligible_again(stack: LocalStack, tmp_path: Path) -> None:
    """A cancel during training releases every node; the same bytes dropped again train in a new run."""
    s = stack.settings
    ledger, executions = FirestoreLedger(s.project), WorkflowsExecutions(s.project, s.region, s.workflow)
    started = time.monotonic()
    dataset, lines = new_dataset(), unique_lines()
    stack.twin.faults = Faults(hold_training_s=120)
    run = drop_lines(stack, tmp_path / "a.jsonl", lines, dataset)
    wait_for_status(stack, run, "training")
    request_cancel(ledger, executions, run.run_id, "wrong data", requested_by=operator_identity())
    cancelled = finish(stack, run, 120)
    assert_released(stack, cancelled, "cancelled")
    # its content goes back in the workflow's finish step, just after the record it waited for
    deadline = time.monotonic() + 60
    while not cancelled.content_returned and time.monotonic() < deadline:
        time.sleep(0.5)
        cancelled = ledger.get_run(run.run_id) or cancelled
    assert cancelled.content_returned and cancelled.gpu_node_seconds > 0
    report("cancel during training", cancelled, started)

    stack.twin.faults = Faults()
    again = drop_lines(stack, tmp_path / "same-bytes.jsonl", lines, dataset, after=run)
    assert again.run_id != run.run_id
    assert_released(stack, finish(stack, again), "succeeded")


def test_a_cancel_while_tokenizing_stops_the_tokenize_job(stack: LocalStack, tmp_path: Path) -> None:
    """The cancel reaches the tokenize wait: the workflow cancels the Dataflow job (jobs.update,
    JOB_STATE_CANCELLED; locally its process is killed), asks for no capacity, and ends cancelled."""
    s = stack.settings
    ledger, executions = FirestoreLedger(s.project), WorkflowsExecutions(s.project, s.region, s.workflow)
    started = time.monotonic()
    corpus = sorted((Path(__file__).resolve().parents[3] / "shared" / "corpus").glob("*.txt"))
    text = "".join(p.read_text(encoding="utf-8") for p in corpus)
    lines = [
        json.dumps({"text": f"{i} {text[j : j + 4000]}"}) for i, j in enumerate(range(0, len(text), 4000))
    ]
    run = drop_lines(stack, tmp_path / "big.jsonl", lines * 4, new_dataset())  # long enough to cancel
    wait_for_status(stack, run, "tokenizing")
    request_cancel(ledger, executions, run.run_id, "wrong data", requested_by=operator_identity())
    ended = finish(stack, run, 120)
    assert_released(stack, ended, "cancelled")
    assert ended.gpu_node_seconds == 0 and ended.tokens == 0  # no capacity asked for, nothing tokenized
    assert stack.dataflow.cancelled, "the tokenize job was not cancelled"
    assert all(job.poll() is not None for job in stack.dataflow.jobs.values())  # nothing still running
    report("cancel while tokenizing", ended, started)


def test_a_forged_failure_posted_to_the_callback_is_ignored(stack: LocalStack, tmp_path: Path) -> None:
    """Anyone who can call the callback is only giving a hint: the training wait reads the JobSet, which
    is running, logs the message as unconfirmed and waits on; a Cancelled with no cancel in the ledger
    (retrain cancel records one first) stops nothing, whatever name it gives; the run succeeds."""
    s = stack.settings
    ledger, executions = FirestoreLedger(s.project), WorkflowsExecutions(s.project, s.region, s.workflow)
    started = time.monotonic()
    stack.twin.faults = Faults(hold_training_s=8)
    run = drop_lines(stack, tmp_path / "a.jsonl", unique_lines(), new_dataset())
    wait_for_status(stack, run, "training")
    current = ledger.get_run(run.run_id)
    assert current is not None and current.callback_url
    forged = {
        "state": "Failed",
        "reason": "FailedJobs",
        "run_id": run.run_id,
        "jobset": f"retrain-{run.run_id}",
    }
    assert executions.send_callback(current.callback_url, forged) == 200  # delivered, and not believed
    cancel = {"state": "Cancelled", "run_id": run.run_id, "requested_by": "the-ceo", "reason": "forged"}
    assert executions.send_callback(current.callback_url, cancel) == 200
    # bodies that are no JSON object (map.get on them raised, and the run failed): logged, waited past
    for odd in (["Cancelled"], "Cancelled", 7):
        assert executions.session().post(current.callback_url, json=odd, timeout=30).status_code == 200
    ended = finish(stack, run)
    assert_released(stack, ended, "succeeded")
    assert ended.cancel_requested_by is None
    said = (stack.state_dir / "function-run_step.log").read_text()  # read, asked after, and let be
    assert f"run {run.run_id}: a Cancelled callback without a cancel in the ledger is ignored" in said
    report("a forged Failed and Cancelled POSTed to the run's callback", ended, started)


def test_a_jobset_replaced_under_the_runs_name_is_not_taken_for_the_runs(
    stack: LocalStack, tmp_path: Path
) -> None:
    """The training wait reads the JobSet by name and confirms it by the uid its create answered: one
    deleted and created again under the run's name, label and all (by whoever may write JobSets), is not
    the run's, and its completion would not be; the run fails saying so, and still releases every GPU."""
    started = time.monotonic()
    stack.twin.faults = Faults(hold_training_s=60)
    run = drop_lines(stack, tmp_path / "a.jsonl", unique_lines(), new_dataset())
    wait_for_status(stack, run, "training")
    name = jobset_name(run.run_id)
    replace_under_its_name(stack, ("jobset.x-k8s.io", "v1alpha2", stack.settings.namespace, "jobsets"), name)
    ended = finish(stack, run, 180)
    assert_released(stack, ended, "failed")
    assert ended.failure == FailureKind.TRAINING_FAILED and ended.reason, ended
    assert f"JobSet {name} is no longer the one this run made" in ended.reason, ended.reason
    report("a JobSet replaced under the run's name", ended, started)


def test_a_lost_execution_is_recorded_failed_and_its_capacity_reaped(
    stack: LocalStack, tmp_path: Path
) -> None:
    """The workflow execution vanishes mid-training (its service lost it): the sweeper records the run
    failed ("execution lost") and reaps its JobSet and capacity request; the nodes scale down."""
    started = time.monotonic()
    stack.twin.faults = Faults(hold_training_s=120)
    run = drop_lines(stack, tmp_path / "a.jsonl", unique_lines(), new_dataset())
    wait_for_status(stack, run, "training")
    current = FirestoreLedger(stack.settings.project).get_run(run.run_id)
    assert current is not None and current.execution
    stack.executions.forget(current.execution)
    ended = finish(stack, run, 180)
    assert ended.reason and ended.reason.startswith("execution lost"), ended
    assert ended.status == "failed" and ended.content_returned
    deadline = time.monotonic() + 120
    while stack.twin.node_names():  # the reaper deleted its JobSet; the autoscaler takes the node
        assert time.monotonic() < deadline, "the lost run's node never went away"
        time.sleep(0.5)
    # the record says so: the reaper's next pass sees the pool at zero and writes it into the lost run's
    # record, which its execution never could
    ledger = FirestoreLedger(stack.settings.project)
    while (seen := ledger.get_run(run.run_id)) is not None and seen.nodes_at_end is None:
        assert time.monotonic() < deadline, "the lost run's record never observed its release"
        time.sleep(0.5)
    assert seen is not None and seen.nodes_at_end == 0 and seen.release_observed_at, seen
    # its folder's write grant stays (only a release deletes it), but the reaper took the service account
    # it names: no pod can be that principal any more
    assert [b.on.key for b in stack.guard.policy.bindings if f"/runs/{run.run_id}/" in b.address] == [
        f"{stack.settings.artifacts_bucket}/runs/{run.run_id}/"
    ]
    assert_nothing_left(stack)
    seconds = time.monotonic() - started
    print(f"\nFAULT workflow execution lost in training: failed; no node left {seconds:.0f} s after the drop")
