terraform {
  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 7.0.0, < 8.0.0"
    }
    archive = {
      source  = "hashicorp/archive"
      version = ">= 2.4.0, < 3.0.0"
    }
    http = {
      source  = "hashicorp/http"
      version = ">= 3.4.0, < 4.0.0"
    }
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = ">= 2.31.0, < 3.0.0"
    }
    kubectl = {
      source  = "alekc/kubectl"
      version = ">= 2.1.0, < 3.0.0"
    }
  }

  # Partial configuration: the bucket comes from the bootstrap stage,
  #   terraform init -backend-config="bucket=$(terraform -chdir=../bootstrap output -raw state_bucket)"
  backend "gcs" {
    prefix = "retrain/app"
  }
}

provider "google" {
  project = var.project_id
  region  = var.region
}

data "google_client_config" "current" {}

# The control plane is reached through its IAM-authenticated DNS endpoint when the platform
# enabled it (no authorized network needed), through its IP endpoint otherwise.
locals {
  k8s_use_dns = local.platform.cluster_dns_endpoint != ""
  k8s_host    = local.k8s_use_dns ? "https://${local.platform.cluster_dns_endpoint}" : "https://${local.platform.cluster_endpoint}"
  k8s_ca      = local.k8s_use_dns ? null : base64decode(local.platform.cluster_ca_certificate)
}

provider "kubernetes" {
  host                   = local.k8s_host
  token                  = data.google_client_config.current.access_token
  cluster_ca_certificate = local.k8s_ca
}

provider "kubectl" {
  host                   = local.k8s_host
  token                  = data.google_client_config.current.access_token
  cluster_ca_certificate = local.k8s_ca
  load_config_file       = false
}
