"""The run plan's deadlines (retrain.plan): pure, from settings."""

from __future__ import annotations

import dataclasses

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
