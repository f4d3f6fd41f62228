"""The children the local stack and the test sessions start: a port taken between its choice and the
child's bind is chosen again, never waited on (a CI run lost four fault tests so: the Pub/Sub emulator's
JVM outlived its BindException and served nothing for the whole 90 s start deadline)."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.cloud import pubsub_v1  # type: ignore[attr-defined]

from retrain_local import emulators, eventarc, processes
from retrain_local.lifetime import Lifetime


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process holds, as a parallel worker's child does after our free_port() chose it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.mark.emulators
def test_the_pubsub_emulator_is_started_again_on_another_port_when_its_port_was_taken(
    tmp_path: Path, held_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = emulators.java_emulators_unavailable_reason()
    if reason:
        pytest.skip(reason)
    made: list[tuple[processes.ManagedProcess, int]] = []

    def make(port: int) -> tuple[processes.ManagedProcess, str]:
        port = held_port if not made else port
        proc, host = emulators.pubsub(tmp_path / str(len(made)), port)
        made.append((proc, port))
        return proc, host

    # Waiting the deadline out would raise a plain EmulatorError, which is not retried.
    proc, host = processes.start_on_a_free_port(make, lambda p: p.start(90))
    try:
        (first, first_port), (_, second_port) = made
        assert first_port == held_port and host == f"127.0.0.1:{second_port}" != f"127.0.0.1:{held_port}"
        assert first.proc is not None and first.proc.poll() is not None, "the JVM that could not bind stopped"
        # the JVM runs with the emulators' options (C1 only, the serial collector), as it says on start
        log = (tmp_path / "1" / "pubsub.log").read_text()
        assert f"Picked up JAVA_TOOL_OPTIONS: {emulators.JAVA_OPTIONS}" in log, log[:2000]
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", host)
        publisher = pubsub_v1.PublisherClient()
        topic = publisher.topic_path("port-taken", "served")
        publisher.create_topic(name=topic)
        assert [t.name for t in publisher.list_topics(project="projects/port-taken")] == [topic]
    finally:
        proc.stop()


def test_a_child_that_fails_for_another_reason_is_not_started_again(tmp_path: Path) -> None:
    """Only a taken port is retried: a child that fails otherwise fails once, with its own error."""
    calls: list[int] = []

    class Broken:
        def start(self, timeout_s: float = 60.0) -> None:
            raise processes.EmulatorError("no such launcher")

    def make(port: int) -> tuple[Broken, str]:
        calls.append(port)
        return Broken(), f"127.0.0.1:{port}"

    with pytest.raises(processes.EmulatorError, match="no such launcher"):
        processes.start_on_a_free_port(make)
    assert len(calls) == 1

    class Taken:
        def start(self, timeout_s: float = 60.0) -> None:
            raise processes.PortTaken("taken")

    tried: list[int] = []

    def always_taken(port: int) -> tuple[Taken, str]:
        tried.append(port)
        return Taken(), f"127.0.0.1:{port}"

    with pytest.raises(processes.PortTaken):
        processes.start_on_a_free_port(always_taken, attempts=3)
    assert len(tried) == 3


#: A child that says when SIGTERM reached it, takes a second to exit, and says so (into the file argv[1]).
SLOW_TO_EXIT = """
import os, signal, sys, time
def bye(*_):
    with open(sys.argv[1], "a") as f:
        f.write(f"term {os.getpid()}\\n")
    time.sleep(1)
    with open(sys.argv[1], "a") as f:
        f.write(f"exit {os.getpid()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("ready", flush=True)
while True:
    time.sleep(60)
"""


@pytest.mark.integration
def test_a_stacks_processes_stop_side_by_side(tmp_path: Path) -> None:
    """A stack's stop signals every child before it waits for any: in turn, each child's exit was waited
    out before the next heard of it (the Firestore emulator alone takes two seconds)."""

    said, script = tmp_path / "said", tmp_path / "slow.py"
    script.write_text(SLOW_TO_EXIT)
    lifetime = Lifetime()
    for i in range(3):
        argv = [sys.executable, str(script), str(said)]
        lifetime.spawn(processes.ManagedProcess(f"slow-{i}", argv, tmp_path / f"{i}.log", "ready"))
    children = [p.proc for p in lifetime.procs]
    lifetime.stop()
    events = [line.split()[0] for line in said.read_text().splitlines()]
    assert events == ["term"] * 3 + ["exit"] * 3, events
    assert all(c is not None and c.returncode == 0 for c in children) and lifetime.procs == []


@pytest.mark.emulators
def test_the_redelivery_loop_stops_at_once_with_a_pull_under_way(
    pubsub_host: str, project: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eventarc's twin stops without waiting out its pull: the stack's stop waited up to 5 s for it."""
    monkeypatch.setattr(eventarc, "PULL_TIMEOUT_S", 600.0)  # longer than stop() waits for the loop
    loop = eventarc.Redelivery(project, "http://127.0.0.1:9/never", f"projects/{project}/topics/dead").start()
    time.sleep(1)  # its first pull is under way
    loop.stop()
    assert loop._thread is not None and not loop._thread.is_alive()
