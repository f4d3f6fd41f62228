"""The workflow's calls into typed Python, between its cloud calls (the ``run_step`` function).

- :meth:`Steps.begin`, first: the execution is bound to its run while the run's start claim is the
  execution argument's, and gets the run's plan from the ledger (the argument names a run, nothing more).
- :meth:`Steps.handover`, once tokenizing is done: the tokenize report's blend and tokenizer files
  complete the run's training plan; its trainer profile renders the command (checked against the
  trainer's own configuration) and the JobSet that runs it; the run record gains ``command``,
  ``image`` and ``blend``, and the workflow submits the JobSet.
- :meth:`Steps.cancel`, when a callback says Cancelled: the operator's cancel as the ledger recorded it
  (none: the callback is ignored).
- :meth:`Steps.finish`, once the run ended: a run that did not succeed gives its content back, so that
  it trains in a later run (content counts as trained only when its run succeeded).
- :meth:`Steps.results`, once the JobSet completed: what the trainer wrote -- TensorBoard events and
  checkpoint folders under the profile's run folder -- becomes the record's ``metrics`` and
  ``checkpoint``, and the eval gate (:func:`retrain.domain.runs.evaluate`) decides whether the checkpoint
  becomes the dataset's champion, which the next run continues from: only when its validation loss is
  not worse than the champion's by more than ``promotion_margin``; the verdict is the record's ``eval``.
  Missing metrics are recorded as missing: a run whose JobSet completed has succeeded.

Workflows calls a function for work its expressions cannot do ("Invoke Cloud Run functions or Cloud
Run", cloud.google.com/workflows/docs/calling-run-functions); the function is internal-only and the
workflow's service account is its only invoker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from typing import Any

from retrain.config import Settings
from retrain.contracts import (
    Accounting,
    Begun,
    CancelRequest,
    Finished,
    Handover,
    Results,
    RunEventType,
    SetAside,
    StepName,
    StepRequest,
    TokenizeReport,
    field_names,
)
from retrain.domain.errors import Rejected
from retrain.domain.events import ObjectVersion
from retrain.domain.runs import (
    Champion,
    Run,
    RunStatus,
    TrainingMetrics,
    evaluate,
    finite,
    gpu_hours,
    node_cost_usd,
)
from retrain.domain.transitions import HandedOver, TrainingResults
from retrain.exports import export_folder
from retrain.lineage import LINEAGE_OBJECT, openlineage_events
from retrain.logs import SUMMARY, Alert
from retrain.plan import render_training, run_root, set_aside, shard_root, tokenize_report_uri
from retrain.ports import Holdings, Ledger, Lineage, ObjectStore, RunEvents, tell
from retrain.tensorboard import Scalar, read_scalars
from retrain.trainers import PlanError, TokenizerFiles, TrainingPlan, profile

log = logging.getLogger("retrain.steps")

EVENTS = "events.out.tfevents."


def metrics_from(scalars: list[Scalar], plan: TrainingPlan) -> TrainingMetrics | None:
    """The run's metrics from its TensorBoard scalars (NeMo's tags), None when there are none.

    A scalar at a step the plan cannot reach (below 0, past ``plan.final_step``) is not the run's: it is
    left out and counted, so that one planted or corrupt event cannot make the champion's step (which the
    next run trains on from) or the steps the next cost estimate divides by."""
    latest: dict[str, Scalar] = {}
    base_val: float | None = None
    outside = 0
    for s in scalars:
        if not 0 <= s.step <= plan.final_step:
            outside += 1
            continue
        if s.tag == "val_loss" and s.step <= plan.base_step:
            # the base checkpoint, validated on this run's data before training (the local trainer does)
            base_val = s.value if plan.base_checkpoint and s.step == plan.base_step else base_val
            continue
        if s.tag not in latest or s.step >= latest[s.tag].step:
            latest[s.tag] = s
    if not latest:
        return None
    steps = max(s.step for s in latest.values())
    samples = latest.get("consumed_samples")
    consumed = int(samples.value) if samples and finite(samples.value) is not None else None
    # the lineage's count can grow by at most the run's steps of global batches (the next estimate and
    # the champion's consumed samples read it)
    gbs = plan.shape.global_batch_size
    most = max(plan.base_consumed_samples, plan.base_step * gbs) + plan.steps * gbs
    if consumed is not None and not 0 <= consumed <= most:
        outside, consumed = outside + 1, None
    return TrainingMetrics(
        steps=steps,
        run_steps=steps - plan.base_step,
        final_loss=latest["reduced_train_loss"].value if "reduced_train_loss" in latest else None,
        val_loss=latest["val_loss"].value if "val_loss" in latest else None,
        consumed_samples=consumed,
        tokens_seen=consumed * plan.seq_length if consumed is not None else None,
        base_val_loss=base_val,
        outside_plan=outside,
    )


def trainer_outputs(store: ObjectStore, run_dir: str) -> tuple[list[Scalar], set[str]]:
    """What a trainer left in its run folder: its TensorBoard scalars, and its checkpoint folders' names."""
    scalars: list[Scalar] = []
    checkpoints = set()
    for info in store.list_objects(run_dir + "/"):
        rel = info.uri[len(run_dir) + 1 :]
        if rel.rsplit("/", 1)[-1].startswith(EVENTS):
            try:
                scalars += read_scalars(store.read_bytes(info.uri))
            except ValueError:
                continue  # a corrupt event file says nothing; the others still count
        elif rel.startswith("checkpoints/") and rel.count("/") >= 2:
            checkpoints.add(rel.split("/")[1])
    return scalars, checkpoints


