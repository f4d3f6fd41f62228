"""Seals and starts: a seal cuts a dataset's timeline, and a sealed batch whose snapshot is new becomes one
run; a run starts when its dataset has no live run: its object list is written as the run's manifest, its
cost is checked against the cap and the dataset's monthly budget, its plan against the trainer, and one
workflow execution starts."""

from __future__ import annotations

import dataclasses
import logging
from datetime import UTC, datetime
from typing import Any

from retrain.contracts import ExecutionArgument, RunEventType, RunManifest
from retrain.domain.datasets import optional_dataset
from retrain.domain.errors import PlanError, Rejected
from retrain.domain.runs import Champion, FailureKind, Run, RunStatus, Trigger
from retrain.domain.transitions import ManifestRewritten, NothingToTrain, RunEnd, RunPlanned
from retrain.ingest.context import Context, Job
from retrain.ingest.outcomes import Action, Outcome
from retrain.logs import Alert
from retrain.plan import (
    Estimate,
    budget_month,
    estimate,
    manifest_object,
    near_monthly_budget,
    over_budget,
    over_monthly_budget,
    spent_this_month,
    workflow_argument,
)
from retrain.ports import ObjectChanged, SealOutcome, SealVerdict, StartVerdict, tell

log = logging.getLogger("retrain.ingest")


def price(ctx: Context, champion: Champion | None) -> Estimate:
    """The next run's estimate, from the champion run's record when the dataset has one."""
    return estimate(ctx.settings, ctx.ledger.get_run(champion.run_id) if champion else None)


def spent(ctx: Context, dataset: str, but: str = "") -> float:
    """What ``dataset`` spent this calendar month (ended runs' costs, live runs' estimates)."""
    return spent_this_month(ctx.ledger.runs_budgeted_in(budget_month(datetime.now(UTC))), dataset, but)


