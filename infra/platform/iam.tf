# One service account per component, each holding only the roles it needs. Grants are made on the
# narrowest resource that IAM supports (bucket, topic, repository, service account); only roles
# that exist solely at project level (Firestore, Dataflow, GKE, Eventarc, logging, Workflows
# invocation) are granted on the project. No primitive role, no default compute account.
# tests/infra/test_terraform.py holds the expected table and fails on any drift.

# ---------------------------------------------------------------------------------------------
# Service accounts
# ---------------------------------------------------------------------------------------------

resource "google_service_account" "gke_nodes" {
  project      = var.project_id
  account_id   = "${var.name_prefix}-gke-nodes"
  display_name = "retrain GKE nodes"
  description  = "Node identity of both GKE node pools (logs, metrics, image pulls). Pods use Workload Identity, not this account."
}

resource "google_service_account" "functions" {
  project      = var.project_id
  account_id   = "${var.name_prefix}-functions"
  display_name = "retrain Cloud Functions"
  description  = "Runtime identity of the retrain Cloud Functions: records batches in Firestore and starts workflow executions."
}

resource "google_service_account" "events" {
  project      = var.project_id
  account_id   = "${var.name_prefix}-events"
  display_name = "retrain event delivery"
  description  = "Identity Eventarc triggers (GCS finalize, BigQuery audit log) and the JobSet push subscription invoke functions with."
}

resource "google_service_account" "scheduler" {
  project      = var.project_id
  account_id   = "${var.name_prefix}-scheduler"
  display_name = "retrain scheduler ticks"
  description  = "Identity the Scheduler-ticks push subscription invokes on_scheduler_tick with."
}

resource "google_service_account" "workflow" {
  project      = var.project_id
  account_id   = "${var.name_prefix}-workflow"
  display_name = "retrain workflow"
  description  = "Identity of the retrain Cloud Workflow: launches Dataflow, sizes the DWS pool, creates ProvisioningRequests and JobSets."
}

resource "google_service_account" "dataflow" {
  project      = var.project_id
  account_id   = "${var.name_prefix}-dataflow"
  display_name = "retrain Dataflow workers"
  description  = "Worker identity of the tokenization flex-template jobs."
}

resource "google_service_account" "notifier" {
  project      = var.project_id
  account_id   = "${var.name_prefix}-notifier"
  display_name = "retrain JobSet notifier"
  description  = "Workload Identity of the in-cluster notifier that publishes JobSet terminal states."
}

resource "google_service_account" "builder" {
  project      = var.project_id
  account_id   = "${var.name_prefix}-builder"
  display_name = "retrain function builds"
  description  = "Cloud Build identity that builds the Cloud Functions (instead of the default compute account)."
}

# ---------------------------------------------------------------------------------------------
# GKE nodes
# ---------------------------------------------------------------------------------------------

resource "google_project_iam_member" "gke_nodes_default_node_sa" {
  project = var.project_id
  role    = "roles/container.defaultNodeServiceAccount"
  member  = "serviceAccount:${google_service_account.gke_nodes.email}"
}

resource "google_artifact_registry_repository_iam_member" "gke_nodes_reader" {
  project    = var.project_id
  location   = google_artifact_registry_repository.retrain.location
  repository = google_artifact_registry_repository.retrain.name
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${google_service_account.gke_nodes.email}"
}

# ---------------------------------------------------------------------------------------------
# Cloud Functions runtime
# ---------------------------------------------------------------------------------------------

resource "google_project_iam_member" "functions_datastore_user" {
  project = var.project_id
  role    = "roles/datastore.user"
  member  = "serviceAccount:${google_service_account.functions.email}"
}

# Workflows has no per-workflow IAM policy; the project holds only the retrain workflow.
resource "google_project_iam_member" "functions_workflows_invoker" {
  project = var.project_id
  role    = "roles/workflows.invoker"
  member  = "serviceAccount:${google_service_account.functions.email}"
}

# The reaper (the Scheduler's "reaper" job, in on_scheduler_tick) reaches the Kubernetes API through the
# cluster's DNS-based endpoint, which authorizes callers by the IAM permission container.clusters.connect
# (cloud.google.com/kubernetes-engine/docs/concepts/network-isolation); what it may then do inside the
# cluster is Kubernetes RBAC's (k8s/reaper.yaml). container.developer would add every Kubernetes verb.
resource "google_project_iam_custom_role" "cluster_connect" {
  project     = var.project_id
  role_id     = "retrainClusterConnect"
  title       = "retrain cluster connect"
  description = "Reach the GKE control plane through its DNS endpoint; Kubernetes RBAC decides the rest."
  permissions = ["container.clusters.connect", "container.clusters.get"]
}

