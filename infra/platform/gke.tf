# The newest GKE version of the configured minor (var.kubernetes_version is a prefix such as "1.35"):
# a pinned patch version falls out of support and makes the next apply fail. A minor GKE no longer offers
# matches nothing, and the provider then leaves latest_master_version empty (the cluster would silently
# get the region's default version): the plan stops instead.
data "google_container_engine_versions" "gke" {
  project        = var.project_id
  location       = var.region
  version_prefix = "${var.kubernetes_version}."

  lifecycle {
    postcondition {
      condition     = try(self.latest_master_version, null) != null && try(self.latest_master_version, "") != ""
      error_message = "GKE offers no ${var.kubernetes_version}.* version in ${var.region} (out of support?): set kubernetes_version to a minor it offers (`gcloud container get-server-config --location ${var.region}`)."
    }
  }
}

locals {
  # The looked-up version as one comparable number: minor, patch and GKE build (1.32.2-gke.1652000 is
  # 32*1e12 + 2*1e8 + 1652000).
  gke_version       = regex("^1\\.(\\d+)\\.(\\d+)-gke\\.(\\d+)", data.google_container_engine_versions.gke.latest_master_version)
  gke_version_order = tonumber(local.gke_version[0]) * 1e12 + tonumber(local.gke_version[1]) * 1e8 + tonumber(local.gke_version[2])
  # Flex-start with queued provisioning: "a GKE cluster in version 1.32.2-gke.1652000 or later"
  # (cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest, "Before you begin").
  flex_start_min_version = 32 * 1e12 + 2 * 1e8 + 1652000
}

