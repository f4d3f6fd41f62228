"""The time an execution lives in: ``sys.now``, ``sys.sleep``, retry backoffs and callback timeouts.

:class:`RealClock` is the wall clock (the executions service runs on it).  :class:`VirtualClock` is a
test's: time stands still while steps run and jumps when the execution waits, to the end of the wait or
to the first thing scheduled before it (:meth:`VirtualClock.at`: a capacity request provisioned, a
callback delivered), which runs on the waiting thread.  A workflow that sleeps six hours in polls of a
minute runs in a fraction of a second, and what happens during the wait happens at the virtual time it
was given.  Only single-threaded executions may run on it (``parallel`` branches would wait on one
another's time): a wait from a second thread raises.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    """What an execution asks of time."""

    def now(self) -> float:
        """Seconds since the epoch (``sys.now``)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock no one sets, for deadlines (a step of the wall clock moves none)."""
        ...

    def sleep(self, seconds: float, cancel: threading.Event) -> bool:
        """Wait ``seconds``, or less if ``cancel`` is set: whether it was."""
        ...

    def pause(self, cond: threading.Condition, seconds: float) -> None:
        """Wait on ``cond`` (held by the caller) for at most ``seconds``, for a change it guards; the
        caller checks what it waits for again, and its deadline by :meth:`now`."""
        ...


class RealClock:
    """The wall clock.  A wait returns early, within 50 ms, when its cancel is set."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float, cancel: threading.Event) -> bool:
        return cancel.wait(max(0.0, seconds))

    def pause(self, cond: threading.Condition, seconds: float) -> None:
        cond.wait(min(max(0.0, seconds), 0.05))  # short: a cancel (another event) is noticed promptly


class VirtualClock:
    """Time that passes only when an execution waits (see the module docstring)."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._owner: threading.Thread | None = None

    def now(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._now

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Run ``action`` once the clock reaches ``when`` (seconds since the epoch): on the thread whose
        wait takes the clock past it, in time order (ties in the order given)."""
        heapq.heappush(self._due, (when, next(self._order), action))

    def after(self, seconds: float, action: Callable[[], None]) -> None:
        self.at(self._now + seconds, action)

    def advance(self, seconds: float) -> None:
        """Move ``seconds`` on, running each action that falls due on the way at its own time."""
        end = self._now + max(0.0, seconds)
        while self._due and self._due[0][0] <= end:
            when, _, action = heapq.heappop(self._due)
            self._now = max(self._now, when)
            action()
        self._now = end

    def sleep(self, seconds: float, cancel: threading.Event) -> bool:
        end = self._now + max(0.0, seconds)
        while not cancel.is_set() and self._now < end:
            self._step_to(end)
        return cancel.is_set()

    def pause(self, cond: threading.Condition, seconds: float) -> None:
        self._step_to(self._now + max(0.0, seconds))

    def _step_to(self, end: float) -> None:
        """To the first action due by ``end`` (and run it), or to ``end``."""
        self._owner = self._owner or threading.current_thread()
        if self._owner is not threading.current_thread():
            raise RuntimeError("a VirtualClock serves one thread: its time jumps when that thread waits")
        if self._due and self._due[0][0] <= end:
            when, _, action = heapq.heappop(self._due)
            self._now = max(self._now, when)
            action()
        else:
            self._now = end
