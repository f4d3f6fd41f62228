# The five Cloud Functions (gen2), built by the dedicated builder account from build/functions/
# (functions/main.py, its requirements.txt and the retrain package it imports, assembled by
# `retrain deploy` before this stage; see var.functions_source_dir).
# Every function: internal ingress only, its runtime identity is the functions account, and no
# allUsers/allAuthenticatedUsers binding exists anywhere (tests/infra enforces all three).

data "archive_file" "functions" {
  type        = "zip"
  source_dir  = "${local.repo_root}/${var.functions_source_dir}"
  output_path = "${path.module}/.build/functions.zip"
  excludes    = ["__pycache__", ".pytest_cache", ".mypy_cache"]

  lifecycle {
    precondition {
      condition = alltrue([
        for f in ["main.py", "requirements.txt", "retrain/__init__.py"] :
        fileexists("${local.repo_root}/${var.functions_source_dir}/${f}")
      ])
      error_message = "The function source (main.py, requirements.txt, the retrain package) is not assembled in functions_source_dir: run `retrain deploy`, which builds it before this stage."
    }
  }
}

resource "google_storage_bucket_object" "functions_source" {
  bucket       = local.platform.function_sources_bucket
  name         = "functions/${data.archive_file.functions.output_md5}.zip"
  source       = data.archive_file.functions.output_path
  content_type = "application/zip"
}

# GCS finalize in the landing bucket (Eventarc) -> record the object in its batch.
resource "google_cloudfunctions2_function" "on_object_finalized" {
  name        = "${var.name_prefix}-on-object-finalized"
  project     = var.project_id
  location    = var.region
  description = "Records objects landing in the landing bucket and seals batches."
  labels      = var.labels

  build_config {
    runtime           = var.functions_runtime
    entry_point       = "on_object_finalized"
    service_account   = local.sa_id.builder
    docker_repository = local.platform.artifact_registry_id

    source {
      storage_source {
        bucket = google_storage_bucket_object.functions_source.bucket
        object = google_storage_bucket_object.functions_source.name
      }
    }
  }

  service_config {
    service_account_email          = local.sa.functions
    ingress_settings               = "ALLOW_INTERNAL_ONLY"
    all_traffic_on_latest_revision = true
    available_memory               = var.function_memory
    timeout_seconds                = var.function_timeout_seconds
    max_instance_count             = var.function_max_instances
    environment_variables          = local.retrain_env
  }

  event_trigger {
    trigger_region        = local.platform.region # must be the landing bucket's location
    event_type            = "google.cloud.storage.object.v1.finalized"
    retry_policy          = "RETRY_POLICY_RETRY"
    service_account_email = local.sa.events

    event_filters {
      attribute = "bucket"
      value     = local.platform.landing_bucket
    }
  }
}

# BigQuery audit log (Eventarc) -> treat a finished load/query job as an arrival.
resource "google_cloudfunctions2_function" "on_bigquery_event" {
  name        = "${var.name_prefix}-on-bigquery-event"
  project     = var.project_id
  location    = var.region
  description = "Turns BigQuery audit-log events (table writes) into arrivals."
  labels      = var.labels

  build_config {
    runtime           = var.functions_runtime
    entry_point       = "on_bigquery_event"
    service_account   = local.sa_id.builder
    docker_repository = local.platform.artifact_registry_id

    source {
      storage_source {
        bucket = google_storage_bucket_object.functions_source.bucket
        object = google_storage_bucket_object.functions_source.name
      }
    }
  }

  service_config {
    service_account_email          = local.sa.functions
    ingress_settings               = "ALLOW_INTERNAL_ONLY"
    all_traffic_on_latest_revision = true
    available_memory               = var.function_memory
    timeout_seconds                = var.function_timeout_seconds
    max_instance_count             = var.function_max_instances
    environment_variables          = local.retrain_env
  }

  event_trigger {
    trigger_region        = var.bigquery_trigger_region
    event_type            = "google.cloud.audit.log.v1.written"
    retry_policy          = "RETRY_POLICY_RETRY"
    service_account_email = local.sa.events

    event_filters {
      attribute = "serviceName"
      value     = "bigquery.googleapis.com"
    }

    event_filters {
      attribute = "methodName"
      value     = var.bigquery_method_name
    }

    dynamic "event_filters" {
      for_each = var.bigquery_resource_pattern == "" ? [] : [var.bigquery_resource_pattern]
      content {
        attribute = "resourceName"
        value     = event_filters.value
        operator  = "match-path-pattern"
      }
    }
  }
}

