output "retrain_env" {
  description = "RETRAIN_* settings of this deployment (what retrain.config.load reads); the CLI exports these."
  value       = local.retrain_env
}

output "workflow_name" {
  description = "Name of the Cloud Workflow (RETRAIN_WORKFLOW)."
  value       = google_workflows_workflow.retrain.name
}

output "workflow_id" {
  description = "Full id of the Cloud Workflow, projects/P/locations/R/workflows/W."
  value       = google_workflows_workflow.retrain.id
}

output "function_names" {
  description = "Deployed function name of each entry point."
  value = {
    on_object_finalized = google_cloudfunctions2_function.on_object_finalized.name
    on_bigquery_event   = google_cloudfunctions2_function.on_bigquery_event.name
    on_jobset_event     = google_cloudfunctions2_function.on_jobset_event.name
    on_scheduler_tick   = google_cloudfunctions2_function.on_scheduler_tick.name
    run_http            = google_cloudfunctions2_function.run_http.name
    run_step            = google_cloudfunctions2_function.run_step.name
  }
}

output "function_uris" {
  description = "Internal-ingress URI of each entry point."
  value = {
    on_object_finalized = google_cloudfunctions2_function.on_object_finalized.service_config[0].uri
    on_bigquery_event   = google_cloudfunctions2_function.on_bigquery_event.service_config[0].uri
    on_jobset_event     = google_cloudfunctions2_function.on_jobset_event.service_config[0].uri
    on_scheduler_tick   = google_cloudfunctions2_function.on_scheduler_tick.service_config[0].uri
    run_http            = google_cloudfunctions2_function.run_http.service_config[0].uri
    run_step            = google_cloudfunctions2_function.run_step.service_config[0].uri
  }
}

output "run_http_url" {
  description = "URL of the authenticated manual trigger (internal ingress)."
  value       = google_cloudfunctions2_function.run_http.service_config[0].uri
}

output "scheduler_jobs" {
  description = "Full id of each Cloud Scheduler job (gcloud scheduler jobs run <id> forces a tick)."
  value       = { for k, j in google_cloud_scheduler_job.tick : k => j.id }
}

output "push_subscriptions" {
  description = "Push subscriptions feeding the Pub/Sub-triggered functions."
  value = {
    jobset_events   = google_pubsub_subscription.jobset_events.name
    scheduler_ticks = google_pubsub_subscription.scheduler_ticks.name
  }
}

output "dataflow_template_path" {
  description = "gs:// path of the tokenization flex-template spec (RETRAIN_DATAFLOW_TEMPLATE)."
  value       = "gs://${google_storage_bucket_object.tokenize_template.bucket}/${google_storage_bucket_object.tokenize_template.name}"
}

output "dataflow_image" {
  description = "Launcher image the flex-template spec points at, by digest (built by `retrain deploy`)."
  value       = local.dataflow_image
}

output "dataflow_temp_location" {
  description = "Dataflow temp location in the artifacts bucket."
  value       = local.dataflow_temp_location
}

output "k8s_settings_config_map" {
  description = "ConfigMap with the RETRAIN_* settings in the retrain namespace (null when apply_kubernetes is false)."
  value       = local.k8s_enabled ? "${local.k8s_namespace}/${var.settings_config_map}" : null
}