resource "google_container_cluster" "retrain" {
  #checkov:skip=CKV_GCP_65:Google Groups for RBAC needs a Google Workspace gke-security-groups group the project may not have; access is granted through IAM (container.developer) instead.
  #checkov:skip=CKV_GCP_24:PodSecurityPolicy was removed from Kubernetes in 1.25; this cluster runs 1.28+ where Pod Security Admission replaces it.
  name     = var.cluster_name
  project  = var.project_id
  location = var.region

  network         = google_compute_network.retrain.id
  subnetwork      = google_compute_subnetwork.retrain.id
  networking_mode = "VPC_NATIVE"

  ip_allocation_policy {
    cluster_secondary_range_name  = "pods"
    services_secondary_range_name = "services"
  }

  # GKE Dataplane V2 enforces NetworkPolicy natively; the legacy Calico add-on stays off. It is also
  # what multi-networking (the GPU networks of GPUDirect-TCPX) requires.
  datapath_provider       = "ADVANCED_DATAPATH"
  enable_multi_networking = var.enable_gpudirect_tcpx

  network_policy {
    enabled  = false
    provider = "PROVIDER_UNSPECIFIED"
  }

  # Node pools are managed as separate resources below.
  remove_default_node_pool = true
  initial_node_count       = 1

  # Only used by the throw-away default pool GKE creates before removing it: never the default
  # compute service account, even for those few minutes.
  node_config {
    service_account = google_service_account.gke_nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    image_type      = "COS_CONTAINERD"

    workload_metadata_config {
      mode = "GKE_METADATA"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    metadata = {
      disable-legacy-endpoints = "true"
    }
  }

  private_cluster_config {
    enable_private_nodes    = true
    enable_private_endpoint = var.enable_private_endpoint
    master_ipv4_cidr_block  = var.master_ipv4_cidr_block

    master_global_access_config {
      enabled = true
    }
  }

  master_authorized_networks_config {
    dynamic "cidr_blocks" {
      for_each = var.master_authorized_networks
      content {
        cidr_block   = cidr_blocks.value.cidr_block
        display_name = cidr_blocks.value.display_name
      }
    }
  }

  control_plane_endpoints_config {
    dns_endpoint_config {
      allow_external_traffic = var.enable_dns_endpoint
    }
  }

  workload_identity_config {
    workload_pool = local.workload_pool
  }

  release_channel {
    channel = var.release_channel
  }
  min_master_version = data.google_container_engine_versions.gke.latest_master_version

  enable_shielded_nodes       = true
  enable_intranode_visibility = true
  enable_legacy_abac          = false

  master_auth {
    client_certificate_config {
      issue_client_certificate = false
    }
  }

  binary_authorization {
    evaluation_mode = "PROJECT_SINGLETON_POLICY_ENFORCE"
  }

  addons_config {
    # Training pods may mount the artifacts bucket (checkpoints) with Cloud Storage FUSE.
    gcs_fuse_csi_driver_config {
      enabled = true
    }
  }

  logging_config {
    enable_components = ["SYSTEM_COMPONENTS", "WORKLOADS"]
  }

  monitoring_config {
    enable_components = ["SYSTEM_COMPONENTS"]

    managed_prometheus {
      enabled = true
    }
  }

  resource_labels     = var.labels
  deletion_protection = var.deletion_protection

  lifecycle {
    # node_config only shapes the transient default pool; changing it later would recreate the cluster.
    ignore_changes = [node_config]
  }
}

# System pool: the JobSet controller, the JobSet notifier. No GPUs.
resource "google_container_node_pool" "default" {
  name     = "default"
  project  = var.project_id
  location = var.region
  cluster  = google_container_cluster.retrain.name

  autoscaling {
    min_node_count = var.default_pool_min_nodes
    max_node_count = var.default_pool_max_nodes
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  upgrade_settings {
    max_surge       = 1
    max_unavailable = 0
  }

  node_config {
    machine_type    = var.default_pool_machine_type
    image_type      = "COS_CONTAINERD"
    disk_type       = "pd-balanced"
    disk_size_gb    = 100
    service_account = google_service_account.gke_nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    resource_labels = var.labels

    workload_metadata_config {
      mode = "GKE_METADATA"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    metadata = {
      disable-legacy-endpoints = "true"
    }
  }

  # Nodes start only once their service account may run as a node and pull images.
  depends_on = [
    google_project_iam_member.gke_nodes_default_node_sa,
    google_artifact_registry_repository_iam_member.gke_nodes_reader,
  ]
}

# DWS (Dynamic Workload Scheduler) queued-provisioning A3 pool. It has no nodes until a
# ProvisioningRequest is accepted; then the whole gang of nodes arrives at once, and the
# autoscaler removes them (down to zero) when the JobSet is done.
resource "google_container_node_pool" "gpu_dws" {
  #checkov:skip=CKV_GCP_9:DWS queued provisioning requires node auto-repair to be disabled (a repair would recreate a node outside the ProvisioningRequest).
  #checkov:skip=CKV_GCP_10:Queued-provisioning nodes live for one training run at most (<= 7 days) and always start at the pool version; an auto-upgrade would evict a running gang. The pool is upgraded explicitly between runs.
  name           = var.gpu_pool_name
  project        = var.project_id
  location       = var.region
  cluster        = google_container_cluster.retrain.name
  node_locations = var.gpu_zones

  initial_node_count = 0

  # Flex-start with queued provisioning, as GKE creates it today: `gcloud container node-pools create
  # ... --enable-queued-provisioning --flex-start --enable-autoscaling --num-nodes=0 --total-max-nodes N
  # --location-policy=ANY --reservation-affinity=none --no-enable-autorepair`
  # (cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest). Its VMs use the project's
  # preemptible GPU quota (infra/README.md, "Quotas").
  queued_provisioning {
    enabled = true
  }

  autoscaling {
    total_min_node_count = 0
    total_max_node_count = var.gpu_max_nodes
    location_policy      = "ANY"
  }

  # GPUDirect-TCPX: the four GPU networks as the nodes' eth1..eth4 (network.tf).
  network_config {
    dynamic "additional_node_network_configs" {
      for_each = range(length(google_compute_network.gpu))
      content {
        network    = google_compute_network.gpu[additional_node_network_configs.value].name
        subnetwork = google_compute_subnetwork.gpu[additional_node_network_configs.value].name
      }
    }
  }

  management {
    auto_repair  = false
    auto_upgrade = false
  }

  node_config {
    flex_start      = true
    machine_type    = var.gpu_machine_type
    image_type      = "COS_CONTAINERD"
    disk_type       = "pd-ssd"
    disk_size_gb    = var.gpu_boot_disk_size_gb
    service_account = google_service_account.gke_nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    resource_labels = var.labels

    labels = {
      "retrain.dev/pool" = var.gpu_pool_name
    }

    guest_accelerator {
      type  = var.gpu_accelerator_type
      count = var.gpus_per_node

      gpu_driver_installation_config {
        gpu_driver_version = var.gpu_driver_version
      }
    }

    # --reservation-affinity=none: DWS capacity never comes from a reservation.
    reservation_affinity {
      consume_reservation_type = "NO_RESERVATION"
    }

    ephemeral_storage_local_ssd_config {
      local_ssd_count = var.gpu_local_ssd_count
    }

    gvnic {
      enabled = true
    }

    taint {
      key    = "nvidia.com/gpu"
      value  = "present"
      effect = "NO_SCHEDULE"
    }

    workload_metadata_config {
      mode = "GKE_METADATA"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    metadata = {
      disable-legacy-endpoints = "true"
    }
  }

  lifecycle {
    precondition {
      condition     = var.release_channel == "UNSPECIFIED"
      error_message = "The DWS pool turns node auto-upgrade off, which GKE only allows outside release channels: set release_channel = \"UNSPECIFIED\"."
    }
    precondition {
      condition     = local.gke_version_order >= local.flex_start_min_version
      error_message = "Flex-start with queued provisioning needs GKE 1.32.2-gke.1652000 or later; kubernetes_version ${var.kubernetes_version} gives ${data.google_container_engine_versions.gke.latest_master_version}."
    }
  }

  # Nodes start only once their service account may run as a node and pull images.
  depends_on = [
    google_project_iam_member.gke_nodes_default_node_sa,
    google_artifact_registry_repository_iam_member.gke_nodes_reader,
  ]
}
