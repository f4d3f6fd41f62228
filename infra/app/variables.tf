# ---------------------------------------------------------------------------------------------
# Where the platform is
# ---------------------------------------------------------------------------------------------

variable "project_id" {
  type        = string
  description = "Project retrain is deployed to (same as the platform stage)."
}

variable "region" {
  type        = string
  description = "Region of the functions, the workflow and the Scheduler jobs (same as the platform stage)."
  default     = "us-central1"
}

variable "state_bucket" {
  type        = string
  description = "Terraform state bucket created by the bootstrap stage; the platform stage's outputs are read from it."
}

variable "platform_state_prefix" {
  type        = string
  description = "State prefix of the platform stage in the state bucket."
  default     = "retrain/platform"
}

variable "name_prefix" {
  type        = string
  description = "Prefix of function, subscription and Scheduler job names."
  default     = "retrain"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,19}$", var.name_prefix))
    error_message = "name_prefix: 1-20 characters, lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "labels" {
  type        = map(string)
  description = "Labels put on every resource of this stage that takes labels."
  default = {
    app   = "retrain"
    stage = "app"
  }
}

# ---------------------------------------------------------------------------------------------
# Sources in this repository (paths relative to the repository root)
# ---------------------------------------------------------------------------------------------

variable "functions_source_dir" {
  type        = string
  description = "Directory zipped as the Cloud Functions source, relative to the repository root: functions/main.py, functions/requirements.txt and a copy of the retrain package they import, as assembled by `retrain deploy` (retrain_ops.deploy.build_functions_source)."
  default     = "build/functions"
}

variable "workflow_source" {
  type        = string
  description = "Cloud Workflows definition, relative to the repository root."
  default     = "workflows/retrain.yaml"
}

variable "dataflow_metadata" {
  type        = string
  description = "Flex-template metadata (parameters) JSON, relative to the repository root; used when the file exists."
  default     = "dataflow/metadata.json"
}

variable "k8s_manifests_dir" {
  type        = string
  description = "Directory of the rendered Kubernetes manifests (service accounts, notifier, reaper and workflow RBAC), relative to the repository root: the k8s/ templates rendered from this deployment's values by `retrain deploy` (retrain_ops.manifests) before this stage. k8s/ itself holds templates and examples and is never applied."
  default     = "build/k8s"
}

variable "notifier_image" {
  type        = string
  description = "Image of the JobSet notifier (`retrain-notify`), by digest (REGISTRY/retrain@sha256:...): `retrain deploy` builds it (cloudbuild.yaml) and renders it into build/k8s."
  default     = ""

  validation {
    condition     = var.notifier_image == "" || can(regex("@sha256:[0-9a-f]{64}$", var.notifier_image))
    error_message = "notifier_image runs by digest (IMAGE@sha256:...), never by a tag that can move."
  }
}

# ---------------------------------------------------------------------------------------------
# Cloud Functions
# ---------------------------------------------------------------------------------------------

variable "functions_runtime" {
  type        = string
  description = "Cloud Functions (gen2) runtime."
  default     = "python311"
}

variable "function_memory" {
  type        = string
  description = "Memory of each function instance."
  default     = "512M"
}

variable "function_timeout_seconds" {
  type        = number
  description = "Request timeout of the functions (event-driven gen2 functions allow at most 540 s). A BigQuery write's handler plans its requests and its wait for an export job within it."
  default     = 300

  validation {
    condition     = var.function_timeout_seconds >= 1 && var.function_timeout_seconds <= 540
    error_message = "function_timeout_seconds must be between 1 and 540."
  }
}

variable "function_max_instances" {
  type        = number
  description = "Upper bound of instances per function."
  default     = 10
}

variable "run_http_invokers" {
  type        = list(string)
  description = "IAM members (user:, group:, serviceAccount:) allowed to call the run_http manual trigger. Never allUsers/allAuthenticatedUsers."
  default     = []

  validation {
    condition     = alltrue([for m in var.run_http_invokers : !contains(["allUsers", "allAuthenticatedUsers"], m)])
    error_message = "run_http is never publicly invokable: allUsers and allAuthenticatedUsers are rejected."
  }

  # By kind: one person, one group or one service account, each named by its email; never a whole
  # domain (domain:), a principal set or a public member.
  validation {
    condition     = alltrue([for m in var.run_http_invokers : can(regex("^(user|group|serviceAccount):[^@:\\s]+@[^@:\\s]+\\.[^@:\\s]+$", m))])
    error_message = "run_http invokers must be user:EMAIL, group:EMAIL or serviceAccount:EMAIL members."
  }
}

