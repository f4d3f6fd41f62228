"""The deployment as ``infra/`` declares it, read from the Terraform itself (never restated).

The local stack takes from here what the cloud gets from Terraform: the functions' ``RETRAIN_*``
environment (``local.retrain_env`` of the app stage), the Scheduler jobs with their schedules and
payloads (``var.scheduler_jobs`` and the ``pubsub_target`` of ``google_cloud_scheduler_job.tick``),
the topics, service accounts and Kubernetes names of the platform stage's outputs.  Locally the project
is :data:`LOCAL_PROJECT`, values Google computes get stand-ins (``retrain_ops.hcl``), and time runs
:data:`LOCAL_TIME_FACTOR` times faster: every schedule and every period below is divided by it.

``retrain deploy`` renders the Kubernetes manifests from the same :class:`ManifestValues`, built from
the real platform outputs instead (:func:`manifest_values`).
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from retrain import config
from retrain_ops.hcl import HclError, Stage

REPO_ROOT = Path(__file__).resolve().parents[1]
INFRA = REPO_ROOT / "infra"

#: The project id the local stack plays (the emulators accept any).
LOCAL_PROJECT = "retrain-local"
#: Local time runs this many times faster than the deployment's: a Scheduler job every 15 minutes
#: ticks every 15 s, a 300 s quiet period lasts 5 s.
LOCAL_TIME_FACTOR = 60.0
#: Provisioned DWS nodes wait this long for their pods: "You have 10 minutes to start the Pods to consume
#: provisioned resources. After this time, the cluster autoscaler considers the nodes as not needed and
#: removes them" (cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest).
DWS_BOOKING_WINDOW_S = 600.0
#: Settings whose values are periods of waiting, scaled by LOCAL_TIME_FACTOR locally: the local clock
#: speeds up what the stack only waits for (the Scheduler, DWS's answer, the autoscaler), never real
#: work. The tokenize and training deadlines bound work that runs at its own speed here as in the cloud
#: (the Beam pipeline, the stand-in trainer), so they are not scaled: a deadline cut sixty-fold would
#: stop a healthy local run.  ``stuck_after_s`` is such a deadline too: how long a starter may work on a
#: claimed run (fixing a run of 2,000 objects and writing its manifest) before the sweeper takes it to
#: have crashed; cut to 2 s, a healthy start was started again, two executions for one run.
SCALED_PERIODS = (
    "quiet_period_s",
    "max_batch_age_s",
    "audit_grace_s",
    "provision_timeout_s",
    "provision_reask_s",
    "release_timeout_s",
    "poll_interval_s",
    "completion_check_s",
    "alert_capacity_wait_s",
    "alert_idle_nodes_s",
    "scale_down_delay_s",
)
#: The local stand-in of the NeMo 24.12 image (``nvcr.io/nvidia/nemo:24.12`` in the deployment), which
#: ``retrain_local.images`` resolves to the cluster twin's local command.
NEMO_STANDIN = "retrain.local/nemo-24.12-standin"
#: The local stand-in of a NeMo Framework image with Megatron-Bridge (``nvcr.io/nvidia/nemo:26.08``).
BRIDGE_STANDIN = "retrain.local/megatron-bridge-standin"
#: What the local stack plays differently, and why: each training image is its stand-in (the same
#: command, run by the cluster twin as local processes; ``retrain_local.images``), and sequences are
#: short enough for two CPU cores to train in seconds, and validations read few enough of them (50
#: batches through GPT-2's 50,257-wide head were over half of a stand-in rank's CPU).
LOCAL_STAND_INS = {
    "RETRAIN_IMAGE": NEMO_STANDIN,
    "RETRAIN_BRIDGE_IMAGE": BRIDGE_STANDIN,
    "RETRAIN_SEQ_LENGTH": "128",
    "RETRAIN_VALIDATION_BATCHES": "4",
    # Data Lineage has no emulator and the stack no twin of it: a run's OpenLineage events are kept in
    # its folder (retrain report shows them), not reported.
    "RETRAIN_LINEAGE_LOCATION": "",
}


@dataclass(frozen=True)
class ScheduledJob:
    """One Cloud Scheduler job as infra/app/scheduler.tf creates it."""

    name: str
    """The job's key in ``var.scheduler_jobs`` (a :class:`retrain.contracts.SchedulerJob`)."""
    schedule: str
    """Its cron schedule."""
    period_s: float
    """Seconds between two ticks, from the schedule."""
    topic: str
    """Full id of the topic it publishes to (``projects/P/topics/T``)."""
    data: bytes
    """The message body it publishes (decoded from the base64 Terraform gives Scheduler)."""
    attributes: dict[str, str]
    """The message attributes it publishes."""