resource "google_project_iam_member" "functions_cluster_connect" {
  project = var.project_id
  role    = google_project_iam_custom_role.cluster_connect.name
  member  = "serviceAccount:${google_service_account.functions.email}"
}

# A run's OpenLineage events, reported by its finish step (retrain.adapters.lineage): "Requires the
# following IAM permission on the parent resource: datalineage.locations.processOpenLineageMessage"
# (cloud.google.com/dataplex/docs/reference/data-lineage/rest/v1/projects.locations/processOpenLineageRunEvent),
# and nothing else of Data Lineage.
resource "google_project_iam_custom_role" "lineage_producer" {
  project     = var.project_id
  role_id     = "retrainLineageProducer"
  title       = "retrain lineage producer"
  description = "Report OpenLineage run events to Data Lineage (ProcessOpenLineageRunEvent), nothing more."
  permissions = ["datalineage.locations.processOpenLineageMessage"]
}

resource "google_project_iam_member" "functions_lineage_producer" {
  project = var.project_id
  role    = google_project_iam_custom_role.lineage_producer.name
  member  = "serviceAccount:${google_service_account.functions.email}"
}

# The functions publish the run events they cause: a run queued by a seal, refused, its execution lost,
# its checkpoint promoted.
resource "google_pubsub_topic_iam_member" "functions_run_events_publisher" {
  project = var.project_id
  topic   = google_pubsub_topic.run_events.name
  role    = "roles/pubsub.publisher"
  member  = "serviceAccount:${google_service_account.functions.email}"
}

resource "google_storage_bucket_iam_member" "functions_landing_viewer" {
  bucket = google_storage_bucket.landing.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.functions.email}"
}

# Run folders (runs/): the functions write a run's manifest there (rewritten when a sweeper restarts a
# half-started run) and run_step's results step lists what the trainer wrote under runs/RUN/. Listing is
# checked on the bucket or a managed folder, never through a condition on the object name ("Since the
# storage.objects.list permission is granted at the bucket level, you cannot use the resource.name
# condition attribute to restrict object listing access", cloud.google.com/storage/docs/access-control/
# iam; "you can grant roles/storage.objectViewer on the managed folder that contains the objects you
# want to view instead of the bucket", cloud.google.com/storage/docs/listing-objects): so the grant is
# on the runs/ managed folder.
resource "google_storage_managed_folder_iam_member" "functions_runs" {
  bucket         = google_storage_managed_folder.runs.bucket
  managed_folder = google_storage_managed_folder.runs.name
  role           = "roles/storage.objectUser"
  member         = "serviceAccount:${google_service_account.functions.email}"
}

# The shard cache (shards/): run_step's handover reads the packs' member lists (`_pack.json`, which only
# the tokenize job writes) to refuse a held-out eval set that shares a shard with the blend. Read only; the
# functions already read the landing bucket these shards are tokenized from.
resource "google_storage_managed_folder_iam_member" "functions_shards_viewer" {
  bucket         = google_storage_managed_folder.shards.bucket
  managed_folder = google_storage_managed_folder.shards.name
  role           = "roles/storage.objectViewer"
  member         = "serviceAccount:${google_service_account.functions.email}"
}

# A watched table's new rows: the functions' EXPORT DATA jobs write them with the functions' own
# credentials (storage.objects.create, and .delete: "Export table data to Cloud Storage",
# cloud.google.com/bigquery/docs/exporting-data), and the functions list what a job wrote and delete
# what a failed one left. Listing needs the managed folder ("you can grant roles/storage.objectViewer
# on the managed folder that contains the objects", cloud.google.com/storage/docs/listing-objects).
resource "google_storage_managed_folder_iam_member" "functions_bigquery_exports" {
  bucket         = google_storage_managed_folder.bigquery.bucket
  managed_folder = google_storage_managed_folder.bigquery.name
  role           = "roles/storage.objectUser"
  member         = "serviceAccount:${google_service_account.functions.email}"
}

# Query jobs that read a watched table's new rows (jobs.create exists only at project level; which
# tables may be read is granted per table, in the app stage).
resource "google_project_iam_member" "functions_bigquery_job_user" {
  project = var.project_id
  role    = "roles/bigquery.jobUser"
  member  = "serviceAccount:${google_service_account.functions.email}"
}

