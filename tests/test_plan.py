"""The run plan's deadlines (retrain.plan): pure, from settings."""

from __future__ import annotations

import dataclasses

import pytest

from retrain import config
from retrain.deployment import Deployment, local_settings
from retrain.plan import tokenize_deadline_s


def test_the_tokenize_deadline_counts_objects_as_well_as_bytes() -> None:
    """Many small objects cost per object (one shard each): 2,000 files of 1 KB are not 2 MB of work."""
    s = dataclasses.replace(
        config.load({}), tokenize_timeout_s=60, tokenize_min_bytes_per_s=1e6, tokenize_min_objects_per_s=2.0
    )
    assert tokenize_deadline_s(s, 2_000_000, 1) == 60 + 2 + 0
    assert tokenize_deadline_s(s, 2_000_000, 2_000) == 60 + 2 + 1000


def test_locally_only_waiting_is_sped_up_never_real_work() -> None:
    """The stack's clock runs 60x for what it waits on (quiet periods, polls, DWS, the autoscaler); the
    tokenize and training deadlines bound work that runs at its own speed, and keep their values."""
    deployed, local = Deployment().settings(), local_settings({})
    assert (local.tokenize_timeout_s, local.train_timeout_s) == (
        deployed.tokenize_timeout_s,
        deployed.train_timeout_s,
    )
    assert (local.quiet_period_s, local.poll_interval_s) == (
        deployed.quiet_period_s / 60,
        deployed.poll_interval_s / 60,
    )


def test_a_datasets_monthly_budget_is_its_own_else_every_datasets() -> None:
    s = dataclasses.replace(config.load({}), monthly_budget_usd=100.0, monthly_budgets="news=250.5,free=0")
    assert (s.monthly_budget_of("news"), s.monthly_budget_of("free"), s.monthly_budget_of("web")) == (
        250.5,
        0.0,
        100.0,
    )
    for bad in ("news", "news=-1", "news=lots", "News=5", "news=inf"):
        with pytest.raises(ValueError, match="RETRAIN_MONTHLY_BUDGETS"):
            dataclasses.replace(s, monthly_budgets=bad).monthly_budget_of("web")


def test_a_month_counts_ended_runs_at_their_cost_and_live_ones_at_their_estimate() -> None:
    from datetime import UTC, datetime

    from retrain.domain.runs import Run, RunStatus
    from retrain.plan import Estimate, month_start, over_monthly_budget, spent_this_month

    assert month_start(datetime(2026, 11, 27, 10, 45, tzinfo=UTC)) == "2026-11-01T00:00:00.000000Z"
    runs = [
        Run("a", "news", "manual", status=RunStatus.SUCCEEDED, cost_usd=40.0, estimated_cost_usd=90.0),
        Run("b", "news", "manual", status=RunStatus.TRAINING, cost_usd=0.0, estimated_cost_usd=30.0),
        Run("c", "news", "manual", status=RunStatus.PENDING),  # not priced yet
        Run("d", "web", "manual", status=RunStatus.FAILED, cost_usd=500.0),  # another dataset's
    ]
    assert spent_this_month(runs, "news") == 70.0
    assert spent_this_month(runs, "news", but="b") == 40.0  # the run being started is not counted twice
    s = dataclasses.replace(config.load({}), monthly_budget_usd=100.0)
    cost = Estimate(training_tokens=1, node_hours=1.0, cost_usd=30.0, basis="test")
    assert over_monthly_budget(s, "news", 70.0, cost) is None  # 100.00 exactly: within
    assert over_monthly_budget(s, "news", 70.01, cost) == (
        "estimated $30.00 would take dataset news's spend this month to $100.01, over its monthly budget "
        "of $100.00 ($29.99 left)"
    )
    assert over_monthly_budget(dataclasses.replace(s, monthly_budget_usd=0.0), "news", 1e9, cost) is None
