"""The plan of one run: everything the workflow needs, decided once, when the run starts.

The workflow stays a thin, auditable sequence of cloud calls; sizing, naming and manifests are
decided here in typed Python and handed to it as its argument (:class:`WorkflowArgument`).  The
training command is rendered here too, twice: when the run starts, with a stand-in blend, so that a run
the trainer would refuse (impossible batch arithmetic, an override its config does not have) is
refused before any capacity is requested; and at handover (``retrain.steps``), with the tokenized data.
Not part of the domain: the plan renders Kubernetes objects and names the trainer's command.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from retrain.config import Settings
from retrain.contracts import WorkflowArgument, tokenize_detail_uri
from retrain.domain.errors import PlanError
from retrain.domain.runs import Champion, FailureKind, ObjectSetAside, Run, node_cost_usd
from retrain.k8s.render import (
    GcsMounts,
    jobset_name,
    provisioning_request_name,
    render_jobset,
    render_provisioning_request,
    render_run_account,
    run_account_name,
    run_principal,
)
from retrain.ports import ObjectStore
from retrain.trainers import BatchShape, Command, TokenizerFiles, TrainingPlan, check, profile


def run_folder(run_id: str) -> str:
    """The run's folder in the artifacts bucket (its manifest, tokenize report, checkpoints, events): the
    managed folder whose policy is the run's own write grant (``WorkflowArgument.run_folder``)."""
    return f"runs/{run_id}/"


def run_root(settings: Settings, run_id: str) -> str:
    return f"{settings.artifacts_uri}/{run_folder(run_id)}".rstrip("/")


def tokenize_report_uri(run_root: str) -> str:
    """Where the tokenize job writes its report (:class:`retrain.contracts.TokenizeReport`)."""
    return f"{run_root}/tokenize_report.json"


def set_aside(settings: Settings, store: ObjectStore, run: Run) -> list[ObjectSetAside]:
    """Every object ``run``'s tokenize job set aside whole: the record names the first 100, the
    report's detail object all of them."""
    if run.quarantined_object_count <= len(run.quarantined_objects):
        return list(run.quarantined_objects)
    report = tokenize_report_uri(run_root(settings, run.run_id))
    detail = json.loads(store.read_bytes(tokenize_detail_uri(report)))
    return [ObjectSetAside.from_dict(q) for q in detail["quarantined_objects"]]


def manifest_object(run_id: str) -> str:
    """The run's object list, in the artifacts bucket: written at seal time, read by the tokenize job.

    Never part of the workflow argument: the Executions API caps an argument at 32 KB, about 450
    object URIs, and one storm of files makes one run.
    """
    return f"{run_folder(run_id)}objects.json"


def shard_root(settings: Settings) -> str:
    """Tokenized shards live outside any run: keyed by content hash, shared by every run."""
    return f"{settings.artifacts_uri}/shards"


def training_plan(
    settings: Settings, run_id: str, champion: Champion | None, dataset: str | None = None
) -> TrainingPlan:
    """The run's training, continuing from the dataset's champion and validated on the dataset's eval
    set if it has one (``eval_sets``, else the one the champion was validated on; no data yet);
    PlanError for a malformed eval set or profile setting, or for a profile other than the one that
    wrote the champion (its checkpoint is that trainer's format)."""
    try:
        eval_set = settings.eval_set_of.get(dataset) if dataset else None
        eval_set = eval_set or (champion.eval_set if champion else None)
        trainer = profile(settings.profile_of(dataset) if dataset else settings.profile).name
    except ValueError as e:
        raise PlanError(str(e)) from None
    if champion is not None and champion.profile != trainer:
        raise PlanError(
            f"dataset {dataset}'s champion {champion.checkpoint} was written by the {champion.profile} "
            f"profile, and {trainer} cannot continue from it (their checkpoint formats differ; retrain "
            f"has no conversion step): keep {champion.profile} for this dataset, or train {trainer} "
            f"under a new dataset name"
        )
    return TrainingPlan(
        run_id=run_id,
        shape=BatchShape(
            nodes=settings.nodes,
            gpus_per_node=settings.gpus_per_node,
            micro_batch_size=settings.micro_batch_size,
            global_batch_size=settings.global_batch_size,
            tensor_parallel=settings.tensor_parallel,
            pipeline_parallel=settings.pipeline_parallel,
        ),
        steps=settings.steps_per_run,
        seq_length=settings.seq_length,
        validation_batches=settings.validation_batches,
        output_dir=run_root(settings, run_id),
        base_checkpoint=champion.checkpoint if champion else None,
        base_step=champion.step if champion else 0,
        base_consumed_samples=(champion.consumed_samples or 0) if champion else 0,
        eval_set=eval_set,
        profile=trainer,
    )


