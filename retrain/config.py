"""All of retrain's settings in one typed place.

Every component (functions, workflow arguments, jobs, the local stack) reads its configuration from
environment variables named ``RETRAIN_*`` through :func:`load`; the cloud deployment sets them in
Terraform and the local stack sets them for the processes it starts.  Emulator endpoints use the
client libraries' own variables (``FIRESTORE_EMULATOR_HOST``, ``PUBSUB_EMULATOR_HOST``,
``STORAGE_EMULATOR_HOST``), so the same code talks to the cloud or to an emulator.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

from retrain.domain.datasets import is_dataset_name
from retrain.domain.runs import DEFAULT_PROFILE, VALIDATION_BATCHES, ProfileName

#: A BigQuery table as settings, SQL and ``bq://`` inputs name it: ``project.dataset.table``.
TABLE_RE = re.compile(r"^[a-z0-9][a-z0-9.:-]{0,99}\.[A-Za-z0-9_]{1,1024}\.[A-Za-z0-9_-]{1,1024}$")

#: BigQuery requests one handler makes at most besides its wait: advancing an export (its status, a
#: cancel and the status again) and starting one (the table, the range's three queries of two requests
#: each, the job's insert).  Each may take twice its timeout at worst (a retry may start just before its
#: deadline); the wait polls until its own end, and its last poll may take two timeouts more.
BIGQUERY_CALLS_PER_HANDLER = 11
#: Share of a function's timeout its BigQuery requests may take at worst; the rest is the ledger's,
#: Cloud Storage's and the seal's.
BIGQUERY_SHARE = 0.8


@dataclass(frozen=True)
class Settings:
    project: str = "retrain-local"
    """Google Cloud project id."""
    project_number: str = "000000000000"
    """The project's number: Google may write it where the id stands in resource names (an execution's
    name, hence its callback URLs), so both are recognised; and Workload Identity's principals name the
    project by number (the run's pods, ``WorkflowArgument.run_principal``).  The default is the local
    stack's (``retrain_ops.hcl.LOCAL_PROJECT_NUMBER``); a deployment sets it (infra/app/main.tf)."""
    region: str = "us-central1"
    """Region of the workflow, functions, Dataflow jobs and the GKE cluster."""
    landing_bucket: str = "retrain-landing"
    """Bucket where new training data lands; its finalize events start runs."""
    landing_prefix: str = "incoming/"
    """Only objects under this prefix are training data."""
    artifacts_bucket: str = "retrain-artifacts"
    """Bucket for tokenized shards, reports and checkpoints (never triggers a run)."""
    dataset: str = "default"
    """Dataset name used when an event does not name one."""
    seal_marker: str = "_SUCCESS"
    """An object with this base name seals the open batch of its dataset."""
    quiet_period_s: float = 300.0
    """The sweeper seals a batch that has had no arrival for this long."""
    max_batch_age_s: float = 21600.0
    """The sweeper seals a batch this old even while data keeps arriving."""
    stuck_after_s: float = 120.0
    """The sweeper finishes seals and starts runs that a crash left half done for this long."""
    audit_grace_s: float = 600.0
    """``retrain audit`` counts an object that landed this recently, and has no arrival yet, as in flight
    (its event may be on its way), not as lost."""
    bigquery_tables: str = ""
    """Watched BigQuery tables, comma-separated ``project.dataset.table=DATASET`` (or just the table:
    its rows join the default dataset). A write to one exports its new rows and seals their batch."""
    bigquery_watermark_column: str = "ingested_at"
    """Column of every watched table whose value only grows as rows are added (a load timestamp or a
    sequence number): a table write exports the rows above the last exported value."""
    bigquery_export_max_rows: int = 5_000_000
    """Rows one export job takes at most: a larger backlog is exported by several jobs in turn, each of
    them bounded."""
    bigquery_export_timeout_s: float = 3600.0
    """Time limit of one export job (BigQuery's ``jobTimeoutMs``); one still running after it is cancelled
    by the next write or tick, and its rows exported again."""
    bigquery_watermark_lag_s: float = 60.0
    """Rows stamped (a time column) less than this before an export's start wait for the next export:
    a load that stamps its rows when it starts may commit them only later."""
    bigquery_watermark_max_step: int = 1_000_000_000
    """How far past the last exported value (or, on a table's first export, past its smallest) an INT64
    watermark may move in one export: one row with a huge value would otherwise move it past every row
    still to come, and they would never be exported.  Rows beyond it wait, with a warning, until the
    values between are filled or this is raised."""
    function_timeout_s: float = 300.0
    """The functions' request timeout (infra/app's ``function_timeout_seconds`` sets both): a handler's
    BigQuery calls and its wait for an export job fit in it."""
    workflow: str = "retrain"
    """Name of the Cloud Workflows workflow deployed from workflows/retrain.yaml."""
    jobset_topic: str = "jobset-events"
    """Pub/Sub topic the notifier publishes JobSet terminal states to."""
    scheduler_topic: str = "projects/retrain-local/topics/retrain-scheduler-ticks"
    """Full id of the topic the Scheduler's ticks go to; a run's workflow publishes a sweeper tick there
    when it ends, so that the dataset's pending run starts at once."""
    lineage_location: str = ""
    """The location (region) of Google's Data Lineage API that a run's OpenLineage events are reported
    to, in this project (empty: not reported).  Either way they are kept in the run's folder
    (``runs/RUN/openlineage.json``), where ``retrain report`` shows them."""
    events_topic: str = "projects/retrain-local/topics/retrain-run-events"
    """Full id of the run events topic: every state change of a run and every promotion is published there
    as a CloudEvent (:class:`retrain.contracts.RunEvent`) for whatever a deployment subscribes."""
    functions_service_account: str = ""
    """Email the functions run as: BigQuery jobs it starts itself (its watermark queries and exports)
    write audit-log entries too, and those must not trigger another export."""
    cluster: str = "retrain"
    """GKE cluster name."""
    node_pool: str = "a3-dws"
    """The DWS queued-provisioning GPU node pool."""
    namespace: str = "retrain"
    """Kubernetes namespace of training JobSets: one of retrain's own (the app stage creates it), never
    ``default``, where the workflow's right to create JobSets would run pods as other workloads' service
    accounts."""
    machine_type: str = "a3-highgpu-8g"
    """GPU machine type of the node pool."""
    gpus_per_node: int = 8
    """GPUs per node of that machine type."""
    nodes: int = 1
    """Nodes a run trains on."""
    price_per_node_hour: float = 88.49
    """Estimated on-demand price of one node-hour, for the run record's cost estimate (USD)."""
    promotion_margin: float = 0.0
    """The eval gate: a run's checkpoint becomes the champion (the next run continues from it) only
    when its validation loss is at most the champion's x (1 + this); 0.0: not worse."""
    eval_sets: str = ""
    """Fixed evaluation sets, comma-separated ``DATASET=gs://ARTIFACTS/eval/NAME_text_document``: a
    Megatron dataset (``retrain tokenize ... --output-prefix``, the runs' tokenizer) that validates
    every run of that dataset instead of the validation split of its blend, so that every checkpoint,
    the champion's too, is judged on the same documents."""
    hold_out_fraction: float = 0.05
    """A dataset without an eval set gets one, carved from its run's data and never trained on: this fraction
    of the run's objects (at least one, at most ``hold_out_max_objects``; none from a run of fewer than four
    objects), chosen by content.  That run and every later one of the dataset validate on it once a checkpoint
    validated on it is the champion (:func:`retrain.plan.hold_out_objects`).  0: never carve (runs validate on
    their blend's split, which a dataset of few large documents leaves empty)."""
    hold_out_max_objects: int = 100
    """The most objects a carved eval set holds."""
    max_run_cost_usd: float = 0.0
    """Per-run cost cap in USD (0: none).  A run estimated over it is refused before it asks for capacity; a
    run may train only until the cap's node time, less each node's start-up and release, runs out: one still
    training then is stopped (it ends failed, its reason naming the cap) and releases every node."""
    alert_capacity_wait_s: float = 6 * 3600
    """A run waiting for DWS capacity longer than this is logged for the capacity-wait alert by every
    sweep (:class:`retrain.logs.Alert`)."""
    alert_idle_nodes_s: float = 1800
    """GPU nodes up with no live run for longer than this are logged for the idle-nodes alert by the
    reaper: idle since the last run ended, and no longer than the nodes have been up."""
    alert_cost_factor: float = 1.5
    """A run whose cost passed its estimate times this is logged for the cost alert when it ends."""
    alert_budget_fraction: float = 0.8
    """A run whose estimate takes its dataset past this fraction of its monthly budget is logged for the
    budget alert when it starts (0 < fraction <= 1)."""
    monthly_budget_usd: float = 0.0
    """What each dataset may spend in a calendar month (UTC), in USD (0: no budget): a run whose estimate
    would take its dataset's spend this month past it is refused before it asks for capacity.  A run
    counts in the month it was made: its cost once it ended, its estimate while it runs."""
    monthly_budgets: str = ""
    """Per-dataset budgets over ``monthly_budget_usd``, comma-separated ``DATASET=USD`` (0: none)."""
    node_tokens_per_s: float = 20000.0
    """Training throughput of one node in tokens per second, for estimates until the dataset's
    champion run has measured its own (its node-seconds for the steps it trained replace this)."""
    node_overhead_s: float = 900.0
    """Node time a run spends besides training, per node: start-up (image pull, checkpoint restore)
    and release (the cluster autoscaler removes an unneeded node after 10 minutes by default)."""
    tokens_per_byte: float = 0.28
    """Tokens per byte of new data, for estimates before tokenizing: GPT-2 BPE gives 0.278 on the
    sample corpus (../shared/corpus, English books)."""
    image: str = "nvcr.io/nvidia/nemo:24.12"
    """Container image of the ``nemo-24.12`` profile's training job (the local stack plays it with a
    stand-in image)."""
    bridge_image: str = "nvcr.io/nvidia/nemo:26.08"
    """Container image of the ``megatron-bridge`` profile: a NeMo Framework release carrying
    Megatron-Bridge 0.6 (its docs pair 0.6 with NeMo Framework 26.08)."""
    tcpx_image: str = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.12"
    """The GPUDirect-TCPX receive-datapath manager (RxDM) sidecar of multi-node runs: the tcpgpudmarxd
    release paired with the NCCL plugin v3.1.9 that nccl-tcpx-installer.yaml installs
    (GoogleCloudPlatform/cluster-toolkit, modules/compute/gke-node-pool/gpu_direct.tf)."""
    profile: str = DEFAULT_PROFILE
    """The trainer profile that renders the training command (``retrain.trainers``): ``nemo-24.12``
    or ``megatron-bridge``."""
    profiles: str = ""
    """Per-dataset trainer profiles, comma-separated ``DATASET=PROFILE`` (the others use ``profile``).
    A dataset keeps the profile its champion checkpoint was written by: a switch is refused."""
    steps_per_run: int = 60
    """Optimizer steps each run trains beyond its base checkpoint (over 100: a multiple of 100)."""
    micro_batch_size: int = 1
    """Sequences per GPU per forward pass."""
    global_batch_size: int = 8
    """Sequences per optimizer step (a multiple of micro batch x data-parallel size)."""
    tensor_parallel: int = 1
    """Tensor model parallel size."""
    pipeline_parallel: int = 1
    """Pipeline model parallel size."""
    seq_length: int = 2048
    """Tokens per training sequence."""
    validation_batches: int = VALIDATION_BATCHES
    """Held-out batches each validation reads, what the eval gate compares (``VALIDATION_BATCHES``)."""
    gpudirect_tcpx: bool = True
    """Multi-node runs use GPUDirect-TCPX (the platform stage builds its networks when this is on)."""
    provision_timeout_s: int = 3600
    """How long a run waits for DWS capacity before it fails."""
    provision_reask_s: int = 1800
    """A capacity request still not provisioned after this long is deleted and made again (a new request
    is often served at once where an old one waits indefinitely: kubernetes-sigs/kueue#3245)."""
    train_timeout_s: int = 86400
    """How long a run waits for the training JobSet to finish."""
    tokenize_timeout_s: int = 1800
    """How long a run waits for its tokenize job (start-up, workers), on top of its batch's bytes at
    tokenize_min_bytes_per_s and its objects at tokenize_min_objects_per_s."""
    tokenize_min_bytes_per_s: float = 1e6
    """The slowest a healthy tokenize job reads (the local FnApiRunner does 10 MB/s on two cores): a
    batch's deadline grows by its size at this rate."""
    tokenize_min_objects_per_s: float = 2.0
    """The slowest a healthy tokenize job takes objects, whatever their size (each is its own shard: a
    few reads and writes apiece; the local FnApiRunner takes about 6 a second on two cores): a batch's
    deadline grows by its objects at this rate, so a storm of small files is not cut short."""
    release_timeout_s: int = 1200
    """How long the release waits for the pool's nodes to be gone (the autoscaler removes unneeded nodes
    after 10 minutes by default)."""
    completion_check_s: float = 300.0
    """The training wait reads the JobSet itself this often, completion message or not: a lost message
    costs at most this long."""
    poll_interval_s: float = 30.0
    """Seconds between the workflow's polls of a Dataflow job or a ProvisioningRequest (a day of polling
    stays far inside Workflows' 100,000 steps per execution)."""
    dataflow_template: str = ""
    """``gs://`` URI of the tokenization flex-template spec (empty: the artifacts bucket's
    ``templates/tokenize.json``)."""
    dataflow_service_account: str = ""
    """Email the Dataflow workers run as (never the default compute account)."""
    dataflow_subnetwork: str = ""
    """Self link of the subnetwork the Dataflow workers run in (private IPs only)."""
    dataflow_temp_location: str = ""
    """``gs://`` folder for Dataflow's temporary files (empty: ``<artifacts>/dataflow/tmp``)."""
    # --- local stack only (LOCAL_ONLY below): the cloud deployment never sets these ---
    provision_delay_s: float = 2.0
    """Local DWS twin: seconds before a ProvisioningRequest is answered."""
    scale_down_delay_s: float = 600.0
    """Local cluster twin: how long a node stays once unneeded, what a released run's nodes still cost:
    the cluster autoscaler's ``--scale-down-unneeded-time``, 10 minutes by default (kubernetes/
    autoscaler's FAQ); a period of waiting, so locally 10 s (``retrain_ops.deployment.SCALED_PERIODS``)."""
    twin_faults: str = ""
    """Local cluster twin: injected faults, e.g. ``provisioning=fail`` or ``crash_pod_once=true``."""
    state_dir: str = ".retrain"
    """Local stack: where emulator data, logs and the stack's endpoints file live."""
    local_iam: bool = True
    """Local stack: enforce infra/'s IAM and k8s/'s RBAC on every call (``RETRAIN_LOCAL_IAM=off``: log
    what would be refused, refuse nothing)."""

    def __post_init__(self) -> None:
        # the estimates divide by these
        if self.nodes < 1 or self.node_tokens_per_s <= 0 or self.price_per_node_hour < 0:
            raise ValueError("nodes must be >= 1, node_tokens_per_s > 0 and price_per_node_hour >= 0")
        if self.tokenize_min_bytes_per_s <= 0 or self.tokenize_min_objects_per_s <= 0:
            raise ValueError("tokenize_min_bytes_per_s and tokenize_min_objects_per_s must be > 0")
        if (
            self.function_timeout_s <= 0
            or self.bigquery_export_timeout_s <= 0
            or self.bigquery_export_max_rows < 1
        ):
            raise ValueError(
                "function_timeout_s and bigquery_export_timeout_s must be > 0, bigquery_export_max_rows >= 1"
            )
        if not 0 <= self.monthly_budget_usd < math.inf:
            raise ValueError(
                f"RETRAIN_MONTHLY_BUDGET_USD: {self.monthly_budget_usd} is not a budget in USD (0: none)"
            )
        self.monthly_budget_of("")  # every entry of monthly_budgets is checked when the settings load
        if not 0 < self.alert_budget_fraction <= 1 or self.alert_cost_factor < 1:
            raise ValueError(
                f"RETRAIN_ALERT_BUDGET_FRACTION: {self.alert_budget_fraction} is not in (0, 1], or "
                f"RETRAIN_ALERT_COST_FACTOR: {self.alert_cost_factor} is below 1"
            )
        if not 0 <= self.hold_out_fraction < 1 or self.hold_out_max_objects < 1:
            raise ValueError(
                f"RETRAIN_HOLD_OUT_FRACTION: {self.hold_out_fraction} is not in [0, 1), or "
                f"RETRAIN_HOLD_OUT_MAX_OBJECTS: {self.hold_out_max_objects} is below 1"
            )

    @property
    def bigquery_call_timeout_s(self) -> float:
        """Bound on one BigQuery request of a handler: at most :data:`BIGQUERY_CALLS_PER_HANDLER` of them
        (each up to twice this) and one wait for an export (:attr:`bigquery_export_wait_s`, and its last
        poll) take :data:`BIGQUERY_SHARE` of :attr:`function_timeout_s` at worst."""
        return BIGQUERY_SHARE * self.function_timeout_s / (2 * BIGQUERY_CALLS_PER_HANDLER + 4)

    @property
    def bigquery_export_wait_s(self) -> float:
        """How long a table write's handler waits for its export job before leaving it to the next tick."""
        return 2 * self.bigquery_call_timeout_s

    @property
    def template_uri(self) -> str:
        return self.dataflow_template or f"{self.artifacts_uri}/templates/tokenize.json"

    @property
    def temp_location(self) -> str:
        return self.dataflow_temp_location or f"{self.artifacts_uri}/dataflow/tmp"

    @property
    def watched_tables(self) -> dict[str, str]:
        """``bigquery_tables`` parsed: table (``project.dataset.table``) -> the dataset its rows join."""
        out = {}
        for item in filter(None, (part.strip() for part in self.bigquery_tables.split(","))):
            table, _, dataset = item.partition("=")
            if not TABLE_RE.match(table) or (dataset and not is_dataset_name(dataset)):
                raise ValueError(f"RETRAIN_BIGQUERY_TABLES: {item!r} is not project.dataset.table[=dataset]")
            out[table] = dataset or self.dataset
        return out

    def profile_of(self, dataset: str) -> str:
        """The trainer profile of ``dataset``'s runs (``profiles``, else ``profile``); ValueError for a
        malformed ``profiles``, whichever dataset asks."""
        chosen: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in self.profiles.split(","))):
            name, _, value = (part.strip() for part in item.partition("="))
            if not is_dataset_name(name) or not value:
                raise ValueError(f"RETRAIN_PROFILES: {item!r} is not DATASET=PROFILE")
            chosen[name] = value
        return chosen.get(dataset, self.profile)

    def dataset_of_object(self, name: str) -> str | None:
        """The dataset of an object named ``name`` under the landing prefix: ``<prefix><dataset>/...``, or
        the default dataset for files directly under the prefix; None when its folder is no dataset name."""
        head, sep, _ = name[len(self.landing_prefix) :].partition("/")
        if not sep:
            return self.dataset
        return head if is_dataset_name(head) else None

    def image_of(self, profile: str) -> str:
        """The training image of ``profile``."""
        return self.bridge_image if profile == ProfileName.MEGATRON_BRIDGE else self.image

    @property
    def eval_set_of(self) -> dict[str, str]:
        """``eval_sets`` parsed: dataset -> the Megatron prefix that validates its runs (under the
        artifacts bucket's ``eval/``, which the training pods mount read-only)."""
        out = {}
        root = f"{self.artifacts_uri}/eval/"
        for item in filter(None, (part.strip() for part in self.eval_sets.split(","))):
            dataset, _, prefix = item.partition("=")
            if not is_dataset_name(dataset) or not prefix.startswith(root) or len(prefix) == len(root):
                raise ValueError(f"RETRAIN_EVAL_SETS: {item!r} is not DATASET={root}NAME_text_document")
            out[dataset] = prefix
        return out

    def monthly_budget_of(self, dataset: str) -> float:
        """``dataset``'s monthly budget in USD (0: none): its own in ``monthly_budgets``, else
        ``monthly_budget_usd``."""
        budgets = {}
        for item in filter(None, (part.strip() for part in self.monthly_budgets.split(","))):
            name, _, usd = item.partition("=")
            try:
                budget = float(usd)
            except ValueError:
                budget = math.nan
            if not is_dataset_name(name) or not 0 <= budget < math.inf:
                raise ValueError(f"RETRAIN_MONTHLY_BUDGETS: {item!r} is not DATASET=USD (0 or more)")
            budgets[name] = budget
        return budgets.get(dataset, self.monthly_budget_usd)

    @property
    def artifacts_uri(self) -> str:
        return f"gs://{self.artifacts_bucket}"


