"""A local Workflow Executions service: the API v1 over gRPC (:mod:`cloudworkflows.grpc_service`,
what ``ExecutionsClient`` speaks) and the shape of its REST API over HTTP (callbacks included).

``retrain.adapters.workflows.WorkflowsExecutions`` talks to this exactly as it talks to
workflowexecutions.googleapis.com, so the local stack exercises the same client code, callbacks
included (callback URLs point back at this server).
"""

from __future__ import annotations

import builtins
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from .callbacks import CallbackHub
from .engine import ConnectorRegistry, Workflow, error_context, load_workflow
from .errors import ExecutionCancelled, WorkflowError, WorkflowSyntaxError, error, format_error
from .rest import http_server

log = logging.getLogger("cloudworkflows.server")

#: The Executions API's documented limit on ``Execution.argument`` (a JSON string): 32 KB.
MAX_ARGUMENT_BYTES = 32 * 1024

# Stays ACTIVE until cancelled, as a real run does for hours.
_HOLD = """
main:
  params: [args]
  steps:
    - hold:
        call: sys.sleep
        args:
          seconds: 600
"""


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


class _Record:
    def __init__(self, name: str, workflow: Workflow, argument: Any, argument_text: str) -> None:
        self.name = name
        self.workflow = workflow
        self.argument = argument
        self.argument_text = argument_text
        self.state = "ACTIVE"
        self.start_time = _now()
        self.end_time: str | None = None
        self.result: str | None = None
        self.error: dict[str, Any] | None = None
        self.cancel = threading.Event()
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def resource(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "state": self.state,
            "argument": self.argument_text,
            "startTime": self.start_time,
            "workflowRevisionId": self.workflow.revision_id,
        }
        if self.end_time:
            out["endTime"] = self.end_time
        if self.result is not None:
            out["result"] = self.result
        if self.error is not None:
            out["error"] = self.error
        return out


#: (bearer token or None, permission, workflow resource name) -> None when allowed, else the refusal.
Authorize = Callable[[str | None, str, str], str | None]


def workflow_of(name: str) -> str:
    """``projects/P/locations/L/workflows/W`` of an execution, callback or workflow name."""
    return "/".join(name.split("/")[:6])


def _failure(name: str, exc: Exception) -> dict[str, Any]:
    """An ended execution's ``error`` (the REST resource's payload and context) for what it raised."""
    if isinstance(exc, WorkflowError):
        payload = format_error(exc.value) if not isinstance(exc.value, str) else json.dumps(exc.value)
        return {"payload": payload, "context": error_context(exc)}
    if isinstance(exc, WorkflowSyntaxError):
        return {"payload": json.dumps({"message": str(exc), "tags": ["SystemError"]}), "context": str(exc)}
    # a bug in a connector or the interpreter: fail the execution visibly
    log.error("execution %s crashed", name, exc_info=exc)
    return {
        "payload": json.dumps({"message": f"{type(exc).__name__}: {exc}", "tags": ["SystemError"]}),
        "context": "internal error",
    }


