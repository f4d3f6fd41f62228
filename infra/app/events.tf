# Who may invoke which function. Gen2 functions are Cloud Run services of the same name, so the
# grant is roles/run.invoker on that one service; nothing is granted project-wide here.

locals {
  pubsub_service_agent = local.platform.pubsub_service_agent
}

# Eventarc (GCS finalize) -> on_object_finalized
resource "google_cloud_run_v2_service_iam_member" "events_invoke_on_object_finalized" {
  project  = var.project_id
  location = var.region
  name     = google_cloudfunctions2_function.on_object_finalized.name
  role     = "roles/run.invoker"
  member   = "serviceAccount:${local.sa.events}"
}

# Eventarc (BigQuery audit log) -> on_bigquery_event
resource "google_cloud_run_v2_service_iam_member" "events_invoke_on_bigquery_event" {
  project  = var.project_id
  location = var.region
  name     = google_cloudfunctions2_function.on_bigquery_event.name
  role     = "roles/run.invoker"
  member   = "serviceAccount:${local.sa.events}"
}

# The functions account reads the watched BigQuery tables (their new rows), and no other table.
resource "google_bigquery_table_iam_member" "functions_reads_watched_tables" {
  for_each = var.bigquery_tables

  project    = split(".", each.key)[0]
  dataset_id = split(".", each.key)[1]
  table_id   = split(".", each.key)[2]
  role       = "roles/bigquery.dataViewer"
  member     = "serviceAccount:${local.sa.functions}"
}

# Pub/Sub push (JobSet events) -> on_jobset_event
resource "google_cloud_run_v2_service_iam_member" "events_invoke_on_jobset_event" {
  project  = var.project_id
  location = var.region
  name     = google_cloudfunctions2_function.on_jobset_event.name
  role     = "roles/run.invoker"
  member   = "serviceAccount:${local.sa.events}"
}

# Pub/Sub push (Scheduler ticks) -> on_scheduler_tick
resource "google_cloud_run_v2_service_iam_member" "scheduler_invoke_on_scheduler_tick" {
  project  = var.project_id
  location = var.region
  name     = google_cloudfunctions2_function.on_scheduler_tick.name
  role     = "roles/run.invoker"
  member   = "serviceAccount:${local.sa.scheduler}"
}

# Named operators -> run_http (validated: never allUsers / allAuthenticatedUsers)
resource "google_cloud_run_v2_service_iam_member" "operators_invoke_run_http" {
  for_each = toset(var.run_http_invokers)

  project  = var.project_id
  location = var.region
  name     = google_cloudfunctions2_function.run_http.name
  role     = "roles/run.invoker"
  member   = each.value
}

# ---------------------------------------------------------------------------------------------
# Push subscriptions: authenticated (OIDC) delivery, exponential retry, dead letter
# ---------------------------------------------------------------------------------------------

resource "google_pubsub_subscription" "jobset_events" {
  name    = "${var.name_prefix}-jobset-events-push"
  project = var.project_id
  topic   = local.platform.jobset_topic_id
  labels  = var.labels

  ack_deadline_seconds       = max(10, var.function_timeout_seconds)
  message_retention_duration = "604800s"

  push_config {
    push_endpoint = google_cloudfunctions2_function.on_jobset_event.service_config[0].uri

    oidc_token {
      service_account_email = local.sa.events
      audience              = google_cloudfunctions2_function.on_jobset_event.service_config[0].uri
    }
  }

  retry_policy {
    minimum_backoff = "10s"
    maximum_backoff = "600s"
  }

  dead_letter_policy {
    dead_letter_topic     = local.platform.dead_letter_topic_id
    max_delivery_attempts = var.push_max_delivery_attempts
  }

  expiration_policy {
    ttl = ""
  }

  depends_on = [google_cloud_run_v2_service_iam_member.events_invoke_on_jobset_event]
}

resource "google_pubsub_subscription" "scheduler_ticks" {
  name    = "${var.name_prefix}-scheduler-ticks-push"
  project = var.project_id
  topic   = local.platform.scheduler_topic_id
  labels  = var.labels

  ack_deadline_seconds = max(10, var.function_timeout_seconds)
  # A tick that could not be delivered within an hour is superseded by the next one.
  message_retention_duration = "3600s"

  push_config {
    push_endpoint = google_cloudfunctions2_function.on_scheduler_tick.service_config[0].uri

    oidc_token {
      service_account_email = local.sa.scheduler
      audience              = google_cloudfunctions2_function.on_scheduler_tick.service_config[0].uri
    }
  }

  retry_policy {
    minimum_backoff = "10s"
    maximum_backoff = "300s"
  }

  dead_letter_policy {
    dead_letter_topic     = local.platform.dead_letter_topic_id
    max_delivery_attempts = var.push_max_delivery_attempts
  }

  expiration_policy {
    ttl = ""
  }

  depends_on = [google_cloud_run_v2_service_iam_member.scheduler_invoke_on_scheduler_tick]
}

# Dead-lettering needs the Pub/Sub service agent to be a subscriber of the source subscription
# (its publisher grant on the dead-letter topic is in the platform stage).
resource "google_pubsub_subscription_iam_member" "pubsub_agent_jobset_events" {
  project      = var.project_id
  subscription = google_pubsub_subscription.jobset_events.name
  role         = "roles/pubsub.subscriber"
  member       = local.pubsub_service_agent
}

resource "google_pubsub_subscription_iam_member" "pubsub_agent_scheduler_ticks" {
  project      = var.project_id
  subscription = google_pubsub_subscription.scheduler_ticks.name
  role         = "roles/pubsub.subscriber"
  member       = local.pubsub_service_agent
}

# Whoever a deployment names in run_event_push_endpoints gets every run event pushed (at least once:
# a subscriber deduplicates on the CloudEvent's id, its ce-id attribute).
resource "google_pubsub_subscription" "run_events_push" {
  for_each = var.run_event_push_endpoints

  name    = "${var.name_prefix}-run-events-${each.key}"
  project = var.project_id
  topic   = local.platform.run_events_topic_id
  labels  = var.labels

  ack_deadline_seconds       = 60
  message_retention_duration = "604800s"

  push_config {
    push_endpoint = each.value
  }

  retry_policy {
    minimum_backoff = "10s"
    maximum_backoff = "600s"
  }

  expiration_policy {
    ttl = ""
  }
}
