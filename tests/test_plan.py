"""The run plan's deadlines (retrain.plan): pure, from settings."""

from __future__ import annotations

import dataclasses

import pytest

from retrain import config
from retrain.plan import tokenize_deadline_s
from retrain_ops.deployment import Deployment, local_settings


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
    for bad in ("news", "news=-1", "news=lots", "News=5", "news=inf", "news=5,web=lots"):
        with pytest.raises(ValueError, match="RETRAIN_MONTHLY_BUDGETS"):  # refused when the settings load
            dataclasses.replace(s, monthly_budgets=bad)
    for bad_usd in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="RETRAIN_MONTHLY_BUDGET_USD"):
            dataclasses.replace(s, monthly_budget_usd=bad_usd)


def test_a_month_counts_ended_runs_at_their_cost_and_live_ones_at_their_estimate() -> None:
    from datetime import UTC, datetime, timedelta, timezone

    from retrain.domain.runs import FailureKind, Run, RunStatus
    from retrain.plan import Estimate, budget_month, over_monthly_budget, spent_this_month

    assert budget_month(datetime(2026, 11, 30, 23, 59, tzinfo=UTC)) == "2026-11"
    assert budget_month(datetime(2026, 12, 1, 0, 30, tzinfo=timezone(timedelta(hours=1)))) == "2026-11"  # UTC
    runs = [
        Run("a", "news", "manual", status=RunStatus.SUCCEEDED, cost_usd=40.0, estimated_cost_usd=90.0),
        Run("b", "news", "manual", status=RunStatus.TRAINING, cost_usd=0.0, estimated_cost_usd=30.0),
        Run("c", "news", "manual", status=RunStatus.PENDING),  # not priced yet
        Run("d", "web", "manual", status=RunStatus.FAILED, cost_usd=500.0),  # another dataset's
        # its execution was lost: what it cost was never recorded, its estimate stands for it
        Run(
            "e",
            "news",
            "manual",
            status=RunStatus.FAILED,
            failure=FailureKind.EXECUTION_LOST,
            estimated_cost_usd=5.0,
        ),
    ]
    assert spent_this_month(runs, "news") == 75.0
    # node time recorded unpriced (its account step could not run): its estimate stands for it
    unpriced = Run(
        "f", "news", "manual", status=RunStatus.SUCCEEDED, gpu_node_seconds=600.0, estimated_cost_usd=7.0
    )
    assert spent_this_month([*runs, unpriced], "news") == 82.0
    assert spent_this_month(runs, "news", but="b") == 45.0  # the run being started is not counted twice
    runs.pop()
    s = dataclasses.replace(config.load({}), monthly_budget_usd=100.0)
    cost = Estimate(training_tokens=1, node_hours=1.0, cost_usd=30.0, basis="test")
    assert over_monthly_budget(s, "news", 70.0, cost) is None  # 100.00 exactly: within
    assert over_monthly_budget(s, "news", 70.01, cost) == (
        "estimated $30.00 would take dataset news's spend this month to $100.01, over its monthly budget "
        "of $100.00 ($29.99 left)"
    )
    assert over_monthly_budget(dataclasses.replace(s, monthly_budget_usd=0.0), "news", 1e9, cost) is None


def test_a_failure_kind_this_release_does_not_know_reads_as_a_failed_step() -> None:
    """A record written by a newer workflow (a tag added there first) must not stop every reader."""
    from retrain.domain.runs import FailureKind, Run

    record = Run("r", "news", "manual").to_dict()
    assert Run.from_dict({**record, "failure": "CapacityError"}).failure == FailureKind.CAPACITY_ERROR
    assert Run.from_dict({**record, "failure": "QuotaExhausted"}).failure == FailureKind.STEP_FAILED
    assert Run.from_dict({k: v for k, v in record.items() if k != "failure"}).failure is None  # older records


def test_a_run_recorded_unpriced_says_so_rather_than_costing_nothing() -> None:
    from retrain.domain.runs import Run, RunStatus
    from retrain_ops.cli import format_run

    unpriced = Run("u", "news", "manual", status=RunStatus.SUCCEEDED, gpu_node_seconds=600.0)
    ended = RunStatus.SUCCEEDED
    priced = Run("p", "news", "manual", status=ended, gpu_node_seconds=600.0, gpu_hours=1.3, cost_usd=14.7)
    assert unpriced.unpriced and not priced.unpriced
    assert not Run("n", "news", "manual", status=RunStatus.FAILED).unpriced  # no node time: nothing to price
    assert "unpriced: its account step could not run" in format_run(unpriced)
    assert "$14.70 of node time" in format_run(priced)
