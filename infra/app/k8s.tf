# In-cluster pieces: the JobSet controller (its upstream release manifest), the retrain namespace, the
# RETRAIN_* ConfigMap, and the k8s/ templates rendered from this deployment's values into build/k8s by
# `retrain deploy` (retrain_ops.manifests: the notifier's service account with its Workload Identity
# annotation, the notifier, the reaper's and the workflow's RBAC; each run's own service account is the
# workflow's to create and delete). No Kueue: each
# run's workflow asks DWS for its capacity itself (README.md, "Capacity"). k8s/ itself is never
# applied: it holds templates and examples. Everything is gated by var.apply_kubernetes; with it off,
# infra/README.md ("Kubernetes step") gives the equivalent commands.

locals {
  k8s_enabled   = var.apply_kubernetes
  k8s_namespace = local.platform.k8s_namespace
  k8s_dir       = "${local.repo_root}/${var.k8s_manifests_dir}"
  k8s_files     = local.k8s_enabled ? fileset(local.k8s_dir, "*.yaml") : toset([])
}

# The rendered manifests must be this project's: `retrain deploy` renders them from this deployment's
# platform outputs and stamps the folder with the project. Anything else (none, or another project's
# left by an earlier render) stops the plan: applying it would replace or delete the RBAC, service
# accounts and notifier (a check block would only warn).
resource "terraform_data" "k8s_manifests_rendered" {
  count = local.k8s_enabled ? 1 : 0
  input = local.k8s_files

  lifecycle {
    precondition {
      condition     = length(local.k8s_files) > 0 && fileexists("${local.k8s_dir}/.rendered-for")
      error_message = "No rendered manifests in ${var.k8s_manifests_dir}: run `retrain deploy`, which renders k8s/ from this deployment's platform outputs before this stage."
    }
    precondition {
      condition     = !fileexists("${local.k8s_dir}/.rendered-for") || trimspace(file("${local.k8s_dir}/.rendered-for")) == var.project_id
      error_message = "The manifests in ${var.k8s_manifests_dir} were rendered for another project: run `retrain deploy --project ${var.project_id}`, which renders them for this one."
    }
  }
}

# ---------------------------------------------------------------------------------------------
# The JobSet controller: its release manifest, checked against the sha256 infra/pins.json holds for it, and applied with every image they name by tag rewritten to tag@digest from the same
# lock (retrain_ops.pins; `retrain pin` fills it). A document still naming an image by tag alone is refused.
# ---------------------------------------------------------------------------------------------

locals {
  controller_manifests = {
    jobset = "https://github.com/kubernetes-sigs/jobset/releases/download/${var.jobset_version}/manifests.yaml"
  }
  # An `image:` line naming its image by tag alone: (indent and key)(reference)(closing quote).
  tag_only_image = "(?m)^(\\s*-?\\s*image:\\s*\"?)([^\"@\\s]+)(\"?\\s*)$"
  # Every fetched document with each such line's reference replaced by its pin (unchanged when the lock
  # has no digest for it, which the resources' preconditions then refuse).
  fetched_documents = {
    jobset = local.k8s_enabled ? data.kubectl_file_documents.jobset[0].manifests : {}
    tcpx = merge([
      for name, docs in data.kubectl_file_documents.tcpx : { for id, body in docs.manifests : "${name}:${id}" => body }
    ]...)
  }
  pinned_documents = {
    for source, docs in local.fetched_documents : source => {
      for id, body in docs : id => join("\n", [
        for line in split("\n", body) : (
          can(regex(local.tag_only_image, line))
          ? replace(line, regex(local.tag_only_image, line)[1], lookup(local.pinned_image, regex(local.tag_only_image, line)[1], regex(local.tag_only_image, line)[1]))
          : line
        )
      ])
    }
  }
}

data "http" "jobset" {
  count = local.k8s_enabled ? 1 : 0
  url   = local.controller_manifests.jobset

  lifecycle {
    postcondition {
      condition     = sha256(self.response_body) == lookup(local.pins.files, self.url, "unpinned")
      error_message = lookup(local.pins.files, self.url, null) == null ? "${self.url} is not pinned in infra/pins.json yet: run `retrain pin` (a version the lock does not list: `retrain pin --add ${self.url}`)." : "${self.url} is not the file infra/pins.json pins (sha256 ${sha256(self.response_body)}): it changed upstream; review it, then `retrain pin --update`."
    }
  }
}