# ---------------------------------------------------------------------------------------------
# Event sources
# ---------------------------------------------------------------------------------------------

variable "bigquery_trigger_region" {
  type        = string
  description = "Eventarc location of the BigQuery audit-log trigger (\"global\" receives events from every dataset location)."
  default     = "global"
}

variable "bigquery_method_name" {
  type        = string
  description = "BigQuery audit-log methodName that triggers on_bigquery_event."
  default     = "google.cloud.bigquery.v2.JobService.InsertJob"
}

variable "bigquery_resource_pattern" {
  type        = string
  description = "Optional path pattern on resourceName narrowing the BigQuery trigger; empty: every resource. A table pattern (projects/P/datasets/D/tables/*) matches only tableDataChange entries: finished extract and load jobs, and retrain's own export jobs (whose end then waits for the sweeper's tick), are named by their job (projects/P/jobs/J)."
  default     = ""
}

variable "bigquery_tables" {
  type        = map(string)
  description = "Watched BigQuery tables (\"project.dataset.table\") and the retrain dataset each one's new rows join. A write to one exports the rows above bigquery_watermark_column into the artifacts bucket and seals; the functions account may read these tables and nothing else. Empty: no table is watched."
  default     = {}

  validation {
    condition = alltrue([
      for table, dataset in var.bigquery_tables :
      can(regex("^[a-z0-9][a-z0-9.:-]{0,99}\\.[A-Za-z0-9_]{1,1024}\\.[A-Za-z0-9_-]{1,1024}$", table)) && can(regex("^[a-z0-9][a-z0-9-]{0,39}$", dataset))
    ])
    error_message = "Keys are project.dataset.table, values retrain dataset names (lowercase letters, digits, dashes)."
  }
}

variable "bigquery_watermark_column" {
  type        = string
  description = "Column of every watched table whose value only grows as rows are added (a load timestamp or a sequence number)."
  default     = "ingested_at"
}

variable "bigquery_watermark_lag_s" {
  type        = number
  description = "Rows stamped (a time watermark column) less than this before an export's start wait for the next export: a load that stamps its rows when it starts may commit them only later."
  default     = 60

  validation {
    condition     = var.bigquery_watermark_lag_s >= 0
    error_message = "bigquery_watermark_lag_s must not be negative."
  }
}

variable "bigquery_watermark_max_step" {
  type        = number
  description = "How far past the last exported value (or a table's smallest, on its first export) an INT64 watermark column may move in one export: a row with a huge value would otherwise hide every row still to come. Rows beyond wait, with a warning."
  default     = 1000000000

  validation {
    condition     = var.bigquery_watermark_max_step >= 1 && floor(var.bigquery_watermark_max_step) == var.bigquery_watermark_max_step
    error_message = "bigquery_watermark_max_step must be a positive whole number."
  }
}

variable "bigquery_export_max_rows" {
  type        = number
  description = "Rows one BigQuery export job takes at most; a larger backlog is exported by several jobs in turn, each bounded."
  default     = 5000000

  validation {
    condition     = var.bigquery_export_max_rows >= 1
    error_message = "bigquery_export_max_rows must be at least 1."
  }
}

variable "bigquery_export_timeout_s" {
  type        = number
  description = "Time limit of one BigQuery export job (its jobTimeoutMs); one still running after it is cancelled by the next write or tick, and its rows exported again."
  default     = 3600

  validation {
    condition     = var.bigquery_export_timeout_s >= 60
    error_message = "bigquery_export_timeout_s must be at least 60."
  }
}

variable "run_event_push_endpoints" {
  type        = map(string)
  description = "Subscribers of the run events topic: a name => the HTTPS URL each run event is pushed to (Pub/Sub's JSON wrapper, the CloudEvent's attributes as the message's). None by default; a deployment may also add its own subscriptions to the platform stage's run_events_topic_id."
  default     = {}

  validation {
    condition     = alltrue([for name, url in var.run_event_push_endpoints : can(regex("^[a-z][a-z0-9-]{0,30}$", name)) && startswith(url, "https://")])
    error_message = "Each subscriber is a short lowercase name (letters, digits, dashes) => an https:// URL."
  }
}

