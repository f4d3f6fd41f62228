"""workflows/retrain.yaml's paths on virtual time (tests/workflows/run_world.py): each way a run ends,
with the deployment's own periods and deadlines (infra/'s values; hours of them in a fraction of a
second each), timed and accounted exactly.  Every path releases everything it made: the JobSet, the
capacity request, its PodTemplate, the run's service account and folder; the nodes go back to zero."""

from __future__ import annotations

import logging
import math

import pytest

from cloudworkflows import WorkflowError, load_workflow
from cloudworkflows.syntax import Step

from .run_world import RUN_ID, WORKFLOW, Scenario, World, deployed_settings

DEFAULT = Scenario()
POLL = deployed_settings().poll_interval_s  # the workflow's polls of Dataflow, DWS and the nodes


def polled(event: float, since: float, period: float = POLL) -> float:
    """When a wait that looks every ``period`` from ``since`` first sees what happened at ``event``."""
    return since + period * math.ceil((event - since) / period)


assert DEFAULT.tokenize_s is not None and DEFAULT.provision_s is not None and DEFAULT.train_s is not None
TOKENIZED = polled(DEFAULT.tokenize_s, 0.0)  # provisioning starts then
PROVISIONED = polled(TOKENIZED + DEFAULT.provision_s, TOKENIZED)  # training starts then
TRAINED = PROVISIONED + DEFAULT.train_s  # the completion's callback wakes the wait at once
ZERO = polled(TRAINED + DEFAULT.scale_down_s, TRAINED)  # the release sees the nodes gone


def ended(world: World) -> WorkflowError:
    """The execution's error (a run that did not succeed ends its execution with one)."""
    result = world.run()
    assert isinstance(result, WorkflowError), result
    return result


def assert_released(world: World) -> None:
    """Nothing the run made is left, its folder is gone, its nodes are back to zero."""
    assert world.kube.objects == {} and world.kube.nodes == []
    assert world.record["nodes_at_end"] == 0
    folder = f"/storage/v1/b/{world.argument['artifacts_bucket']}/managedFolders/runs/{RUN_ID}/"
    assert world.folders[-1] == ("DELETE", folder)
    assert world.steps[-1] == "finish"  # the content of a run that did not succeed is given back


def jobset_deleted_at(world: World) -> list[float]:
    """When the run's JobSet was deleted (seconds after the start): when its wait ended."""
    return [t for t, path in world.kube.deleted if "/jobsets/" in path]


def statuses(world: World) -> list[tuple[float, str]]:
    return [(t, w["status"]) for t, w in world.writes if "status" in w]


def test_a_run_that_trains_is_billed_from_its_capacity_to_the_autoscaler_s_removal() -> None:
    world = World(Scenario(nodes=2))
    assert world.run() == {"run_id": RUN_ID, "status": "succeeded", "nodes_at_end": 0}
    assert statuses(world) == [
        (0.0, "tokenizing"),
        (TOKENIZED, "provisioning"),
        (PROVISIONED, "training"),
        (ZERO, "succeeded"),
    ]
    nodes, price = world.argument["nodes"], world.argument["price_per_node_hour"]
    record = world.record
    assert nodes == 2 and record["nodes"] == 2
    assert record["gpu_node_seconds"] == (ZERO - PROVISIONED) * nodes
    assert record["idle_node_seconds"] == (ZERO - TRAINED) * nodes  # the scale-down delay, as seen
    assert record["cost_usd"] == pytest.approx((ZERO - PROVISIONED) * nodes / 3600 * price)
    gpus = world.argument["gpus_per_node"]
    assert record["gpu_hours"] == pytest.approx((ZERO - PROVISIONED) * nodes * gpus / 3600)
    assert record["tokens"] == world.scenario.tokens and "failure" not in record
    assert [t for t, _ in world.kube.deleted] == [TRAINED] * 4  # JobSet, request, PodTemplate, account
    assert world.steps == ["begin", "handover", "results", "account", "finish"]
    types = [e["type"] for e in world.events if "type" in e]
    assert types == ["tokenizing", "provisioning", "training", "releasing", "succeeded"]
    assert_released(world)


def test_a_run_whose_node_time_cannot_be_priced_still_records_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The account step is Python's (run_step down then): the end is recorded all the same, with the node
    time observed and no price, and the run's content is still settled."""
    world = World(Scenario(steps_account=False))
    caplog.set_level(logging.WARNING, logger="cloudworkflows.sys.log")
    assert world.run() == {"run_id": RUN_ID, "status": "succeeded", "nodes_at_end": 0}
    record = world.record
    assert record["status"] == "succeeded" and record["gpu_node_seconds"] == ZERO - PROVISIONED
    assert "cost_usd" not in record and "gpu_hours" not in record
    assert world.steps[-2:] == ["account", "finish"]
    assert "account step failed, the node time is recorded unpriced" in caplog.text