def render_training(
    settings: Settings,
    plan: TrainingPlan,
    callback_url: str | None = None,
    service_account: str | None = None,
) -> tuple[dict[str, Any], Command]:
    """The JobSet that trains ``plan`` (its data handed over) and the command it runs, checked against
    the trainer's own configuration; PlanError naming what the trainer would refuse.  Its pods run as
    ``service_account``: the account the run's plan names (``WorkflowArgument.run_account``), which its
    workflow creates (by default the one :func:`workflow_argument` names)."""
    trainer = profile(plan.profile)
    mounts = GcsMounts()
    command = trainer.render(plan, mounts.path)
    check(trainer, command)
    jobset = render_jobset(
        plan.run_id,
        nodes=plan.shape.nodes,
        gpus_per_node=plan.shape.gpus_per_node,
        image=settings.image_of(plan.profile),
        command=command,
        mounts=mounts,
        node_pool=settings.node_pool,
        namespace=settings.namespace,
        callback_url=callback_url,
        tcpx_image=settings.tcpx_image if settings.gpudirect_tcpx and plan.shape.nodes > 1 else None,
        service_account=service_account or run_account_name(plan.run_id),
        provisioning_request=provisioning_request_name(plan.run_id),
    )
    return jobset, command


def check_before_capacity(settings: Settings, plan: TrainingPlan) -> None:
    """Render the command with a stand-in blend: PlanError now, not after tokenizing and provisioning."""
    shards = shard_root(settings)
    stand_in = plan.with_data(
        [1.0, f"{shards}/plan-check/data_text_document"],
        TokenizerFiles(
            "GPT2BPETokenizer",
            vocab_file=f"{shards}/_tokenizer/plan-check/vocab.json",
            merge_file=f"{shards}/_tokenizer/plan-check/merges.txt",
        ),
    )
    render_training(settings, stand_in)


@dataclass(frozen=True)
class Estimate:
    """What one run would cost, priced before it starts (``retrain plan`` and the budget check)."""

    training_tokens: int
    """Tokens it trains on: steps x global batch x sequence length, whatever its data's size."""
    node_hours: float
    """GPU node time: those tokens at the node throughput, plus each node's start-up and release."""
    cost_usd: float
    """``node_hours`` at the price of a node-hour."""
    basis: str
    """Where the throughput came from: the settings, or a run of the dataset that measured it."""


def estimate(settings: Settings, measured: Run | None = None) -> Estimate:
    """The next run's cost; from ``measured`` (the dataset's champion run) when its record has the steps
    it trained and the node time it took (start-up and release included), scaled to this run's steps
    (the batch shape is the settings', as it was then), else from the settings."""
    tokens = settings.steps_per_run * settings.global_batch_size * settings.seq_length
    steps = measured.metrics.run_steps if measured and measured.metrics else 0
    if measured is not None and steps > 0 and measured.gpu_node_seconds > 0:
        node_s = measured.gpu_node_seconds * settings.steps_per_run / steps
        basis = f"run {measured.run_id}: {measured.gpu_node_seconds:.0f} node-seconds for {steps} steps"
    else:
        node_s = tokens / settings.node_tokens_per_s + settings.nodes * settings.node_overhead_s
        basis = (
            f"settings: {settings.node_tokens_per_s:g} tokens/s per node, "
            f"{settings.node_overhead_s:g} s start-up and release per node"
        )
    return Estimate(tokens, node_s / 3600, node_cost_usd(node_s, settings.price_per_node_hour), basis)