def checkpoint_fingerprint(store: ObjectStore, checkpoint: str) -> str:
    """sha256 over every object under ``checkpoint``: its name (relative), generation and MD5, sorted."""
    lines = sorted(
        f"{info.uri[len(checkpoint) + 1 :]}#{info.generation}#{info.md5_hash}"
        for info in store.list_objects(checkpoint + "/")
    )
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _check_base(store: ObjectStore, champion: Champion | None, plan: TrainingPlan) -> None:
    """The checkpoint a run restores is its dataset's champion, unchanged since it was promoted."""
    if plan.base_checkpoint is None:
        return
    if champion is None or champion.checkpoint != plan.base_checkpoint:
        raise PlanError(f"the base checkpoint {plan.base_checkpoint} is not the dataset's champion")
    if champion.fingerprint and checkpoint_fingerprint(store, champion.checkpoint) != champion.fingerprint:
        raise PlanError(
            f"the champion checkpoint {champion.checkpoint} changed since it was promoted "
            f"(run {champion.run_id}): not restored"
        )


def with_held_out(plan: TrainingPlan, report: dict[str, Any]) -> TrainingPlan:
    """``plan`` validated on the eval set its tokenize job carved (the report's ``held_out``) when it had
    none: handover renders the trainer's command with it, and results judges (and records on the
    champion) on it, so every later run of the dataset validates on the same documents."""
    held = report.get("held_out")
    if plan.eval_set or not isinstance(held, dict) or not isinstance(held.get("data_prefix"), str):
        return plan
    return dataclasses.replace(plan, eval_set=held["data_prefix"])


def _within_shards(root: str, report_uri: str, plan: TrainingPlan, held_out: str | None = None) -> None:
    """Every data and tokenizer path the report names lies under the shard root, and every dataset is
    named in the one form the tokenize job writes (``ROOT/<kind>-<sha256>/data_<key>_document``): the
    report is written where a run's trainer may write too, and must not make a run read (or hand its
    tokenizer) any other object of the bucket, nor name one dataset twice under two spellings (the pods
    read through a mount, where ``x/`` and ``x``, ``a//b`` and ``a/b`` are one file)."""
    tokenizer = plan.tokenizer
    datasets = [p for p in plan.blend if isinstance(p, str)] + ([held_out] if held_out is not None else [])
    named = list(datasets)
    if tokenizer is not None:
        named += [f for f in (tokenizer.vocab_file, tokenizer.merge_file, tokenizer.tokenizer_json) if f]
    outside = [p for p in named if not p.startswith(root + "/") or ".." in p.split("/")]
    if outside:
        raise PlanError(f"the tokenize report {report_uri} names data outside {root}/: {outside[:3]}")
    form = re.compile(re.escape(root) + r"/[a-z0-9]+-[0-9a-f]{64}/data_\w+_document")
    odd = [p for p in datasets if not form.fullmatch(p)]
    if odd:
        raise PlanError(f"the tokenize report {report_uri} names datasets in no form it writes: {odd[:3]}")


