# Periodic seal, sweeper and reaper. Each tick is a Pub/Sub message {"job": "<name>"} (also as
# the "job" attribute) on the Scheduler ticks topic; the push subscription in events.tf delivers
# it to on_scheduler_tick. Cloud Scheduler publishes as its own service agent: no key, no SA.
resource "google_cloud_scheduler_job" "tick" {
  for_each = var.scheduler_jobs

  name        = "${var.name_prefix}-${each.key}"
  project     = var.project_id
  region      = var.region
  description = each.value.description
  schedule    = each.value.schedule
  time_zone   = var.scheduler_time_zone

  retry_config {
    retry_count          = 3
    min_backoff_duration = "10s"
    max_backoff_duration = "120s"
  }

  pubsub_target {
    topic_name = local.platform.scheduler_topic_id
    data       = base64encode(jsonencode({ job = each.key }))
    attributes = {
      job = each.key
    }
  }
}