def over_budget(settings: Settings, cost: Estimate) -> str | None:
    """Why a run estimated at ``cost`` must not start (None: within the cap, or no cap)."""
    cap = settings.max_run_cost_usd
    if cap <= 0 or cost.cost_usd <= cap:
        return None
    return f"estimated ${cost.cost_usd:.2f} is over the per-run cap of ${cap:.2f} ({cost.basis})"


def budget_month(now: datetime) -> str:
    """The calendar month (UTC) a run starting at ``now`` counts in: ``YYYY-MM``."""
    return now.astimezone(UTC).strftime("%Y-%m")


def spent_this_month(runs: Iterable[Run], dataset: str, but: str = "") -> float:
    """What ``dataset``'s runs (those started this month: ``runs`` as the ledger gives them) cost or are
    committed to: an ended run's cost, a live run's estimate, and the estimate of one whose cost was never
    recorded (its execution lost, or its node time recorded unpriced: its account step could not run); the
    run ``but`` left out."""
    return sum(
        r.cost_usd
        if r.status.terminal and r.failure != FailureKind.EXECUTION_LOST and not r.unpriced
        else (r.estimated_cost_usd or 0.0)
        for r in runs
        if r.dataset == dataset and r.run_id != but
    )


def over_monthly_budget(settings: Settings, dataset: str, spent: float, cost: Estimate) -> str | None:
    """Why a run of ``dataset`` estimated at ``cost`` must not start, its dataset having ``spent`` this
    month (None: within its monthly budget, or it has none)."""
    budget = settings.monthly_budget_of(dataset)
    if budget <= 0 or spent + cost.cost_usd <= budget:
        return None
    return (
        f"estimated ${cost.cost_usd:.2f} would take dataset {dataset}'s spend this month to "
        f"${spent + cost.cost_usd:.2f}, over its monthly budget of ${budget:.2f} "
        f"(${max(0.0, budget - spent):.2f} left)"
    )


def near_monthly_budget(settings: Settings, dataset: str, spent: float, cost: Estimate) -> str | None:
    """Why an operator should know that a run of ``dataset`` estimated at ``cost``, which may start,
    takes its spend this month past ``alert_budget_fraction`` of its budget (None: it does not)."""
    budget = settings.monthly_budget_of(dataset)
    after = spent + cost.cost_usd
    if budget <= 0 or after <= budget * settings.alert_budget_fraction:
        return None
    return (
        f"dataset {dataset} has spent ${spent:.2f} of its monthly budget of ${budget:.2f}; with this run "
        f"(estimated ${cost.cost_usd:.2f}) ${after:.2f}, {after / budget:.0%}"
    )


def _cap_node_s_per_node(settings: Settings) -> float | None:
    """The cost cap as node time per node (None: no cap, or node time costs nothing)."""
    if settings.max_run_cost_usd <= 0 or settings.price_per_node_hour <= 0:
        return None
    return settings.max_run_cost_usd / settings.price_per_node_hour * 3600 / settings.nodes


def training_deadline(settings: Settings) -> tuple[int, str]:
    """How long a run may train, and what sets that: the training timeout, or the cost cap's node time
    less each node's start-up and release (``node_overhead_s``: the nodes bill until they are gone), so
    that a run stopped there still ends near the cap."""
    cap_s = _cap_node_s_per_node(settings)
    if cap_s is None or cap_s - settings.node_overhead_s >= settings.train_timeout_s:
        return settings.train_timeout_s, "the training timeout"
    reason = f"the per-run cost cap of ${settings.max_run_cost_usd:.2f}"
    return max(1, int(cap_s - settings.node_overhead_s)), reason


def max_run_duration_s(settings: Settings) -> int:
    """DWS's ``maxRunDurationSeconds`` (counted from provisioning): the training timeout, or the cap's
    whole node time per node, a backstop just after the workflow's own training deadline."""
    cap_s = _cap_node_s_per_node(settings)
    return settings.train_timeout_s if cap_s is None else max(1, min(settings.train_timeout_s, int(cap_s)))


