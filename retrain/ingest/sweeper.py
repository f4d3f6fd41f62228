"""The sweeper and the Scheduler's other jobs: what a timer must do when no event comes (seal quiet or old
batches, finish what a crash cut short, record executions that died without an outcome, give back what an
unsuccessful run still holds, start queued runs, advance BigQuery exports), the reaper, and the audit."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial

from retrain.audit import Account, AuditReport, audit, log_report, repair
from retrain.contracts import RunEventType
from retrain.domain.errors import ExecutionLost, Retry
from retrain.domain.runs import BatchState, FailureKind, Run, RunStatus, Trigger, iso, now_iso, parse_iso
from retrain.domain.transitions import ReleaseObserved, RunEnd
from retrain.exports import Step
from retrain.ingest.arrivals import Arrivals
from retrain.ingest.context import Context, Job
from retrain.ingest.outcomes import Action, Outcome
from retrain.ingest.starts import Starts
from retrain.logs import Alert
from retrain.ports import ExecutionState, ExecutionStatus, Ledger, NodeUp, Orchestrator, RunEvents, tell

log = logging.getLogger("retrain.ingest")


def record_silent_end(
    ledger: Ledger, orchestrator: Orchestrator, run: Run, events: RunEvents | None = None
) -> Outcome | None:
    """Record as failed a run whose workflow execution ended (a crash, a hard cancel) without writing
    its outcome, or no longer exists at all (the executions service lost it); None while the execution
    is active or the record is already final."""
    try:
        execution = orchestrator.get(str(run.execution))
    except ExecutionLost:
        execution = ExecutionStatus(ExecutionState.LOST)
    state = execution.state
    if not state.ended:
        return None
    current = ledger.get_run(run.run_id)  # re-read: the workflow writes its outcome before it ends
    if current is None or current.status.terminal:
        return None
    if current.checkpoint:
        # Trained, its results recorded (its checkpoint judged, promoted or not): only what came after
        # (the release, the final record) was cut short, so it succeeded; the reaper releases.
        how = "was lost" if state == ExecutionState.LOST else f"ended {state}"
        reason = f"trained; its execution {run.execution} {how} while releasing (the reaper releases)"
        ledger.record(run.run_id, RunEnd(RunStatus.SUCCEEDED, reason))
        tell(events, RunEventType.SUCCEEDED, current, reason=reason)
        return Outcome(Action.RECORDED_SUCCESS, reason, run.run_id)
    if state == ExecutionState.LOST:
        reason = f"execution lost: {run.execution} no longer exists (nothing will release its capacity)"
    else:
        reason = f"workflow execution ended {state} without recording an outcome" + (
            f": {execution.error}" if execution.error else ""
        )
    ledger.record(run.run_id, RunEnd(RunStatus.FAILED, reason, FailureKind.EXECUTION_LOST))
    tell(events, RunEventType.FAILED, current, reason=reason, failure=str(FailureKind.EXECUTION_LOST))
    ledger.give_back(current)  # identical bytes dropped again are new; `run --retry` re-runs them
    return Outcome(Action.RECORDED_FAILURE, reason, run.run_id)


class Sweeper(Job):
    """What the Scheduler's timers do: the sweep, the reaper and the audit."""

    def __init__(self, ctx: Context, starts: Starts, arrivals: Arrivals) -> None:
        super().__init__(ctx)
        self.starts, self.arrivals = starts, arrivals

    def sweep(self, now: datetime | None = None) -> list[Outcome]:
        """What a timer must do, in order: seal quiet or old batches, finish seals and starts a crash cut
        short, record executions that died without an outcome (and reap what they left), start queued
        runs, and advance BigQuery exports (and start those that are due).  Each item is handled on its
        own: one failure is logged, and the round goes on."""
        began, now = time.monotonic(), now or datetime.now(UTC)
        s = self.settings
        stuck_before, quiet_before, old_before = (
            iso(now - timedelta(seconds=x)) for x in (s.stuck_after_s, s.quiet_period_s, s.max_batch_age_s)
        )
        outcomes: list[Outcome] = []

        def each(what: str, fn: Callable[[], Outcome | None]) -> Outcome | None:
            try:
                outcome = fn()
            except Exception as e:  # the next round retries it; this one goes on
                log.exception("sweep: %s failed", what)
                outcome = Outcome(Action.ERROR, f"{what}: {type(e).__name__}: {e}")
            if outcome is not None:
                outcomes.append(outcome)
            return outcome

        for pending in self.ledger.pending():
            if pending.last_arrival_at < quiet_before:
                each(
                    f"seal {pending.dataset}",
                    partial(self.starts.seal, pending.dataset, Trigger.QUIET_PERIOD),
                )
            elif pending.first_arrival_at < old_before:
                each(f"seal {pending.dataset}", partial(self.starts.seal, pending.dataset, Trigger.MAX_AGE))
        sealing: set[str] = set()  # datasets whose sealer is still putting a batch into the pending run
        for batch in self.ledger.batches_in(BatchState.SEALED):
            if batch.get("sealed_at", "") < stuck_before:
                each(f"batch {batch['batch_id']}", partial(self.starts.materialized, batch["batch_id"]))
            else:
                sealing.add(str(batch.get("dataset")))
        ended = False
        live = (RunStatus.TOKENIZING, RunStatus.PROVISIONING, RunStatus.TRAINING, RunStatus.PENDING)
        for run in self.ledger.runs_in(*live):
            self.note_capacity_wait(run, now)
            if run.execution:
                silent = each(
                    f"run {run.run_id}",
                    partial(record_silent_end, self.ledger, self.orchestrator, run, self.events),
                )
                ended |= silent is not None and silent.action in (
                    Action.RECORDED_FAILURE,
                    Action.RECORDED_SUCCESS,  # its release was cut short: what it left is reaped too
                )
        if ended and self.cluster is not None:
            each("reaping what ended runs left", self.reap)  # their JobSets and capacity go now
        for run in self.ledger.unsettled():
            # ended without succeeding, its content still held: its finish step did not run or failed
            each(f"give back {run.run_id}", partial(self._settle, run))
        for run in self.ledger.runs_in(RunStatus.PENDING):
            # queued behind a finished run, or orphaned by a crash (a start claimed moments ago is left
            # to its starter: claim_start says so).  Not while its dataset's sealer is still joining a
            # batch into it: started then, the rest of that batch (10,000 objects join 400 at a time)
            # would go to another run, one batch cut in two.
            if not run.execution and run.dataset not in sealing:
                each(f"start {run.run_id}", partial(self.starts.start, run))
        if self.warehouse is not None:
            # Last, and only while the round is within half the function's timeout: BigQuery may be
            # slow, and what is left waits for the next tick.
            exports, until = self.arrivals.exports(), began + s.function_timeout_s / 2

            def within_time(what: str, step: Callable[[], Step]) -> bool:
                if time.monotonic() > until:
                    log.warning("sweep: out of time; %s waits for the next tick", what)
                    return False
                each(f"export {what}", partial(self.arrivals.export_step, step))
                return True

            for job in self.ledger.pending_exports():
                if not within_time(job.job_id, partial(exports.advance, job)):
                    break
            for table, dataset in exports.due():  # read after: what just landed may leave rows behind
                if not within_time(table, partial(exports.resume, table, dataset)):
                    break
        return outcomes

    def _settle(self, run: Run) -> Outcome | None:
        """Give back what a run that ended without succeeding still holds (a promoted one keeps it: its
        checkpoint holds that content)."""
        if run.promoted:
            return None
        returned = self.ledger.give_back(run)
        log.warning(
            "run %s ended %s holding its content: %d object(s) given back", run.run_id, run.status, returned
        )
        return Outcome(Action.GAVE_BACK, f"{returned} object(s) of {run.status} run {run.run_id}", run.run_id)

    def note_capacity_wait(self, run: Run, now: datetime) -> None:
        """Log a run waiting for capacity past ``alert_capacity_wait_s`` for its alert (each sweep, while
        it waits: the alert policy limits how often it notifies)."""
        since = parse_iso(run.provisioning_at) if run.status == RunStatus.PROVISIONING else None
        waited = (now - since).total_seconds() if since else 0.0
        if waited > self.settings.alert_capacity_wait_s:
            log.warning(
                "run %s has waited %.0f s for capacity (DWS has not provisioned %d node(s))",
                run.run_id,
                waited,
                self.settings.nodes,
                extra={"alert": Alert.CAPACITY_WAIT, "run_id": run.run_id, "dataset": run.dataset},
            )

    def reap(self) -> Outcome:
        """Delete the cluster objects no live run owns (a crashed or hard-cancelled execution leaves
        its JobSet and capacity request behind); say which GPU nodes are still up."""
        if self.cluster is None:
            raise Retry("the reaper needs the cluster, and none is configured")
        report = self.cluster.reap(self.ledger)
        deleted = [f"{d.kind} {d.name}" for d in report.deleted]
        nodes = [n.name for n in report.nodes_up]
        detail = f"deleted {deleted or 'nothing'}; GPU nodes up: {nodes or 'none'}"
        if report.idle_nodes:
            log.warning("reaper: GPU nodes up with no live run: %s", nodes)
            self.note_idle_nodes(report.nodes_up)
        if report.errors:
            raise Retry(f"reaper: {report.errors}")
        if not report.nodes_up:
            observed = self._record_release()
            if observed:
                detail += f"; zero nodes recorded for {', '.join(observed)}"
        return Outcome(Action.REAPED, detail)

    def note_idle_nodes(self, nodes_up: list[NodeUp]) -> None:
        """Log GPU nodes idle past ``alert_idle_nodes_s`` for their alert: idle since the last run ended
        (as recent runs record it), and never longer than the oldest node has been up."""
        ends = [parse_iso(r.finished_at) for r in self.ledger.list_runs(50)]
        last_end = max((t for t in ends if t is not None), default=None)
        up_s = max(n.up_s for n in nodes_up)
        idle_s = min(up_s, (datetime.now(UTC) - last_end).total_seconds()) if last_end else up_s
        if idle_s > self.settings.alert_idle_nodes_s:
            log.warning(
                "%d GPU node(s) up with no live run for %.0f s: %s",
                len(nodes_up),
                idle_s,
                ", ".join(n.name for n in nodes_up),
                extra={"alert": Alert.IDLE_NODES},
            )

    def _record_release(self) -> list[str]:
        """The pool is at zero nodes: every ended run whose record never observed its release (its
        execution was lost, so nothing recorded ``nodes_at_end``) gets the zero the reaper sees, so that
        the record, which operators trust, says its GPUs are released.  The node time such a run used
        cannot be observed after the fact: its ``gpu_node_seconds`` stay what its execution recorded."""
        observed = []
        for run in self.ledger.unobserved_release():
            self.ledger.record(run.run_id, ReleaseObserved(now_iso()))
            observed.append(run.run_id)
        return observed

    def audit(self) -> Outcome:
        """Account for every landed object (:mod:`retrain.audit`); log what is not, and record the arrivals
        of objects whose finalize events never came (Eventarc stops retrying after a day).  The other
        findings wait for an operator (``retrain audit --repair``): they mean a run to retry or a fault."""
        report = audit(self.settings, self.ledger, self.store)
        log_report(report)
        lost = [e for e in report.findings if e.account == Account.UNRECORDED]
        repair(AuditReport(lost, report.checked_at), self.settings, self.ledger, self.store)
        detail = f"{len(report.entries)} object version(s): {report.counts()}"
        if lost:
            detail += f"; {len(lost)} arrival(s) recorded"
        return Outcome(Action.AUDITED, detail)
