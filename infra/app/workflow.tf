# The workflow reads nothing but its argument (the run plan, retrain.contracts.WorkflowArgument), so it
# has no user environment variables: one source of settings, the functions' environment.
resource "google_workflows_workflow" "retrain" {
  name                = var.workflow_name
  project             = var.project_id
  region              = var.region
  description         = "One retraining run: tokenize (Dataflow), provision (DWS), train (JobSet), scale to zero."
  service_account     = local.sa_id.workflow
  call_log_level      = var.workflow_call_log_level
  labels              = var.labels
  source_contents     = file("${local.repo_root}/${var.workflow_source}")
  deletion_protection = var.workflow_deletion_protection

  # What the workflow reads with sys.get_env (tests/test_contracts.py holds the two sides together).
  user_env_vars = {
    RETRAIN_STEPS_URL = google_cloudfunctions2_function.run_step.service_config[0].uri
  }
}
