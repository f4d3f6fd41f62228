"""Shared fixtures: the real emulators, started once per test session and stopped at its end.

Tests that need something this machine lacks (Java, the Cloud SDK, envtest binaries) skip with the
reason; each test isolates its data with its own Firestore project id.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cloudworkflows import ExecutionsServer
from retrain_local import emulators, processes

pytest_plugins = ("pytester",)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("RETRAIN_SHARED", REPO.parent / "shared"))
CORPUS = SHARED / "corpus"


# The tiers, by the marks a test carries (pyproject.toml's `markers`): the first tier whose marks it
# has; a test with none of them is a unit test.
TIER_MARKS = {"e2e": {"e2e", "faults"}, "integration": {"integration", "emulators", "envtest"}}


#: The order tests run in: the longest tier first, and in it the ``long`` tests first, so that the
#: workers sharing a run (``./scripts/test`` runs on several) end together instead of one of them
#: starting a ten-minute test when the others are done.
TIER_ORDER = ("e2e", "integration", "unit")

#: Packages whose tests share a package-scoped fixture: all their tests on one worker, so that it starts
#: once and stops after their last test.  tests/k8s's control plane costs some 18 CPU s to start and
#: 2.25 a minute while it idles (measured alone); held per worker for the session, three idled on
#: through the whole suite.  tests/shared_stack's local stack serves four modules that each booted
#: their own.
SHARED_PACKAGES = ("tests/k8s", "tests/shared_stack")


def xdist_group_of(nodeid: str, long: bool) -> str:
    """A ``long`` test apart from every other test, its parametrizations together (they share its module's
    stack: tests/test_nothing_lost.py's two folders and two seeds booted four stacks, each 42 to 57 s of a
    worker's time to set up and tear down in a full run, where two serve); a shared package's tests
    together; otherwise a module's tests."""
    if long:
        return nodeid.split("[", 1)[0]
    module = nodeid.split("::")[0]
    return next((p for p in SHARED_PACKAGES if module.startswith(p + "/")), module)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (xdist/remote.py)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every test exactly one tier mark, so that ``-m unit`` (``./scripts/test --fast``) selects the
    unit tier and a test carries no tier mark that contradicts its needs; order the tests longest
    first; and group them for ``--dist loadgroup``: a module's tests on one worker (they share its
    fixtures: a module's stack boots once), a shared package's too, a ``long`` test on a worker by
    itself."""
    tiers: dict[str, str] = {}
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        tier = next((t for t, implied in TIER_MARKS.items() if marks & implied), "unit")
        other = {"unit", *TIER_MARKS} - {tier}
        if marks & other:
            raise pytest.UsageError(
                f"{item.nodeid} is marked {sorted(marks & other)} but needs the {tier} tier"
            )
        item.add_marker(tier)
        tiers[item.nodeid] = tier
        group = xdist_group_of(item.nodeid, "long" in marks)
        # xdist reads a group after the last "@", and only past any "]" (loadgroup._split_scope)
        item.add_marker(pytest.mark.xdist_group(re.sub(r"[^\w./:-]+", "-", group)))
    items.sort(key=lambda i: (TIER_ORDER.index(tiers[i.nodeid]), i.get_closest_marker("long") is None))


class StartsAProcess(Exception):
    """A unit test started a process: it belongs to the integration tier (mark it so)."""


#: The unit test now running (its node id), while one runs: the audit hook below refuses its processes.
_UNIT_TEST: dict[str, str | None] = {"running": None}
#: Python's audit events for starting a process (docs.python.org/3/library/audit_events.html).
_PROCESS_EVENTS = frozenset(
    ("subprocess.Popen", "os.system", "os.posix_spawn", "os.fork", "os.forkpty", "os.exec")
)


def _refuse_processes(event: str, args: tuple[object, ...]) -> None:
    """The unit tier's rule, enforced for the test and its fixtures: no process, by any of Python's ways
    to start one.  Only on the main thread, where tests run: a background thread of a session fixture
    (an emulator's supervisor) is not the test's doing."""
    nodeid = _UNIT_TEST["running"]
    if (
        nodeid is None
        or event not in _PROCESS_EVENTS
        or threading.current_thread() is not threading.main_thread()
    ):
        return
    started = args[1] if event == "subprocess.Popen" else args
    raise StartsAProcess(
        f"{nodeid} is in the unit tier, which starts no process, and started {str(started)[:200]} "
        f"({event}): mark it integration (one real component) or e2e (the local stack)"
    )


sys.addaudithook(_refuse_processes)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if item.get_closest_marker("unit") is None:
        return (yield)
    _UNIT_TEST["running"] = item.nodeid
    try:
        return (yield)
    finally:
        _UNIT_TEST["running"] = None


def resident_mb() -> float:
    """This process's resident set now (not its peak: a test that frees what it used is not a leak)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@dataclass
class MemoryGuard:
    """A worker past ``limit_mb`` resident is leaking (a whole test run peaks at a few hundred MB per
    worker): the test that took it there fails, naming the tests that grew it most, and the worker's
    other tests skip, instead of the worker growing until the kernel's OOM killer ends it, which xdist
    may not notice (the run then hangs until CI's time limit)."""

    limit_mb: float
    resident: Callable[[], float] = resident_mb
    growth: list[tuple[float, str]] = field(default_factory=list)  # (MB added, node id), largest first
    past_limit_at: str | None = None
    _before: float = 0.0

    def before(self) -> str | None:
        """Why this test must not run (the worker already went past its limit), or None."""
        self._before = self.resident()
        if self.past_limit_at is None:
            return None
        return f"this worker's memory went past {self.limit_mb:.0f} MB in {self.past_limit_at}"

    def after(self, nodeid: str) -> str | None:
        """Why the test that just ran fails (it took the worker past its limit), or None."""
        now = self.resident()
        self.growth = sorted([*self.growth, (now - self._before, nodeid)], reverse=True)[:5]
        if now <= self.limit_mb:
            return None
        self.past_limit_at = nodeid
        grew = "; ".join(f"{n} +{mb:.0f} MB" for mb, n in self.growth)
        return f"this worker holds {now:.0f} MB (limit {self.limit_mb:.0f} MB); the largest growths: {grew}"


_MEMORY = MemoryGuard(float(os.environ.get("RETRAIN_TEST_RSS_LIMIT_MB", "4096")))


@pytest.fixture(autouse=True)
def _memory_bounded(request: pytest.FixtureRequest) -> Iterator[None]:
    if (why := _MEMORY.before()) is not None:
        pytest.skip(why)
    yield
    if (why := _MEMORY.after(request.node.nodeid)) is not None:
        pytest.fail(why)


@pytest.fixture(autouse=True)
def _every_object_accounted_for(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that drove a local stack ends with its audit (``retrain audit``) of the datasets no
    earlier test's audit found accounted for: a test that loses an object fails, whatever it was
    testing (the stack's last audit, before it stops, reads every dataset again)."""
    yield
    from retrain_local.stack import LocalStack

    stacks = [v for v in request.node.funcargs.values() if isinstance(v, LocalStack)]
    if stacks and not getattr(request.node, "rep_call_failed", False):
        from stack_support import assert_accounted

        for stack in stacks:
            assert_accounted(stack, new_only=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Note a failed test body, so that its audit (above) does not report the same failure twice."""
    report = yield
    if call.when == "call" and report.failed:  # type: ignore[attr-defined]
        item.rep_call_failed = True  # type: ignore[attr-defined]
    return report


@pytest.fixture(scope="session")
def emulator_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("emulators")


def _serve(
    make: Callable[[Path, int], tuple[processes.Service, str]], state: Path, env_key: str, needs_java: bool
) -> Iterator[str]:
    """Run one emulator for the session, exported to this process through its client variable."""
    reason = emulators.java_emulators_unavailable_reason() if needs_java else None
    if reason:
        pytest.skip(reason)
    proc, host = processes.start_on_a_free_port(lambda port: make(state, port))
    old = os.environ.get(env_key)
    os.environ[env_key] = host
    yield host
    if old is None:
        os.environ.pop(env_key, None)
    else:
        os.environ[env_key] = old
    proc.stop()


@pytest.fixture(scope="session")
def firestore_host(emulator_dir: Path) -> Iterator[str]:
    """FIRESTORE_EMULATOR_HOST of a real Firestore emulator."""
    yield from _serve(emulators.firestore, emulator_dir, "FIRESTORE_EMULATOR_HOST", needs_java=True)


@pytest.fixture(scope="session")
def pubsub_host(emulator_dir: Path) -> Iterator[str]:
    """PUBSUB_EMULATOR_HOST of a real Pub/Sub emulator."""
    yield from _serve(emulators.pubsub, emulator_dir, "PUBSUB_EMULATOR_HOST", needs_java=True)


@pytest.fixture(scope="session")
def gcs_host(emulator_dir: Path) -> Iterator[str]:
    """STORAGE_EMULATOR_HOST of gcp-storage-emulator."""
    yield from _serve(emulators.gcs, emulator_dir, "STORAGE_EMULATOR_HOST", needs_java=False)


@pytest.fixture(scope="session")
def bigquery_host(emulator_dir: Path, gcs_host: str) -> Iterator[str]:
    """BIGQUERY_EMULATOR_HOST of bqemulator: an optional tier, skipped where it is not installed. The
    files its jobs export land in the storage emulator (``retrain_local.bigquery_gcs``)."""
    if emulators.bqemulator_path() is None:
        pytest.skip("bqemulator is not installed (scripts/test installs it in .tools/bqemulator)")
    yield from _serve(emulators.bigquery, emulator_dir, "BIGQUERY_EMULATOR_HOST", needs_java=False)


@pytest.fixture
def project() -> str:
    """A fresh project id: the emulators keep each project's data apart."""
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def held_executions() -> Iterator[ExecutionsServer]:
    """retrain's executions service (the Workflow Executions API's local twin), every run held."""
    with ExecutionsServer.holding() as server:
        yield server


@dataclass(frozen=True)
class ServedFunction:
    """A function of functions/main.py behind the real functions-framework server, in its own project."""

    url: str
    project: str
    log: Path
    landing: str
    artifacts: str


@pytest.fixture(scope="module")
def serve_function(
    tmp_path_factory: pytest.TempPathFactory,
    firestore_host: str,
    gcs_host: str,
    held_executions: ExecutionsServer,
) -> Iterator[Callable[..., ServedFunction]]:
    """serve(target, **env): the function with the emulators, its own project and buckets (landing
    ``land-PROJECT`` unless RETRAIN_LANDING_BUCKET says otherwise), runs starting held executions."""
    from retrain.adapters import objects
    from retrain_local.serverless import function_server

    started: list[emulators.ManagedProcess] = []

    def start_and_keep(proc: emulators.ManagedProcess) -> None:
        proc.start()
        started.append(proc)

    def serve(target: str, signature: str = "cloudevent", **extra: str) -> ServedFunction:
        project = f"fn-{uuid.uuid4().hex[:8]}"
        env = {
            "FIRESTORE_EMULATOR_HOST": firestore_host,
            "STORAGE_EMULATOR_HOST": gcs_host,
            "RETRAIN_PROJECT": project,
            "RETRAIN_LANDING_BUCKET": f"land-{project}",
            "RETRAIN_ARTIFACTS_BUCKET": f"art-{project}",
            "RETRAIN_WORKFLOWS_ENDPOINT": held_executions.base_url,
            "RETRAIN_WORKFLOWS_GRPC_ENDPOINT": held_executions.grpc_target,
            **extra,
        }
        client = objects.storage_client()
        for bucket in (env["RETRAIN_LANDING_BUCKET"], env["RETRAIN_ARTIFACTS_BUCKET"]):
            if client.lookup_bucket(bucket) is None:
                client.create_bucket(bucket)
        log = tmp_path_factory.mktemp(target) / "function.log"
        _, url = processes.start_on_a_free_port(
            lambda port: function_server(target, log, env, signature, port), start_and_keep
        )
        return ServedFunction(
            url, project, log, env["RETRAIN_LANDING_BUCKET"], env["RETRAIN_ARTIFACTS_BUCKET"]
        )

    yield serve
    for proc in started:
        proc.stop()
