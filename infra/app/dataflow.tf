# Flex-template spec of the tokenization pipeline, in the artifacts bucket. It is the same
# document `gcloud dataflow flex-template build` writes: the launcher image plus parameter
# metadata. The image is built by `retrain deploy` (cloudbuild.yaml) and named here by digest.
locals {
  dataflow_metadata_path = "${local.repo_root}/${var.dataflow_metadata}"
  dataflow_metadata = fileexists(local.dataflow_metadata_path) ? jsondecode(file(local.dataflow_metadata_path)) : {
    name        = "retrain-tokenize"
    description = "Tokenize a sealed batch into Megatron indexed shards."
    parameters  = []
  }
}

resource "google_storage_bucket_object" "tokenize_template" {
  bucket       = local.platform.artifacts_bucket
  name         = var.dataflow_template_object
  content_type = "application/json"
  content = jsonencode({
    image    = local.dataflow_image
    sdkInfo  = { language = "PYTHON" }
    metadata = local.dataflow_metadata
    defaultEnvironment = {
      serviceAccountEmail = local.sa.dataflow
      subnetwork          = local.platform.subnetwork
      ipConfiguration     = "WORKER_IP_PRIVATE"
      tempLocation        = local.dataflow_temp_location
      stagingLocation     = "gs://${local.platform.artifacts_bucket}/dataflow/staging"
    }
  })

  lifecycle {
    precondition {
      condition     = local.dataflow_image != ""
      error_message = "No tokenize image: `retrain deploy` builds it (cloudbuild.yaml) and passes dataflow_image by digest."
    }
  }
}