variable "push_max_delivery_attempts" {
  type        = number
  description = "Push deliveries to a function before the message goes to the dead-letter topic (5-100)."
  default     = 10

  validation {
    condition     = var.push_max_delivery_attempts >= 5 && var.push_max_delivery_attempts <= 100
    error_message = "Pub/Sub allows 5 to 100 delivery attempts."
  }
}

variable "scheduler_time_zone" {
  type        = string
  description = "Time zone of the Scheduler job schedules."
  default     = "Etc/UTC"
}

variable "scheduler_jobs" {
  type = map(object({
    schedule    = string
    description = string
  }))
  description = "Periodic jobs; each publishes {\"job\": <key>} to the Scheduler ticks topic, which on_scheduler_tick receives. Keys are retrain.contracts.SchedulerJob values (seal, sweeper, reaper, audit); schedules fire at a steady rate (minute and hour fields only)."

  default = {
    seal = {
      schedule    = "0 * * * *"
      description = "Seal every dataset's pending arrivals and start their runs (the hourly cut)."
    }
    sweeper = {
      schedule    = "*/5 * * * *"
      description = "Seal quiet or old batches, finish seals and starts a crash cut short, record executions that ended silently, start queued runs."
    }
    reaper = {
      schedule    = "*/15 * * * *"
      description = "Delete JobSets and capacity requests that no live run owns, and report GPU nodes left up."
    }
    audit = {
      schedule    = "30 * * * *"
      description = "Account for every landed object against the ledger; log what is not, and record the arrivals of objects whose events never came."
    }
  }

  validation {
    condition     = alltrue([for k, _ in var.scheduler_jobs : contains(["seal", "sweeper", "reaper", "audit"], k)])
    error_message = "scheduler_jobs keys are the jobs on_scheduler_tick runs: seal, sweeper, reaper, audit."
  }
}

# ---------------------------------------------------------------------------------------------
# Workflow and run settings (RETRAIN_* environment of functions, workflow and pods)
# ---------------------------------------------------------------------------------------------

variable "workflow_name" {
  type        = string
  description = "Name of the Cloud Workflow (RETRAIN_WORKFLOW)."
  default     = "retrain"
}

variable "workflow_deletion_protection" {
  type        = bool
  description = "Refuse to destroy (or replace, as a rename does) the workflow. Provider 6.x defaults it to true; false lets `terraform destroy` and renames go through."
  default     = false
}

variable "workflow_call_log_level" {
  type        = string
  description = "Workflows call logging level."
  default     = "LOG_ERRORS_ONLY"
}

variable "quiet_period_s" {
  type        = number
  description = "The sweeper seals a dataset's batch once no object has arrived for this long (RETRAIN_QUIET_PERIOD_S)."
  default     = 300
}

variable "max_batch_age_s" {
  type        = number
  description = "The sweeper seals a batch this old even while data keeps arriving (RETRAIN_MAX_BATCH_AGE_S)."
  default     = 21600
}

variable "stuck_after_s" {
  type        = number
  description = "The sweeper finishes seals and starts that a crash left half done for this long (RETRAIN_STUCK_AFTER_S)."
  default     = 120
}

variable "audit_grace_s" {
  type        = number
  description = "The audit counts an object that landed this recently, with no arrival recorded yet, as in flight rather than lost (RETRAIN_AUDIT_GRACE_S)."
  default     = 600
}

variable "landing_prefix" {
  type        = string
  description = "Only objects under this prefix of the landing bucket are training data (RETRAIN_LANDING_PREFIX)."
  default     = "incoming/"
}

variable "default_dataset" {
  type        = string
  description = "Dataset name used when an event does not name one (RETRAIN_DATASET)."
  default     = "default"
}

variable "seal_marker" {
  type        = string
  description = "Object base name that seals the open batch of its dataset (RETRAIN_SEAL_MARKER)."
  default     = "_SUCCESS"
}

variable "nodes_per_run" {
  type        = number
  description = "GPU nodes a run trains on (RETRAIN_NODES); at most the platform's gpu_max_nodes."
  default     = 1
}

variable "price_per_node_hour" {
  type        = number
  description = "Estimated price of one GPU node-hour in USD, for the run record's cost estimate (RETRAIN_PRICE_PER_NODE_HOUR)."
  default     = 88.49
  validation {
    condition     = var.price_per_node_hour >= 0
    error_message = "price_per_node_hour is a price in USD: 0 or more."
  }
}

