"""Runs every documented-behaviour workflow under conformance/ and checks its declared outcome.

The cases are organised by the documentation page that states the behaviour: one folder per page
(``syntax-variables``, ``stdlib-text``, ``troubleshooting`` ...), and every case names its page in a
``# source: URL`` header line. Each YAML file states its expectation in header comments (``# expect: JSON``,
``# expect_error: JSON``, ``# expect_deploy_error: "message"`` for what Google refuses when the workflow
is deployed, and optionally ``# args: JSON``); JSON definitions use a ``.expect`` sidecar holding the same
keys.

Every case runs with callbacks served over real HTTP (the local executions service's hub), and starts
other executions (``experimental.executions``) of the workflows in ``CHILDREN`` there. A case with
``# serve: echo`` also gets ``args.echo``, the base URL of a loopback server that echoes each request as
JSON (``/status/NNN`` answers with that status instead, ``/flaky/CODE/N/KEY`` with CODE to KEY's first N
requests), so the HTTP functions meet a real peer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlparse

import pytest

from cloudworkflows import ConnectorRegistry, ExecutionsServer, WorkflowError, load_workflow
from cloudworkflows.errors import WorkflowSyntaxError

HERE = Path(__file__).parent / "conformance"
CASES = sorted(p for p in HERE.rglob("*") if p.suffix in (".yaml", ".json"))
GOOGLE_DOCS = "https://cloud.google.com/workflows/docs/"
EXECUTION = "projects/proj-1/locations/us-central1/workflows/wf/executions/exec-1"


def expectations(path: Path) -> dict[str, Any]:
    if path.suffix == ".json":
        return dict(json.loads(path.with_suffix(".json.expect").read_text()))
    out: dict[str, Any] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# source:"):
            out["source"] = line.removeprefix("# source:").strip()
        if line.startswith("# serve:"):
            out["serve"] = line.removeprefix("# serve:").strip()
        for key in ("args", "expect", "expect_error", "expect_deploy_error"):
            prefix = f"# {key}:"
            if line.startswith(prefix):
                out[key] = json.loads(line[len(prefix) :])
    return out


class Echo(BaseHTTPRequestHandler):
    """The HTTP peer of the ``serve: echo`` cases."""

    protocol_version = "HTTP/1.1"
    attempts: ClassVar[dict[str, int]] = {}
    lock = threading.Lock()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        url = urlparse(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        code, payload = 200, b""
        if url.path.startswith("/status/"):
            code = int(url.path.rsplit("/", 1)[1])
            payload = json.dumps({"status": code}).encode()
        elif url.path.startswith("/flaky/"):  # /flaky/CODE/N/KEY: CODE for KEY's first N requests, then 200
            _, _, failing, times, key = url.path.split("/")
            with Echo.lock:
                Echo.attempts[key] = attempt = Echo.attempts.get(key, 0) + 1
            code = int(failing) if attempt <= int(times) else 200
            payload = json.dumps({"attempts": attempt}).encode()
        else:
            payload = json.dumps(
                {
                    "method": self.command,
                    "path": url.path,
                    "query": parse_qs(url.query),
                    "content_type": self.headers.get("Content-Type"),
                    "body": body.decode("utf-8", "replace"),
                }
            ).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    Echo.attempts.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


#: The workflows the ``experimental.executions`` cases start, by workflow id.
CHILDREN = {
    "double": (
        "main:\n  params: [n]\n  steps:\n    - r:\n        switch:\n"
        '          - condition: ${get_type(n) == "string"}\n            return: ${n + n}\n'
        "    - number:\n        return: ${n * 2}\n"
    ),
    "fail_on_two": (
        "main:\n  params: [n]\n  steps:\n    - check:\n        switch:\n          - condition: ${n == 2}\n"
        "            raise: two\n    - r:\n        return: ${n}\n"
    ),
    "sleepy": "- nap:\n    call: sys.sleep\n    args:\n      seconds: 30\n",
}


@pytest.fixture(scope="module")
def executions() -> Iterator[ExecutionsServer]:
    """Serves the cases' callback endpoints over HTTP and runs the executions they start, as Workflows
    does."""
    children = {name: load_workflow(source, name) for name, source in CHILDREN.items()}
    with ExecutionsServer(children.__getitem__, ConnectorRegistry(), {}) as server:
        yield server


def same(a: Any, b: Any) -> bool:
    """Equality that tells 1 from 1.0 from true, like Workflows' typed values."""
    if type(a) is not type(b) and not (isinstance(a, int | float) and isinstance(b, int | float)):
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, float) or isinstance(b, float):
        return type(a) is type(b) and a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def test_cases_exist() -> None:
    assert len(CASES) >= 30
    for case in CASES:
        exp = expectations(case)
        outcomes = [k for k in ("expect", "expect_error", "expect_deploy_error") if k in exp]
        assert len(outcomes) == 1, f"{case.name} must declare one outcome"
        assert str(exp.get("source", "")).startswith(GOOGLE_DOCS), f"{case.name} must cite its Google page"
        assert case.parent != HERE, f"{case.name} belongs in the folder of its documentation page"
        assert exp.get("serve", "echo") == "echo", f"{case.name}: the only peer served is echo"


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_conformance(case: Path, executions: ExecutionsServer, echo_url: str) -> None:
    exp = expectations(case)
    args = exp.get("args")
    if exp.get("serve") == "echo":
        args = {**(args or {}), "echo": echo_url}
    if "expect_deploy_error" in exp:
        with pytest.raises(WorkflowSyntaxError) as refused:
            load_workflow(case)
        assert exp["expect_deploy_error"] in str(refused.value)
        return
    wf = load_workflow(case)

    def run() -> Any:
        return wf.run(args, execution_name=EXECUTION, hub=executions.hub, executions=executions)

    if "expect" in exp:
        result = run()
        assert same(result, exp["expect"]), f"{case.name}: got {result!r}, expected {exp['expect']!r}"
        return
    with pytest.raises(WorkflowError) as info:
        run()
    want, got = exp["expect_error"], info.value.value
    if isinstance(want, str):
        assert got == want
        return
    assert isinstance(got, dict), got
    for key, value in want.items():
        if key == "tags":
            assert set(value) <= set(got.get("tags", [])), got
        else:
            assert same(got.get(key), value), got