#: Settings only the local stack uses; every other field is set by Terraform (tests/test_contracts.py).
LOCAL_ONLY = frozenset({"provision_delay_s", "scale_down_delay_s", "twin_faults", "state_dir", "local_iam"})


def _coerce(value: str, like: object) -> object:
    if isinstance(like, bool):
        if value.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError("expected true or false (or on/off)")
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(like, int):
        return int(value)
    if isinstance(like, float):
        return float(value)
    return value


def load(env: Mapping[str, str] | None = None) -> Settings:
    """Settings from ``RETRAIN_<FIELD>`` variables, defaults elsewhere; bad values fail loudly."""
    env = os.environ if env is None else env
    defaults = Settings()
    values: dict[str, object] = {}
    for f in fields(Settings):
        key = "RETRAIN_" + f.name.upper()
        if key in env:
            try:
                values[f.name] = _coerce(env[key], getattr(defaults, f.name))
            except ValueError as e:
                raise ValueError(f"{key}={env[key]!r}: {e}") from None
    if "project" not in values and env.get("GOOGLE_CLOUD_PROJECT"):
        values["project"] = env["GOOGLE_CLOUD_PROJECT"]
    return Settings(**values)  # type: ignore[arg-type]


def to_env(settings: Settings) -> dict[str, str]:
    """The inverse of :func:`load`, for processes the local stack starts."""
    out = {}
    for f in fields(Settings):
        out["RETRAIN_" + f.name.upper()] = str(getattr(settings, f.name))
    return out
