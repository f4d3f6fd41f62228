# Images: Cloud Functions builds, the Dataflow flex-template launcher image, the notifier and
# (optionally) a customized NeMo training image.
resource "google_artifact_registry_repository" "retrain" {
  #checkov:skip=CKV_GCP_84:Images hold code, not data; Google-managed encryption at rest is the chosen baseline (no CMEK key ring is operated for retrain).
  project       = var.project_id
  location      = var.region
  repository_id = var.artifact_repository_id
  format        = "DOCKER"
  description   = "retrain images (functions, Dataflow template, notifier, training)."
  labels        = var.labels

  cleanup_policy_dry_run = false

  cleanup_policies {
    id     = "delete-untagged"
    action = "DELETE"
    condition {
      tag_state  = "UNTAGGED"
      older_than = "604800s"
    }
  }

  cleanup_policies {
    id     = "keep-recent"
    action = "KEEP"
    most_recent_versions {
      keep_count = 20
    }
  }
}