def test_a_lost_completion_message_costs_at_most_one_completion_check() -> None:
    world = World(Scenario(notify=False, train_s=3650.0))  # ends between two checks
    assert world.run()["status"] == "succeeded"
    check, ended_at = world.argument["completion_check_s"], PROVISIONED + 3650.0
    noticed = jobset_deleted_at(world)
    assert noticed == [polled(ended_at, PROVISIONED, check)] and 0 < noticed[0] - ended_at <= check
    assert_released(world)


def test_capacity_dws_never_provides_fails_the_run_at_its_deadline_asking_again_meanwhile() -> None:
    world = World(Scenario(provision_s=None))
    error = ended(world)
    timeout, reask = world.argument["provision_timeout_s"], world.argument["provision_reask_s"]
    requests = [t for t, path in world.kube.created if "/provisioningrequests/" in path]
    assert len(requests) == timeout // reask  # made again every reask period, until the deadline
    assert requests[0] == TOKENIZED and requests[1] - requests[0] >= reask
    assert world.record["failure"] == "CapacityTimeout" and world.record["status"] == "failed"
    assert error.value["message"] == (
        f"DWS did not provision 1 node(s) within {timeout} s ({len(requests)} request(s))"
    )
    failed_at = statuses(world)[-1][0]
    poll = world.argument["poll_interval_s"]
    assert TOKENIZED + timeout < failed_at <= TOKENIZED + timeout + poll
    assert not [p for _, p in world.kube.created if "/jobsets/" in p]
    assert world.record["gpu_node_seconds"] == 0.0 and world.record["cost_usd"] == 0.0
    assert_released(world)


def test_capacity_dws_refuses_fails_the_run_with_its_condition() -> None:
    world = World(Scenario(provision_condition="Failed"))
    error = ended(world)
    assert world.record["failure"] == "CapacityError"
    assert error.value["message"].startswith("DWS did not provide capacity (Failed)")
    assert statuses(world)[-1] == (PROVISIONED, "failed")  # seen at the poll it happened on
    assert_released(world)


def test_a_capacity_request_deleted_under_the_run_ends_it_with_a_capacity_error() -> None:
    """Someone deletes the run's capacity request while it waits (and, in
    tests/shared_stack/test_workflow_failures.py, makes it again, which the run may read between): the next
    poll reads a 404, and the run fails as it does when the request was replaced, not with the connector's
    bare error."""
    world = World(Scenario(provision_s=None, withdraw_request_s=60.0))
    error = ended(world)
    assert world.record["failure"] == "CapacityError" and error.value["tags"] == ["failed"]
    name = next(p for _, p in world.kube.created if "/provisioningrequests" in p).rsplit("/", 1)[1]
    assert error.value["message"].startswith(f"capacity request {name} is no longer the one this run made")
    assert error.value["message"].endswith(", now gone)")
    assert_released(world)


def test_training_that_fails_releases_its_nodes_and_bills_them_to_their_removal() -> None:
    world = World(Scenario(train_condition="Failed"))
    error = ended(world)
    assert world.record["failure"] == "TrainingFailed" and error.value["tags"] == ["failed"]
    assert error.value["message"].startswith("training failed: Failed")
    assert world.record["gpu_node_seconds"] == (ZERO - PROVISIONED) * world.argument["nodes"]
    assert world.steps == ["begin", "handover", "account", "finish"]  # no results to read
    assert_released(world)


def test_capacity_taken_back_in_training_is_seen_at_the_next_check_and_ends_the_run() -> None:
    world = World(Scenario(revoke_s=1000.0))
    error = ended(world)
    assert world.record["failure"] == "CapacityError"
    assert error.value["message"] == "DWS took the capacity back (CapacityRevoked): preempted"
    check = world.argument["completion_check_s"]
    stopped = jobset_deleted_at(world)
    assert stopped == [polled(PROVISIONED + 1000, PROVISIONED, check)]  # the first check after it
    # the nodes went with the capacity: billed to when the release saw them gone (at once), none idle
    assert world.record["gpu_node_seconds"] == (stopped[0] - PROVISIONED) * world.argument["nodes"]
    assert world.record["idle_node_seconds"] == 0.0
    assert_released(world)


def test_training_that_never_ends_is_stopped_at_its_deadline() -> None:
    world = World(Scenario(train_s=None))
    error = ended(world)
    deadline = world.argument["train_timeout_s"]
    assert world.record["failure"] == "TrainingTimeout"
    assert error.value["message"].startswith(f"training did not finish within {deadline} s")
    stopped = jobset_deleted_at(world)
    check = world.argument["completion_check_s"]
    assert PROVISIONED + deadline < stopped[0] <= PROVISIONED + deadline + check
    assert_released(world)


def test_a_cancel_while_waiting_for_capacity_stops_the_run_at_once_in_the_operator_s_name() -> None:
    world = World(Scenario(provision_s=None, cancel_at_s=TOKENIZED + 50))
    error = ended(world)
    assert world.record["status"] == "cancelled" and world.record["failure"] == "Cancelled"
    assert error.value["message"] == "cancelled by oncall@example.com: wrong data"
    assert [t for t, _ in world.kube.deleted] == [TOKENIZED + 50] * 3  # request, PodTemplate, account
    assert "cancel" in world.steps  # the name is the ledger's, not the callback's
    assert_released(world)


