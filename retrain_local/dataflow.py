"""Dataflow's flex-template launcher and its jobs, played locally.

A flex-template launch reads the template spec at ``containerSpecGcsPath`` (what infra/app/dataflow.tf
writes: the image and the parameters' metadata), checks the launch's parameters against that metadata,
and runs the template's program (``dataflow/main.py``, the file the image's FLEX_TEMPLATE_PYTHON_PY_FILE
names) with the parameters as ``--name=value``.  The program must run a pipeline: the launcher submits
the job graph the pipeline leaves behind, and a program that exits without one leaves it nothing to
submit ("Failed to read the job file", GoogleCloudPlatform/python-docs-samples#4894), so the job fails.
Locally the same program runs with ``LaunchedJobRunner`` (:data:`RUNNER`), which runs the pipeline on
the FnApiRunner and leaves the job file; no job file, no job, a failed launch, as in the cloud.

Given a fork server started with :data:`JOB_PRELOAD` (:mod:`retrain_local.forkserver`), each job forks
from that warm interpreter instead of starting one: the same program, arguments, environment and log,
without each job's own import of Beam and the tokenizer (about half of a small job's CPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.api_core.exceptions import NotFound

from cloudworkflows import WorkflowError, http_error
from retrain.adapters import credentials, objects
from retrain_local import forkserver, processes
from retrain_local.iam import Kind, Resource
from retrain_local.identities import Caller, connector_require

Args = dict[str, Any]

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The template's program, as the launcher image runs it (dataflow/Dockerfile's FLEX_TEMPLATE_PYTHON_PY_FILE).
TEMPLATE_PROGRAM = REPO_ROOT / "dataflow" / "main.py"
#: Where LaunchedJobRunner leaves the job file (what the launcher would submit).
JOB_FILE_VAR = "RETRAIN_LOCAL_DATAFLOW_JOB_FILE"
#: The runner a launched program's pipeline meets locally (``--runner``), by name: importing Beam costs a
#: second, which every `retrain` command that reaches the stack would pay.
RUNNER = "retrain_local.dataflow_runner.LaunchedJobRunner"
#: What a job's fork server imports once: the template program's own imports and the local runner's.
JOB_PRELOAD = ("retrain_tokenize.cli", "retrain_local.dataflow_runner")


class _ForkedJob:
    """A job forked from the fork server, waited on as a :class:`subprocess.Popen` (``poll``, ``wait``)."""

    def __init__(self, child: forkserver.Child, forks: forkserver.ForkServer, mark: tuple[str, str]) -> None:
        self.pid = child.pid
        self.returncode: int | None = None
        self._child, self._forks, self._mark = child, forks, mark
        self._ended = threading.Event()
        threading.Thread(target=self._wait, name=f"dataflow job {child.pid}", daemon=True).start()

    def _wait(self) -> None:
        try:
            self.returncode = self._child.wait()
        except forkserver.ForkServerError:  # the server went, and its children with it
            self.returncode = -signal.SIGKILL
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode if self._ended.is_set() else None

    def wait(self) -> int | None:
        self._ended.wait()
        return self.returncode

    def kill(self) -> None:
        self._forks.kill(*self._mark)


Job = subprocess.Popen[bytes] | _ForkedJob


def _kill_group(proc: Job) -> None:
    """A job and the workers it started (its own process group)."""
    if isinstance(proc, _ForkedJob):
        proc.kill()  # the server kills the child's session (it leads one) and reaps it
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _refuse(code: int, message: str) -> WorkflowError:
    return WorkflowError(http_error(code, message))


def check_parameters(parameters: Mapping[str, Any], metadata: Mapping[str, Any]) -> None:
    """The launch's parameters against the template's metadata: each declared, each matching the
    declared ``regexes`` ("An array of POSIX-egrep regular expressions ... used to validate the value of
    the parameter", Dataflow's template metadata); a 400 naming the first that is not."""
    declared = {p["name"]: p for p in metadata.get("parameters") or []}
    for name, value in parameters.items():
        if name not in declared:
            raise _refuse(400, f"parameter {name!r} is not declared in the template's metadata")
        for pattern in declared[name].get("regexes") or []:
            if not re.search(pattern, str(value)):
                raise _refuse(400, f"parameter {name!r}: {str(value)[:200]!r} does not match {pattern!r}")
    for name, spec in declared.items():
        if not spec.get("isOptional") and name not in parameters:
            raise _refuse(400, f"parameter {name!r} is required by the template's metadata")


@dataclass
class LocalDataflow:
    """``flexTemplates.launch``, ``jobs.get`` and ``jobs.update`` (cancel) for the workflow's connector."""

    log_dir: Path
    env: Mapping[str, str]
    program: Path = TEMPLATE_PROGRAM
    caller: Caller | None = None
    """Who launches (the workflow's service account): ``flexTemplates.launch`` needs
    ``dataflow.jobs.create`` on the project and ``iam.serviceAccounts.actAs`` on the worker account
    (cloud.google.com/dataflow/docs/concepts/security-and-permissions), and reads the template spec as
    the caller; None: unchecked."""
    identity_env: Callable[[str], Mapping[str, str]] = lambda _member: {}
    """The environment a job's processes get to run as a member (its workers' service account)."""
    forks: forkserver.ForkServer | None = None
    """A fork server started with :data:`JOB_PRELOAD` that jobs fork from; None (or a server that is no
    longer running): each job is a process of its own."""
    jobs: dict[str, Job] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def forking(cls, log_dir: Path, env: Mapping[str, str], **kwargs: Any) -> LocalDataflow:
        """One whose jobs fork from a fork server of its own, started now (and stopped with it)."""
        forks = forkserver.ForkServer(JOB_PRELOAD, log_dir / "fork-server.log").start()
        return cls(log_dir, env, forks=forks, **kwargs)

    def _job_file(self, job_id: str) -> Path:
        return self.log_dir / f"{job_id}.job"

    def launch(self, args: Args, _: Args) -> Any:
        launch = args["body"]["launchParameter"]
        project = Resource(Kind.PROJECT, str(args.get("projectId")))
        connector_require(self.caller, "dataflow.jobs.create", project)
        spec_uri = str(launch.get("containerSpecGcsPath") or "")
        try:
            with credentials.acting_as(self.caller.token if self.caller else None):
                spec = json.loads(objects.read_bytes(spec_uri))
        except (FileNotFoundError, NotFound, ValueError) as e:
            raise _refuse(400, f"cannot read the template spec {spec_uri!r}: {e}") from None
        except Exception as e:
            if getattr(e, "code", None) == 403:
                raise _refuse(403, f"cannot read the template spec {spec_uri!r}: {e}") from None
            raise
        params = dict(launch.get("parameters") or {})
        check_parameters(params, spec.get("metadata") or {})
        # Not Dataflow's rule but the deployment's: workers never run as the default compute account on
        # the default network, so a launch that leaves these out is refused here as a bug.
        environment = launch.get("environment") or {}
        for required in ("serviceAccountEmail", "subnetwork", "tempLocation"):
            if not environment.get(required):
                raise _refuse(400, f"launchParameter.environment.{required} is required")
        worker = str(environment["serviceAccountEmail"])
        connector_require(self.caller, "iam.serviceAccounts.actAs", Resource(Kind.SERVICE_ACCOUNT, worker))
        name = str(launch.get("jobName", "job"))
        with self.lock:
            active = [j for j, p in self.jobs.items() if j.rsplit("-", 1)[0] == name and self._active(j, p)]
        if active:
            # A job name is unique among a project's active jobs; Dataflow's answer, as apache/beam#29441
            # quotes it (a retried or duplicated launch meets it on the cloud first).
            message = (
                f"There is already an active job named {name}. If you want to  submit a second job, try "
                "again by setting a different name."
            )
            body = {"error": {"code": 409, "message": message, "status": "ALREADY_EXISTS"}}
            raise WorkflowError(http_error(409, message, body))
        job_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            str(self.program),
            *(f"--{name}={value}" for name, value in params.items()),
            f"--project={args.get('projectId')}",
            f"--region={args.get('location')}",
            f"--job_name={launch.get('jobName', 'job')}",
            f"--temp_location={environment['tempLocation']}",
            f"--runner={RUNNER}",
            # One in-process worker: FnApiRunner's multi-worker data plane can corrupt a large input's stream
            # ("Unknown type tag", apache/beam#21104, #23944), and for many small objects one worker was the
            # faster here too (2,000 objects: 7.6 s against 10.4 s on two threads).
            "--direct_num_workers=1",
            "--direct_running_mode=in_memory",
        ]
        identity = self.identity_env(f"serviceAccount:{worker}")
        env = {**os.environ, **self.env, **identity, JOB_FILE_VAR: str(self._job_file(job_id))}
        with open(self.log_dir / f"{job_id}.log", "wb") as log:  # handed to the child
            proc: Job
            # a fork server that went (killed: nothing restarts it) leaves each job a process of its own
            if self.forks is not None and self.forks.running():
                child = forkserver.Child(
                    self.forks.socket_path, argv[1:], env, stdout=log.fileno(), stderr=log.fileno()
                )
                proc = _ForkedJob(child, self.forks, (JOB_FILE_VAR, env[JOB_FILE_VAR]))
            else:
                proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
        processes.record(proc.pid, f"dataflow {job_id}")
        with self.lock:
            self.jobs[job_id] = proc
        return {
            "job": {
                "id": job_id,
                "name": launch.get("jobName"),
                "projectId": args.get("projectId"),
                "location": args.get("location"),
                "currentState": "JOB_STATE_PENDING",
            }
        }

    def _job(self, args: Args) -> Job:
        job_id = args["jobId"]
        with self.lock:
            proc = self.jobs.get(job_id)
        if proc is None:
            raise _refuse(404, f"job {job_id} not found")
        return proc

    def _active(self, job_id: str, proc: Job) -> bool:
        return proc.poll() is None and job_id not in self.cancelled

    def state(self, job_id: str, proc: Job) -> str:
        code = proc.poll()
        if job_id in self.cancelled:
            return "JOB_STATE_CANCELLED"
        if code is None:
            return "JOB_STATE_RUNNING"
        if code != 0:
            return "JOB_STATE_FAILED"
        if not self._job_file(job_id).exists():  # the program ran no pipeline: nothing was submitted
            with open(self.log_dir / f"{job_id}.log", "a") as log:
                log.write("launcher: Failed to read the job file: the program ran no pipeline\n")
            return "JOB_STATE_FAILED"
        return "JOB_STATE_DONE"

    def get(self, args: Args, _: Args) -> Any:
        connector_require(
            self.caller, "dataflow.jobs.get", Resource(Kind.PROJECT, str(args.get("projectId")))
        )
        return {"id": args["jobId"], "currentState": self.state(args["jobId"], self._job(args))}

    def update(self, args: Args, _: Args) -> Any:
        """jobs.update: ``requestedState`` JOB_STATE_CANCELLED stops a running job (Dataflow's cancel)."""
        requested = (args.get("body") or {}).get("requestedState")
        connector_require(
            self.caller, "dataflow.jobs.cancel", Resource(Kind.PROJECT, str(args.get("projectId")))
        )
        if requested != "JOB_STATE_CANCELLED":
            raise _refuse(400, f"requestedState {requested!r} is not supported locally")
        proc = self._job(args)
        if proc.poll() is None:
            _kill_group(proc)
            self.cancelled.add(args["jobId"])
        return self.get(args, {})

    def stop(self) -> None:
        """Every running job killed, then the fork server stopped."""
        with self.lock:
            for proc in self.jobs.values():
                if proc.poll() is None:
                    _kill_group(proc)
        if self.forks is not None:
            self.forks.stop()