variable "max_run_cost_usd" {
  type        = number
  description = "Per-run cost cap in USD, 0 for none (RETRAIN_MAX_RUN_COST_USD): a run estimated over it is refused; a run still training when the cap's node time runs out is stopped and releases every node."
  default     = 0
  validation {
    condition     = var.max_run_cost_usd >= 0
    error_message = "max_run_cost_usd is a cap in USD: 0 (none) or more."
  }
}

variable "lineage_location" {
  type        = string
  description = "Location of Data Lineage (Dataplex) that each run's OpenLineage events are reported to (RETRAIN_LINEAGE_LOCATION); empty: not reported (they are kept in the run's folder either way)."
  default     = "us-central1"
}

variable "alert_capacity_wait_s" {
  type        = number
  description = "Seconds a run may wait for DWS capacity before the capacity-wait alert fires (RETRAIN_ALERT_CAPACITY_WAIT_S)."
  default     = 21600
}

variable "alert_idle_nodes_s" {
  type        = number
  description = "Seconds GPU nodes may stay up with no live run before the idle-nodes alert fires (RETRAIN_ALERT_IDLE_NODES_S)."
  default     = 1800
}

variable "alert_cost_factor" {
  type        = number
  description = "The cost alert fires for a run whose cost passed its estimate times this (RETRAIN_ALERT_COST_FACTOR)."
  default     = 1.5
  validation {
    condition     = var.alert_cost_factor >= 1
    error_message = "alert_cost_factor is a factor on the estimate: 1 or more."
  }
}

variable "alert_budget_fraction" {
  type        = number
  description = "The budget alert fires when a run starts whose estimate takes its dataset past this fraction of its monthly budget (RETRAIN_ALERT_BUDGET_FRACTION)."
  default     = 0.8
  validation {
    condition     = var.alert_budget_fraction > 0 && var.alert_budget_fraction <= 1
    error_message = "alert_budget_fraction is a fraction of the budget: more than 0, at most 1."
  }
}

variable "alert_email_addresses" {
  type        = list(string)
  description = "E-mail addresses every alert policy notifies (a notification channel each). None by default."
  default     = []
}

variable "alert_notification_channels" {
  type        = list(string)
  description = "Notification channels made elsewhere (projects/P/notificationChannels/ID: Slack, a webhook, PagerDuty, as Cloud Monitoring supports them) that every alert policy notifies too. None by default."
  default     = []
}

variable "alert_function_errors_per_s" {
  type        = number
  description = "A function answering more 5xx than this per second, over 10 minutes, fires the function-errors alert (a 5xx asks for redelivery, so some are expected)."
  default     = 0.1
}

variable "monthly_budget_usd" {
  type        = number
  description = "What each dataset may spend in a calendar month (UTC), in USD, 0 for none (RETRAIN_MONTHLY_BUDGET_USD): a run whose estimate would take its dataset's spend this month past it is refused before it asks for capacity."
  default     = 0
  validation {
    condition     = var.monthly_budget_usd >= 0
    error_message = "monthly_budget_usd is a budget in USD: 0 (none) or more."
  }
}

variable "monthly_budgets" {
  type        = map(number)
  description = "Per-dataset monthly budgets in USD over monthly_budget_usd (RETRAIN_MONTHLY_BUDGETS): dataset -> USD, 0 for none."
  default     = {}
  validation {
    condition     = alltrue([for dataset, usd in var.monthly_budgets : usd >= 0 && can(regex("^[a-z0-9][a-z0-9-]{0,39}$", dataset))])
    error_message = "monthly_budgets maps dataset names to budgets in USD: 0 (none) or more."
  }
}

variable "promotion_margin" {
  type        = number
  description = "Eval gate (RETRAIN_PROMOTION_MARGIN): a checkpoint is promoted only when its val_loss is at most the champion's x (1 + this)."
  default     = 0
  validation {
    condition     = var.promotion_margin >= 0
    error_message = "promotion_margin is a relative margin: 0 (not worse) or more."
  }
}

variable "eval_sets" {
  type        = map(string)
  description = "Fixed evaluation sets (RETRAIN_EVAL_SETS): dataset -> gs://ARTIFACTS/eval/NAME_text_document, a Megatron dataset that validates every run of that dataset."
  default     = {}
}

variable "hold_out_fraction" {
  type        = number
  description = "A dataset without an eval set gets one carved from its run's data, never trained on (RETRAIN_HOLD_OUT_FRACTION): this fraction of the run's objects, at least one; 0: never carve."
  default     = 0.05
  validation {
    condition     = var.hold_out_fraction >= 0 && var.hold_out_fraction < 1
    error_message = "hold_out_fraction is a fraction of a run's objects: 0 (never carve) up to, not including, 1."
  }
}

