# A dedicated VPC: GKE nodes and Dataflow workers have private IPs only and reach the internet
# (container registries such as nvcr.io, PyPI for Dataflow workers) through Cloud NAT.

resource "google_compute_network" "retrain" {
  name                    = "${var.name_prefix}-vpc"
  project                 = var.project_id
  auto_create_subnetworks = false
  routing_mode            = "REGIONAL"
}

resource "google_compute_subnetwork" "retrain" {
  name          = "${var.name_prefix}-${var.region}"
  project       = var.project_id
  region        = var.region
  network       = google_compute_network.retrain.id
  ip_cidr_range = var.subnet_cidr

  # Private nodes and workers reach Google APIs (GCS, Artifact Registry, Pub/Sub) without NAT.
  private_ip_google_access = true

  secondary_ip_range {
    range_name    = "pods"
    ip_cidr_range = var.pods_cidr
  }

  secondary_ip_range {
    range_name    = "services"
    ip_cidr_range = var.services_cidr
  }

  log_config {
    aggregation_interval = "INTERVAL_10_MIN"
    flow_sampling        = 0.5
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

resource "google_compute_router" "retrain" {
  name    = "${var.name_prefix}-router"
  project = var.project_id
  region  = var.region
  network = google_compute_network.retrain.id
}

resource "google_compute_router_nat" "retrain" {
  name                               = "${var.name_prefix}-nat"
  project                            = var.project_id
  region                             = var.region
  router                             = google_compute_router.retrain.name
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "ALL_SUBNETWORKS_ALL_IP_RANGES"

  log_config {
    enable = true
    filter = "ERRORS_ONLY"
  }
}

# Dataflow workers exchange shuffle data with each other on TCP 12345-12346; Dataflow tags every
# worker VM with "dataflow". Nothing else is opened: VPC ingress is denied by default.
resource "google_compute_firewall" "dataflow_workers" {
  name        = "${var.name_prefix}-dataflow-workers"
  project     = var.project_id
  network     = google_compute_network.retrain.id
  description = "Dataflow worker-to-worker traffic (tokenization jobs)."
  direction   = "INGRESS"
  priority    = 1000

  source_tags = ["dataflow"]
  target_tags = ["dataflow"]

  allow {
    protocol = "tcp"
    ports    = ["12345-12346"]
  }

  log_config {
    metadata = "INCLUDE_ALL_METADATA"
  }
}

# GPUDirect-TCPX (multi-node A3 High runs): each a3-highgpu-8g node has four more gVNICs, one per GPU
# network, each its own VPC with an 8244-byte MTU, as Google's A3 Terraform builds them
# (GoogleCloudPlatform/nvidia-nemo-on-gke, infra/terraform/modules/a3/common/network/main.tf). The DWS pool
# attaches them (additional_node_network_configs), GKE multi-networking hands them to pods as eth1..eth4,
# and k8s/tcpx.yaml declares them to Kubernetes (Network and GKENetworkParamSet vpc1..vpc4).
# var.enable_gpudirect_tcpx = false builds none of this, and runs never ask for it.
resource "google_compute_network" "gpu" {
  count = var.enable_gpudirect_tcpx ? length(var.gpu_network_cidrs) : 0

  name                    = "${var.name_prefix}-gpu-${count.index + 1}"
  project                 = var.project_id
  auto_create_subnetworks = false
  routing_mode            = "REGIONAL"
  mtu                     = 8244
}

resource "google_compute_subnetwork" "gpu" {
  count = var.enable_gpudirect_tcpx ? length(var.gpu_network_cidrs) : 0

  name          = "${var.name_prefix}-gpu-${count.index + 1}"
  project       = var.project_id
  region        = var.region
  network       = google_compute_network.gpu[count.index].id
  ip_cidr_range = var.gpu_network_cidrs[count.index]

  private_ip_google_access = true

  log_config {
    aggregation_interval = "INTERVAL_10_MIN"
    flow_sampling        = 0.5
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

# NCCL traffic between the GPU nodes of one run, on their GPU networks only.
resource "google_compute_firewall" "gpu_internal" {
  count = var.enable_gpudirect_tcpx ? length(var.gpu_network_cidrs) : 0

  name        = "${var.name_prefix}-gpu-${count.index + 1}-internal"
  project     = var.project_id
  network     = google_compute_network.gpu[count.index].id
  description = "GPUDirect-TCPX traffic between GPU nodes on GPU network ${count.index + 1}."
  direction   = "INGRESS"
  priority    = 1000

  source_ranges = [var.gpu_network_cidrs[count.index]]

  allow {
    protocol = "tcp"
    ports    = ["0-65535"]
  }

  allow {
    protocol = "udp"
    ports    = ["0-65535"]
  }

  allow {
    protocol = "icmp"
  }

  log_config {
    metadata = "INCLUDE_ALL_METADATA"
  }
}
