"""The eval gate (retrain.domain.runs.evaluate) on its own: pure domain, no emulator.

The steps' tests (tests/test_steps.py) drive it through the trainer's outputs; these pin the decisions
a trainer's numbers must never be able to bend: a loss that is not a finite number, a champion recorded
with one, and a base loss the run's own outputs claim against the ledger's."""

from __future__ import annotations

import math

import pytest

from retrain.domain.runs import CHAMPIONS_DATA, EVAL_SET, NOTHING_TO_COMPARE, SAME_DATA, Champion, evaluate

EVAL = "gs://art/eval/news_text_document"


def champion(val_loss: float | None, eval_set: str | None = None) -> Champion:
    return Champion("news-1", "gs://art/runs/news-1/checkpoints/last", 60, val_loss, eval_set)


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_loss_that_is_not_finite_is_refused_first_run_or_not(loss: float) -> None:
    for against in (None, champion(3.0)):
        verdict = evaluate(loss, against, margin=0.02)
        assert verdict.promoted is False
        assert verdict.reason == f"val_loss {loss} is not a finite number: refused"
        assert verdict.val_loss is None  # the record holds no NaN (JSON has none)


def test_a_champion_recorded_with_nan_does_not_disable_the_gate() -> None:
    # every comparison with NaN is false: "worse than NaN" never held, so everything was promoted
    verdict = evaluate(9.0, champion(math.nan), margin=0.0, base_val_loss=3.0)
    assert (verdict.promoted, verdict.champion_val_loss, verdict.compared_on) == (False, 3.0, SAME_DATA)
    nothing = evaluate(9.0, champion(math.nan), margin=0.0)
    assert (nothing.promoted, nothing.reason) == (True, NOTHING_TO_COMPARE)  # and the record says so


def test_on_the_same_eval_set_the_ledger_outranks_a_base_loss_the_run_reports() -> None:
    # a planted base_val_loss of 1e9 would let anything through; the champion's own loss on the same
    # eval set is the ledger's number, which no trainer output can change
    verdict = evaluate(5.0, champion(3.0, EVAL), margin=0.0, base_val_loss=1e9, eval_set=EVAL)
    assert (verdict.promoted, verdict.champion_val_loss, verdict.compared_on) == (False, 3.0, EVAL_SET)


def test_a_base_loss_that_is_not_finite_is_ignored() -> None:
    verdict = evaluate(5.0, champion(3.0), margin=0.0, base_val_loss=math.inf)
    assert (verdict.promoted, verdict.champion_val_loss, verdict.compared_on) == (False, 3.0, CHAMPIONS_DATA)


def test_a_first_run_without_validation_says_so() -> None:
    assert evaluate(None, None, margin=0.0).reason == "the dataset's first checkpoint (no validation ran)"
