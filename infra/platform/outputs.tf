output "project_id" {
  description = "Project retrain runs in (RETRAIN_PROJECT)."
  value       = var.project_id
}

output "project_number" {
  description = "Project number (service-agent addresses)."
  value       = data.google_project.this.number
}

output "pubsub_service_agent" {
  description = "IAM member of the project's Pub/Sub service agent (created by this stage before any grant to it)."
  value       = local.pubsub_service_agent
}

output "region" {
  description = "Region of the cluster, buckets, topics (RETRAIN_REGION)."
  value       = var.region
}

output "network" {
  description = "Self link of the retrain VPC."
  value       = google_compute_network.retrain.self_link
}

output "subnetwork" {
  description = "Self link of the subnetwork of GKE nodes and Dataflow workers (pass to Dataflow as subnetwork)."
  value       = google_compute_subnetwork.retrain.self_link
}

output "cluster_name" {
  description = "GKE cluster name (RETRAIN_CLUSTER)."
  value       = google_container_cluster.retrain.name
}

output "cluster_location" {
  description = "GKE cluster location."
  value       = google_container_cluster.retrain.location
}

output "cluster_id" {
  description = "GKE cluster id, projects/P/locations/L/clusters/C (the Workflows gke.request cluster_id is the name)."
  value       = google_container_cluster.retrain.id
}

output "cluster_endpoint" {
  description = "IP endpoint of the control plane (private or public, see enable_private_endpoint)."
  value       = google_container_cluster.retrain.endpoint
  sensitive   = true
}

output "cluster_dns_endpoint" {
  description = "IAM-authenticated DNS endpoint of the control plane (empty when disabled)."
  value       = try(google_container_cluster.retrain.control_plane_endpoints_config[0].dns_endpoint_config[0].endpoint, "")
}

output "cluster_ca_certificate" {
  description = "Base64 CA certificate of the control plane."
  value       = google_container_cluster.retrain.master_auth[0].cluster_ca_certificate
  sensitive   = true
}

output "default_node_pool" {
  description = "Name of the system node pool."
  value       = google_container_node_pool.default.name
}

output "gpu_node_pool" {
  description = "Name of the DWS queued-provisioning GPU node pool (RETRAIN_NODE_POOL)."
  value       = google_container_node_pool.gpu_dws.name
}

output "gpu_machine_type" {
  description = "Machine type of the GPU pool (RETRAIN_MACHINE_TYPE)."
  value       = var.gpu_machine_type
}

output "gpus_per_node" {
  description = "GPUs per node of the GPU pool (RETRAIN_GPUS_PER_NODE)."
  value       = var.gpus_per_node
}

output "gpudirect_tcpx" {
  description = "Whether GPUDirect-TCPX is built (RETRAIN_GPUDIRECT_TCPX): multi-node runs use it."
  value       = var.enable_gpudirect_tcpx
}

output "gpu_networks" {
  description = "The GPU networks of GPUDirect-TCPX, in NIC order (eth1..eth4): VPC and subnetwork names (k8s/tcpx.yaml)."
  value = [
    for i, network in google_compute_network.gpu : {
      vpc    = network.name
      subnet = google_compute_subnetwork.gpu[i].name
    }
  ]
}

output "gpu_max_nodes" {
  description = "Upper autoscaling bound of the GPU pool; the workflow never asks for more."
  value       = var.gpu_max_nodes
}

output "landing_bucket" {
  description = "Landing bucket name (RETRAIN_LANDING_BUCKET)."
  value       = google_storage_bucket.landing.name
}

output "artifacts_bucket" {
  description = "Artifacts bucket name (RETRAIN_ARTIFACTS_BUCKET)."
  value       = google_storage_bucket.artifacts.name
}

output "function_sources_bucket" {
  description = "Bucket the app stage uploads the zipped function source to."
  value       = google_storage_bucket.function_sources.name
}

output "jobset_topic" {
  description = "Short name of the JobSet events topic (RETRAIN_JOBSET_TOPIC)."
  value       = google_pubsub_topic.jobset_events.name
}

output "jobset_topic_id" {
  description = "Full id of the JobSet events topic."
  value       = google_pubsub_topic.jobset_events.id
}

output "scheduler_topic_id" {
  description = "Full id of the Scheduler ticks topic."
  value       = google_pubsub_topic.scheduler_ticks.id
}

output "run_events_topic_id" {
  description = "Full id of the run events topic (RETRAIN_EVENTS_TOPIC; subscribe to follow every run)."
  value       = google_pubsub_topic.run_events.id
}

output "dead_letter_topic_id" {
  description = "Full id of the dead-letter topic."
  value       = google_pubsub_topic.dead_letter.id
}

output "dead_letter_subscription" {
  description = "Pull subscription to inspect dead letters (gcloud pubsub subscriptions pull ...)."
  value       = google_pubsub_subscription.dead_letter.name
}

output "firestore_database" {
  description = "Firestore database of the run ledger."
  value       = google_firestore_database.default.name
}

output "artifact_registry" {
  description = "Docker repository URL, REGION-docker.pkg.dev/PROJECT/REPO."
  value       = "${google_artifact_registry_repository.retrain.location}-docker.pkg.dev/${var.project_id}/${google_artifact_registry_repository.retrain.repository_id}"
}

output "artifact_registry_id" {
  description = "Full id of the Docker repository (Cloud Functions build_config.docker_repository)."
  value       = google_artifact_registry_repository.retrain.id
}

output "service_accounts" {
  description = "Email of each component's service account."
  value = {
    gke_nodes = google_service_account.gke_nodes.email
    functions = google_service_account.functions.email
    events    = google_service_account.events.email
    scheduler = google_service_account.scheduler.email
    workflow  = google_service_account.workflow.email
    dataflow  = google_service_account.dataflow.email
    notifier  = google_service_account.notifier.email
    builder   = google_service_account.builder.email
  }
}

output "service_account_ids" {
  description = "Full resource id (projects/P/serviceAccounts/EMAIL) of each component's service account."
  value = {
    gke_nodes = google_service_account.gke_nodes.id
    functions = google_service_account.functions.id
    events    = google_service_account.events.id
    scheduler = google_service_account.scheduler.id
    workflow  = google_service_account.workflow.id
    dataflow  = google_service_account.dataflow.id
    notifier  = google_service_account.notifier.id
    builder   = google_service_account.builder.id
  }
}

output "k8s_namespace" {
  description = "Namespace of training JobSets and the notifier (RETRAIN_NAMESPACE)."
  value       = var.k8s_namespace
}

output "notifier_ksa" {
  description = "Kubernetes service account the notifier must run as (bound to the notifier GSA)."
  value       = var.notifier_ksa
}