def tokenize_deadline_s(settings: Settings, batch_bytes: int, batch_objects: int) -> int:
    """How long the tokenize job may take: the fixed allowance (start-up, workers) plus the batch at the
    slowest rates a healthy job keeps, in bytes read and in objects taken (each object is its own shard,
    so many small ones cost more than their bytes say)."""
    return int(
        settings.tokenize_timeout_s
        + batch_bytes / settings.tokenize_min_bytes_per_s
        + batch_objects / settings.tokenize_min_objects_per_s
    )


#: A run of fewer objects holds none out: a quarter or more of its data would never train.
HOLD_OUT_MIN_OBJECTS = 4


def hold_out_objects(settings: Settings, plan: TrainingPlan, objects: int) -> int:
    """How many of a run's ``objects`` its tokenize job holds out as the dataset's eval set: none when
    the run has one already; else ``hold_out_fraction`` of them, at least one, at most
    ``hold_out_max_objects`` (:attr:`Settings.hold_out_fraction` says why)."""
    if plan.eval_set or settings.hold_out_fraction <= 0 or objects < HOLD_OUT_MIN_OBJECTS:
        return 0
    return min(settings.hold_out_max_objects, max(1, int(objects * settings.hold_out_fraction)))


def workflow_argument(
    settings: Settings, run: Run, champion: Champion | None, batch_bytes: int = 0
) -> WorkflowArgument:
    """The argument of one execution of workflows/retrain.yaml (its objects are in the manifest);
    PlanError when the trainer would refuse the run."""
    root = run_root(settings, run.run_id)
    plan = training_plan(settings, run.run_id, champion, run.dataset)
    deadline, deadline_reason = training_deadline(settings)
    check_before_capacity(settings, plan)
    account = render_run_account(run.run_id, settings.namespace)
    podtemplate, provreq = render_provisioning_request(
        run.run_id,
        nodes=settings.nodes,
        gpus_per_node=settings.gpus_per_node,
        namespace=settings.namespace,
        node_pool=settings.node_pool,
        max_run_duration_s=max_run_duration_s(settings),
    )
    return WorkflowArgument(
        run_id=run.run_id,
        dataset=run.dataset,
        project=settings.project,
        region=settings.region,
        cluster=settings.cluster,
        node_pool=settings.node_pool,
        namespace=settings.namespace,
        nodes=settings.nodes,
        gpus_per_node=settings.gpus_per_node,
        artifacts_bucket=settings.artifacts_bucket,
        manifest_object=manifest_object(run.run_id),
        manifest_generation=None,  # Ingest.start writes the manifest, then gives its generation
        report_object=f"{run_folder(run.run_id)}tokenize_report.json",
        objects=run.objects,
        shard_root=shard_root(settings),
        run_root=root,
        report=tokenize_report_uri(root),
        dataflow_template=settings.template_uri,
        dataflow_service_account=settings.dataflow_service_account,
        dataflow_subnetwork=settings.dataflow_subnetwork,
        dataflow_temp_location=settings.temp_location,
        hold_out_objects=hold_out_objects(settings, plan, run.objects),
        training=plan.to_dict(),
        jobset_name=jobset_name(run.run_id),
        run_account=account,
        run_principal=run_principal(
            settings.project_number, settings.project, settings.namespace, account["metadata"]["name"]
        ),
        run_folder=run_folder(run.run_id),
        podtemplate=podtemplate,
        provisioning_request=provreq,
        tokenize_timeout_s=tokenize_deadline_s(settings, batch_bytes, run.objects),
        provision_timeout_s=settings.provision_timeout_s,
        provision_reask_s=settings.provision_reask_s,
        train_timeout_s=deadline,
        train_deadline_reason=deadline_reason,
        release_timeout_s=settings.release_timeout_s,
        poll_interval_s=settings.poll_interval_s,
        completion_check_s=settings.completion_check_s,
        price_per_node_hour=settings.price_per_node_hour,
        ticks_topic=settings.scheduler_topic,
        events_topic=settings.events_topic,
    )
