# Operators are told: alert policies (each saying what to do), the channels they notify, the log-based
# metrics a dashboard reads. The code writes what they match (retrain/logs.py): structured entries with
# jsonPayload.alert (an Alert) or jsonPayload.run_event (a RunEvent), from the functions
# (cloud_run_revision) and the workflow (sys.log json, workflows.googleapis.com/Workflow).
# tests/test_monitoring.py keeps every filter naming a field and a value the code writes.
# Shapes: terraform-provider-google's google_monitoring_alert_policy (condition_matched_log needs
# alert_strategy.notification_rate_limit), google_logging_metric, google_monitoring_dashboard.

locals {
  alert_channels = concat([for c in google_monitoring_notification_channel.email : c.id], var.alert_notification_channels)
  # Each log-match alert: the logs filter, how often it may notify, its severity, and what to do.
  log_alerts = {
    run_failed = {
      name     = "a run failed"
      filter   = "jsonPayload.run_event.type=\"failed\""
      period   = "300s"
      severity = "ERROR"
      todo     = "A run ended failed; its nodes were released and its content given back (`retrain run --retry RUN` re-runs it). `retrain status RUN` shows its failure kind and reason: CapacityTimeout or CapacityError (DWS had no A3 capacity: retry later or in another region), TokenizeFailed (the Dataflow job's logs), TrainingFailed (the JobSet's pod logs), StepFailed (the run_step function's logs), ExecutionLost (the workflow execution vanished: `retrain reap` checks nothing was left)."
    }
    capacity_wait = {
      name     = "a run waits for capacity"
      filter   = "jsonPayload.alert=\"capacity_wait\""
      period   = "3600s"
      severity = "WARNING"
      todo     = "A run has waited for DWS capacity longer than alert_capacity_wait_s; it asks again every provision_reask_s and fails at provision_timeout_s. Nothing is spent while it waits. To stop waiting: `retrain cancel RUN`. To wait less next time: fewer nodes per run, another region or zone, or a reservation."
    }
    idle_nodes = {
      name     = "GPU nodes up with no live run"
      filter   = "jsonPayload.alert=\"idle_nodes\""
      period   = "3600s"
      severity = "CRITICAL"
      todo     = "GPU nodes of the DWS pool are up with no live run, longer than alert_idle_nodes_s: they cost money for nothing. `retrain reap --dry-run` lists what holds them (a JobSet or ProvisioningRequest of no live run); `retrain reap` deletes those, and the autoscaler then removes the nodes. If nothing holds them, check the pool's autoscaler events in the cluster."
    }
    cost_over_estimate = {
      name     = "a run cost more than its estimate"
      filter   = "jsonPayload.alert=\"cost_over_estimate\""
      period   = "300s"
      severity = "WARNING"
      todo     = "A run's GPU node time cost more than its estimate times alert_cost_factor. `retrain report RUN` shows where the time went (waiting for nodes, training, idle before release). If training was slower than planned, the next estimate learns from this run; set max_run_cost_usd to cap a run."
    }
    budget = {
      name     = "a dataset nears its monthly budget"
      filter   = "jsonPayload.alert=\"budget\""
      period   = "86400s"
      severity = "WARNING"
      todo     = "A run started whose estimate takes its dataset past alert_budget_fraction of its monthly budget (monthly_budget_usd, or its entry in monthly_budgets); a run that would pass the budget is refused before any capacity (failure Refused). `retrain plan --dataset D` shows what is left. Raise the budget, or let the dataset wait for next month (`retrain run --retry RUN` then)."
    }
  }
}

resource "google_monitoring_notification_channel" "email" {
  for_each = toset(var.alert_email_addresses)

  project      = var.project_id
  display_name = "retrain alerts to ${each.value}"
  type         = "email"
  labels = {
    email_address = each.value
  }
}

resource "google_monitoring_alert_policy" "log" {
  for_each = local.log_alerts

  project               = var.project_id
  display_name          = "retrain: ${each.value.name}"
  combiner              = "OR"
  severity              = each.value.severity
  notification_channels = local.alert_channels

  conditions {
    display_name = each.value.name
    condition_matched_log {
      filter = each.value.filter
    }
  }

  alert_strategy {
    notification_rate_limit {
      period = each.value.period
    }
    auto_close = "86400s"
  }

  documentation {
    subject   = "retrain: ${each.value.name}"
    content   = each.value.todo
    mime_type = "text/markdown"
  }
}

# Messages a function kept refusing: each is an event retrain did not take (an object, a tick, a JobSet
# completion). `gcloud pubsub subscriptions pull` on the dead-letter subscription shows them.
resource "google_monitoring_alert_policy" "dead_letters" {
  project               = var.project_id
  display_name          = "retrain: messages in the dead-letter topic"
  combiner              = "OR"
  severity              = "ERROR"
  notification_channels = local.alert_channels

  conditions {
    display_name = "undelivered dead letters"
    condition_threshold {
      filter          = "metric.type=\"pubsub.googleapis.com/subscription/num_undelivered_messages\" AND resource.type=\"pubsub_subscription\" AND resource.label.subscription_id=\"${local.platform.dead_letter_subscription}\""
      comparison      = "COMPARISON_GT"
      threshold_value = 0
      duration        = "300s"
      aggregations {
        alignment_period   = "60s"
        per_series_aligner = "ALIGN_MAX"
      }
    }
  }

  documentation {
    subject   = "retrain: messages in the dead-letter topic"
    content   = "A function refused a message past its delivery attempts (push_max_delivery_attempts), so it went to the dead-letter topic: an object arrival, a Scheduler tick or a JobSet completion retrain never took. Pull it from the dead-letter subscription (`gcloud pubsub subscriptions pull SUBSCRIPTION --auto-ack=false`), read the function's logs for why, fix that, and publish it again to its topic; `retrain audit` lists landed objects the ledger never recorded."
    mime_type = "text/markdown"
  }
}

