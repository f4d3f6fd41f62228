# ---------------------------------------------------------------------------------------------
# Project and naming
# ---------------------------------------------------------------------------------------------

variable "project_id" {
  type        = string
  description = "Project retrain is deployed to (the one the bootstrap stage prepared)."
}

variable "region" {
  type        = string
  description = "Region of the network, the GKE cluster, the buckets, Pub/Sub and Artifact Registry."
  default     = "us-central1"
}

variable "name_prefix" {
  type        = string
  description = "Prefix of resource and service-account names (lowercase letters, digits, hyphens; at most 12 characters so that service-account ids stay under 30)."
  default     = "retrain"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,11}$", var.name_prefix))
    error_message = "name_prefix: 1-12 characters, lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "labels" {
  type        = map(string)
  description = "Labels put on every resource of this stage that takes labels."
  default = {
    app   = "retrain"
    stage = "platform"
  }
}

variable "deletion_protection" {
  type        = bool
  description = "Protect the GKE cluster and the Firestore database against `terraform destroy`."
  default     = true
}

variable "force_destroy" {
  type        = bool
  description = "Allow `terraform destroy` to delete buckets that still hold objects (training data, checkpoints)."
  default     = false
}

# ---------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------

variable "subnet_cidr" {
  type        = string
  description = "Primary range of the subnetwork of the GKE nodes and the Dataflow workers."
  default     = "10.10.0.0/20"
}

variable "pods_cidr" {
  type        = string
  description = "Secondary range for GKE Pods."
  default     = "10.20.0.0/14"
}

variable "services_cidr" {
  type        = string
  description = "Secondary range for GKE Services."
  default     = "10.30.0.0/20"
}

variable "master_ipv4_cidr_block" {
  type        = string
  description = "/28 range of the GKE control plane's private endpoint."
  default     = "172.16.0.0/28"
}

# ---------------------------------------------------------------------------------------------
# GKE cluster
# ---------------------------------------------------------------------------------------------

variable "cluster_name" {
  type        = string
  description = "GKE cluster name (RETRAIN_CLUSTER)."
  default     = "retrain"
}

variable "kubernetes_version" {
  type        = string
  description = "GKE minor version, a prefix such as \"1.35\": the cluster gets the newest patch of it that google_container_engine_versions lists. Flex-start with queued provisioning needs 1.32.2-gke.1652000 or later; a minor GKE no longer offers stops the plan."
  default     = "1.35"

  validation {
    condition     = can(regex("^1\\.[0-9]+$", var.kubernetes_version))
    error_message = "kubernetes_version is a minor version prefix such as \"1.35\"."
  }
}

variable "release_channel" {
  type        = string
  description = "GKE release channel. UNSPECIFIED (static version) is required because the DWS pool runs with node auto-upgrade off, which GKE refuses on release-channel clusters."
  default     = "UNSPECIFIED"

  validation {
    condition     = contains(["UNSPECIFIED", "RAPID", "REGULAR", "STABLE", "EXTENDED"], var.release_channel)
    error_message = "release_channel must be one of UNSPECIFIED, RAPID, REGULAR, STABLE, EXTENDED."
  }
}

variable "enable_private_endpoint" {
  type        = bool
  description = "Make the control plane's IP endpoint private-only. Keep false to reach it from the authorized networks below (or use the DNS endpoint)."
  default     = false
}

variable "master_authorized_networks" {
  type = list(object({
    cidr_block   = string
    display_name = string
  }))
  description = "CIDR ranges allowed to reach the control plane's IP endpoint (e.g. the CI runner that applies the app stage). Empty: nothing outside the VPC."
  default     = []
}

variable "enable_dns_endpoint" {
  type        = bool
  description = "Expose the control plane's IAM-authenticated DNS endpoint, which Terraform's kubernetes providers and kubectl can use without an authorized network."
  default     = true
}

variable "default_pool_machine_type" {
  type        = string
  description = "Machine type of the default (system) node pool: the JobSet controller, the notifier."
  default     = "e2-standard-4"
}

variable "default_pool_min_nodes" {
  type        = number
  description = "Minimum nodes per zone of the default pool."
  default     = 1
}

variable "default_pool_max_nodes" {
  type        = number
  description = "Maximum nodes per zone of the default pool."
  default     = 3
}

# ---------------------------------------------------------------------------------------------
# DWS queued-provisioning GPU pool
# ---------------------------------------------------------------------------------------------

variable "gpu_pool_name" {
  type        = string
  description = "Name of the DWS queued-provisioning GPU node pool (RETRAIN_NODE_POOL)."
  default     = "a3-dws"
}

variable "gpu_machine_type" {
  type        = string
  description = "GPU machine type of the DWS pool (RETRAIN_MACHINE_TYPE)."
  default     = "a3-highgpu-8g"
}

variable "gpu_accelerator_type" {
  type        = string
  description = "Accelerator type attached to each GPU node."
  default     = "nvidia-h100-80gb"
}

variable "gpus_per_node" {
  type        = number
  description = "Accelerators per GPU node (RETRAIN_GPUS_PER_NODE); must match the machine type."
  default     = 8
}