variable "hold_out_max_objects" {
  type        = number
  description = "The most objects a carved eval set holds (RETRAIN_HOLD_OUT_MAX_OBJECTS)."
  default     = 100
  validation {
    condition     = var.hold_out_max_objects >= 1 && floor(var.hold_out_max_objects) == var.hold_out_max_objects
    error_message = "hold_out_max_objects is a count: 1 or more."
  }
}

variable "node_tokens_per_s" {
  type        = number
  description = "Training tokens per second of one node, for estimates until a dataset's run measured its own (RETRAIN_NODE_TOKENS_PER_S)."
  default     = 20000
  validation {
    condition     = var.node_tokens_per_s > 0
    error_message = "node_tokens_per_s is a throughput: more than 0."
  }
}

variable "node_overhead_s" {
  type        = number
  description = "Node time a run spends besides training, per node: start-up and release (RETRAIN_NODE_OVERHEAD_S)."
  default     = 900
}

variable "tokens_per_byte" {
  type        = number
  description = "Tokens per byte of new data, for estimates before tokenizing (RETRAIN_TOKENS_PER_BYTE)."
  default     = 0.28
}

variable "training_image" {
  type        = string
  description = "Container image of the training JobSet (RETRAIN_IMAGE)."
  default     = "nvcr.io/nvidia/nemo:24.12"
}

variable "tcpx_image" {
  type        = string
  description = "The GPUDirect-TCPX receive-datapath manager (RxDM) sidecar of multi-node runs (RETRAIN_TCPX_IMAGE): the tcpgpudmarxd release paired with the NCCL plugin v3.1.9 the installer puts on the nodes."
  default     = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.12"
}

variable "trainer_profile" {
  type        = string
  description = "Trainer profile rendering the training command (RETRAIN_PROFILE): nemo-24.12 runs NeMo 1.0's Megatron GPT script of training_image; megatron-bridge runs Megatron-Bridge's run_recipe.py of bridge_training_image."
  default     = "nemo-24.12"
  validation {
    condition     = contains(["nemo-24.12", "megatron-bridge"], var.trainer_profile)
    error_message = "trainer_profile is nemo-24.12 or megatron-bridge."
  }
}

variable "trainer_profiles" {
  type        = map(string)
  description = "Per-dataset trainer profiles (RETRAIN_PROFILES): dataset -> nemo-24.12 or megatron-bridge. A dataset keeps the profile its champion checkpoint was written by."
  default     = {}
  validation {
    condition     = alltrue([for name in values(var.trainer_profiles) : contains(["nemo-24.12", "megatron-bridge"], name)])
    error_message = "Each trainer profile is nemo-24.12 or megatron-bridge."
  }
}

variable "bridge_training_image" {
  type        = string
  description = "Container image of the megatron-bridge profile (RETRAIN_BRIDGE_IMAGE): a NeMo Framework release carrying Megatron-Bridge 0.6 (NeMo Framework 26.08)."
  default     = "nvcr.io/nvidia/nemo:26.08"
}

variable "steps_per_run" {
  type        = number
  description = "Optimizer steps each run trains beyond its base checkpoint (RETRAIN_STEPS_PER_RUN); above 100, a multiple of 100."
  default     = 60
}

variable "micro_batch_size" {
  type        = number
  description = "Sequences per GPU per forward pass (RETRAIN_MICRO_BATCH_SIZE)."
  default     = 1
}

variable "global_batch_size" {
  type        = number
  description = "Sequences per optimizer step (RETRAIN_GLOBAL_BATCH_SIZE): a multiple of micro batch x data-parallel size (nodes x GPUs / (TP x PP)); a run planned otherwise is refused before capacity is requested."
  default     = 8
}

variable "tensor_parallel" {
  type        = number
  description = "Tensor model parallel size (RETRAIN_TENSOR_PARALLEL)."
  default     = 1
}

variable "pipeline_parallel" {
  type        = number
  description = "Pipeline model parallel size (RETRAIN_PIPELINE_PARALLEL)."
  default     = 1
}

variable "seq_length" {
  type        = number
  description = "Tokens per training sequence (RETRAIN_SEQ_LENGTH)."
  default     = 2048
}

