"""The forecast: what sealing each dataset now would train and cost, and whether it would be refused, read
from the ledger alone (``retrain forecast``)."""

from __future__ import annotations

from typing import Any

from retrain.contracts import Forecast
from retrain.domain.datasets import optional_dataset
from retrain.domain.errors import PlanError
from retrain.domain.runs import RunStatus
from retrain.ingest import starts
from retrain.ingest.context import Context
from retrain.plan import check_before_capacity, over_budget, over_monthly_budget, training_plan


def forecast(ctx: Context, dataset: Any = None) -> list[Forecast]:
    """What sealing every dataset with new data or a pending run (or only ``dataset``) would train,
    and its cost; nothing is written."""
    dataset = optional_dataset(dataset)
    if dataset:
        names = [dataset]
    else:
        waiting = {p.dataset for p in ctx.ledger.pending()}
        names = sorted(waiting | {r.dataset for r in ctx.ledger.runs_in(RunStatus.PENDING)})
    return [forecast_of(ctx, name) for name in names]


def forecast_of(ctx: Context, dataset: str) -> Forecast:
    """What sealing ``dataset`` now would train, and its cost; nothing is written."""
    preview = ctx.ledger.preview(dataset)
    new_bytes = sum(v.size for v in preview.objects)
    held_bytes = sum(v.size for v in preview.pending_objects)
    champion = ctx.ledger.champion(dataset)
    cost = starts.price(ctx, champion)
    budget = ctx.settings.monthly_budget_of(dataset)
    spent = (
        starts.spent(ctx, dataset, preview.pending_run.run_id if preview.pending_run else "")
        if budget > 0
        else 0.0
    )
    refused = over_budget(ctx.settings, cost) or over_monthly_budget(ctx.settings, dataset, spent, cost)
    try:  # what start would check before asking for capacity
        check_before_capacity(ctx.settings, training_plan(ctx.settings, "plan", champion, dataset))
    except PlanError as e:
        refused = refused or f"the trainer would refuse this run: {e}"
    trains = len(preview.objects) + len(preview.pending_objects)
    if not trains:
        reason = (
            f"nothing new: {preview.skipped} object(s) skipped, their content trained before or is "
            "in the live run"
        )
    elif refused:
        reason = f"a run would be refused: {refused}"
    elif not preview.objects and preview.pending_run is not None:
        reason = (
            f"nothing new to seal; pending run {preview.pending_run.run_id} holds "
            f"{len(preview.pending_objects)} object(s) and starts when the dataset's live run ends"
        )
    else:
        reason = f"a run would train {trains} object(s)"
    return Forecast(
        dataset=dataset,
        objects=len(preview.objects),
        bytes=new_bytes,
        skipped=preview.skipped,
        pending_run=preview.pending_run.run_id if preview.pending_run else None,
        pending_objects=len(preview.pending_objects),
        estimated_tokens=int((new_bytes + held_bytes) * ctx.settings.tokens_per_byte),
        training_tokens=cost.training_tokens,
        estimated_node_hours=round(cost.node_hours, 4),
        estimated_cost_usd=round(cost.cost_usd, 2),
        max_cost_usd=ctx.settings.max_run_cost_usd,
        monthly_budget_usd=budget,
        budget_left_usd=round(max(0.0, budget - spent), 2) if budget > 0 else None,
        basis=cost.basis,
        would_run=bool(trains) and refused is None,
        reason=reason,
    )