def give_back_unread(settings: Settings, ledger: Holdings, store: ObjectStore, run: Run) -> int:
    """Give back the content of the objects ``run`` set aside whole (gone since they arrived, unreadable,
    too large): it never trained.  When one was gone (overwritten or deleted), a copy of its bytes that
    arrived under another name and was skipped as held by this run arrives again, so that it trains in a
    later run; how many objects' content went back."""
    unread = {q.version: q for q in set_aside(settings, store, run)}
    if not unread:
        return 0
    held = [v for v in ledger.run_objects(run) if (v.uri, v.generation) in unread]
    returned = ledger.give_back(run, held)
    for version in held:
        if unread[(version.uri, version.generation)].reason == SetAside.OBJECT_CHANGED and version.md5:
            copy = _readable_copy(ledger, store, run.dataset, version)
            if copy is not None:
                ledger.arrive_again(run.dataset, copy, f"copy of {version.uri}#{version.generation}")
    return returned


def _readable_copy(
    ledger: Holdings, store: ObjectStore, dataset: str, gone: ObjectVersion
) -> ObjectVersion | None:
    """Another version that arrived with ``gone``'s content and still holds its bytes, if any."""
    for other in ledger.versions_of(dataset, gone.content_hash):
        if (other.uri, other.generation) == (gone.uri, gone.generation):
            continue
        try:
            info = store.stat(other.uri, other.generation or None)
        except FileNotFoundError:
            continue
        if info.md5_hash == gone.md5:
            return other
    return None