# ---------------------------------------------------------------------------------------------
# Event delivery (Eventarc + JobSet push subscription); run.invoker on the functions is in app/
# ---------------------------------------------------------------------------------------------

resource "google_project_iam_member" "events_event_receiver" {
  project = var.project_id
  role    = "roles/eventarc.eventReceiver"
  member  = "serviceAccount:${google_service_account.events.email}"
}

# ---------------------------------------------------------------------------------------------
# Workflow
# ---------------------------------------------------------------------------------------------

resource "google_project_iam_member" "workflow_dataflow_developer" {
  #checkov:skip=CKV_GCP_49:Creating and watching the tokenization jobs needs dataflow.developer (project-level only). Running them as a service account is granted separately, on the Dataflow worker account alone (workflow_acts_as_dataflow).
  project = var.project_id
  role    = "roles/dataflow.developer"
  member  = "serviceAccount:${google_service_account.workflow.email}"
}

# Kubernetes API connector (gke.request): ProvisioningRequests, pod templates and JobSets in the
# retrain namespace, and the GPU pool's nodes. Google's connector page grants roles/container.developer
# (every Kubernetes verb in every namespace) and adds that Kubernetes RBAC gives "fine-grained
# permissions for every object and operation within your cluster" (cloud.google.com/workflows/docs/
# access-kubernetes-api). GKE needs only container.clusters.get to authenticate a caller, which "does
# not authorize them to perform any actions inside those clusters. Authorization can then be provided by
# IAM or Kubernetes RBAC" (cloud.google.com/kubernetes-engine/docs/role-based-access-control, its zh-CN
# rendering translated); .connect lets it through the DNS-based endpoint. What it may do inside is
# k8s/workflow.yaml's RBAC.
resource "google_project_iam_member" "workflow_cluster_connect" {
  project = var.project_id
  role    = google_project_iam_custom_role.cluster_connect.name
  member  = "serviceAccount:${google_service_account.workflow.email}"
}

# When a run ends the workflow publishes a sweeper tick, so the dataset's pending run starts at once.
resource "google_pubsub_topic_iam_member" "workflow_ticks_publisher" {
  project = var.project_id
  topic   = google_pubsub_topic.scheduler_ticks.name
  role    = "roles/pubsub.publisher"
  member  = "serviceAccount:${google_service_account.workflow.email}"
}

# The workflow publishes a run's state changes (tokenizing ... released, its outcome) as run events.
resource "google_pubsub_topic_iam_member" "workflow_run_events_publisher" {
  project = var.project_id
  topic   = google_pubsub_topic.run_events.name
  role    = "roles/pubsub.publisher"
  member  = "serviceAccount:${google_service_account.workflow.email}"
}

resource "google_project_iam_member" "workflow_datastore_user" {
  project = var.project_id
  role    = "roles/datastore.user"
  member  = "serviceAccount:${google_service_account.workflow.email}"
}

resource "google_project_iam_member" "workflow_log_writer" {
  project = var.project_id
  role    = "roles/logging.logWriter"
  member  = "serviceAccount:${google_service_account.workflow.email}"
}

# Launch Dataflow jobs that run as the Dataflow worker account, and no other account.
resource "google_service_account_iam_member" "workflow_acts_as_dataflow" {
  service_account_id = google_service_account.dataflow.name
  role               = "roles/iam.serviceAccountUser"
  member             = "serviceAccount:${google_service_account.workflow.email}"
}

# A run's own write grant (see "Training workload" below): the workflow creates the managed folder
# runs/RUN/ ("storage.managedfolders.create"), sets its policy ("storage.managedfolders.setIamPolicy"),
# and deletes it at release ("storage.managedfolders.delete ... To use allowNonEmpty, the user must also
# have the storage.managedFolders.setIamPolicy permission"; cloud.google.com/storage/docs/json_api/v1/
# managedFolder/insert, /setIamPolicy, /delete). Google's Storage Folder Admin would add get, list and
# getIamPolicy; this role holds exactly what the calls need. On the bucket, conditioned on the folders
# nested in runs/ and never runs/ itself, whose policy Terraform owns.
resource "google_project_iam_custom_role" "run_folders" {
  project     = var.project_id
  role_id     = "retrainRunFolders"
  title       = "retrain run folders"
  description = "Create a run's managed folder, set its policy, delete it: nothing else of Cloud Storage."
  permissions = [
    "storage.managedFolders.create",
    "storage.managedFolders.delete",
    "storage.managedFolders.setIamPolicy",
  ]
}