# JobSet terminal state (Pub/Sub push, see events.tf) -> send the workflow's callback.
resource "google_cloudfunctions2_function" "on_jobset_event" {
  name        = "${var.name_prefix}-on-jobset-event"
  project     = var.project_id
  location    = var.region
  description = "Relays JobSet completion published by the notifier to the waiting workflow callback."
  labels      = var.labels

  build_config {
    runtime           = var.functions_runtime
    entry_point       = "on_jobset_event"
    service_account   = local.sa_id.builder
    docker_repository = local.platform.artifact_registry_id

    source {
      storage_source {
        bucket = google_storage_bucket_object.functions_source.bucket
        object = google_storage_bucket_object.functions_source.name
      }
    }
  }

  service_config {
    service_account_email          = local.sa.functions
    ingress_settings               = "ALLOW_INTERNAL_ONLY"
    all_traffic_on_latest_revision = true
    available_memory               = var.function_memory
    timeout_seconds                = var.function_timeout_seconds
    max_instance_count             = var.function_max_instances
    environment_variables          = local.retrain_env
  }
}

# Cloud Scheduler tick (Pub/Sub push, see events.tf) -> seal / sweep / reap.
resource "google_cloudfunctions2_function" "on_scheduler_tick" {
  name        = "${var.name_prefix}-on-scheduler-tick"
  project     = var.project_id
  location    = var.region
  description = "Runs the periodic seal, sweeper and reaper jobs."
  labels      = var.labels

  build_config {
    runtime           = var.functions_runtime
    entry_point       = "on_scheduler_tick"
    service_account   = local.sa_id.builder
    docker_repository = local.platform.artifact_registry_id

    source {
      storage_source {
        bucket = google_storage_bucket_object.functions_source.bucket
        object = google_storage_bucket_object.functions_source.name
      }
    }
  }

  service_config {
    service_account_email          = local.sa.functions
    ingress_settings               = "ALLOW_INTERNAL_ONLY"
    all_traffic_on_latest_revision = true
    available_memory               = var.function_memory
    timeout_seconds                = var.function_timeout_seconds
    max_instance_count             = var.function_max_instances
    environment_variables          = local.retrain_env
  }
}

# Authenticated manual trigger. Internal ingress: callable from the VPC (or through other
# internal Google services), by the members of var.run_http_invokers only.
resource "google_cloudfunctions2_function" "run_http" {
  name        = "${var.name_prefix}-run-http"
  project     = var.project_id
  location    = var.region
  description = "Authenticated manual trigger: seal a dataset's batch or start a run."
  labels      = var.labels

  build_config {
    runtime           = var.functions_runtime
    entry_point       = "run_http"
    service_account   = local.sa_id.builder
    docker_repository = local.platform.artifact_registry_id

    source {
      storage_source {
        bucket = google_storage_bucket_object.functions_source.bucket
        object = google_storage_bucket_object.functions_source.name
      }
    }
  }

  service_config {
    service_account_email          = local.sa.functions
    ingress_settings               = "ALLOW_INTERNAL_ONLY"
    all_traffic_on_latest_revision = true
    available_memory               = var.function_memory
    timeout_seconds                = var.function_timeout_seconds
    max_instance_count             = var.function_max_instances
    environment_variables          = local.retrain_env
  }
}

# The workflow's calls into Python (retrain.steps): render the trainer's command once the data is
# tokenized, read what the trainer wrote once it is done. Internal ingress: Workflows reaches it
# ("Invoke Cloud Run functions or Cloud Run": a workflow can call internal-only functions of its own
# project through their run.app URL), with an OIDC token of the workflow account, its only invoker.
resource "google_cloudfunctions2_function" "run_step" {
  name        = "${var.name_prefix}-run-step"
  project     = var.project_id
  location    = var.region
  description = "The workflow's steps in Python: handover (trainer command) and results (metrics, champion)."
  labels      = var.labels

  build_config {
    runtime           = var.functions_runtime
    entry_point       = "run_step"
    service_account   = local.sa_id.builder
    docker_repository = local.platform.artifact_registry_id

    source {
      storage_source {
        bucket = google_storage_bucket_object.functions_source.bucket
        object = google_storage_bucket_object.functions_source.name
      }
    }
  }

  service_config {
    service_account_email          = local.sa.functions
    ingress_settings               = "ALLOW_INTERNAL_ONLY"
    all_traffic_on_latest_revision = true
    available_memory               = var.function_memory
    timeout_seconds                = var.function_timeout_seconds
    max_instance_count             = var.function_max_instances
    environment_variables          = local.retrain_env
  }
}

resource "google_cloud_run_v2_service_iam_member" "workflow_invokes_run_step" {
  project  = var.project_id
  location = var.region
  name     = google_cloudfunctions2_function.run_step.name
  role     = "roles/run.invoker"
  member   = "serviceAccount:${local.sa.workflow}"
}
