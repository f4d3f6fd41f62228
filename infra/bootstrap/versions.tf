terraform {
  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 7.0.0, < 8.0.0"
    }
  }

  # Bootstrap starts on local state: the bucket that holds remote state does not exist yet.
  # After the first apply, move this stage's state into the bucket it created:
  #   terraform init -migrate-state -backend-config="bucket=$(terraform output -raw state_bucket)"
  # after uncommenting the backend block below (see infra/README.md).
  # backend "gcs" {
  #   prefix = "retrain/bootstrap"
  # }
}

provider "google" {
  project = var.project_id
  region  = var.region
}