class ExecutionsServer:
    """Runs executions in threads and serves them over HTTP on 127.0.0.1."""

    def __init__(
        self,
        resolve: Callable[[str], Workflow],
        connectors: ConnectorRegistry,
        env: Mapping[str, str],
        host: str = "127.0.0.1",
        port: int = 0,
        authorize: Authorize | None = None,
    ) -> None:
        self.resolve = resolve
        self.connectors = connectors
        self.env = dict(env)
        self.authorize = authorize
        """Who may call: (the caller's bearer token, the permission, the workflow's name) -> None, or the
        refusal's message (the Workflows API's PERMISSION_DENIED); None: every caller may."""
        self._lock = threading.Lock()
        self._records: dict[str, _Record] = {}
        self._httpd = http_server(self, host, port)
        host_name, real_port = self._httpd.server_address[:2]
        self.base_url = f"http://{host_name!s}:{real_port}"
        self.hub = CallbackHub(self.base_url)
        self._serve_thread: threading.Thread | None = None
        self._grpc: Any = None
        self.grpc_target = ""
        """``host:port`` of the gRPC side (``ExecutionsClient``), once started."""

    def refusal(self, token: str | None, permission: str, name: str) -> str | None:
        """Why the caller of ``token`` may not do ``permission`` on the workflow of ``name`` (an execution,
        callback or workflow name); None: it may (or every caller may: no ``authorize``)."""
        return None if self.authorize is None else self.authorize(token, permission, workflow_of(name))

    @classmethod
    def holding(cls) -> ExecutionsServer:
        """An executions service whose every execution holds until cancelled.

        It stands in for the retrain workflow wherever only the trigger side is exercised
        (tests, the storm benchmark): executions exist, are ACTIVE and can be listed.
        """
        workflow = load_workflow(_HOLD)
        return cls(lambda _name: workflow, ConnectorRegistry(), {})

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ExecutionsServer:
        if self._grpc is None:
            from cloudworkflows.grpc_service import serve

            self._grpc, self.grpc_target = serve(self, str(self._httpd.server_address[0]))
        if self._serve_thread is None:
            self._serve_thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.05},
                daemon=True,
                name="workflows-executions-server",
            )
            self._serve_thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            records = list(self._records.values())
        for rec in records:
            rec.cancel.set()
        if self._grpc is not None:
            self._grpc.stop(grace=None)
            self._grpc = None
        if self._serve_thread is not None:
            self._httpd.shutdown()
            self._serve_thread.join(timeout=5)
            self._serve_thread = None
        self._httpd.server_close()
        for rec in records:
            if rec.thread is not None:
                rec.thread.join(timeout=2)

    def __enter__(self) -> ExecutionsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- Python API --------------------------------------------------------------------------

    def start_execution(
        self, workflow: Workflow | str, argument: Any = None, parent: str | None = None
    ) -> str:
        """Start an execution; ``argument`` is a Python value (a str is taken as JSON text)."""
        wf = self.resolve(workflow) if isinstance(workflow, str) else workflow
        workflow_id = workflow if isinstance(workflow, str) else wf.name
        if isinstance(argument, str):
            text = argument
            value = json.loads(argument) if argument else None
        else:
            value = argument
            text = json.dumps(argument) if argument is not None else ""
        if parent is None:
            project = self.env.get("GOOGLE_CLOUD_PROJECT_ID", "local-project")
            location = self.env.get("GOOGLE_CLOUD_LOCATION", "local")
            parent = f"projects/{project}/locations/{location}/workflows/{workflow_id}"
        name = f"{parent}/executions/{uuid.uuid4()}"
        rec = _Record(name, wf, value, text)
        with self._lock:
            self._records[name] = rec
        rec.thread = threading.Thread(
            target=self._run, args=(rec,), daemon=True, name=f"execution-{name[-8:]}"
        )
        rec.thread.start()
        log.info("started execution %s", name)
        return name

    def create(self, parent: str, argument: Any) -> dict[str, Any]:
        """CreateExecution: the new execution's resource; ValueError for a bad parent or argument (the
        API's INVALID_ARGUMENT), KeyError naming an unknown workflow (NOT_FOUND)."""
        parts = parent.split("/")
        if len(parts) != 6 or parts[0] != "projects" or parts[2] != "locations" or parts[4] != "workflows":
            raise ValueError(f"bad parent {parent}")
        if not isinstance(argument, str):
            raise ValueError("invalid argument: argument must be a JSON string")
        if len(argument.encode()) > MAX_ARGUMENT_BYTES:
            raise ValueError(
                f"invalid argument: argument is {len(argument.encode())} bytes; the size limit is 32KB"
            )
        try:
            if argument:
                json.loads(argument)
        except ValueError as exc:
            raise ValueError(f"invalid argument: {exc}") from None
        workflow = self.resolve(parts[5])
        return self.get(self.start_execution(workflow, argument, parent=parent))

    def peak_memory(self, name: str) -> int | None:
        """The peak memory of an ended execution's variables (None while it runs or when unknown)."""
        with self._lock:
            rec = self._records.get(name)
        return None if rec is None else rec.workflow.peak_memory.get(name)

    def _run(self, rec: _Record) -> None:
        env = dict(self.env)
        parts = rec.name.split("/")
        env["GOOGLE_CLOUD_PROJECT_ID"] = parts[1]
        env["GOOGLE_CLOUD_LOCATION"] = parts[3]
        state, result, err = "SUCCEEDED", None, None
        try:
            value = rec.workflow.run(
                rec.argument,
                connectors=self.connectors,
                env=env,
                hub=self.hub,
                execution_name=rec.name,
                cancel=rec.cancel,
                executions=self,
            )
            result = json.dumps(value)
        except ExecutionCancelled:
            state = "CANCELLED"
        except Exception as exc:
            state, err = "FAILED", _failure(rec.name, exc)
        with self._lock:
            if rec.state == "ACTIVE":
                rec.state = "CANCELLED" if rec.cancel.is_set() and state != "SUCCEEDED" else state
                rec.result = result if rec.state == "SUCCEEDED" else None
                rec.error = err if rec.state == "FAILED" else None
                rec.end_time = _now()
        rec.done.set()
        log.info("execution %s finished: %s", rec.name, rec.state)

    def get(self, name: str) -> dict[str, Any]:
        with self._lock:
            rec = self._records.get(name)
            if rec is None:
                raise KeyError(name)
            return rec.resource()

    def list(self, parent: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [
                r.resource()
                for r in self._records.values()
                if parent is None or r.name.startswith(parent + "/")
            ]

    def wait(
        self, name: str, timeout: float = 30.0, check_cancel: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """Block until the execution leaves ACTIVE; raises TimeoutError otherwise, and whatever
        ``check_cancel`` raises (the waiting caller cancelled)."""
        with self._lock:
            rec = self._records.get(name)
        if rec is None:
            raise KeyError(name)
        deadline = time.monotonic() + timeout
        while True:
            if check_cancel is not None:
                check_cancel()
            resource = self.get(name)
            if resource["state"] != "ACTIVE":
                return resource
            if time.monotonic() >= deadline:
                raise TimeoutError(f"execution {name} still ACTIVE after {timeout}s")
            rec.done.wait(min(0.05, max(0.0, deadline - time.monotonic())))

    def cancel(self, name: str) -> dict[str, Any]:
        with self._lock:
            rec = self._records.get(name)
            if rec is None:
                raise KeyError(name)
            if rec.state == "ACTIVE":
                rec.state = "CANCELLED"
                rec.end_time = _now()
            rec.cancel.set()
            return rec.resource()

    def run_children(
        self, parent: str, arguments: Sequence[Any], timeout: float, check_cancel: Callable[[], None]
    ) -> builtins.list[Any]:
        """``experimental.executions``: one execution of ``parent`` per argument, waited for together.
        A cancelled caller cancels its children; a timeout leaves them running, as a caller's own
        TimeoutError says nothing of them. An unknown workflow is a ValueError here (Google's pages do not
        say what the function raises for one)."""
        workflow_id = parent.rsplit("/", 1)[-1]
        try:
            workflow = self.resolve(workflow_id)
        except KeyError:
            raise error("ValueError", f"workflow {parent} not found") from None
        # Each argument as JSON text: start_execution reads a str argument as JSON.
        names = [self.start_execution(workflow, json.dumps(a), parent=parent) for a in arguments]
        deadline = time.monotonic() + timeout
        try:
            for name in names:
                self.wait(name, max(0.0, deadline - time.monotonic()), check_cancel)
        except ExecutionCancelled:
            for name in names:
                self.cancel(name)
            raise
        except TimeoutError:
            raise error("TimeoutError", f"executions of {parent} still running after {timeout:g}s") from None
        results = []
        for name in names:
            child = self.get(name)
            if child["state"] != "SUCCEEDED":
                detail = (child.get("error") or {}).get("payload", "")
                raise error("ExecutionError", f"execution {name} {child['state']}: {detail}".rstrip(": "))
            results.append(json.loads(child["result"]) if child.get("result") else None)
        return results

    def forget(self, name: str) -> None:
        """Lose an execution, as a crashed service would: it stops where it is (no except, no release)
        and is never heard of again (404).  For the fault suite."""
        self.cancel(name)
        with self._lock:
            del self._records[name]
