variable "project_id" {
  type        = string
  description = "Existing Google Cloud project that retrain is deployed to (the project itself is not created here)."

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id must be a valid Google Cloud project id."
  }
}

variable "region" {
  type        = string
  description = "Region of the state bucket; also the default region of every later stage."
  default     = "us-central1"
}

variable "state_bucket_name" {
  type        = string
  description = "Name of the Terraform state bucket. Empty means \"<project_id>-retrain-tfstate\"."
  default     = ""
}

variable "state_noncurrent_versions_kept" {
  type        = number
  description = "How many noncurrent versions of each state object the state bucket keeps."
  default     = 20

  validation {
    condition     = var.state_noncurrent_versions_kept >= 1
    error_message = "Keep at least one noncurrent state version."
  }
}

variable "extra_services" {
  type        = list(string)
  description = "APIs to enable in addition to the ones retrain needs."
  default     = []
}

variable "labels" {
  type        = map(string)
  description = "Labels put on every resource of this stage that takes labels."
  default = {
    app   = "retrain"
    stage = "bootstrap"
  }
}

variable "force_destroy" {
  type        = bool
  description = "Allow `terraform destroy` to delete the state and log buckets while they still hold objects."
  default     = false
}
