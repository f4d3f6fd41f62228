resource "google_workflows_workflow" "retrain" {
  name            = var.workflow_name
  project         = var.project_id
  region          = var.region
  description     = "One retraining run: tokenize (Dataflow), provision (DWS), train (JobSet), scale to zero."
  service_account = local.sa_id.workflow
  call_log_level  = var.workflow_call_log_level
  labels          = var.labels
  user_env_vars   = local.workflow_env
  source_contents = file("${local.repo_root}/${var.workflow_source}")

  lifecycle {
    precondition {
      condition     = length(local.workflow_env) <= 20
      error_message = "Cloud Workflows accepts at most 20 user environment variables."
    }
  }
}