def test_a_cancel_in_training_releases_at_once_and_bills_to_the_nodes_removal() -> None:
    world = World(Scenario(cancel_at_s=PROVISIONED + 600))
    error = ended(world)
    assert world.record["failure"] == "Cancelled" and error.value["tags"] == ["cancelled"]
    assert error.value["message"] == "cancelled by oncall@example.com: wrong data"
    assert jobset_deleted_at(world) == [PROVISIONED + 600]
    zero = polled(PROVISIONED + 600 + world.scenario.scale_down_s, PROVISIONED + 600)
    assert world.record["gpu_node_seconds"] == (zero - PROVISIONED) * world.argument["nodes"]
    assert_released(world)


def test_a_forged_completion_is_read_against_the_jobset_and_ignored() -> None:
    """A ``Failed`` the JobSet does not confirm, and a body that is no JSON object, change nothing."""
    world = World(Scenario(forged_at_s=PROVISIONED + 600))
    assert world.run()["status"] == "succeeded"
    assert jobset_deleted_at(world) == [TRAINED]
    assert_released(world)


def test_a_cancelled_callback_the_ledger_does_not_hold_stops_nothing() -> None:
    world = World(Scenario(provision_s=None, cancel_at_s=TOKENIZED + 50))
    world._cancel = lambda: world.deliver(b'{"state": "Cancelled"}')  # type: ignore[method-assign]
    ended(world)
    assert "cancel" in world.steps  # the ledger was asked, and holds none
    assert world.record["failure"] == "CapacityTimeout"  # it waited on to its deadline
    assert_released(world)


def test_tokenizing_that_never_ends_stops_the_job_at_its_deadline() -> None:
    world = World(Scenario(tokenize_s=None))
    error = ended(world)
    deadline = world.argument["tokenize_timeout_s"]
    assert world.record["failure"] == "TokenizeTimeout"
    assert error.value["message"] == f"tokenization did not finish within {deadline} s"
    poll = world.argument["poll_interval_s"]
    assert world.dataflow.cancelled_at is not None
    assert deadline < world.dataflow.cancelled_at <= deadline + poll
    assert [p for _, p in world.kube.created if "serviceaccounts" not in p] == []  # the account only
    assert_released(world)


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        (Scenario(tokenize_state="JOB_STATE_FAILED"), "ended in JOB_STATE_FAILED"),
        (Scenario(tokens=0), "tokenization produced no tokens"),
    ],
    ids=["job failed", "no tokens"],
)
def test_tokenizing_that_fails_ends_the_run_before_any_capacity(scenario: Scenario, message: str) -> None:
    world = World(scenario)
    error = ended(world)
    assert world.record["failure"] == "TokenizeFailed" and message in error.value["message"]
    assert [p for _, p in world.kube.created if "serviceaccounts" not in p] == []
    assert_released(world)


#: Every path above, for the census below.
PATHS = [
    Scenario(),
    Scenario(notify=False),
    Scenario(provision_s=None),
    Scenario(provision_condition="Failed"),
    Scenario(revoke_s=1000.0),
    Scenario(train_condition="Failed"),
    Scenario(train_s=None),
    Scenario(cancel_at_s=PROVISIONED + 600),
    Scenario(forged_at_s=PROVISIONED + 600),
    Scenario(provision_s=None, cancel_at_s=TOKENIZED + 50),
    Scenario(provision_s=None, withdraw_request_s=60.0),
    Scenario(tokenize_s=None),
    Scenario(tokenize_state="JOB_STATE_FAILED"),
    Scenario(tokens=0),
]

#: The steps that raise a new error (ending the run, unless caught) which no path above takes, and where
#: each is tested instead.
RAISED_ELSEWHERE = {
    ("provision", "still_going"): "a withdrawn request that never goes: a cluster fault, not played here",
    ("kube_create", "not_ours"): "tests/k8s/test_k8s_workflow_calls.py (against envtest)",
    ("kube_get_own", "same"): (
        "tests/shared_stack/test_faults.py and test_workflow_failures.py (objects replaced)"
    ),
}


def test_every_error_the_workflow_raises_is_raised_by_a_path_here_or_listed() -> None:
    """The census of retrain.yaml's raising steps: a new one needs a path here, or a line above."""
    workflow = load_workflow(WORKFLOW)
    for scenario in PATHS:
        World(scenario, workflow=workflow).run()
    raising = {where for where, step in workflow.steps().items() if _raises_a_new_error(step)}
    assert {(r, n) for r, n, _ in raising - workflow.steps_taken} == set(RAISED_ELSEWHERE)
    print(f"\n{len(workflow.steps_taken)} of {len(workflow.steps())} steps of retrain.yaml taken")


def _raises_a_new_error(step: Step) -> bool:
    """A ``raise`` of an error it makes (a map), not one it caught (``${e}``)."""
    return step.kind == "raise" and isinstance(step.value, dict)
