output "project_id" {
  description = "Project retrain is deployed to."
  value       = var.project_id
}

output "region" {
  description = "Default region of the later stages."
  value       = var.region
}

output "state_bucket" {
  description = "Bucket holding the Terraform state of platform and app: pass it as -backend-config=\"bucket=...\"."
  value       = google_storage_bucket.state.name
}

output "enabled_services" {
  description = "APIs enabled by this stage."
  value       = sort(tolist(local.services))
}