resource "google_storage_bucket_iam_member" "workflow_run_folders" {
  bucket = google_storage_bucket.artifacts.name
  role   = google_project_iam_custom_role.run_folders.name
  member = "serviceAccount:${google_service_account.workflow.email}"

  condition {
    title       = "a run's folder under runs/"
    description = "Managed folders nested in runs/, never runs/ itself."
    expression  = "resource.name.startsWith(\"projects/_/buckets/${google_storage_bucket.artifacts.name}/managedFolders/runs/\") && resource.name != \"projects/_/buckets/${google_storage_bucket.artifacts.name}/managedFolders/runs/\""
  }
}

resource "google_storage_bucket_iam_member" "workflow_artifacts_viewer" {
  bucket = google_storage_bucket.artifacts.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.workflow.email}"
}

# ---------------------------------------------------------------------------------------------
# Dataflow workers
# ---------------------------------------------------------------------------------------------

resource "google_project_iam_member" "dataflow_worker" {
  project = var.project_id
  role    = "roles/dataflow.worker"
  member  = "serviceAccount:${google_service_account.dataflow.email}"
}

resource "google_storage_bucket_iam_member" "dataflow_landing_viewer" {
  bucket = google_storage_bucket.landing.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.dataflow.email}"
}

# Reads anything in the bucket (the shard cache, its template); writes only its managed folders: shards/,
# the run's tokenize report under runs/, and staging/temp files under dataflow/ that the job deletes again.
resource "google_storage_bucket_iam_member" "dataflow_artifacts_viewer" {
  bucket = google_storage_bucket.artifacts.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.dataflow.email}"
}

resource "google_storage_managed_folder_iam_member" "dataflow_shards_admin" {
  bucket         = google_storage_managed_folder.shards.bucket
  managed_folder = google_storage_managed_folder.shards.name
  role           = "roles/storage.objectAdmin"
  member         = "serviceAccount:${google_service_account.dataflow.email}"
}

resource "google_storage_managed_folder_iam_member" "dataflow_runs_admin" {
  bucket         = google_storage_managed_folder.runs.bucket
  managed_folder = google_storage_managed_folder.runs.name
  role           = "roles/storage.objectAdmin"
  member         = "serviceAccount:${google_service_account.dataflow.email}"
}

resource "google_storage_managed_folder_iam_member" "dataflow_temp_admin" {
  bucket         = google_storage_managed_folder.dataflow.bucket
  managed_folder = google_storage_managed_folder.dataflow.name
  role           = "roles/storage.objectAdmin"
  member         = "serviceAccount:${google_service_account.dataflow.email}"
}

# The flex-template launcher VM pulls the template image as the worker account.
resource "google_artifact_registry_repository_iam_member" "dataflow_reader" {
  project    = var.project_id
  location   = google_artifact_registry_repository.retrain.location
  repository = google_artifact_registry_repository.retrain.name
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${google_service_account.dataflow.email}"
}

# ---------------------------------------------------------------------------------------------
# JobSet notifier (Workload Identity)
# ---------------------------------------------------------------------------------------------

resource "google_pubsub_topic_iam_member" "notifier_publisher" {
  project = var.project_id
  topic   = google_pubsub_topic.jobset_events.name
  role    = "roles/pubsub.publisher"
  member  = "serviceAccount:${google_service_account.notifier.email}"
}

resource "google_service_account_iam_member" "notifier_workload_identity" {
  service_account_id = google_service_account.notifier.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${local.workload_pool}[${var.k8s_namespace}/${var.notifier_ksa}]"

  depends_on = [google_container_cluster.retrain] # the identity pool exists once the cluster does
}

# ---------------------------------------------------------------------------------------------
# Training workload (Workload Identity)
# ---------------------------------------------------------------------------------------------

# Each run's pods run as a Kubernetes service account of their own (retrain.k8s.render.render_run_account),
# which maps to no Google service account: Google knows them by their own principal (Workload Identity
# Federation for GKE, "principal://.../subject/ns/NAMESPACE/sa/KSA", cloud.google.com/iam/docs/
# principal-identifiers). Cloud Storage takes these principals ("Identity federation with all Cloud
# Storage APIs is supported only for uniform bucket-level access buckets", cloud.google.com/iam/docs/
# federated-identity-supported-services), and so does the Cloud Storage FUSE CSI driver ("With the new
# Workload Identity Federation for GKE feature, these steps [GSA creation and KSA configuration] are no
# longer required", GoogleCloudPlatform/gcs-fuse-csi-driver docs/authentication.md).
#
# Reads: every pod of the namespace ("All GKE Pods in a Kubernetes namespace": principalSet://...
# /namespace/NAMESPACE) may read the artifacts bucket: the shards, the tokenizer files and the champion
# checkpoint a run continues from (Cloud Storage FUSE lists, so bucket-level read). The namespace holds
# retrain's pods only; the notifier, which calls as its Google service account, could also read the bucket
# as its own principal: a read of what the runs train on, nothing it could change.
resource "google_storage_bucket_iam_member" "training_artifacts_viewer" {
  bucket = google_storage_bucket.artifacts.name
  role   = "roles/storage.objectViewer"
  member = "principalSet://iam.googleapis.com/projects/${data.google_project.this.number}/locations/global/workloadIdentityPools/${local.workload_pool}/namespace/${var.k8s_namespace}"
}

