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
