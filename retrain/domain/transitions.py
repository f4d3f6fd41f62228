"""What Python writes to a run record, one typed change per transition.

A run record (:class:`retrain.domain.runs.Run`) has two writers: the workflow, which records the states it
moves through (``workflows/retrain.yaml``, its ``record`` sub-workflow), and Python, whose every write is
one of the changes here, handed to the ledger (:meth:`retrain.ports.RunStore.record`).  The field names
each change sets are fixed here and nowhere else; the ledger adds only its own bookkeeping (a start's
claim, a run's objects and snapshot, the content it gave back)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from retrain.domain.runs import Evaluation, FailureKind, RunStatus, TrainingMetrics, now_iso


@dataclass(frozen=True)
class RunPlanned:
    """A start's plan, kept under its claim before its execution exists (``Starts.start``)."""

    plan: dict[str, Any]
    """The workflow's argument (:class:`retrain.contracts.WorkflowArgument`), which its begin step reads
    back: the execution itself is handed only the run and the claim."""
    service_account: str | None = None
    """The Kubernetes service account its pods will run as (its plan's ``run_account``)."""
    profile: str | None = None
    """The trainer profile the plan chose."""
    base_checkpoint: str | None = None
    """The champion's checkpoint it continues from (None: the dataset's first run)."""
    base_step: int = 0
    """That checkpoint's step."""
    estimated_cost_usd: float | None = None
    """Its price at this start, rounded to cents (the per-run cap and the monthly budget judge it)."""
    cost_cap_usd: float | None = None
    """The per-run cap it starts under (None: none)."""
    budget_month: str | None = None
    """The month (``YYYY-MM``, UTC) its price counts against."""
    manifest_generation: int | None = None
    """The generation of the manifest this start wrote."""

    def fields(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "service_account": self.service_account,
            "profile": self.profile,
            "base_checkpoint": self.base_checkpoint,
            "base_step": self.base_step,
            "estimated_cost_usd": self.estimated_cost_usd,
            "cost_cap_usd": self.cost_cap_usd,
            "budget_month": self.budget_month,
            "manifest_generation": self.manifest_generation,
        }


@dataclass(frozen=True)
class ManifestRewritten:
    """The run's manifest is about to be written again at another generation (its content changed between
    two claims): the generation recorded is no longer the one its tokenize job will read."""

    def fields(self) -> dict[str, Any]:
        return {"manifest_generation": None}


@dataclass(frozen=True)
class HandedOver:
    """What its training was handed (``Steps.handover``): the JobSet's command and the data it names."""

    profile: str
    """The trainer profile that rendered the command."""
    image: str
    """The training container's image."""
    command: list[str]
    """The trainer's argv as submitted."""
    blend: list[Any]
    """The blend it trains on: ``[weight, gs://prefix, ...]``."""
    eval_set: str | None
    """The prefix it validates on (None: its blend's validation split)."""

    def fields(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "image": self.image,
            "command": list(self.command),
            "blend": list(self.blend),
            "eval_set": self.eval_set,
        }


@dataclass(frozen=True)
class TrainingResults:
    """What its training left (``Steps.results``): a checkpoint, the trainer's metrics, the eval gate's
    verdict; written before any promotion, so a retried step finds the verdict."""

    checkpoint: str | None
    """The checkpoint it produced (None: none was found)."""
    metrics: TrainingMetrics | None
    """What the trainer reported (None: no TensorBoard events were found)."""
    eval: Evaluation | None = None
    """The eval gate's verdict (None: nothing judged; a retried step leaves the first verdict)."""
    missing: str = ""
    """What was not found, for a person (empty: nothing missing; the record's ``reason`` is then left)."""

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "checkpoint": self.checkpoint,
            "metrics": self.metrics.to_dict() if self.metrics else None,
        }
        if self.missing:
            out["reason"] = self.missing
        if self.eval is not None:
            out["eval"] = self.eval.to_dict()
        return out


@dataclass(frozen=True)
class RunEnd:
    """A run's end as its record keeps it, when Python ends it (a refusal, an empty run, a lost execution;
    the workflow records the ends it reaches itself): one shape for each of them."""

    status: RunStatus
    reason: str
    """Why, for a person."""
    failure: FailureKind | None = None
    """Why, for a program (None: it succeeded)."""
    nodes_at_end: int | None = None
    """The GPU nodes up when it ended, where that is known (0: it never asked for any)."""
    at: str | None = None
    """When it ended (None: when it is written)."""

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "status": str(self.status),
            "reason": self.reason,
            "finished_at": self.at or now_iso(),
        }
        if self.failure is not None:
            out["failure"] = str(self.failure)
        if self.nodes_at_end is not None:
            out["nodes_at_end"] = self.nodes_at_end
        return out


@dataclass(frozen=True)
class NothingToTrain:
    """A run whose every object is empty succeeds at its start, without a job or capacity."""

    objects: int
    """Its objects (all of them empty)."""
    manifest_generation: int | None
    """The manifest its start wrote (for its lineage and the audit)."""

    @property
    def reason(self) -> str:
        return f"nothing to train: its {self.objects} object(s) are empty"

    def fields(self) -> dict[str, Any]:
        now = now_iso()
        end = RunEnd(RunStatus.SUCCEEDED, self.reason, nodes_at_end=0, at=now)
        return {
            **end.fields(),
            "manifest_generation": self.manifest_generation,
            "objects": self.objects,
            "work_ended_at": now,
        }


@dataclass(frozen=True)
class ReleaseObserved:
    """The reaper saw the node pool at zero for an ended run whose own end never recorded its release."""

    at: str
    """When it saw it."""

    def fields(self) -> dict[str, Any]:
        return {"nodes_at_end": 0, "release_observed_at": self.at}


RunChange = (
    RunPlanned | ManifestRewritten | HandedOver | TrainingResults | RunEnd | NothingToTrain | ReleaseObserved
)
"""Every write Python makes to a run record."""
