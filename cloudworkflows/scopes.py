"""An execution's variable scopes, and its control flow (``next``, ``return``, ``break``, ``continue``),
which travels as exceptions of its own so that a workflow's ``except`` can never catch it."""

from __future__ import annotations

from typing import Any


class Signal(Exception):
    """Control flow, never a workflow's error."""


class Jump(Signal):
    """``next: target``."""

    def __init__(self, target: str) -> None:
        self.target = target


class Return(Signal):
    """``return: value`` from the running (sub)workflow."""

    def __init__(self, value: Any) -> None:
        self.value = value


class End(Signal):
    """``next: end``."""


class Break(Signal):
    """``next: break`` out of a ``for``."""


class Continue(Signal):
    """``next: continue`` with a ``for``'s next iteration."""


class Scope:
    """A variable scope. ``shared`` is set on parallel-branch roots: the writable parent names."""

    def __init__(self, parent: Scope | None = None, shared: set[str] | None = None) -> None:
        self.vars: dict[str, Any] = {}
        self.sizes: dict[str, int] = {}  # each variable's memory_of, as counted in the execution's total
        self.parent = parent
        self.shared = shared

    def find(self, name: str) -> Scope | None:
        scope: Scope | None = self
        while scope is not None:
            if name in scope.vars:
                return scope
            scope = scope.parent
        return None


def in_parallel(scope: Scope | None) -> bool:
    while scope is not None:
        if scope.shared is not None:
            return True
        scope = scope.parent
    return False
