locals {
  state_bucket_name = var.state_bucket_name != "" ? var.state_bucket_name : "${var.project_id}-retrain-tfstate"

  # Every API that the platform and app stages use. Enabling them here, once, keeps the later
  # stages free of project-wide side effects.
  services = toset(concat([
    "artifactregistry.googleapis.com",
    "bigquery.googleapis.com",
    "binaryauthorization.googleapis.com",
    "cloudbuild.googleapis.com",
    "cloudfunctions.googleapis.com",
    "cloudresourcemanager.googleapis.com",
    "cloudscheduler.googleapis.com",
    "compute.googleapis.com",
    "container.googleapis.com",
    "containerfilesystem.googleapis.com",
    "dataflow.googleapis.com",
    "datalineage.googleapis.com",
    "eventarc.googleapis.com",
    "firestore.googleapis.com",
    "iam.googleapis.com",
    "iamcredentials.googleapis.com",
    "logging.googleapis.com",
    "monitoring.googleapis.com",
    "pubsub.googleapis.com",
    "run.googleapis.com",
    "serviceusage.googleapis.com",
    "storage.googleapis.com",
    "workflowexecutions.googleapis.com",
    "workflows.googleapis.com",
  ], var.extra_services))
}

resource "google_project_service" "enabled" {
  for_each = local.services

  project = var.project_id
  service = each.value

  # Other workloads in the project may depend on these APIs: never switch them off on destroy.
  disable_on_destroy         = false
  disable_dependent_services = false
}

# Access logs of the state bucket.
resource "google_storage_bucket" "state_access_logs" {
  #checkov:skip=CKV_GCP_62:This bucket is the access-log sink of the state bucket; logging the sink into itself would recurse.
  name     = "${local.state_bucket_name}-logs"
  project  = var.project_id
  location = var.region
  labels   = var.labels

  force_destroy               = var.force_destroy
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  versioning {
    enabled = true
  }

  lifecycle_rule {
    condition {
      age = 365
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      days_since_noncurrent_time = 30
    }
    action {
      type = "Delete"
    }
  }

  depends_on = [google_project_service.enabled]
}

# Cloud Storage writes the state bucket's usage and storage logs as this Google group; the log bucket
# must let it create objects ("Grant Cloud Storage the roles/storage.objectCreator role for the bucket",
# cloud.google.com/storage/docs/access-logs), or no log is ever written.
resource "google_storage_bucket_iam_member" "state_access_logs_analytics_writer" {
  bucket = google_storage_bucket.state_access_logs.name
  role   = "roles/storage.objectCreator"
  member = "group:cloud-storage-analytics@google.com"
}

# Remote state of the platform and app stages (and of bootstrap itself once migrated).
resource "google_storage_bucket" "state" {
  name     = local.state_bucket_name
  project  = var.project_id
  location = var.region
  labels   = var.labels

  force_destroy               = var.force_destroy
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  versioning {
    enabled = true
  }

  logging {
    log_bucket = google_storage_bucket.state_access_logs.name
  }

  lifecycle_rule {
    condition {
      num_newer_versions = var.state_noncurrent_versions_kept
      with_state         = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  depends_on = [google_project_service.enabled]
}