data "kubectl_file_documents" "jobset" {
  count   = local.k8s_enabled ? 1 : 0
  content = data.http.jobset[0].response_body
}

resource "kubectl_manifest" "jobset" {
  for_each = local.pinned_documents.jobset

  yaml_body         = each.value
  server_side_apply = true
  force_conflicts   = true
  wait              = true

  lifecycle {
    precondition {
      condition     = length(regexall(local.tag_only_image, each.value)) == 0
      error_message = "Images of the JobSet manifest not pinned by digest: ${join(", ", [for m in regexall(local.tag_only_image, each.value) : m[1]])}. Run `retrain pin` (`retrain pin --add IMAGE` for one infra/pins.json does not list)."
    }
  }
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
# The rendered manifests (build/k8s), applied after the CRDs and the ConfigMap exist.
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

  lifecycle {
    precondition {
      condition     = length(regexall(local.tag_only_image, each.value)) == 0
      error_message = "An image of ${each.key} is not pinned by digest: ${join(", ", [for m in regexall(local.tag_only_image, each.value) : m[1]])}. `retrain deploy` builds this project's images and renders them by digest."
    }
  }

  depends_on = [
    terraform_data.k8s_manifests_rendered,
    kubectl_manifest.jobset,
    kubernetes_config_map_v1.settings,
  ]
}

# ---------------------------------------------------------------------------------------------
# GPUDirect-TCPX node software, when the platform builds it: the NCCL GPUDirect-TCPX plugin installer
# (puts NCCL and the plugin v3.1.9 into the nodes' /home/kubernetes/bin/nvidia/lib64) and the NRI device
# injector (gives the RxDM sidecar its GPUs), from GoogleCloudPlatform/container-engine-accelerators,
# pinned to one commit and checked against the SHA-256 of what that commit holds: a changed file stops
# the apply instead of reaching the cluster. (The networks they serve are k8s/tcpx.yaml.)
# ---------------------------------------------------------------------------------------------

locals {
  tcpx_enabled = local.k8s_enabled && local.platform.gpudirect_tcpx
  tcpx_commit  = "992db81257553607f1477945f1b3219632991829"
  tcpx_manifests = {
    nccl_tcpx_installer = {
      path   = "gpudirect-tcpx/nccl-tcpx-installer.yaml"
      sha256 = "8bbaeb56fccc3e42abcb09a3e56086ff813ed57721dd4c09aa7ac9894922d7b5"
    }
    nri_device_injector = {
      path   = "nri_device_injector/nri-device-injector.yaml"
      sha256 = "44b410770b9528737172b61f5ad64f0c53e469e5066ac471863caa0ef2965d18"
    }
  }
}

data "http" "tcpx" {
  for_each = local.tcpx_enabled ? local.tcpx_manifests : {}
  url      = "https://raw.githubusercontent.com/GoogleCloudPlatform/container-engine-accelerators/${local.tcpx_commit}/${each.value.path}"

  lifecycle {
    postcondition {
      condition     = sha256(self.response_body) == each.value.sha256
      error_message = "${each.value.path} at ${local.tcpx_commit} is not the file this deployment was reviewed against."
    }
  }
}

data "kubectl_file_documents" "tcpx" {
  for_each = data.http.tcpx
  content  = each.value.response_body
}

resource "kubectl_manifest" "tcpx" {
  for_each = local.pinned_documents.tcpx

  yaml_body         = each.value
  server_side_apply = true
  wait              = true

  lifecycle {
    precondition {
      condition     = length(regexall(local.tag_only_image, each.value)) == 0
      error_message = "Images of the GPUDirect-TCPX manifests not pinned by digest: ${join(", ", [for m in regexall(local.tag_only_image, each.value) : m[1]])}. Run `retrain pin` (`retrain pin --add IMAGE` for one infra/pins.json does not list)."
    }
  }
}
