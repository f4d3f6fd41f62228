"""Each fake in ``tests/fakes`` has every method of its port, called as the port and the real adapter are
called (the same parameters, kinds and defaults): a port that grows a method or a parameter fails here
until the fake follows, before any test on the fake can pass on a call the adapter would refuse."""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any, Protocol

import pytest
from fakes.ledger import InMemoryLedger
from fakes.objects import InMemoryObjects

from retrain.adapters import objects
from retrain.adapters.ledger import FirestoreLedger
from retrain.ports import Ledger, ObjectStore


def port_methods(port: type) -> list[str]:
    """The public methods a port (a Protocol and the Protocols it extends) declares."""
    return sorted(
        {
            name
            for cls in port.__mro__
            if cls not in (Protocol, object) and Protocol in cls.__mro__
            for name, value in vars(cls).items()
            if callable(value) and not name.startswith("_")
        }
    )


def parameters(method: Any, declared: list[tuple[str, Any, Any]] | None = None) -> list[tuple[str, Any, Any]]:
    """How a method is called: each parameter's name, kind and default; where the port ``declared`` a
    default as ``...`` (its way of saying "has one"), any default matches it."""
    found = [
        (p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values() if p.name != "self"
    ]
    for i, (_, _, default) in enumerate(declared or []):
        if default is Ellipsis and i < len(found) and found[i][2] is not inspect.Parameter.empty:
            found[i] = (*found[i][:2], Ellipsis)
    return found


@pytest.mark.parametrize(
    ("port", "fake", "adapter"),
    [
        pytest.param(Ledger, InMemoryLedger, FirestoreLedger, id="ledger"),
        pytest.param(ObjectStore, InMemoryObjects, objects, id="object-store"),
    ],
)
def test_a_fake_is_called_as_its_port_and_the_real_adapter_are(
    port: type, fake: type, adapter: type | ModuleType
) -> None:
    methods = port_methods(port)
    assert len(methods) >= 5
    for name in methods:
        declared = parameters(getattr(port, name))
        assert parameters(getattr(fake, name), declared) == declared, f"{fake.__name__}.{name}"
        assert parameters(getattr(adapter, name), declared) == declared, f"{adapter.__name__}.{name}"
