"""The plan of one run: everything the workflow needs, decided once, when the run starts.

The workflow stays a thin, auditable sequence of cloud calls; sizing, naming and manifests are
decided here in typed Python and handed to it as its argument (:class:`WorkflowArgument`).  Not part
of the domain: the plan renders Kubernetes objects and names the trainer's command.
"""

from __future__ import annotations

from retrain.config import Settings
from retrain.contracts import WorkflowArgument
from retrain.domain.runs import Run
from retrain.k8s.render import render_jobset, render_provisioning_request


def run_root(settings: Settings, run_id: str) -> str:
    return f"{settings.artifacts_uri}/runs/{run_id}"


def manifest_object(run_id: str) -> str:
    """The run's object list, in the artifacts bucket: written at seal time, read by the tokenize job.

    Never part of the workflow argument: the Executions API caps an argument at 32 KB, about 450
    object URIs, and one storm of files makes one run.
    """
    return f"runs/{run_id}/objects.json"


def shard_root(settings: Settings) -> str:
    """Tokenized shards live outside any run: keyed by content hash, shared by every run."""
    return f"{settings.artifacts_uri}/shards"


def trainer_argv(settings: Settings, report_uri: str, checkpoint_dir: str) -> list[str] | None:
    """The command the JobSet's pods run; None means the NeMo image's default launcher."""
    if settings.trainer == "nemo":
        return None
    from retrain.train import trainer_command

    return trainer_command(settings.trainer, ["@" + report_uri], checkpoint_dir, settings.max_steps)


def workflow_argument(settings: Settings, run: Run) -> WorkflowArgument:
    """The argument of one execution of workflows/retrain.yaml (its objects are in the manifest)."""
    root = run_root(settings, run.run_id)
    report = f"{root}/tokenize_report.json"
    checkpoint_dir = f"{root}/checkpoints"
    podtemplate, provreq = render_provisioning_request(
        run.run_id,
        nodes=settings.nodes,
        gpus_per_node=settings.gpus_per_node,
        namespace=settings.namespace,
        node_pool=settings.node_pool,
        max_run_duration_s=settings.train_timeout_s,
    )
    jobset = render_jobset(
        run.run_id,
        nodes=settings.nodes,
        gpus_per_node=settings.gpus_per_node,
        image=settings.image,
        command=trainer_argv(settings, report, checkpoint_dir),
        data_prefix=["@" + report],
        checkpoint_dir=checkpoint_dir,
        max_steps=settings.max_steps,
        queue=settings.local_queue,
        node_pool=settings.node_pool,
        namespace=settings.namespace,
        service_account=settings.training_ksa,
        provisioning_request=provreq["metadata"]["name"],
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
        report_object=f"runs/{run.run_id}/tokenize_report.json",
        metrics_object=f"runs/{run.run_id}/checkpoints/metrics.json",
        objects=run.objects,
        shard_root=shard_root(settings),
        run_root=root,
        report=report,
        checkpoint_dir=checkpoint_dir,
        dataflow_template=settings.template_uri,
        dataflow_service_account=settings.dataflow_service_account,
        dataflow_subnetwork=settings.dataflow_subnetwork,
        dataflow_temp_location=settings.temp_location,
        jobset=jobset,
        podtemplate=podtemplate,
        provisioning_request=provreq,
        provision_timeout_s=settings.provision_timeout_s,
        train_timeout_s=settings.train_timeout_s,
        price_per_node_hour=settings.price_per_node_hour,
        ticks_topic=settings.scheduler_topic,
    )
