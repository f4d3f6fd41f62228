"""Every process the local stack starts, recorded as it starts, so that none outlives the stack.

The stack runs emulators, functions, etcd and kube-apiserver, tokenize jobs and the pods' trainers, each
in its own process group.  When the stack process itself is killed (SIGKILL, a crash), they would go on
running, still holding ports, a "node" and a JobSet.  So each start appends a line to
``<state dir>/processes.jsonl`` (pid, process group, name, start time) before anything else happens, and
:func:`stop_recorded` -- what ``retrain down`` does -- stops every recorded group still alive, whether
or not the stack that started them is.  A pid is only signalled while its start time is the recorded
one, so a pid the system has since given to another process is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

#: The registry this process writes to (set by the stack; None: nothing is recorded).
_registry: Path | None = None
_lock = threading.Lock()


@dataclass(frozen=True)
class Recorded:
    pid: int
    pgid: int
    name: str
    started: str
    """The process's start time as /proc/<pid>/stat gives it (clock ticks since boot)."""


def start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (None when there is no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def use(registry: Path | None) -> None:
    """Record this process's children in ``registry`` from now on (None: stop recording)."""
    global _registry
    _registry = registry
    if registry is not None:
        registry.parent.mkdir(parents=True, exist_ok=True)


def record(pid: int, name: str) -> None:
    """Note a child just started (in its own process group)."""
    if _registry is None:
        return
    started = start_time(pid) or ""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    line = json.dumps(asdict(Recorded(pid, pgid, name, started)))
    with _lock, open(_registry, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def recorded(registry: Path) -> list[Recorded]:
    if not registry.exists():
        return []
    out = []
    for line in registry.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError, TypeError):
            out.append(Recorded(**json.loads(line)))
    return out


def alive(p: Recorded) -> bool:
    return bool(p.started) and start_time(p.pid) == p.started


def stop_recorded(registry: Path, grace_s: float = 10.0) -> list[Recorded]:
    """SIGTERM every recorded group still alive, then SIGKILL what is left; the processes it stopped.
    The registry is emptied once nothing recorded is alive."""
    targets = [p for p in recorded(registry) if alive(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in targets:
            if alive(p):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if p.pgid == p.pid:  # a group of its own: its children go with it
                        os.killpg(p.pgid, sig)
                    else:  # started in someone else's group (the control plane's script): itself only
                        os.kill(p.pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(p) for p in targets):
            time.sleep(0.1)
    if not any(alive(p) for p in recorded(registry)):
        registry.unlink(missing_ok=True)
    return targets


class EmulatorError(RuntimeError):
    """An emulator that could not be found or did not come up."""


class PortTaken(EmulatorError):
    """Another process bound the child's port between its choice and the child's own bind."""


#: What a child logs when its port is taken: the JVM emulators' Netty (whose main thread dies while the
#: JVM lives on, serving nothing), Python's socket servers and Go's net.Listen.
BIND_FAILED = re.compile(r"java\.net\.BindException|address already in use|EADDRINUSE", re.IGNORECASE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service(Protocol):
    """What a test session or the local stack starts and stops: an emulator process, or one behind a proxy."""

    def start(self, timeout_s: float = 60.0) -> None: ...

    def stop(self, grace_s: float = 10.0) -> None: ...


S = TypeVar("S", bound=Service)


def start_on_a_free_port(
    make: Callable[[int], tuple[S, str]],
    start: Callable[[S], None] = lambda child: child.start(),
    attempts: int = 3,
) -> tuple[S, str]:
    """``make(port)`` on a free port and start it; on another port when the chosen one was taken before
    the child bound it (a free port is only free until someone binds it: parallel tests and stacks do).
    Returns the started child and its address."""
    for attempt in range(1, attempts + 1):
        child, address = make(free_port())
        try:
            start(child)
        except PortTaken:
            if attempt == attempts:
                raise
            continue
        return child, address
    raise AssertionError("unreachable")


@dataclass
class ManagedProcess:
    """A child process in its own process group, with its output in a log file."""

    name: str
    argv: list[str]
    log_path: Path
    ready_line: str | None
    """A regex its log prints once it serves; None: rely on ``probe_url`` alone."""
    env: dict[str, str] = field(default_factory=dict)
    probe_url: str | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()
        record(self.proc.pid, self.name)
        pattern = re.compile(self.ready_line or "")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            if BIND_FAILED.search(text):  # before the probe, which whoever holds the port may answer
                self.stop()
                raise PortTaken(f"{self.name} could not bind its port: {text[-2000:]}")
            if pattern.search(text) and self._probe():
                return
            if self.proc.poll() is not None:
                text = self.log_path.read_text(errors="replace")  # all it wrote before it exited
                if BIND_FAILED.search(text):
                    raise PortTaken(f"{self.name} could not bind its port: {text[-2000:]}")
                raise EmulatorError(f"{self.name} exited with {self.proc.returncode}: {text[-2000:]}")
            time.sleep(0.1)
        self.stop()
        raise EmulatorError(f"{self.name} did not start in {timeout_s:.0f}s; see {self.log_path}")

    def _probe(self) -> bool:
        if self.probe_url is None:
            return True
        try:
            with urllib.request.urlopen(self.probe_url, timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # it answered: up, whatever it thinks of the request
        except OSError:
            return False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the whole group (launcher scripts fork Java), wait for all of it, then SIGKILL."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                self.proc.poll()
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    self.proc.wait()
                    return
                time.sleep(0.05)
        self.proc.wait()
