"""The per-run cost cap on the whole local stack: a run still training when its node time reaches the
cap is stopped there and releases every node (the refusal of a run priced over the cap, and the
deadline's arithmetic, are in tests/test_triggers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from stack_support import assert_released, module_stack, run_with

from retrain_local.cluster import Faults
from retrain_local.stack import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.emulators, pytest.mark.envtest]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # $1 a node-second and a $20 cap: a run may train 20 s on its one node.  Priced at a billion
    # tokens a second and no start-up, every run is estimated far under the cap, so it starts.
    yield from module_stack(
        tmp_path_factory,
        price_per_node_hour=3600.0,
        max_run_cost_usd=20.0,
        node_tokens_per_s=1e9,
        node_overhead_s=0.0,
    )


def test_a_run_still_training_at_the_cost_cap_is_stopped_and_releases_every_node(
    stack: LocalStack, tmp_path: Path
) -> None:
    run = run_with(stack, tmp_path, Faults(hold_training_s=600))
    assert_released(stack, run, "failed")  # stopped: zero nodes, no JobSet, no ProvisioningRequest
    assert (run.estimated_cost_usd, run.cost_cap_usd) == (0.0, 20.0)  # under the cap when it started
    assert run.reason and "training did not finish within 20 s, the per-run cost cap of $20.00" in run.reason
    assert run.failure == "TrainingTimeout"
    # it trained (held) until the cap's node time ran out: 20 s, plus what capacity and release add
    assert run.gpu_node_seconds >= 20
