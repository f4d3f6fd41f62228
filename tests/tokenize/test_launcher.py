"""The local flex-template launch keeps Dataflow's contract: the launch is checked against the template
spec's metadata, the template's program (dataflow/main.py) runs with its parameters, and a program that
runs no pipeline leaves no job to submit, so the job fails, as it does in the cloud.  Each job runs both
ways the local Dataflow starts one: a process of its own, and forked from a warm interpreter (the stack's)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cloudworkflows import WorkflowError
from retrain.adapters import objects
from retrain.contracts import RunManifest
from retrain.domain.events import ObjectVersion
from retrain_local.dataflow import LocalDataflow
from retrain_ops.deployment import Deployment

pytestmark = pytest.mark.integration  # the Cloud Storage emulator, a process


@pytest.fixture
def template(gcs_emulator: str) -> str:
    """The template spec as infra/app/dataflow.tf writes it, in the test bucket."""
    _, spec = Deployment().template_spec()
    uri = f"{gcs_emulator}/templates/tokenize.json"
    objects.write_bytes(uri, spec, "application/json")
    return uri


@pytest.fixture(params=["process", "forked"])
def local_dataflow(request: pytest.FixtureRequest) -> Iterator[Callable[..., LocalDataflow]]:
    """Makes a LocalDataflow whose jobs start each as a process of its own, or fork from a fork server
    of its own (``LocalDataflow.forking``, the stack's way); every one made is stopped after the test."""
    made: list[LocalDataflow] = []

    def make(log_dir: Path, **kwargs: Any) -> LocalDataflow:
        dataflow = (LocalDataflow.forking if request.param == "forked" else LocalDataflow)(
            log_dir, {}, **kwargs
        )
        made.append(dataflow)
        return dataflow

    yield make
    for dataflow in made:
        dataflow.stop()


def launch_args(template: str, **parameters: str) -> dict[str, Any]:
    environment = {"serviceAccountEmail": "df@p.iam", "subnetwork": "s", "tempLocation": "gs://t/tmp"}
    return {
        "projectId": "p",
        "location": "us-central1",
        "body": {
            "launchParameter": {
                "jobName": "tokenize-test",
                "containerSpecGcsPath": template,
                "environment": environment,
                "parameters": parameters,
            }
        },
    }


def run_job(dataflow: LocalDataflow, args: dict[str, Any]) -> str:
    job = dataflow.launch(args, {})["job"]["id"]
    deadline = time.monotonic() + 300
    while (state := dataflow.get({"jobId": job}, {})["currentState"]) == "JOB_STATE_RUNNING":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    return str(state)


def test_a_retry_with_nothing_new_still_runs_a_job_that_writes_the_report(
    gcs_emulator: str, template: str, tmp_path: Path, local_dataflow: Callable[..., LocalDataflow]
) -> None:
    """Every object's shard exists already (the run's retry): the program still runs a pipeline, so the
    launcher has a job, and the job writes the report."""
    uri = f"{gcs_emulator}/landing/once.jsonl"
    objects.write_bytes(uri, b'{"text": "tokenized once, reused by the retry"}\n')
    info = objects.stat(uri)
    manifest = f"{gcs_emulator}/runs/r/objects.json"
    version = ObjectVersion(uri, int(info.generation or 0), info.size, f"md5:{info.md5_hash}:jsonl")
    objects.write_bytes(manifest, RunManifest("r", "d", "b", "s", [version]).to_json())
    dataflow = local_dataflow(tmp_path)
    params = {
        "manifest": manifest,
        "shard_root": f"{gcs_emulator}/shards",
        "report": f"{gcs_emulator}/r1.json",
    }
    assert run_job(dataflow, launch_args(template, **params)) == "JOB_STATE_DONE"
    params["report"] = f"{gcs_emulator}/r2.json"
    assert run_job(dataflow, launch_args(template, **params)) == "JOB_STATE_DONE"  # nothing new to tokenize
    report = json.loads(objects.read_bytes(params["report"]))
    assert (report["new_objects"], report["reused_objects"], report["documents"]) == (0, 1, 1)


def test_a_program_that_runs_no_pipeline_fails_its_launch(
    template: str, tmp_path: Path, local_dataflow: Callable[..., LocalDataflow]
) -> None:
    program = tmp_path / "main.py"
    program.write_text("import sys\nprint('parsed', sys.argv[1:])\n")  # exits 0, submits nothing
    dataflow = local_dataflow(tmp_path / "jobs", program=program)
    assert run_job(dataflow, launch_args(template, manifest="gs://b/m.json")) == "JOB_STATE_FAILED"
    (log,) = (tmp_path / "jobs").glob("tokenize-*.log")  # the job's, beside a fork server's
    assert "parsed ['--manifest=gs://b/m.json'" in log.read_text()  # the program's own output
    assert "Failed to read the job file" in log.read_text()


def test_a_cancelled_job_is_stopped_and_says_so(
    template: str, tmp_path: Path, local_dataflow: Callable[..., LocalDataflow]
) -> None:
    """jobs.update to JOB_STATE_CANCELLED stops the job's process at once (Dataflow's cancel), and the
    job reads JOB_STATE_CANCELLED from then on."""
    program = tmp_path / "main.py"
    program.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    dataflow = local_dataflow(tmp_path / "jobs", program=program)
    job = dataflow.launch(launch_args(template, manifest="gs://b/m.json"), {})["job"]["id"]
    (log,) = (tmp_path / "jobs").glob("tokenize-*.log")  # the job's, beside a fork server's
    deadline = time.monotonic() + 120
    while "started" not in log.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    pid = dataflow.jobs[job].pid
    cancel = {"jobId": job, "projectId": "p", "body": {"requestedState": "JOB_STATE_CANCELLED"}}
    assert dataflow.update(cancel, {})["currentState"] == "JOB_STATE_CANCELLED"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, and reaped
    assert dataflow.get({"jobId": job, "projectId": "p"}, {})["currentState"] == "JOB_STATE_CANCELLED"


def test_jobs_run_on_as_processes_of_their_own_once_the_fork_server_went(
    template: str, tmp_path: Path
) -> None:
    """Nothing restarts a killed fork server: the jobs launched after it went start as processes of their
    own, as a LocalDataflow without one starts them, instead of failing to reach it."""
    program = tmp_path / "main.py"
    program.write_text("print('ran', flush=True)\n")  # exits 0, submits nothing
    dataflow = LocalDataflow.forking(tmp_path / "jobs", {}, program=program)
    try:
        assert dataflow.forks is not None and dataflow.forks.proc is not None
        dataflow.forks.proc.kill()
        dataflow.forks.proc.wait()
        assert run_job(dataflow, launch_args(template, manifest="gs://b/m.json")) == "JOB_STATE_FAILED"
        (job,) = dataflow.jobs.values()
        assert isinstance(job, subprocess.Popen)
        (log,) = (tmp_path / "jobs").glob("tokenize-*.log")
        assert "ran" in log.read_text() and "Failed to read the job file" in log.read_text()
    finally:
        dataflow.stop()


@pytest.mark.parametrize(
    ("parameters", "refusal"),
    [
        ({"manifest": "gs://b/m.json", "extra": "x"}, "parameter 'extra' is not declared"),
        ({"manifest": "/local/m.json"}, "parameter 'manifest': '/local/m.json' does not match"),
    ],
)
def test_parameters_are_checked_against_the_template_metadata(
    template: str, tmp_path: Path, parameters: dict[str, str], refusal: str
) -> None:
    with pytest.raises(WorkflowError, match=refusal):
        LocalDataflow(tmp_path, {}).launch(launch_args(template, **parameters), {})


def test_a_launch_without_its_template_spec_is_refused(gcs_emulator: str, tmp_path: Path) -> None:
    with pytest.raises(WorkflowError, match="cannot read the template spec"):
        LocalDataflow(tmp_path, {}).launch(launch_args(f"{gcs_emulator}/templates/none.json"), {})


def test_a_second_launch_under_an_active_job_s_name_is_refused(
    template: str, tmp_path: Path, local_dataflow: Callable[..., LocalDataflow]
) -> None:
    """A job name is unique among active jobs (409 ALREADY_EXISTS, apache/beam#29441); once the job has
    ended, the name is free again."""
    program = tmp_path / "main.py"
    program.write_text("import time\ntime.sleep(3)\n")
    dataflow = local_dataflow(tmp_path / "jobs", program=program)
    args = launch_args(template, manifest="gs://b/m.json")
    first = dataflow.launch(args, {})["job"]["id"]
    with pytest.raises(WorkflowError, match="already an active job named tokenize-test") as refused:
        dataflow.launch(args, {})
    assert refused.value.value["code"] == 409
    assert refused.value.value["body"]["error"]["status"] == "ALREADY_EXISTS"
    while dataflow.get({"jobId": first}, {})["currentState"] == "JOB_STATE_RUNNING":
        time.sleep(0.2)
    assert dataflow.launch(args, {})["job"]["id"] != first
    dataflow.stop()