class Starts(Job):
    """Seals, a run's start (or its queueing, refusal or empty end), and a retried run's objects again."""

    def seal(self, dataset: str, trigger: Trigger, retry_of: str | None = None) -> Outcome:
        """Seal the dataset's pending arrivals and start their run (or queue it behind the live one)."""
        return self.started(self.ledger.seal(dataset, trigger, retry_of))

    def seal_pending(self, dataset: Any, trigger: Trigger) -> list[Outcome]:
        """Seal every dataset's pending data (or only ``dataset``'s): ticks and manual triggers."""
        dataset = optional_dataset(dataset)
        return [self.seal(p.dataset, trigger) for p in self.ledger.pending(dataset)]

    def materialized(self, batch_id: str) -> Outcome:
        return self.started(self.ledger.materialize(batch_id))

    def started(self, sealed: SealOutcome) -> Outcome:
        if sealed.verdict == SealVerdict.NOTHING_PENDING:
            return Outcome(Action.NOTHING_TO_SEAL, sealed.reason)
        if sealed.run is None:
            log.info("seal: %s", sealed.reason)
            return Outcome(Action.ALREADY_TRAINED, sealed.reason)
        if sealed.run.execution:
            return Outcome(Action.STARTED, sealed.run.execution, sealed.run.run_id)
        tell(self.events, RunEventType.QUEUED, sealed.run)  # each seal that joins it: one event, by id
        return self.start(sealed.run)

    def start(self, run: Run) -> Outcome:
        """Start a pending run's workflow if its dataset has no live run; otherwise it stays pending
        (later seals join it) until the live run ends.

        The object list is fixed here and goes to the run's manifest (arguments are capped at 32 KB)."""
        claim = self.ledger.claim_start(run, self.settings.stuck_after_s)
        if claim.verdict == StartVerdict.QUEUED:
            log.info("run %s pending behind the live run of dataset %s", run.run_id, run.dataset)
            return Outcome(Action.QUEUED, f"dataset {run.dataset} has a live run", run.run_id)
        if claim.verdict == StartVerdict.EMPTY:
            return Outcome(Action.ALREADY_TRAINED, f"run {run.run_id} had nothing left to train", run.run_id)
        if claim.verdict == StartVerdict.STARTING:
            return Outcome(Action.QUEUED, "its start was claimed moments ago and is under way", run.run_id)
        if claim.verdict == StartVerdict.STARTED:
            current = self.ledger.get_run(run.run_id)
            return Outcome(Action.STARTED, str(current.execution if current else ""), run.run_id)
        run = dataclasses.replace(run, objects=len(claim.objects), snapshot=claim.snapshot)
        manifest = RunManifest(run.run_id, run.dataset, run.batch_id, run.snapshot, list(claim.objects))
        if manifest.total_bytes == 0:
            return self._nothing_to_train(run, claim.token, manifest)
        champion = self.ledger.champion(run.dataset)
        cost = price(self.ctx, champion)
        if (too_dear := over_budget(self.settings, cost) or self._budget_refusal(run, cost)) is not None:
            return self._refuse(run, claim.token, too_dear)
        try:
            argument = workflow_argument(self.settings, run, champion, manifest.total_bytes)
        except PlanError as e:
            return self._refuse(run, claim.token, f"the trainer would refuse this run: {e}")
        written = self.write_manifest(run, claim.token, manifest)
        argument = dataclasses.replace(argument, manifest_generation=written)
        # The plan is the ledger's, kept under this claim: the execution's argument names only the run
        # and the claim, and its begin step reads the plan back (ExecutionArgument says why).
        planned = RunPlanned(
            plan=argument.to_dict(),
            service_account=argument.run_account["metadata"]["name"],
            profile=argument.training["profile"],
            base_checkpoint=champion.checkpoint if champion else None,
            base_step=champion.step if champion else 0,
            estimated_cost_usd=round(cost.cost_usd, 2),
            cost_cap_usd=self.settings.max_run_cost_usd or None,
            budget_month=budget_month(datetime.now(UTC)),
            manifest_generation=written,
        )
        kept = self.ledger.record_claimed(run.run_id, claim.token, planned)
        if not kept:
            return self._superseded(run)
        execution = self.orchestrator.start(ExecutionArgument(run.run_id, claim.token).to_dict())
        if self.ledger.attach_execution(run.run_id, claim.token, execution) is None:
            # Its begin step finds the claim is another's and ends it before it touches anything.
            return self._superseded(run, execution)
        log.info("run %s started: %d objects, execution %s", run.run_id, run.objects, execution)
        return Outcome(Action.STARTED, execution, run.run_id)

    def retry(self, run_id: str) -> Outcome:
        """Run a failed or cancelled run's objects again, or those of a run whose checkpoint the eval gate
        refused (on the champion this time): its content is given back (if its end did not already), its
        objects arrive again, and its dataset is sealed now, so a run takes them (with whatever else is
        pending)."""
        run = self.ledger.get_run(run_id)
        if run is None:
            raise Rejected(f"no run {run_id}")
        if run.promoted:
            raise Rejected(f"run {run_id} was promoted: the champion holds its content, never trained twice")
        if not run.status.terminal or (run.status == RunStatus.SUCCEEDED and not run.refused):
            raise Rejected(
                f"run {run_id} is {run.status}: only a failed or cancelled run, or one whose checkpoint the "
                "eval gate refused, is retried"
            )
        self.ledger.give_back(run)
        returned = self.ledger.requeue(run)
        log.info("retrying run %s: its %d object(s) arrive again", run_id, returned)
        return self.seal(run.dataset, Trigger.RETRY, retry_of=run_id)

    def _superseded(self, run: Run, execution: str = "") -> Outcome:
        """This starter's claim was taken over (a sweep took it to be stuck): the other starter's
        execution is the run's; this one's, if it made one, ends at its begin step."""
        log.warning(
            "run %s: its start was taken over by another starter%s",
            run.run_id,
            f"; execution {execution} will end at its begin step" if execution else "",
        )
        current = self.ledger.get_run(run.run_id)
        if current is not None and current.execution:
            return Outcome(Action.STARTED, current.execution, run.run_id)
        return Outcome(Action.QUEUED, "its start was taken over by another starter", run.run_id)

    def write_manifest(self, run: Run, claim: str, manifest: RunManifest) -> int | None:
        """Write the run's manifest; the generation written (the version the audit and report read and
        the tokenize job is pinned to: the run record's ``manifest_generation``).

        Written only where none is (ifGenerationMatch=0): a starter whose claim a sweep took over must
        not rewrite the manifest its successor recorded, whose version would then be noncurrent and, after
        the bucket's retention, gone from under the run's audit and report.  The same bytes already there
        (a starter of this run before, on the same content) are this claim's manifest; other bytes (the
        run's content changed between the two claims) are rewritten only at the generation read and only
        while the claim is still this one; None when it is not (the caller's claimed update then fails).
        Left open: a starter that checked its claim and stalls before that rewrite, past two takeovers,
        can still make a successor's recorded version noncurrent (still readable until the retention)."""
        uri = f"{self.settings.artifacts_uri}/{manifest_object(run.run_id)}"
        data = manifest.to_json()
        try:
            return self.store.write_bytes(uri, data, "application/json", if_generation_match=0)
        except ObjectChanged:
            there = self.store.stat(uri)
        if self.store.read_bytes(uri, there.generation) == data:
            return there.generation
        if not self.ledger.record_claimed(run.run_id, claim, ManifestRewritten()):
            return None
        try:
            return self.store.write_bytes(uri, data, "application/json", if_generation_match=there.generation)
        except ObjectChanged:  # another starter wrote meanwhile: the claim is most likely not this one's
            return None

    def _nothing_to_train(self, run: Run, claim: str, manifest: RunManifest) -> Outcome:
        """End a run whose every object is empty: it would tokenize to nothing and fail, so it succeeds
        now, without a job or capacity (its manifest is written, for its lineage and the audit)."""
        empty = NothingToTrain(len(manifest.objects), self.write_manifest(run, claim, manifest))
        reason = empty.reason
        if not self.ledger.record_claimed(run.run_id, claim, empty):
            return self._superseded(run)
        tell(self.events, RunEventType.SUCCEEDED, run, reason=reason, cost_usd=0.0)
        log.info("run %s: %s", run.run_id, reason)
        return Outcome(Action.EMPTY, reason, run.run_id)

    def _budget_refusal(self, run: Run, cost: Estimate) -> str | None:
        """Why ``run``, estimated at ``cost``, would pass its dataset's monthly budget (None: it would
        not); one that would take it past ``alert_budget_fraction`` of it is logged for the budget alert."""
        if self.settings.monthly_budget_of(run.dataset) <= 0:
            return None  # no budget: no query
        so_far = spent(self.ctx, run.dataset, run.run_id)
        refusal = over_monthly_budget(self.settings, run.dataset, so_far, cost)
        if refusal is None and (near := near_monthly_budget(self.settings, run.dataset, so_far, cost)):
            extra = {"alert": Alert.BUDGET, "run_id": run.run_id, "dataset": run.dataset}
            log.warning("run %s starts: %s", run.run_id, near, extra=extra)
        return refusal

    def _refuse(self, run: Run, claim: str, reason: str) -> Outcome:
        """End a run before it asks for any capacity, its content given back (eligible again: dropped
        again, or ``run --retry`` once whatever refused it is fixed); not when a sweep took its start
        over (the other starter decides)."""
        end = RunEnd(RunStatus.FAILED, reason, FailureKind.REFUSED, nodes_at_end=0)
        if not self.ledger.record_claimed(run.run_id, claim, end):
            return self._superseded(run)
        tell(self.events, RunEventType.REFUSED, run, reason=reason, failure=str(FailureKind.REFUSED))
        returned = self.ledger.give_back(run)
        log.warning(
            "run %s refused before any capacity was requested (%d objects given back): %s",
            run.run_id,
            returned,
            reason,
        )
        return Outcome(Action.REFUSED, reason, run.run_id)
