data "google_project" "this" {
  project_id = var.project_id
}

locals {
  landing_bucket_name   = var.landing_bucket_name != "" ? var.landing_bucket_name : "${var.project_id}-retrain-landing"
  artifacts_bucket_name = var.artifacts_bucket_name != "" ? var.artifacts_bucket_name : "${var.project_id}-retrain-artifacts"

  workload_pool = "${var.project_id}.svc.id.goog"

  # Google-managed service agents that need a grant on a retrain resource.
  pubsub_service_agent = "serviceAccount:${google_project_service_identity.pubsub.email}"
}
