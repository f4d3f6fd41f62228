data "terraform_remote_state" "platform" {
  backend = "gcs"
  config = {
    bucket = var.state_bucket
    prefix = var.platform_state_prefix
  }
}

locals {
  platform  = data.terraform_remote_state.platform.outputs
  repo_root = abspath("${path.module}/../..")

  # Service-account emails (sa) and resource ids (sa_id) of the platform's components.
  sa    = local.platform.service_accounts
  sa_id = local.platform.service_account_ids

  # Every third-party image and fetched manifest, pinned: infra/pins.json (retrain_ops.pins; `retrain pin`
  # fills it). An image of the lock runs as ref@digest; one given with its digest runs as given.
  pins                  = jsondecode(file("${local.repo_root}/infra/pins.json"))
  pinned_image          = { for ref, digest in local.pins.images : ref => digest == null ? ref : "${ref}@${digest}" }
  training_image        = lookup(local.pinned_image, var.training_image, var.training_image)
  bridge_training_image = lookup(local.pinned_image, var.bridge_training_image, var.bridge_training_image)
  tcpx_image            = lookup(local.pinned_image, var.tcpx_image, var.tcpx_image)
  unpinned_images = [
    for ref in [local.training_image, local.bridge_training_image, local.tcpx_image] : ref
    if !can(regex("@sha256:[0-9a-f]{64}$", ref))
  ]

  dataflow_image         = var.dataflow_image
  dataflow_template_path = "gs://${local.platform.artifacts_bucket}/${var.dataflow_template_object}"
  dataflow_temp_location = "gs://${local.platform.artifacts_bucket}/dataflow/tmp"

  # The settings every component reads through retrain.config.load(): the functions (environment),
  # which hand the workflow its run plan as its argument, and pods (the ConfigMap, envFrom). Every key
  # is a retrain.config.Settings field, and every field but the local stack's own is here
  # (tests/test_contracts.py); the local stack reads this very map (retrain_ops.deployment).
  retrain_env = {
    RETRAIN_PROJECT                    = var.project_id
    RETRAIN_PROJECT_NUMBER             = tostring(local.platform.project_number)
    RETRAIN_REGION                     = var.region
    RETRAIN_LANDING_BUCKET             = local.platform.landing_bucket
    RETRAIN_LANDING_PREFIX             = var.landing_prefix
    RETRAIN_ARTIFACTS_BUCKET           = local.platform.artifacts_bucket
    RETRAIN_DATASET                    = var.default_dataset
    RETRAIN_SEAL_MARKER                = var.seal_marker
    RETRAIN_QUIET_PERIOD_S             = tostring(var.quiet_period_s)
    RETRAIN_MAX_BATCH_AGE_S            = tostring(var.max_batch_age_s)
    RETRAIN_STUCK_AFTER_S              = tostring(var.stuck_after_s)
    RETRAIN_AUDIT_GRACE_S              = tostring(var.audit_grace_s)
    RETRAIN_WORKFLOW                   = var.workflow_name
    RETRAIN_JOBSET_TOPIC               = local.platform.jobset_topic
    RETRAIN_SCHEDULER_TOPIC            = local.platform.scheduler_topic_id
    RETRAIN_EVENTS_TOPIC               = local.platform.run_events_topic_id
    RETRAIN_LINEAGE_LOCATION           = var.lineage_location
    RETRAIN_CLUSTER                    = local.platform.cluster_name
    RETRAIN_NODE_POOL                  = local.platform.gpu_node_pool
    RETRAIN_NAMESPACE                  = local.platform.k8s_namespace
    RETRAIN_MACHINE_TYPE               = local.platform.gpu_machine_type
    RETRAIN_GPUS_PER_NODE              = tostring(local.platform.gpus_per_node)
    RETRAIN_NODES                      = tostring(var.nodes_per_run)
    RETRAIN_PRICE_PER_NODE_HOUR        = tostring(var.price_per_node_hour)
    RETRAIN_MAX_RUN_COST_USD           = tostring(var.max_run_cost_usd)
    RETRAIN_MONTHLY_BUDGET_USD         = tostring(var.monthly_budget_usd)
    RETRAIN_ALERT_CAPACITY_WAIT_S      = tostring(var.alert_capacity_wait_s)
    RETRAIN_ALERT_IDLE_NODES_S         = tostring(var.alert_idle_nodes_s)
    RETRAIN_ALERT_COST_FACTOR          = tostring(var.alert_cost_factor)
    RETRAIN_ALERT_BUDGET_FRACTION      = tostring(var.alert_budget_fraction)
    RETRAIN_MONTHLY_BUDGETS            = join(",", [for dataset, usd in var.monthly_budgets : "${dataset}=${usd}"])
    RETRAIN_PROMOTION_MARGIN           = tostring(var.promotion_margin)
    RETRAIN_EVAL_SETS                  = join(",", [for dataset, prefix in var.eval_sets : "${dataset}=${prefix}"])
    RETRAIN_HOLD_OUT_FRACTION          = tostring(var.hold_out_fraction)
    RETRAIN_HOLD_OUT_MAX_OBJECTS       = tostring(var.hold_out_max_objects)
    RETRAIN_NODE_TOKENS_PER_S          = tostring(var.node_tokens_per_s)
    RETRAIN_NODE_OVERHEAD_S            = tostring(var.node_overhead_s)
    RETRAIN_TOKENS_PER_BYTE            = tostring(var.tokens_per_byte)
    RETRAIN_IMAGE                      = local.training_image
    RETRAIN_PROFILE                    = var.trainer_profile
    RETRAIN_PROFILES                   = join(",", [for dataset, name in var.trainer_profiles : "${dataset}=${name}"])
    RETRAIN_BRIDGE_IMAGE               = local.bridge_training_image
    RETRAIN_TCPX_IMAGE                 = local.tcpx_image
    RETRAIN_STEPS_PER_RUN              = tostring(var.steps_per_run)
    RETRAIN_MICRO_BATCH_SIZE           = tostring(var.micro_batch_size)
    RETRAIN_GLOBAL_BATCH_SIZE          = tostring(var.global_batch_size)
    RETRAIN_TENSOR_PARALLEL            = tostring(var.tensor_parallel)
    RETRAIN_PIPELINE_PARALLEL          = tostring(var.pipeline_parallel)
    RETRAIN_SEQ_LENGTH                 = tostring(var.seq_length)
    RETRAIN_VALIDATION_BATCHES         = tostring(var.validation_batches)
    RETRAIN_GPUDIRECT_TCPX             = tostring(local.platform.gpudirect_tcpx)
    RETRAIN_PROVISION_TIMEOUT_S        = tostring(var.provision_timeout_s)
    RETRAIN_PROVISION_REASK_S          = tostring(var.provision_reask_s)
    RETRAIN_TRAIN_TIMEOUT_S            = tostring(var.train_timeout_s)
    RETRAIN_TOKENIZE_TIMEOUT_S         = tostring(var.tokenize_timeout_s)
    RETRAIN_TOKENIZE_MIN_BYTES_PER_S   = tostring(var.tokenize_min_bytes_per_s)
    RETRAIN_TOKENIZE_MIN_OBJECTS_PER_S = tostring(var.tokenize_min_objects_per_s)
    RETRAIN_RELEASE_TIMEOUT_S          = tostring(var.release_timeout_s)
    RETRAIN_POLL_INTERVAL_S            = tostring(var.poll_interval_s)
    RETRAIN_COMPLETION_CHECK_S         = tostring(var.completion_check_s)

    RETRAIN_DATAFLOW_TEMPLATE         = local.dataflow_template_path
    RETRAIN_DATAFLOW_TEMP_LOCATION    = local.dataflow_temp_location
    RETRAIN_DATAFLOW_SERVICE_ACCOUNT  = local.sa.dataflow
    RETRAIN_DATAFLOW_SUBNETWORK       = local.platform.subnetwork
    RETRAIN_FUNCTIONS_SERVICE_ACCOUNT = local.sa.functions

    RETRAIN_BIGQUERY_TABLES             = join(",", [for table, dataset in var.bigquery_tables : "${table}=${dataset}"])
    RETRAIN_BIGQUERY_WATERMARK_COLUMN   = var.bigquery_watermark_column
    RETRAIN_BIGQUERY_WATERMARK_LAG_S    = tostring(var.bigquery_watermark_lag_s)
    RETRAIN_BIGQUERY_WATERMARK_MAX_STEP = tostring(var.bigquery_watermark_max_step)
    RETRAIN_BIGQUERY_EXPORT_MAX_ROWS    = tostring(var.bigquery_export_max_rows)
    RETRAIN_BIGQUERY_EXPORT_TIMEOUT_S   = tostring(var.bigquery_export_timeout_s)
    RETRAIN_FUNCTION_TIMEOUT_S          = tostring(var.function_timeout_seconds)
  }
}

# Nothing third-party runs by tag alone: the training images and the TCPX daemon must carry a digest
# (from infra/pins.json, or given as name@sha256:...) before anything is planned.
resource "terraform_data" "pinned_images" {
  input = [local.training_image, local.bridge_training_image, local.tcpx_image]

  lifecycle {
    precondition {
      condition     = length(local.unpinned_images) == 0
      error_message = "Not pinned by digest: ${join(", ", local.unpinned_images)}. Run `retrain pin` (`retrain pin --add IMAGE` for an image infra/pins.json does not list yet), or give the image as name@sha256:..."
    }
  }
}
