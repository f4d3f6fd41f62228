# In-cluster pieces: Kueue and JobSet (upstream release manifests), the retrain namespace
# objects that carry Terraform-known values (Workload Identity service accounts, RETRAIN_*
# ConfigMap), and every manifest under k8s/. Everything is gated by var.apply_kubernetes; with it
# off, infra/README.md ("Kubernetes step") gives the equivalent kubectl commands.

locals {
  k8s_enabled   = var.apply_kubernetes
  k8s_namespace = local.platform.k8s_namespace
  k8s_dir       = "${local.repo_root}/${var.k8s_manifests_dir}"
  k8s_files = local.k8s_enabled ? toset([
    for f in fileset(local.k8s_dir, "**/*.{yaml,yml}") : f
    if !can(regex("(^|/)kustomization\\.ya?ml$", f))
  ]) : toset([])
}

# ---------------------------------------------------------------------------------------------
# Kueue and JobSet controllers
# ---------------------------------------------------------------------------------------------

data "http" "kueue" {
  count = local.k8s_enabled ? 1 : 0
  url   = "https://github.com/kubernetes-sigs/kueue/releases/download/${var.kueue_version}/manifests.yaml"
}

data "kubectl_file_documents" "kueue" {
  count   = local.k8s_enabled ? 1 : 0
  content = data.http.kueue[0].response_body
}

resource "kubectl_manifest" "kueue" {
  for_each = local.k8s_enabled ? data.kubectl_file_documents.kueue[0].manifests : {}

  yaml_body         = each.value
  server_side_apply = true
  force_conflicts   = true
  wait              = true
}

data "http" "jobset" {
  count = local.k8s_enabled ? 1 : 0
  url   = "https://github.com/kubernetes-sigs/jobset/releases/download/${var.jobset_version}/manifests.yaml"
}

data "kubectl_file_documents" "jobset" {
  count   = local.k8s_enabled ? 1 : 0
  content = data.http.jobset[0].response_body
}

resource "kubectl_manifest" "jobset" {
  for_each = local.k8s_enabled ? data.kubectl_file_documents.jobset[0].manifests : {}

  yaml_body         = each.value
  server_side_apply = true
  force_conflicts   = true
  wait              = true
}

# ---------------------------------------------------------------------------------------------
# retrain namespace objects with values only Terraform knows
# ---------------------------------------------------------------------------------------------

resource "kubernetes_namespace_v1" "retrain" {
  count = local.k8s_enabled && local.k8s_namespace != "default" ? 1 : 0

  metadata {
    name   = local.k8s_namespace
    labels = { "app.kubernetes.io/part-of" = "retrain" }
  }
}

# Workload Identity: the notifier pods act as the notifier GSA (publisher on the JobSet topic).
resource "kubernetes_service_account_v1" "notifier" {
  count = local.k8s_enabled ? 1 : 0

  metadata {
    name      = local.platform.notifier_ksa
    namespace = local.k8s_namespace
    labels    = { "app.kubernetes.io/part-of" = "retrain" }
    annotations = {
      "iam.gke.io/gcp-service-account" = local.sa.notifier
    }
  }

  automount_service_account_token = true # the notifier watches JobSets through the API server

  depends_on = [kubernetes_namespace_v1.retrain]
}

# Workload Identity: training pods act as the training GSA (objectAdmin on the artifacts bucket).
resource "kubernetes_service_account_v1" "training" {
  count = local.k8s_enabled ? 1 : 0

  metadata {
    name      = local.platform.training_ksa
    namespace = local.k8s_namespace
    labels    = { "app.kubernetes.io/part-of" = "retrain" }
    annotations = {
      "iam.gke.io/gcp-service-account" = local.sa.training
    }
  }

  automount_service_account_token = false # training never talks to the API server

  depends_on = [kubernetes_namespace_v1.retrain]
}

resource "kubernetes_config_map_v1" "settings" {
  count = local.k8s_enabled ? 1 : 0

  metadata {
    name      = var.settings_config_map
    namespace = local.k8s_namespace
    labels    = { "app.kubernetes.io/part-of" = "retrain" }
  }

  data = local.retrain_env

  depends_on = [kubernetes_namespace_v1.retrain]
}

# ---------------------------------------------------------------------------------------------
# k8s/ manifests (ResourceFlavor, ClusterQueue, AdmissionCheck + ProvisioningRequestConfig,
# LocalQueue, the notifier Deployment and its RBAC, ...), applied after the CRDs exist.
# ---------------------------------------------------------------------------------------------

data "kubectl_file_documents" "retrain" {
  for_each = local.k8s_files
  content  = file("${local.k8s_dir}/${each.value}")
}

resource "kubectl_manifest" "retrain" {
  for_each = merge([
    for f, docs in data.kubectl_file_documents.retrain : {
      for id, body in docs.manifests : "${f}:${id}" => body
    }
  ]...)

  yaml_body         = each.value
  server_side_apply = true
  wait              = true

  depends_on = [
    kubectl_manifest.kueue,
    kubectl_manifest.jobset,
    kubernetes_service_account_v1.notifier,
    kubernetes_service_account_v1.training,
    kubernetes_config_map_v1.settings,
  ]
}
