# Access logs of the landing, artifacts and function-source buckets.
resource "google_storage_bucket" "access_logs" {
  #checkov:skip=CKV_GCP_62:This bucket is the access-log sink of the other buckets; logging the sink into itself would recurse.
  name     = "${var.project_id}-retrain-access-logs"
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
      days_since_noncurrent_time = var.noncurrent_retention_days
    }
    action {
      type = "Delete"
    }
  }
}

# Cloud Storage writes usage and storage logs as this Google group; the log bucket must let it create
# objects (cloud.google.com/storage/docs/access-logs, "Set IAM permissions").
resource "google_storage_bucket_iam_member" "access_logs_analytics_writer" {
  bucket = google_storage_bucket.access_logs.name
  role   = "roles/storage.objectCreator"
  member = "group:cloud-storage-analytics@google.com"
}

# Where new training data lands. Its object-finalize events (Eventarc) start runs, so it lives in
# the same region as the trigger.
resource "google_storage_bucket" "landing" {
  name     = local.landing_bucket_name
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
    log_bucket = google_storage_bucket.access_logs.name
  }

  # Landed objects are tokenized into the artifacts bucket; the raw copy expires.
  lifecycle_rule {
    condition {
      age        = var.landing_retention_days
      with_state = "LIVE"
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.noncurrent_retention_days
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      age = 1
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }
}

# Tokenized shards, run reports, checkpoints, the Dataflow flex template spec and Dataflow temp.
# It never triggers anything.
resource "google_storage_bucket" "artifacts" {
  name     = local.artifacts_bucket_name
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
    log_bucket = google_storage_bucket.access_logs.name
  }

  lifecycle_rule {
    condition {
      age            = var.dataflow_temp_retention_days
      matches_prefix = ["dataflow/"]
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.noncurrent_retention_days
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      age = 1
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }
}

# Zipped source of the Cloud Functions (uploaded by the app stage, read by Cloud Build).
resource "google_storage_bucket" "function_sources" {
  name     = "${var.project_id}-retrain-fn-sources"
  project  = var.project_id
  location = var.region
  labels   = var.labels

  force_destroy               = true
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  versioning {
    enabled = true
  }

  logging {
    log_bucket = google_storage_bucket.access_logs.name
  }

  lifecycle_rule {
    condition {
      days_since_noncurrent_time = 7
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      age = 90
    }
    action {
      type = "Delete"
    }
  }
}

# Where each runtime account may write in the artifacts bucket. Cloud Storage's per-prefix IAM is the
# managed folder: an IAM condition on object names cannot restrict listing ("Since the
# storage.objects.list permission is granted at the bucket level, you cannot use the resource.name
# condition attribute to restrict object listing access", cloud.google.com/storage/docs/access-control/iam),
# and managed folders need uniform bucket-level access, which the bucket has. Grants: iam.tf. The
# template spec (templates/) lies outside every folder: only the deployer writes it.
resource "google_storage_managed_folder" "runs" {
  bucket        = google_storage_bucket.artifacts.name
  name          = "runs/" # run manifests, tokenize reports, checkpoints, TensorBoard events
  force_destroy = var.force_destroy
}

resource "google_storage_managed_folder" "shards" {
  bucket        = google_storage_bucket.artifacts.name
  name          = "shards/" # tokenized shards (by content hash) and the tokenizer files they used
  force_destroy = var.force_destroy
}

resource "google_storage_managed_folder" "bigquery" {
  bucket        = google_storage_bucket.artifacts.name
  name          = "bigquery/" # a watched table's new rows, written by the functions' EXPORT DATA jobs
  force_destroy = var.force_destroy
}

resource "google_storage_managed_folder" "dataflow" {
  bucket        = google_storage_bucket.artifacts.name
  name          = "dataflow/" # Dataflow staging and temp files
  force_destroy = var.force_destroy
}