# A function answering 5xx asks for redelivery (a transient failure is expected now and then); many of
# them mean it cannot do its work.
resource "google_monitoring_alert_policy" "function_errors" {
  project               = var.project_id
  display_name          = "retrain: a function keeps failing"
  combiner              = "OR"
  severity              = "ERROR"
  notification_channels = local.alert_channels

  conditions {
    display_name = "5xx answers of retrain's functions"
    condition_threshold {
      filter          = "metric.type=\"run.googleapis.com/request_count\" AND resource.type=\"cloud_run_revision\" AND metric.label.response_code_class=\"5xx\" AND resource.label.service_name=starts_with(\"${var.name_prefix}-\")"
      comparison      = "COMPARISON_GT"
      threshold_value = var.alert_function_errors_per_s
      duration        = "600s"
      aggregations {
        alignment_period     = "60s"
        per_series_aligner   = "ALIGN_RATE"
        cross_series_reducer = "REDUCE_SUM"
        group_by_fields      = ["resource.label.service_name"]
      }
    }
  }

  documentation {
    subject   = "retrain: a function keeps failing"
    content   = "One of retrain's functions answers 5xx more than alert_function_errors_per_s: the events it refuses are redelivered until they land in the dead-letter topic. Its logs (Cloud Run service of the same name) say why: the ledger (Firestore), the Workflows API or the cluster unreachable, or a permission missing."
    mime_type = "text/markdown"
  }
}

# Run events as metrics for the dashboard: one counter by type (the workflow's entries), and each ended
# run's numbers from the summary its finish step logs (retrain.logs.SUMMARY).
resource "google_logging_metric" "run_events" {
  project = var.project_id
  name    = "${var.name_prefix}-run-events"
  filter  = "resource.type=\"workflows.googleapis.com/Workflow\" AND jsonPayload.run_event.type:*"

  metric_descriptor {
    metric_kind = "DELTA"
    value_type  = "INT64"
    labels {
      key        = "type"
      value_type = "STRING"
    }
  }
  label_extractors = {
    type = "EXTRACT(jsonPayload.run_event.type)"
  }
}

resource "google_logging_metric" "run_record" {
  for_each = {
    tokens                = "tokens per ended run"
    gpu_node_seconds      = "GPU node-seconds per ended run"
    idle_node_seconds     = "idle GPU node-seconds per ended run"
    cost_usd              = "cost per ended run (USD)"
    waited_for_capacity_s = "seconds waited for capacity per ended run"
  }

  project         = var.project_id
  name            = "${var.name_prefix}-run-${replace(each.key, "_", "-")}"
  description     = each.value
  filter          = "resource.type=\"cloud_run_revision\" AND jsonPayload.run_summary.status:*"
  value_extractor = "EXTRACT(jsonPayload.run_summary.${each.key})"

  metric_descriptor {
    metric_kind = "DELTA"
    value_type  = "DISTRIBUTION"
  }
  bucket_options {
    exponential_buckets {
      num_finite_buckets = 32
      growth_factor      = 2
      scale              = 1
    }
  }
}

resource "google_monitoring_dashboard" "runs" {
  project = var.project_id
  dashboard_json = jsonencode({
    displayName = "retrain: runs"
    gridLayout = {
      columns = 2
      widgets = concat(
        [{
          title = "Runs by state (run events per hour)"
          xyChart = {
            dataSets = [{
              plotType = "STACKED_BAR"
              timeSeriesQuery = {
                timeSeriesFilter = {
                  filter = "metric.type=\"logging.googleapis.com/user/${google_logging_metric.run_events.name}\" AND resource.type=\"workflows.googleapis.com/Workflow\""
                  aggregation = {
                    alignmentPeriod    = "3600s"
                    perSeriesAligner   = "ALIGN_DELTA"
                    crossSeriesReducer = "REDUCE_SUM"
                    groupByFields      = ["metric.label.type"]
                  }
                }
              }
            }]
          }
        }],
        [for key, metric in google_logging_metric.run_record : {
          title = metric.description
          xyChart = {
            dataSets = [{
              plotType = "LINE"
              timeSeriesQuery = {
                timeSeriesFilter = {
                  filter = "metric.type=\"logging.googleapis.com/user/${metric.name}\" AND resource.type=\"cloud_run_revision\""
                  aggregation = {
                    alignmentPeriod    = "86400s"
                    perSeriesAligner   = "ALIGN_PERCENTILE_50"
                    crossSeriesReducer = "REDUCE_MEAN"
                  }
                }
              }
            }]
          }
        }],
        [{
          title = "Dead letters waiting"
          xyChart = {
            dataSets = [{
              plotType = "LINE"
              timeSeriesQuery = {
                timeSeriesFilter = {
                  filter = "metric.type=\"pubsub.googleapis.com/subscription/num_undelivered_messages\" AND resource.type=\"pubsub_subscription\" AND resource.label.subscription_id=\"${local.platform.dead_letter_subscription}\""
                  aggregation = {
                    alignmentPeriod  = "300s"
                    perSeriesAligner = "ALIGN_MAX"
                  }
                }
              }
            }]
          }
        }]
      )
    }
  })
}
