"""The whole local stack for tests that drive runs through it: one stack per module, a run from a fresh
dataset, and the checks every ending must pass (zero nodes, no JobSet, no ProvisioningRequest)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes.ledger import InMemoryLedger
from kubernetes import client

from retrain.adapters.ledger import FirestoreLedger
from retrain.adapters.workflows import WorkflowsExecutions
from retrain.domain.runs import FailureKind, Run, now_iso
from retrain.k8s.render import RUN_ID_ANNOTATION
from retrain_local import emulators
from retrain_local.envtest import envtest_unavailable_reason
from retrain_local.iam import RUNTIME_POLICY
from retrain_local.landing import drop
from retrain_local.stack import LocalStack
from retrain_ops.cli import follow
from retrain_ops.deployment import local_settings


def module_stack(tmp_path_factory: pytest.TempPathFactory, **overrides: Any) -> Iterator[LocalStack]:
    """The local stack on infra/'s values, scaled for tests: one stand-in rank per node, 4 steps of 2
    sequences (a stand-in rank of infra's 8 spent most of a run's CPU on its 32 forward and backward
    passes through GPT-2's 50,257-wide head), a released run's nodes gone a second after they are
    unneeded (the demo's test keeps the autoscaler's 10 minutes / 60; each of these runs would wait them
    out), and any other settings in ``overrides``."""
    for reason in (emulators.java_emulators_unavailable_reason(), envtest_unavailable_reason()):
        if reason:
            pytest.skip(reason)
    settings = dataclasses.replace(
        local_settings({}),  # what the local stack runs on: infra/'s values (retrain_ops.deployment)
        gpus_per_node=1,  # one stand-in rank per node: these runs are about their endings, not training
        steps_per_run=4,
        global_batch_size=2,
        provision_timeout_s=8,
        provision_reask_s=3,
        provision_delay_s=0.5,
        scale_down_delay_s=1.0,
        state_dir=str(tmp_path_factory.mktemp("stack")),
        **overrides,
    )
    # No later stack reads its ledger: no export while it runs.  Its runs are about their endings: the
    # stand-in launcher (PyTorch's own launches the demo's, the round trip's and tests/train/'s runs).
    with LocalStack(settings, fresh=True, ledger_export_s=None, standin_launcher=True) as s:
        yield s
        assert_accounted(s)  # every dataset once more: no later test lost what an earlier one dropped


def unique_lines(n: int = 5) -> list[str]:
    return [json.dumps({"text": f"document {i} of a unique batch {uuid.uuid4()}"}) for i in range(n)]


def drop_lines(
    stack: LocalStack, path: Path, lines: list[str], dataset: str, after: Run | None = None
) -> Run:
    """Drop one file of ``lines`` into ``dataset`` (sealed); the run it made (not ``after``)."""
    path.write_text("\n".join(lines) + "\n")
    drop(stack.settings, stack.endpoints.ingest_function, [path], dataset=dataset)
    return wait_for_run(stack, dataset, after=after)


def wait_for_run(stack: LocalStack, dataset: str, timeout_s: float = 120, after: Run | None = None) -> Run:
    """The newest run of ``dataset`` (other than ``after``), waiting for it to be made."""
    ledger = FirestoreLedger(stack.settings.project)
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [r for r in ledger.list_runs() if r.dataset == dataset]
        runs = [r for r in runs if after is None or r.run_id != after.run_id]
        if runs:
            return runs[0]
        assert time.monotonic() < deadline, f"no run of {dataset} within {timeout_s} s"
        time.sleep(0.5)


def finish(stack: LocalStack, run: Run, timeout_s: float = 300) -> Run:
    """The run's record once it ended and its execution is done: the workflow's steps after the end's
    record (the finish step gives a failed run's content back) run before the record is read again."""
    s = stack.settings
    executions = WorkflowsExecutions(s.project, s.region, s.workflow)
    ledger = FirestoreLedger(s.project)
    ended = follow(ledger, run.run_id, timeout_s, executions)
    if ended.execution:
        with contextlib.suppress(KeyError):  # an execution the test made vanish
            stack.executions.wait(ended.execution, timeout=120)
    return ledger.get_run(run.run_id) or ended


def wait_for_status(stack: LocalStack, run: Run, status: str, timeout_s: float = 120) -> None:
    ledger = FirestoreLedger(stack.settings.project)
    deadline = time.monotonic() + timeout_s
    while (current := ledger.get_run(run.run_id)) is None or current.status != status:
        assert current is None or not current.status.terminal, current
        assert time.monotonic() < deadline, current
        time.sleep(0.2)


def replace_under_its_name(stack: LocalStack, group: tuple[str, str, str, str], name: str) -> dict[str, Any]:
    """Delete a run's custom object (``group``: API group, version, namespace, plural) once the workflow
    has made it, and create it again under its name, labels and annotations (as whoever may write that
    kind could): a new object with a new uid.  Returns the object the workflow made."""
    custom = client.CustomObjectsApi(stack.kube_api)
    deadline = time.monotonic() + 60  # the status the test waited for is recorded just before the create
    while True:
        try:
            made: dict[str, Any] = custom.get_namespaced_custom_object(*group, name)
            break
        except client.ApiException as e:
            assert e.status == 404 and time.monotonic() < deadline, e
            time.sleep(0.2)
    custom.delete_namespaced_custom_object(*group, name)
    again = {k: v for k, v in made.items() if k != "status"}
    again["metadata"] = {k: made["metadata"][k] for k in ("name", "namespace", "labels", "annotations")}
    replaced = custom.create_namespaced_custom_object(*group, again)
    assert replaced["metadata"]["uid"] != made["metadata"]["uid"]
    return made


def run_with(stack: LocalStack, tmp_path: Path, faults: object, lines: list[str] | None = None) -> Run:
    """A run from a fresh dataset with the cluster twin's ``faults``, followed to its end."""
    stack.twin.faults = faults
    run = drop_lines(stack, tmp_path / f"{uuid.uuid4().hex}.jsonl", lines or unique_lines(), new_dataset())
    return finish(stack, run)


def new_dataset() -> str:
    return f"d{uuid.uuid4().hex[:8]}"


def assert_released(stack: LocalStack, run: Run, status: str = "failed") -> None:
    """The run ended ``status`` and left nothing: zero nodes, no JobSet, no ProvisioningRequest."""
    assert run.status == status, run
    assert run.nodes_at_end == 0
    assert_nothing_left(stack)


def assert_nothing_left(stack: LocalStack) -> None:
    """No GPU node; no JobSet, ProvisioningRequest or PodTemplate in any namespace; no run's service
    account, nor its folder's grant but those of runs whose execution was lost (only a release deletes a
    grant; the reaper takes their service account, so nothing can be what the grant names)."""
    assert stack.twin.node_names() == []
    custom = client.CustomObjectsApi(stack.kube_api)
    for group, version, plural in (
        ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
        ("autoscaling.x-k8s.io", "v1", "provisioningrequests"),
    ):
        items = custom.list_cluster_custom_object(group, version, plural)["items"]
        assert [i["metadata"]["name"] for i in items] == [], plural
    templates = client.CoreV1Api(stack.kube_api).list_pod_template_for_all_namespaces().items
    assert [t.metadata.name for t in templates] == []
    # nor a run's identity: its service account, and the write grant on its folder
    accounts = client.CoreV1Api(stack.kube_api).list_service_account_for_all_namespaces().items
    assert [a.metadata.name for a in accounts if RUN_ID_ANNOTATION in (a.metadata.annotations or {})] == []
    ledger = FirestoreLedger(stack.settings.project)
    left = [b.on.key for b in stack.guard.policy.bindings if b.address.startswith(RUNTIME_POLICY)]
    runs = {key: ledger.get_run(key.rstrip("/").rsplit("/", 1)[-1]) for key in left}
    assert [k for k, run in runs.items() if not (run and run.failure == FailureKind.EXECUTION_LOST)] == []


_ACCOUNTED: dict[Path, set[str]] = {}
"""Per stack (its state folder): the datasets an audit after one of its tests found every object of
accounted for."""


def assert_accounted(stack: LocalStack, settle_s: float = 60.0, *, new_only: bool = False) -> None:
    """``retrain audit`` on the stack: every object that landed is trained, held, pending, given back by a
    run that failed, gone or refused with a reason; a finding that holds for ``settle_s`` (work still in
    flight settles) fails the test, object by object.  ``new_only`` (the audit after each test) reads
    only the datasets no earlier audit of this stack found accounted for: a stack shared by many tests
    read every earlier test's runs again after each test; :func:`module_stack` audits the whole stack
    once more before it stops."""
    from retrain.adapters import objects
    from retrain.audit import audit, landed

    s = stack.settings
    ledger = FirestoreLedger(s.project)
    if new_only:
        names = set(ledger.datasets()) | {n for n in landed(s, objects).by_dataset if n}
        todo = sorted(names - _ACCOUNTED.get(stack.state_dir, set()))
        reports = [audit(s, ledger, objects, dataset=name, settle_s=settle_s) for name in todo]
    else:
        todo, reports = [], [audit(s, ledger, objects, settle_s=settle_s)]
    lines = [
        f"{e.account} {e.uri}#{e.generation} ({e.detail}): {e.action}" for r in reports for e in r.findings
    ]
    assert not lines, "objects not accounted for:\n" + "\n".join(lines)
    _ACCOUNTED.setdefault(stack.state_dir, set()).update(todo)


REPO = Path(__file__).resolve().parents[1]


def infra_copy(into: Path) -> Path:
    """A copy of the repository's infra/ to mutate, beside links to everything else of the repository
    (what the Terraform reads: workflows/, k8s/, functions/ ...); returns the copy's infra/."""
    import shutil

    into.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if entry.name == "infra":
            shutil.copytree(entry, into / "infra", ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
        elif not entry.name.startswith("."):
            (into / entry.name).symlink_to(entry)
    return into / "infra"


def remove_resource(infra: Path, stage_file: str, rtype: str, name: str, replace_with: str = "") -> None:
    """Delete ``resource "rtype" "name" { ... }`` from ``infra/stage_file`` (or put ``replace_with`` in
    its place); AssertionError when the file has no such resource."""
    path = infra / stage_file
    text = path.read_text()
    start = text.find(f'resource "{rtype}" "{name}" {{')
    assert start >= 0, f"{stage_file} has no {rtype}.{name}"
    depth, end = 0, start
    for end in range(text.index("{", start), len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            break
    path.write_text(text[:start] + replace_with + text[end + 1 :])


def stored_plan(ledger: FirestoreLedger, run_id: str) -> dict[str, Any] | None:
    """The plan Ingest kept on the run's record (``plan``), which the workflow's begin step hands over."""
    snap = ledger.db.collection("runs").document(run_id).get(field_paths=["plan"])
    plan = (snap.to_dict() or {}).get("plan") if snap.exists else None
    return dict(plan) if isinstance(plan, dict) else None


def overwrite_run(ledger: FirestoreLedger | InMemoryLedger, run_id: str, fields: dict[str, Any]) -> None:
    """Set a run record's fields as a test's setup: the states and outcomes the workflow's ``record``
    sub-workflow writes, or a record an older release left.  Python's own writes are typed changes
    (:mod:`retrain.domain.transitions`); only tests write fields by name."""
    if isinstance(ledger, InMemoryLedger):
        ledger.overwrite_run(run_id, fields)
    else:
        ledger.db.collection("runs").document(run_id).update({**fields, "updated_at": now_iso()})