class Steps:
    """The handlers, over the ports alone."""

    def __init__(
        self,
        settings: Settings,
        ledger: Ledger,
        store: ObjectStore,
        events: RunEvents | None = None,
        lineage: Lineage | None = None,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.store = store
        self.events = events
        self.lineage = lineage

    def handle(self, body: Any) -> dict[str, Any]:
        """One request (:class:`StepRequest`); Rejected for a malformed one or a plan that cannot run."""
        request = StepRequest.parse(body)
        if request.step == StepName.BEGIN:
            return dataclasses.asdict(self.begin(request.run_id, request.claim, request.execution))
        if request.step == StepName.CANCEL:
            return dataclasses.asdict(self.cancel(request.run_id))
        if request.step == StepName.ACCOUNT:
            return dataclasses.asdict(self.account(request.run_id, request.gpu_node_seconds))
        try:
            plan = self._plan(request.run_id)
            if request.step == StepName.HANDOVER:
                return dataclasses.asdict(self.handover(plan, request.callback_url))
            if request.step == StepName.FINISH:
                return dataclasses.asdict(self.finish(plan))
            return dataclasses.asdict(self.results(plan))
        except PlanError as e:
            raise Rejected(str(e)) from None

    def _plan(self, run_id: str) -> TrainingPlan:
        """The run's training plan as its start kept it in the ledger: the one copy, which no request can
        replace (a forged plan would have results read, and promote, another run's checkpoint)."""
        kept = self.ledger.plan_of(run_id)
        training = (kept or {}).get("training")
        if not isinstance(training, dict):
            raise Rejected(
                f"run {run_id} has no plan in the ledger (not a run, or one its start never planned)"
            )
        plan = TrainingPlan.parse(training)
        own = run_root(self.settings, plan.run_id)
        if plan.run_id != run_id or plan.output_dir != own:  # a record written by hand, not by a start
            raise Rejected(f"run {run_id}'s kept plan is run {plan.run_id}'s, writing to {plan.output_dir}")
        return plan

    def account(self, run_id: str, node_seconds: float) -> Accounting:
        """What the run's observed node time cost, at the price and GPUs per node its plan was made with
        (the estimate's formula, :func:`node_cost_usd`); the workflow records it with the run's end."""
        kept = self.ledger.plan_of(run_id) or {}
        price, gpus = kept.get("price_per_node_hour"), kept.get("gpus_per_node")
        if not isinstance(price, (int, float)) or not isinstance(gpus, int):
            raise Rejected(f"run {run_id} has no plan in the ledger with a price and GPUs per node")
        return Accounting(gpu_hours(node_seconds, gpus), node_cost_usd(node_seconds, float(price)))

    def begin(self, run_id: str, claim: str, execution: str) -> Begun:
        """Bind the execution to its run and hand it the ledger's plan: only while the run is pending and
        its start claim is the execution's (the argument is no authority: whoever may create executions
        can name a run, never plan one).  Any other answer ends the execution before it touches anything:
        the run is another execution's, or a sweep took over its start, or it already ended."""
        s = self.settings
        name = f"projects/{s.project}/locations/{s.region}/workflows/{s.workflow}/executions/{execution}"
        plan = self.ledger.attach_execution(run_id, claim, name)
        if plan is not None:
            return Begun(plan, "")
        run = self.ledger.get_run(run_id)  # why not, for the execution's result and its log
        if run is None:
            reason = f"no run {run_id} in the ledger"
        elif run.status != RunStatus.PENDING:
            reason = f"run {run_id} is {run.status}, not pending"
        else:
            reason = f"run {run_id} is another execution's (its start claim is not this one's)"
        log.warning("execution %s ends at begin: %s", execution, reason)
        return Begun(None, reason)

    def cancel(self, run_id: str) -> CancelRequest:
        """The operator's cancel of the run as the ledger holds it: the workflow stops a run on a
        Cancelled callback only when one is recorded, and names who asked from here, never from the
        callback's body (whoever may send callbacks could write any name there, or stop any run)."""
        run = self.ledger.get_run(run_id)
        if run is None or not run.cancel_requested_by:
            log.warning("run %s: a Cancelled callback without a cancel in the ledger is ignored", run_id)
            return CancelRequest(None, "")
        return CancelRequest(run.cancel_requested_by, run.cancel_reason or "no reason given")

    def _report(self, plan: TrainingPlan) -> dict[str, Any]:
        """The run's tokenize report; PlanError when it cannot be read or lacks a field."""
        uri = tokenize_report_uri(plan.output_dir)
        try:
            body = json.loads(self.store.read_bytes(uri))
        except (FileNotFoundError, ValueError) as e:
            raise PlanError(f"cannot read the tokenize report {uri}: {e}") from None
        # held_out is newer than the tokenize image a run in flight during a deployment may have used
        missing = field_names(TokenizeReport) - {"held_out"} - set(body if isinstance(body, dict) else ())
        if missing:
            raise PlanError(f"the tokenize report {uri} lacks {sorted(missing)}")
        return dict(body)

    def _pack(self, prefix: str) -> dict[str, Any] | None:
        """A pack's or held-out set's ``_pack.json`` (only the tokenize job writes under the shard root);
        None for a prefix that is neither (an object's shard, or an eval set under ``eval/``, which the
        functions may not read: nothing is read for them); PlanError for one never committed."""
        if not re.fullmatch(
            re.escape(shard_root(self.settings)) + r"/(pack|eval)-[0-9a-f]{64}/[^/]+", prefix
        ):
            return None
        try:
            body = json.loads(self.store.read_bytes(prefix + "_pack.json"))
        except FileNotFoundError:
            raise PlanError(f"{prefix} has no _pack.json: it was never committed") from None
        return body if isinstance(body, dict) else {}

    def _members(self, prefix: str) -> set[str]:
        """The shards a dataset concatenates: a pack's members, else the prefix itself."""
        pack = self._pack(prefix)
        listed = pack.get("members") if pack is not None else None
        return {str(m) for m in listed} if isinstance(listed, list) else {prefix}

    def _apart_from_blend(self, plan: TrainingPlan) -> None:
        """The run's eval set shares no shard with its blend (carved, or the dataset's): the report lies
        where trainers write, and one training on the eval set would make the gate judge on it."""
        assert plan.eval_set is not None
        trained = set().union(*(self._members(p) for p in plan.blend if isinstance(p, str)))
        shared = self._members(plan.eval_set) & trained
        if shared:
            raise PlanError(f"run {plan.run_id}'s blend trains on its eval set's data: {sorted(shared)[:3]}")

    def _carved_by_its_job(self, report_uri: str, plan: TrainingPlan) -> None:
        """A held-out set the report names is one the run's own tokenize job carved: its ``_pack.json``
        says so (a forged report could otherwise name any shard, one an earlier run trained on)."""
        assert plan.eval_set is not None
        pack = self._pack(plan.eval_set)
        if pack is None or pack.get("held_out_for") != plan.run_id:
            raise PlanError(
                f"the tokenize report {report_uri} names {plan.eval_set} as held out, which run "
                f"{plan.run_id}'s tokenize job did not carve"
            )

    def handover(self, plan: TrainingPlan, callback_url: str) -> Handover:
        uri = tokenize_report_uri(plan.output_dir)
        body = self._report(plan)
        plan = plan.with_data(list(body["data_prefix_blend"]), TokenizerFiles.parse(body["tokenizer"]))
        carved = with_held_out(plan, body)
        _within_shards(shard_root(self.settings), uri, plan, carved.eval_set if carved != plan else None)
        if carved != plan:
            self._carved_by_its_job(uri, carved)
        plan = carved
        if plan.eval_set:
            self._apart_from_blend(plan)
        run = self.ledger.get_run(plan.run_id)
        if run is None:
            raise PlanError(f"no run {plan.run_id} in the ledger")
        _check_base(self.store, self.ledger.champion(run.dataset), plan)
        if not run.service_account:  # its workflow opened no account for its pods: they could never start
            raise PlanError(
                f"run {plan.run_id} was planned before runs had service accounts of their own; "
                f"`retrain run --retry {plan.run_id}` plans it again"
            )
        jobset, command = render_training(
            self.settings, plan, callback_url or None, service_account=run.service_account
        )
        image = self.settings.image_of(plan.profile)
        handed = HandedOver(plan.profile, image, command.argv, list(plan.blend), plan.eval_set)
        self.ledger.record(plan.run_id, handed)
        return Handover(jobset, command.argv)

    def finish(self, plan: TrainingPlan) -> Finished:
        """A run gives back the content it did not train: content counts as trained only when it
        trained, so identical bytes dropped again are new again.  A run that ended without succeeding
        gives back all of it (``run --retry`` re-runs its own objects); one that succeeded, the objects its
        tokenize job set aside whole (:func:`give_back_unread`)."""
        run = self.ledger.get_run(plan.run_id)
        if run is None or not run.status.terminal:
            return Finished(0)
        self._note_cost(run)
        self._log_summary(run)
        try:
            self._record_lineage(run)
        except Exception:  # what it tells of the run never keeps its content from going back
            log.exception("run %s: its lineage was not recorded", run.run_id)
        if run.status != RunStatus.SUCCEEDED and not run.promoted:
            return Finished(self.ledger.give_back(run))
        return Finished(give_back_unread(self.settings, self.ledger, self.store, run))

    def _record_lineage(self, run: Run) -> None:
        """The run's OpenLineage events (``retrain.lineage``), kept in its folder and reported to Data
        Lineage when the deployment asks for it."""
        tables = {
            f"{self.settings.artifacts_uri}/{export_folder(dataset, table)}": table
            for table, dataset in self.settings.watched_tables.items()
        }
        uris = [v.uri for v in self.ledger.run_objects(run)]
        events = openlineage_events(run, uris, tables)
        uri = f"{run_root(self.settings, run.run_id)}/{LINEAGE_OBJECT}"
        self.store.write_bytes(uri, json.dumps(events, indent=1).encode(), "application/json")
        if self.lineage is not None:
            self.lineage.report(run.run_id, events)

    def _log_summary(self, run: Run) -> None:
        """The ended run's numbers as one structured entry (``run_summary``): the dashboard's charts."""
        summary = {"status": str(run.status), **{k: getattr(run, k) for k in SUMMARY}}
        if run.unpriced:
            summary["cost_usd"] = None  # not $0: the dashboard's cost per run leaves it out
        extra = {"run_id": run.run_id, "dataset": run.dataset, "run_summary": summary}
        log.info("run %s ended %s: %s", run.run_id, run.status, summary, extra=extra)

    def _note_cost(self, run: Run) -> None:
        """Log a run whose cost passed its estimate times ``alert_cost_factor`` for the cost alert."""
        estimate = run.estimated_cost_usd or 0.0
        if estimate > 0 and run.cost_usd > estimate * self.settings.alert_cost_factor:
            log.warning(
                "run %s cost $%.2f, %.1fx its estimate of $%.2f",
                run.run_id,
                run.cost_usd,
                run.cost_usd / estimate,
                estimate,
                extra={"alert": Alert.COST_OVER_ESTIMATE, "run_id": run.run_id, "dataset": run.dataset},
            )

    def results(self, plan: TrainingPlan) -> Results:
        trainer = profile(plan.profile)
        run_dir = trainer.run_dir(plan)
        scalars, checkpoints = trainer_outputs(self.store, run_dir)
        metrics = metrics_from(trainer.lineage_scalars(scalars, plan), plan)
        name = trainer.final_checkpoint(checkpoints)
        checkpoint = f"{run_dir}/checkpoints/{name}" if name else None
        missing = []
        if metrics is None:
            missing.append(f"no TensorBoard events under {run_dir}")
        if checkpoint is None:
            missing.append(f"no checkpoint under {run_dir}/checkpoints")
        run = self.ledger.get_run(plan.run_id)
        if run is not None and run.eval_set and not plan.eval_set:
            # its tokenize job carved the dataset's eval set (handover recorded it; the report lies where
            # trainers write, the record does not): it validated on it, and is judged on it
            plan = dataclasses.replace(plan, eval_set=run.eval_set)
        champion = self.ledger.champion(run.dataset) if checkpoint and run else None
        retried = champion is not None and champion.run_id == plan.run_id  # promoted the first time
        val_loss = metrics.val_loss if metrics else None
        verdict = None
        if checkpoint is not None and run is not None and not retried:
            base_val = metrics.base_val_loss if metrics else None
            verdict = evaluate(val_loss, champion, self.settings.promotion_margin, base_val, plan.eval_set)
        left = TrainingResults(checkpoint, metrics, verdict, "; ".join(missing))
        self.ledger.record(plan.run_id, left)  # before promoting: a retried step finds the verdict
        promoted = retried
        if verdict is not None and verdict.promoted and checkpoint is not None and run is not None:
            step = metrics.steps if metrics else plan.final_step
            consumed = metrics.consumed_samples if metrics else None
            new = Champion(
                plan.run_id,
                checkpoint,
                step,
                val_loss,
                plan.eval_set,
                plan.profile,
                consumed,
                checkpoint_fingerprint(self.store, checkpoint),
            )
            promoted = self.ledger.promote(run.dataset, new)
            if promoted:
                tell(
                    self.events, RunEventType.PROMOTED, run, checkpoint=checkpoint, verdict=verdict.to_dict()
                )
        return Results(checkpoint, metrics.to_dict() if metrics else None, promoted, left.missing)
