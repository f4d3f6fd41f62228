"""What a local stack started, so that its stop undoes it: the child processes (a function that dies is
started again, as Cloud Run starts a new instance), what to close newest first, the environment it
pointed at itself, and the state folder's lock (one stack per folder)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from retrain_local import emulators, processes

log = logging.getLogger("retrain.stack")


def periodically(every_s: float, fn: Callable[[], None], what: str) -> Callable[[], None]:
    """Run ``fn`` every ``every_s`` seconds on a daemon thread until the returned stop is called."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                fn()
            except Exception as e:  # keep going: the next round may succeed
                log.warning("%s: %s", what, e)

    threading.Thread(target=loop, name=what, daemon=True).start()
    return stop.set


@dataclass
class Lifetime:
    """Everything a stack started, in order, and how to stop it."""

    procs: list[emulators.ManagedProcess] = field(default_factory=list)
    _closers: list[Callable[[], None]] = field(default_factory=list)
    _saved_env: dict[str, str | None] = field(default_factory=dict)
    _held_down: set[str] = field(default_factory=set)

    def on_stop(self, closer: Callable[[], None]) -> None:
        """Call ``closer`` at the stop, before whatever was registered earlier."""
        self._closers.append(closer)

    def spawn(self, proc: emulators.ManagedProcess, timeout_s: float = 90.0) -> None:
        """Start ``proc``, kept for the stop (and the functions' supervisor) from its start on; one that
        could not bind its port is dropped again (its successor on another port takes its place)."""
        self.procs.append(proc)
        try:
            proc.start(timeout_s)
        except processes.PortTaken:
            self.procs.remove(proc)
            raise

    def spawn_on_a_free_port(
        self, make: Callable[[int], tuple[emulators.ManagedProcess, str]]
    ) -> tuple[emulators.ManagedProcess, str]:
        return processes.start_on_a_free_port(make, self.spawn)

    def setenv(self, values: dict[str, str]) -> None:
        """Point this process's clients at the stack; the stop puts the environment back as it was."""
        for key, value in values.items():
            if key not in self._saved_env:
                self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value

    def lock(self, state_dir: Path) -> None:
        """One stack per state folder: a second ``retrain up`` refuses while this one starts or runs."""
        import fcntl

        lock = open(state_dir / "stack.lock", "w")  # noqa: SIM115 - held for the stack's lifetime
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise RuntimeError(f"another local stack is starting or running on {state_dir}") from None
        self.on_stop(lock.close)

    def supervise_functions(self) -> None:
        """Start a dead function again within a second (Cloud Run starts a new instance), unless held down."""
        self.on_stop(periodically(1.0, self._restart_dead_functions, "function supervisor"))

    def _restart_dead_functions(self) -> None:
        for proc in self.procs:
            if proc.name in self._held_down:
                continue
            if proc.name.startswith("function-") and proc.proc is not None and proc.proc.poll() is not None:
                log.warning("%s exited with %s: starting it again", proc.name, proc.proc.returncode)
                proc.start()

    @contextlib.contextmanager
    def function_down(self, target: str) -> Iterator[None]:
        """Function ``target`` stopped, and kept down until the block ends, when the supervisor starts it
        again on its port: a crashed instance, for the fault suite."""
        (proc,) = [p for p in self.procs if p.name == f"function-{target}"]
        self._held_down.add(proc.name)
        proc.stop()
        try:
            yield
        finally:
            self._held_down.discard(proc.name)
            deadline = time.monotonic() + 60
            while proc.proc is None or proc.proc.poll() is not None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name} did not come back")
                time.sleep(0.2)

    def stop(self) -> None:
        """Close everything that started, newest first, then stop the processes; never raises."""
        while self._closers:
            closer = self._closers.pop()
            try:
                closer()
            except Exception as e:  # keep stopping the rest
                log.warning("while stopping: %s", e)
        # Nothing reaches the processes once the closers are done: they stop side by side (in turn, a
        # stack's stop waited out each one's exit: the Firestore emulator's alone takes two seconds).
        procs, self.procs = self.procs, []
        with ThreadPoolExecutor(max(1, len(procs))) as pool:
            for stopped in [pool.submit(p.stop) for p in procs]:
                try:
                    stopped.result()
                except Exception as e:  # keep stopping the rest
                    log.warning("while stopping: %s", e)
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()