variable "validation_batches" {
  type        = number
  description = "Batches of held-out data each validation reads (RETRAIN_VALIDATION_BATCHES): NeMo's trainer.limit_val_batches, Megatron-Bridge's validation.eval_iters; the eval gate compares checkpoints on them."
  default     = 50

  validation {
    condition     = var.validation_batches >= 1
    error_message = "validation_batches must be at least 1."
  }
}

variable "tokenize_timeout_s" {
  type        = number
  description = "Fixed part of a run's tokenize deadline (RETRAIN_TOKENIZE_TIMEOUT_S): the job is cancelled and the run fails after this plus its batch's bytes at tokenize_min_bytes_per_s and its objects at tokenize_min_objects_per_s."
  default     = 1800
}

variable "tokenize_min_bytes_per_s" {
  type        = number
  description = "The slowest rate a healthy tokenize job reads at (RETRAIN_TOKENIZE_MIN_BYTES_PER_S): a batch's deadline grows by its size at this rate."
  default     = 1000000
}

variable "tokenize_min_objects_per_s" {
  type        = number
  description = "The slowest rate a healthy tokenize job takes objects at, whatever their size (RETRAIN_TOKENIZE_MIN_OBJECTS_PER_S): each object is its own shard, so a batch's deadline grows by its objects at this rate."
  default     = 2

  validation {
    condition     = var.tokenize_min_objects_per_s > 0
    error_message = "tokenize_min_objects_per_s must be > 0."
  }
}

variable "release_timeout_s" {
  type        = number
  description = "How long the release waits for the GPU pool to reach zero nodes (RETRAIN_RELEASE_TIMEOUT_S); longer than the cluster autoscaler's 10-minute scale-down delay."
  default     = 1200
}

variable "completion_check_s" {
  type        = number
  description = "The training wait reads the JobSet's status itself this often, completion message or not (RETRAIN_COMPLETION_CHECK_S): a lost message costs at most this long."
  default     = 300
}

variable "poll_interval_s" {
  type        = number
  description = "Seconds between the workflow's polls of a Dataflow job, a ProvisioningRequest and the pool's nodes (RETRAIN_POLL_INTERVAL_S); a day of polling stays far inside Workflows' steps-per-execution limit."
  default     = 30
}

variable "provision_timeout_s" {
  type        = number
  description = "How long a run waits for DWS capacity before it fails (RETRAIN_PROVISION_TIMEOUT_S)."
  default     = 3600
}

variable "provision_reask_s" {
  type        = number
  description = "A run's capacity request still not provisioned after this long is deleted and made again (RETRAIN_PROVISION_REASK_S): an Accepted request can wait indefinitely while a new one is often served at once (kubernetes-sigs/kueue#3245)."
  default     = 1800
}

variable "train_timeout_s" {
  type        = number
  description = "How long a run waits for the training JobSet to finish (RETRAIN_TRAIN_TIMEOUT_S)."
  default     = 86400
}

# ---------------------------------------------------------------------------------------------
# Dataflow flex template
# ---------------------------------------------------------------------------------------------

variable "dataflow_image" {
  type        = string
  description = "Flex-template launcher image of the tokenization pipeline, by digest (REGISTRY/tokenize@sha256:...): `retrain deploy` builds it (cloudbuild.yaml) and passes it."
  default     = ""

  validation {
    condition     = var.dataflow_image == "" || can(regex("@sha256:[0-9a-f]{64}$", var.dataflow_image))
    error_message = "dataflow_image runs by digest (IMAGE@sha256:...), never by a tag that can move."
  }
}

variable "dataflow_template_object" {
  type        = string
  description = "Object path of the flex-template spec in the artifacts bucket."
  default     = "templates/tokenize.json"
}

# ---------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------

variable "apply_kubernetes" {
  type        = bool
  description = "Install the JobSet controller, the retrain namespace objects and k8s/ manifests with Terraform. False: do it with the documented kubectl step (infra/README.md)."
  default     = true
}

variable "jobset_version" {
  type        = string
  description = "JobSet controller release installed in the cluster (v0.8 and later name no kube-rbac-proxy image; v0.7's gcr.io/kubebuilder one is gone). Its digest and manifest checksum live in infra/pins.json."
  default     = "v0.12.0"
}

variable "settings_config_map" {
  type        = string
  description = "Name of the ConfigMap holding the RETRAIN_* settings in the retrain namespace (for envFrom in k8s/ manifests)."
  default     = "retrain-settings"
}