# Writes: nothing here. The workflow grants each run's principal roles/storage.objectAdmin on the run's
# own managed folder, runs/RUN/, and deletes that folder (its policy with it) at release, so a run's pods
# write their checkpoints and events there and can touch no other run's files, manifest or champion.

# ---------------------------------------------------------------------------------------------
# Function builds
# ---------------------------------------------------------------------------------------------

resource "google_project_iam_member" "builder_log_writer" {
  project = var.project_id
  role    = "roles/logging.logWriter"
  member  = "serviceAccount:${google_service_account.builder.email}"
}

resource "google_artifact_registry_repository_iam_member" "builder_writer" {
  project    = var.project_id
  location   = google_artifact_registry_repository.retrain.location
  repository = google_artifact_registry_repository.retrain.name
  role       = "roles/artifactregistry.writer"
  member     = "serviceAccount:${google_service_account.builder.email}"
}

resource "google_storage_bucket_iam_member" "builder_sources_viewer" {
  bucket = google_storage_bucket.function_sources.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.builder.email}"
}

# Cloud Functions (gen2) copies the uploaded source into its own gcf-v2-sources-NUMBER-REGION bucket
# and the build reads it from there as the build service account; without this grant a custom build
# account fails with a storage 403 (hashicorp/terraform-provider-google#20571). That bucket is created
# by Google on the first deployment, so the grant is on the project, conditioned on that bucket alone.
resource "google_project_iam_member" "builder_gcf_sources_viewer" {
  project = var.project_id
  role    = "roles/storage.objectViewer"
  member  = "serviceAccount:${google_service_account.builder.email}"

  condition {
    title       = "gcf-v2-sources bucket only"
    description = "The bucket Cloud Functions copies function sources into, in this region."
    expression  = "resource.name.startsWith(\"projects/_/buckets/gcf-v2-sources-${data.google_project.this.number}-${var.region}\")"
  }
}

# ---------------------------------------------------------------------------------------------
# Google-managed service agents
# ---------------------------------------------------------------------------------------------

# Eventarc's Cloud Storage triggers need the project's GCS service agent to publish to Pub/Sub.
data "google_storage_project_service_account" "gcs" {
  project = var.project_id
}

resource "google_project_iam_member" "gcs_agent_pubsub_publisher" {
  project = var.project_id
  role    = "roles/pubsub.publisher"
  member  = "serviceAccount:${data.google_storage_project_service_account.gcs.email_address}"
}

# The Pub/Sub service agent exists only once Google creates it (on first use of the API); granting
# roles to it before that fails. Asking for its identity creates it first.
resource "google_project_service_identity" "pubsub" {
  provider = google-beta
  project  = var.project_id
  service  = "pubsub.googleapis.com"
}

# Pub/Sub forwards undeliverable push messages to the dead-letter topic as its service agent
# (the subscriber grant on the source subscriptions is made in app/, next to them).
resource "google_pubsub_topic_iam_member" "pubsub_agent_dead_letter_publisher" {
  project = var.project_id
  topic   = google_pubsub_topic.dead_letter.name
  role    = "roles/pubsub.publisher"
  member  = local.pubsub_service_agent
}

# Pub/Sub mints the OIDC tokens of authenticated push deliveries (needed on projects created
# before April 2021; harmless elsewhere). Scoped to the two push identities only.
resource "google_service_account_iam_member" "pubsub_agent_events_token_creator" {
  service_account_id = google_service_account.events.name
  role               = "roles/iam.serviceAccountTokenCreator"
  member             = local.pubsub_service_agent
}

resource "google_service_account_iam_member" "pubsub_agent_scheduler_token_creator" {
  service_account_id = google_service_account.scheduler.name
  role               = "roles/iam.serviceAccountTokenCreator"
  member             = local.pubsub_service_agent
}