def _cron_field(spec: str, low: int, high: int) -> list[int]:
    out: set[int] = set()
    for part in spec.split(","):
        body, _, step_s = part.partition("/")
        step = int(step_s) if step_s else 1
        if body == "*":
            start, end = low, high
        elif "-" in body:
            a, b = body.split("-")
            start, end = int(a), int(b)
        else:
            start = int(body)
            end = high if step_s else start
        out.update(range(start, end + 1, step))
    if not out or min(out) < low or max(out) > high:
        raise ValueError(f"cron field {spec!r} is out of range {low}-{high}")
    return sorted(out)


def cron_period_s(schedule: str) -> float:
    """The period of a cron schedule that fires at a steady rate (minute and hour fields; the day
    fields ``*``); ValueError for anything irregular, so a schedule is never misread."""
    fields = schedule.split()
    if len(fields) != 5 or fields[2:] != ["*", "*", "*"]:
        raise ValueError(f"schedule {schedule!r}: only minute and hour fields are supported")
    minutes = _cron_field(fields[0], 0, 59)
    hours = _cron_field(fields[1], 0, 23)
    fires = sorted(h * 60 + m for h in hours for m in minutes)
    gaps = {b - a for a, b in itertools.pairwise(fires)} | {fires[0] + 1440 - fires[-1]}
    if len(gaps) != 1:
        raise ValueError(f"schedule {schedule!r} does not fire at a steady rate")
    return 60.0 * gaps.pop()


@dataclass(frozen=True)
class ManifestValues:
    """What the Kubernetes manifests under ``k8s/`` are rendered with (``${name}`` placeholders)."""

    project: str
    """Google Cloud project id."""
    namespace: str
    """Namespace of the training JobSets, the notifier and their RBAC."""
    notifier_ksa: str
    """Kubernetes service account of the notifier (Workload Identity: the notifier GSA)."""
    notifier_gsa: str
    """The notifier's Google service account (publisher on the JobSet topic)."""
    notifier_image: str
    """Image of the notifier (``retrain-notify``): by digest as ``retrain deploy`` builds it; ``unbuilt``
    in the local stack, which runs the notifier in its own process."""
    settings_config_map: str
    """ConfigMap holding the ``RETRAIN_*`` settings (Terraform writes it from ``local.retrain_env``)."""
    reaper_user: str
    """The Google service account the reaper runs as (the functions'), as Kubernetes RBAC names it."""
    workflow_user: str
    """The workflow's Google service account (its Kubernetes API connector calls), as RBAC names it."""
    gpu_networks: tuple[tuple[str, str], ...] = ()
    """GPUDirect-TCPX's GPU networks (VPC, subnet), eth1..eth4; empty when the platform builds none."""

    def as_strings(self) -> dict[str, str]:
        out = {k: str(v) for k, v in dataclasses.asdict(self).items() if k != "gpu_networks"}
        for i, (vpc, subnet) in enumerate(self.gpu_networks, 1):
            out[f"gpu_vpc_{i}"], out[f"gpu_subnet_{i}"] = vpc, subnet
        return out


