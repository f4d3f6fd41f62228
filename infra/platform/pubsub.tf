# JobSet terminal states, published by the in-cluster notifier (Workload Identity), delivered to
# the on_jobset_event function by a push subscription the app stage creates.
resource "google_pubsub_topic" "jobset_events" {
  #checkov:skip=CKV_GCP_83:Messages carry only JobSet names and states, no training data; Google-managed encryption at rest is the chosen baseline (no CMEK key ring is operated for retrain).
  name                       = var.jobset_topic
  project                    = var.project_id
  labels                     = var.labels
  message_retention_duration = var.message_retention_duration
}

# Cloud Scheduler ticks (seal, sweeper, reaper), delivered to on_scheduler_tick.
resource "google_pubsub_topic" "scheduler_ticks" {
  #checkov:skip=CKV_GCP_83:Ticks carry only the name of a periodic job; Google-managed encryption at rest is the chosen baseline (no CMEK key ring is operated for retrain).
  name                       = var.scheduler_topic
  project                    = var.project_id
  labels                     = var.labels
  message_retention_duration = var.message_retention_duration
}

# Run events (a run's state changes, promotions) as CloudEvents, published by the workflow and the
# functions, for whatever a deployment subscribes (infra/app's run_event_push_endpoints, or its own
# subscriptions). Retained, so that `retrain events` replays them (a new subscription seeks back within
# the topic's retention: cloud.google.com/pubsub/docs/replay-overview).
resource "google_pubsub_topic" "run_events" {
  #checkov:skip=CKV_GCP_83:Run events carry run ids, states, costs and checkpoint paths, no training data; Google-managed encryption at rest is the chosen baseline (no CMEK key ring is operated for retrain).
  name                       = var.run_events_topic
  project                    = var.project_id
  labels                     = var.labels
  message_retention_duration = var.message_retention_duration
}

# Deliveries that a function kept rejecting end up here for inspection and replay.
resource "google_pubsub_topic" "dead_letter" {
  #checkov:skip=CKV_GCP_83:Dead letters are copies of the two topics above (no training data); Google-managed encryption at rest is the chosen baseline.
  name                       = var.dead_letter_topic
  project                    = var.project_id
  labels                     = var.labels
  message_retention_duration = var.message_retention_duration
}

resource "google_pubsub_subscription" "dead_letter" {
  name    = "${var.dead_letter_topic}-pull"
  project = var.project_id
  topic   = google_pubsub_topic.dead_letter.id
  labels  = var.labels

  ack_deadline_seconds       = 60
  message_retention_duration = var.message_retention_duration
  retain_acked_messages      = false

  # Never expire, even when nobody pulls for a while.
  expiration_policy {
    ttl = ""
  }
}
