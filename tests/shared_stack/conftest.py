"""One local stack for the end-to-end tests that run on its default settings (tests/stack_support's
``module_stack``): the fault suite, the workflow's failure paths, the IAM the stack enforces and the CLI
against a deployment target.  Each test drives a fresh dataset, and a test that needs a quiet stack
pauses the Scheduler jobs it must not race (``paused_jobs``) instead of booting one with other settings.
The stack boots before the package's first test and stops after its last (``tests/conftest.py`` runs the
package's tests on one worker: ``SHARED_PACKAGES``), where each module once booted and stopped its own
(some 25 CPU seconds and 30 s of a worker's time each)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from stack_support import module_stack

from retrain_local.cluster import Faults
from retrain_local.stack import LocalStack


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from module_stack(tmp_path_factory)


@pytest.fixture(autouse=True)
def healthy_twin(stack: LocalStack) -> Iterator[None]:
    """Each test starts on a healthy cluster twin with every Scheduler job ticking: a test that sets
    faults (``run_with``) or pauses a job leaves neither to the next.  The faults are set only when they
    are not healthy already: setting them waits for the twin's pass under way."""
    if stack.twin.faults != Faults():
        stack.twin.faults = Faults()
    yield
    assert not stack.paused_jobs, f"a test left Scheduler jobs paused: {sorted(stack.paused_jobs)}"