def manifest_values(platform: Mapping[str, Any], app: Mapping[str, Any]) -> ManifestValues:
    """The manifests' values from the platform stage's outputs and the app stage's variables;
    KeyError naming an output that is missing or not known yet."""

    def out(key: str, sub: str | None = None) -> Any:
        value = platform.get(key)
        if sub is not None and isinstance(value, Mapping):
            value = value.get(sub)
        if value is None:
            raise KeyError(f"platform output {key}{'.' + sub if sub else ''} is not known")
        return value

    return ManifestValues(
        project=str(out("project_id")),
        namespace=str(out("k8s_namespace")),
        notifier_ksa=str(out("notifier_ksa")),
        notifier_gsa=str(out("service_accounts", "notifier")),
        notifier_image=str(app.get("notifier_image") or f"{out('artifact_registry')}/retrain:unbuilt"),
        settings_config_map=str(app.get("settings_config_map") or "retrain-settings"),
        reaper_user=str(out("service_accounts", "functions")),
        workflow_user=str(out("service_accounts", "workflow")),
        gpu_networks=tuple((str(n["vpc"]), str(n["subnet"])) for n in platform.get("gpu_networks") or ()),
    )


@dataclass
class Deployment:
    """``infra/`` evaluated for one project (by default the local stand-in)."""

    project: str = LOCAL_PROJECT
    infra: Path = INFRA
    variables: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Values for the app stage's variables beyond their defaults."""

    @cached_property
    def platform(self) -> Stage:
        return Stage(self.infra / "platform", {"project_id": self.project})

    @cached_property
    def app(self) -> Stage:
        values = {"project_id": self.project, "state_bucket": "local", **self.variables}
        return Stage(self.infra / "app", values, platform=self.platform.outputs())

    @cached_property
    def env(self) -> dict[str, str]:
        """The ``RETRAIN_*`` environment Terraform gives every function (``local.retrain_env``)."""
        return {k: str(v) for k, v in self.app.local("retrain_env").items()}

    def settings(self) -> config.Settings:
        return config.load(self.env)

    def scheduler_jobs(self) -> list[ScheduledJob]:
        """Each Cloud Scheduler job, with the message it publishes (evaluated from scheduler.tf)."""
        tick = self.app.resource("google_cloud_scheduler_job", "tick")
        jobs = self.app.evaluate(tick["for_each"])
        out = []
        for name, spec in jobs.items():
            target = self.app.evaluate(tick["pubsub_target"], each={"key": name, "value": spec})[0]
            out.append(
                ScheduledJob(
                    name=name,
                    schedule=spec["schedule"],
                    period_s=cron_period_s(spec["schedule"]),
                    topic=target["topic_name"],
                    data=base64.b64decode(target["data"]),
                    attributes=dict(target.get("attributes") or {}),
                )
            )
        return out

    def workflow_env(self, values: Mapping[str, str]) -> dict[str, str]:
        """The workflow's ``user_env_vars`` (what it reads with ``sys.get_env``), with ``values`` in place
        of what only the cloud knows (a function's URL); KeyError for a value the workflow is not given."""
        workflow = self.app.resource("google_workflows_workflow", "retrain")
        declared = {str(k).strip('"') for k in workflow["user_env_vars"]}
        unknown = set(values) - declared
        if unknown:
            raise KeyError(f"infra/app/workflow.tf gives the workflow no {sorted(unknown)}")
        missing = declared - set(values)
        if missing:
            raise KeyError(f"no local value for the workflow's {sorted(missing)}")
        return dict(values)

    def execution_env(self, values: Mapping[str, str]) -> dict[str, str]:
        """What an execution reads with ``sys.get_env`` beyond what its name carries: the built-ins Google
        derives from the deployed workflow, then its ``user_env_vars`` (``values`` as in ``workflow_env``).

        ``GOOGLE_CLOUD_SERVICE_ACCOUNT_NAME`` is "The name of the workflow execution's service account"
        (cloud.google.com/workflows/docs/reference/environment-variables): the workflow resource's
        ``service_account`` as deployed, here ``projects/P/serviceAccounts/EMAIL``, the form Google's own
        demo hands on to Cloud Build's ``serviceAccount`` (GoogleCloudPlatform/workflows-demos
        workflows-executes-commands/using-cloudbuild-api/workflow-gcloud.yaml at d373ee6), which takes
        "projects/{PROJECT_ID}/serviceAccounts/{ACCOUNT}" only."""
        workflow = self.app.resource("google_workflows_workflow", "retrain")
        return {
            "GOOGLE_CLOUD_PROJECT_ID": self.project,
            "GOOGLE_CLOUD_PROJECT_NUMBER": self.env["RETRAIN_PROJECT_NUMBER"],
            "GOOGLE_CLOUD_SERVICE_ACCOUNT_NAME": str(self.app.evaluate(workflow["service_account"])),
            **self.workflow_env(values),
        }

    @cached_property
    def bootstrap(self) -> Stage:
        return Stage(self.infra / "bootstrap", {"project_id": self.project})

    def enabled_services(self) -> list[str]:
        """The APIs the bootstrap stage enables (``local.services``)."""
        return [str(s) for s in self.bootstrap.local("services")]

    def versioned_buckets(self) -> dict[str, bool]:
        """Each bucket infra/platform creates, by name, and whether it keeps object versions (the local
        storage emulator keeps noncurrent versions for those, as Cloud Storage does)."""
        out = {}
        for spec in self.platform.resources("google_storage_bucket").values():
            versioning = self.platform.evaluate(spec.get("versioning") or [{}])
            out[str(self.platform.evaluate(spec["name"]))] = bool(versioning and versioning[0].get("enabled"))
        return out

    def template_spec(self) -> tuple[str, bytes]:
        """The tokenize job's flex-template spec as the app stage writes it: (its gs:// URI, its JSON)."""
        obj = self.app.resource("google_storage_bucket_object", "tokenize_template")
        uri = f"gs://{self.app.evaluate(obj['bucket'])}/{self.app.evaluate(obj['name'])}"
        return uri, str(self.app.evaluate(obj["content"])).encode()

    def topic_retention_s(self, resource: str) -> int:
        """How long infra/platform's ``google_pubsub_topic.<resource>`` retains messages, in seconds."""
        spec = self.platform.resource("google_pubsub_topic", resource)
        return int(str(self.platform.evaluate(spec["message_retention_duration"])).removesuffix("s"))

    def topic(self, output: str) -> str:
        """A topic's full id from the platform stage's outputs (``jobset_topic_id`` ...)."""
        return str(self.platform.output(output))

    def manifest_values(self) -> ManifestValues:
        app = {k: self.app.var(k) for k in ("notifier_image", "settings_config_map")}
        return manifest_values(self.platform.outputs(), app)


def local_settings(env: Mapping[str, str] | None = None) -> config.Settings:
    """The local stack's settings: the deployment's, periods divided by LOCAL_TIME_FACTOR, then any
    ``RETRAIN_*`` variable of ``env`` (the operator's environment) on top."""
    env = os.environ if env is None else env
    deployed = Deployment().env
    scaled = {}
    for name in SCALED_PERIODS:
        key = "RETRAIN_" + name.upper()
        default = getattr(config.Settings(), name)
        value = float(deployed.get(key, default)) / LOCAL_TIME_FACTOR
        scaled[key] = str(max(1, int(value)) if isinstance(default, int) else value)
    operator = {k: v for k, v in env.items() if k.startswith("RETRAIN_")}
    merged = {**deployed, **scaled, **LOCAL_STAND_INS, **operator}
    return config.load(merged)


__all__ = [
    "LOCAL_PROJECT",
    "LOCAL_TIME_FACTOR",
    "Deployment",
    "HclError",
    "ManifestValues",
    "ScheduledJob",
    "cron_period_s",
    "local_settings",
    "manifest_values",
]