variable "gpu_driver_version" {
  type        = string
  description = "GPU driver GKE installs on the GPU nodes: DEFAULT or LATEST."
  default     = "LATEST"

  validation {
    condition     = contains(["DEFAULT", "LATEST"], var.gpu_driver_version)
    error_message = "gpu_driver_version must be DEFAULT or LATEST."
  }
}

variable "gpu_max_nodes" {
  type        = number
  description = "Upper bound of the DWS pool's autoscaler over all zones; the pool's lower bound is always 0."
  default     = 4

  validation {
    condition     = var.gpu_max_nodes >= 1
    error_message = "gpu_max_nodes must be at least 1."
  }
}

variable "gpu_zones" {
  type        = list(string)
  description = "Zones of the region the DWS pool may obtain GPU nodes in (location policy ANY picks whichever has capacity)."
  default     = ["us-central1-a", "us-central1-b", "us-central1-c"]
}

variable "gpu_boot_disk_size_gb" {
  type        = number
  description = "Boot disk size of a GPU node (GB)."
  default     = 200
}

variable "gpu_local_ssd_count" {
  type        = number
  description = "Local SSDs used as node ephemeral storage on a GPU node (a3-highgpu-8g comes with 16)."
  default     = 16
}

# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

variable "landing_bucket_name" {
  type        = string
  description = "Landing bucket name (RETRAIN_LANDING_BUCKET). Empty means \"<project_id>-retrain-landing\"."
  default     = ""
}

variable "artifacts_bucket_name" {
  type        = string
  description = "Artifacts bucket name (RETRAIN_ARTIFACTS_BUCKET). Empty means \"<project_id>-retrain-artifacts\"."
  default     = ""
}

variable "landing_retention_days" {
  type        = number
  description = "Days a landed object is kept before lifecycle deletes it (it has been tokenized into the artifacts bucket by then)."
  default     = 90
}

variable "noncurrent_retention_days" {
  type        = number
  description = "Days noncurrent (overwritten or deleted) object versions are kept in the landing and artifacts buckets."
  default     = 30
}

variable "dataflow_temp_retention_days" {
  type        = number
  description = "Days Dataflow staging/temp files under dataflow/ in the artifacts bucket are kept."
  default     = 7
}

variable "firestore_location" {
  type        = string
  description = "Location of the (default) Firestore database (a region such as us-central1, or a multi-region such as nam5)."
  default     = "us-central1"
}

variable "artifact_repository_id" {
  type        = string
  description = "Artifact Registry Docker repository for function builds, the Dataflow template image, the notifier and training images."
  default     = "retrain"
}

# ---------------------------------------------------------------------------------------------
# Messaging
# ---------------------------------------------------------------------------------------------

variable "jobset_topic" {
  type        = string
  description = "Topic the in-cluster notifier publishes JobSet terminal states to (RETRAIN_JOBSET_TOPIC)."
  default     = "jobset-events"
}

variable "scheduler_topic" {
  type        = string
  description = "Topic Cloud Scheduler publishes its ticks (seal, sweeper, reaper) to."
  default     = "retrain-scheduler-ticks"
}

variable "run_events_topic" {
  type        = string
  description = "Topic every run's state changes and promotions are published to, as CloudEvents (retrain.contracts.RunEvent)."
  default     = "retrain-run-events"
}

variable "dead_letter_topic" {
  type        = string
  description = "Topic that receives push deliveries the functions kept rejecting."
  default     = "retrain-dead-letter"
}

variable "message_retention_duration" {
  type        = string
  description = "How long the topics retain messages (seconds, with an s suffix)."
  default     = "604800s"
}

# ---------------------------------------------------------------------------------------------
# Kubernetes identities (Workload Identity)
# ---------------------------------------------------------------------------------------------

variable "k8s_namespace" {
  type        = string
  description = "Namespace of the training JobSets and the notifier (RETRAIN_NAMESPACE): retrain's own, created by the app stage. Not \"default\": the workflow may create JobSets there, and a JobSet's pods may run as any service account of its namespace."
  default     = "retrain"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.k8s_namespace)) && var.k8s_namespace != "default" && !startswith(var.k8s_namespace, "kube-")
    error_message = "k8s_namespace must be a DNS-1123 label of retrain's own, not default or a kube-* namespace."
  }
}

variable "notifier_ksa" {
  type        = string
  description = "Kubernetes service account of the JobSet notifier Deployment."
  default     = "jobset-notifier"
}

variable "enable_gpudirect_tcpx" {
  type        = bool
  description = "Build GPUDirect-TCPX for multi-node runs: four GPU networks on the DWS pool, GKE multi-networking, and (app stage) the NCCL plugin installer, the NRI device injector and the Network objects. Off: none of it, and multi-node runs use the nodes' primary network."
  default     = true
}

variable "gpu_network_cidrs" {
  type        = list(string)
  description = "Primary ranges of the four GPU networks (eth1..eth4 of an a3-highgpu-8g node)."
  default     = ["192.168.1.0/24", "192.168.2.0/24", "192.168.3.0/24", "192.168.4.0/24"]

  validation {
    condition     = length(var.gpu_network_cidrs) == 4
    error_message = "An a3-highgpu-8g node has four GPU NICs: give four ranges."
  }
}
