"""Offline checks of the Terraform in infra/ (no providers, no cloud).

The Terraform is parsed with python-hcl2 and checked for what the deployment promises:
typed and described variables, least-privilege IAM (an exact table per service account), no
primitive roles, no default compute service account, no public members, internal-only functions
with a dedicated identity, and a DWS GPU pool that can reach zero nodes. `terraform fmt -check`
and checkov run when their binaries are installed.

Every check is a function returning a list of problems; the ``test_mutation_*`` tests feed it
deliberately broken copies of the real files so that a check that can no longer fail is noticed.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from retrain_ops import hcl  # python-hcl2's parse, kept across processes by content

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
STAGES = ("bootstrap", "platform", "app")
STAGE_FILES = ("versions.tf", "variables.tf", "outputs.tf")

PRIMITIVE_ROLES = {"roles/owner", "roles/editor", "roles/viewer"}
PUBLIC_MEMBERS = {"allUsers", "allAuthenticatedUsers"}
ENTRY_POINTS = {
    "on_object_finalized",
    "on_jobset_event",
    "on_bigquery_event",
    "on_scheduler_tick",
    "run_http",
    "run_step",
}

# Least privilege, one row per component service account: (role, where it is granted).
# "project" is a project-level grant; everything else names the one resource it is granted on.
# Any grant added, widened or moved in infra/ must be reflected here, on purpose.
EXPECTED_SA_ROLES: dict[str, set[tuple[str, str]]] = {
    "gke_nodes": {
        ("roles/container.defaultNodeServiceAccount", "project"),
        ("roles/artifactregistry.reader", "repository:retrain"),
    },
    "functions": {
        ("roles/datastore.user", "project"),
        ("roles/workflows.invoker", "project"),
        ("roles/storage.objectViewer", "bucket:landing"),
        ("roles/storage.objectUser", "managed_folder:runs"),  # manifests; results lists runs/RUN/
        ("roles/storage.objectUser", "managed_folder:bigquery"),  # its EXPORT DATA jobs' files
        ("roles/storage.objectViewer", "managed_folder:shards"),  # handover reads the packs' member lists
        ("roles/bigquery.jobUser", "project"),
        ("roles/bigquery.dataViewer", "table:var.bigquery_tables"),
        ("custom:cluster_connect", "project"),  # the reaper: the DNS endpoint; RBAC decides the rest
        ("roles/pubsub.publisher", "topic:run_events"),  # queued, refused, lost, promoted
        ("custom:lineage_producer", "project"),  # a run's OpenLineage events (ProcessOpenLineageRunEvent)
    },
    "events": {
        ("roles/eventarc.eventReceiver", "project"),
        ("roles/run.invoker", "function:on_object_finalized"),
        ("roles/run.invoker", "function:on_bigquery_event"),
        ("roles/run.invoker", "function:on_jobset_event"),
    },
    "scheduler": {
        ("roles/run.invoker", "function:on_scheduler_tick"),
    },
    "workflow": {
        ("roles/dataflow.developer", "project"),
        (
            "custom:cluster_connect",
            "project",
        ),  # the connector authenticates; k8s/workflow.yaml's RBAC decides
        ("roles/datastore.user", "project"),
        ("roles/logging.logWriter", "project"),
        ("roles/iam.serviceAccountUser", "service_account:dataflow"),
        ("roles/storage.objectViewer", "bucket:artifacts"),  # reads reports; the manifest is the function's
        ("roles/pubsub.publisher", "topic:scheduler_ticks"),  # a sweeper tick when a run ends
        ("roles/pubsub.publisher", "topic:run_events"),  # a run's state changes
        ("roles/run.invoker", "function:run_step"),  # its steps in Python (handover, results)
        # conditioned: the managed folders nested in runs/ (a run's own write grant), never runs/ itself
        ("custom:run_folders", "bucket:artifacts"),
    },
    "dataflow": {
        ("roles/dataflow.worker", "project"),
        ("roles/storage.objectViewer", "bucket:landing"),
        ("roles/storage.objectViewer", "bucket:artifacts"),
        ("roles/storage.objectAdmin", "managed_folder:shards"),
        ("roles/storage.objectAdmin", "managed_folder:runs"),  # the tokenize report
        ("roles/storage.objectAdmin", "managed_folder:dataflow"),  # staging and temp
        ("roles/artifactregistry.reader", "repository:retrain"),
    },
    "notifier": {
        ("roles/pubsub.publisher", "topic:jobset_events"),
    },
    "builder": {
        ("roles/logging.logWriter", "project"),
        ("roles/artifactregistry.writer", "repository:retrain"),
        ("roles/storage.objectViewer", "bucket:function_sources"),
        ("roles/storage.objectViewer", "project"),  # conditioned: the gcf-v2-sources bucket only
    },
}

# Grants to principals that are not retrain's own service accounts.
EXPECTED_OTHER_GRANTS: dict[str, set[tuple[str, str]]] = {
    "pubsub_service_agent": {
        ("roles/pubsub.publisher", "topic:dead_letter"),
        ("roles/iam.serviceAccountTokenCreator", "service_account:events"),
        ("roles/iam.serviceAccountTokenCreator", "service_account:scheduler"),
        ("roles/pubsub.subscriber", "subscription:jobset_events"),
        ("roles/pubsub.subscriber", "subscription:scheduler_ticks"),
    },
    "gcs_service_agent": {
        ("roles/pubsub.publisher", "project"),
    },
    "ksa:notifier_ksa": {
        ("roles/iam.workloadIdentityUser", "service_account:notifier"),
    },
    # every pod of retrain's namespace (a run's own service account: its shards, tokenizer, champion);
    # its writes are granted per run by the workflow, on runs/RUN/ alone
    "namespace:k8s_namespace": {
        ("roles/storage.objectViewer", "bucket:artifacts"),
    },
    "var.run_http_invokers": {
        ("roles/run.invoker", "function:run_http"),
    },
    "literal:group:cloud-storage-analytics@google.com": {
        ("roles/storage.objectCreator", "bucket:access_logs"),
        ("roles/storage.objectCreator", "bucket:state_access_logs"),
    },
}

EXPECTED_CUSTOM_ROLE_PERMISSIONS: dict[str, set[str]] = {
    "cluster_connect": {"container.clusters.connect", "container.clusters.get"},
    "lineage_producer": {"datalineage.locations.processOpenLineageMessage"},
    "run_folders": {
        "storage.managedFolders.create",
        "storage.managedFolders.delete",
        "storage.managedFolders.setIamPolicy",
    },
}

# For each IAM resource type: the attribute naming the resource the grant is made on.
SCOPE_ATTRIBUTE = {
    "google_project_iam_member": None,
    "google_storage_bucket_iam_member": "bucket",
    "google_pubsub_topic_iam_member": "topic",
    "google_pubsub_subscription_iam_member": "subscription",
    "google_service_account_iam_member": "service_account_id",
    "google_artifact_registry_repository_iam_member": "repository",
    "google_cloud_run_v2_service_iam_member": "name",
    "google_bigquery_table_iam_member": "table_id",
    "google_storage_managed_folder_iam_member": "managed_folder",
}
SCOPE_KIND = {
    "google_storage_bucket": "bucket",
    "google_pubsub_topic": "topic",
    "google_pubsub_subscription": "subscription",
    "google_service_account": "service_account",
    "google_artifact_registry_repository": "repository",
    "google_cloudfunctions2_function": "function",
    "google_storage_managed_folder": "managed_folder",
}


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------


def _unquote(value: Any) -> Any:
    """python-hcl2 >= 7 keeps the quotes of string literals and block labels; drop them."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def _clean(node: Any) -> Any:
    if isinstance(node, dict):
        return {_unquote(k): _clean(v) for k, v in node.items() if not str(k).startswith("__")}
    if isinstance(node, list):
        return [_clean(v) for v in node]
    return _unquote(node)


def parse_hcl(text: str) -> dict[str, Any]:
    """A fresh copy of the file's blocks: a mutation test parses again only the file it changed."""
    return copy.deepcopy(_parsed(text))


@functools.cache
def _parsed(text: str) -> dict[str, Any]:
    return _clean(hcl.parse(text))


@dataclass(frozen=True)
class Block:
    stage: str
    kind: str  # resource | data | variable | output
    type: str  # resource/data type; "" for variables and outputs
    name: str
    body: Mapping[str, Any]

    @property
    def address(self) -> str:
        return f"{self.stage}:{self.type + '.' if self.type else ''}{self.name}"


class Model:
    """All blocks of all stages, from {stage: {filename: text}}."""

    def __init__(self, sources: Mapping[str, Mapping[str, str]]):
        self.sources = sources
        self.blocks: list[Block] = []
        for stage, files in sources.items():
            for text in files.values():
                doc = parse_hcl(text)
                for kind in ("resource", "data"):
                    for entry in doc.get(kind, []):
                        for rtype, named in entry.items():
                            for name, body in named.items():
                                self.blocks.append(Block(stage, kind, rtype, name, body))
                for kind in ("variable", "output"):
                    for entry in doc.get(kind, []):
                        for name, body in entry.items():
                            self.blocks.append(Block(stage, kind, "", name, body))

    @classmethod
    def from_dir(cls, root: Path) -> Model:
        return cls(
            {
                stage: {p.name: p.read_text() for p in sorted((root / stage).glob("*.tf"))}
                for stage in STAGES
                if (root / stage).is_dir()
            }
        )

    def with_replacement(self, stage: str, filename: str, old: str, new: str) -> Model:
        """The model with ``old`` replaced by ``new`` once; a space in ``old`` matches any run of spaces
        (``terraform fmt`` aligns a block's ``=`` signs, so a new key can move them)."""
        text = self.sources[stage][filename]
        pattern = re.escape(old).replace("\\ ", " +")
        mutated, n = re.subn(pattern, lambda _: new, text, count=1)
        assert n == 1, f"mutation target not found in {stage}/{filename}: {old!r}"
        sources = {s: dict(f) for s, f in self.sources.items()}
        sources[stage][filename] = mutated
        return Model(sources)

    def of(self, kind: str, rtype: str | None = None) -> Iterator[Block]:
        return (b for b in self.blocks if b.kind == kind and (rtype is None or b.type == rtype))

    def variable_default(self, stage: str, name: str) -> Any:
        for b in self.of("variable"):
            if b.stage == stage and b.name == name:
                return b.body.get("default")
        raise KeyError(f"{stage}: no variable {name}")


def one(block_list: Any) -> Mapping[str, Any]:
    """A nested block (serialized as a one-element list) or {} when absent."""
    if isinstance(block_list, list):
        return block_list[0] if block_list else {}
    return block_list or {}


def resolve(model: Model, stage: str, value: Any) -> Any:
    """A literal, or the default of the single variable the expression is."""
    if isinstance(value, str):
        m = re.fullmatch(r"\$\{var\.(\w+)\}", value)
        if m:
            return model.variable_default(stage, m.group(1))
    return value


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    """(key, value) of every attribute at any depth."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield k, v
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.from_dir(INFRA)


# ---------------------------------------------------------------------------------------------
# IAM model
# ---------------------------------------------------------------------------------------------


def _member_key(member: str) -> str:
    m = re.fullmatch(r"serviceAccount:\$\{google_service_account\.(\w+)\.email\}", member)
    if m:
        return "sa:" + m.group(1)
    m = re.fullmatch(r"serviceAccount:\$\{local\.sa\.(\w+)\}", member)
    if m:
        return "sa:" + m.group(1)
    if "pubsub_service_agent" in member or "gcp-sa-pubsub" in member:
        return "pubsub_service_agent"
    if "google_storage_project_service_account" in member:
        return "gcs_service_agent"
    m = re.search(r"workload_pool.*/\$\{var\.(\w+)\}\]", member)
    if m:
        return "ksa:" + m.group(1)
    m = re.fullmatch(
        r"principalSet://iam\.googleapis\.com/.*/workloadIdentityPools/.*/namespace/\$\{var\.(\w+)\}", member
    )
    if m:
        return "namespace:" + m.group(1)
    if member == "${each.value}":
        return "each.value"
    return "literal:" + member


def _scope(rtype: str, body: Mapping[str, Any]) -> str:
    attr = SCOPE_ATTRIBUTE[rtype]
    if attr is None:
        return "project"
    for_each = re.fullmatch(r"\$\{var\.(\w+)\}", str(body.get("for_each", "")))
    if rtype == "google_bigquery_table_iam_member" and for_each:
        return f"table:var.{for_each.group(1)}"  # tables named by a variable: each one, nothing else
    ref = str(body.get(attr, ""))
    m = re.search(r"(google_\w+)\.(\w+)\.", ref)
    if not m or m.group(1) not in SCOPE_KIND:
        return f"unresolved:{ref}"
    return f"{SCOPE_KIND[m.group(1)]}:{m.group(2)}"


def _roles(block: Block) -> list[str]:
    role = str(block.body.get("role", ""))
    m = re.fullmatch(r"\$\{google_project_iam_custom_role\.(\w+)\.(name|id)\}", role)
    if m:
        return ["custom:" + m.group(1)]
    if role == "${each.value}":
        return re.findall(r'"(roles/[^"]+)"', str(block.body.get("for_each", ""))) or [
            f"unresolved:{block.body.get('for_each')}"
        ]
    return [role]


@dataclass(frozen=True)
class Grant:
    principal: str
    role: str
    scope: str
    address: str


def grants(model: Model) -> tuple[list[Grant], list[str]]:
    out: list[Grant] = []
    problems: list[str] = []
    for b in model.of("resource"):
        if not re.search(r"_iam_(member|binding|policy)$", b.type):
            continue
        if b.type not in SCOPE_ATTRIBUTE:
            problems.append(f"{b.address}: IAM resource type {b.type} is not understood by this test")
            continue
        key = _member_key(str(b.body.get("member", "")))
        if key == "each.value":
            key = "var." + re.sub(r"^\$\{toset\(var\.(\w+)\)\}$", r"\1", str(b.body.get("for_each", "")))
        for role in _roles(b):
            out.append(Grant(key, role, _scope(b.type, b.body), b.address))
    return out, problems


def grants_by_principal(model: Model) -> dict[str, set[tuple[str, str]]]:
    table: dict[str, set[tuple[str, str]]] = {}
    for g in grants(model)[0]:
        table.setdefault(g.principal, set()).add((g.role, g.scope))
    return table


# ---------------------------------------------------------------------------------------------
# Checks (each returns a list of problems)
# ---------------------------------------------------------------------------------------------


def check_stage_layout(model: Model) -> list[str]:
    problems = [f"infra/{s}/ is missing" for s in STAGES if s not in model.sources]
    for stage, files in model.sources.items():
        problems += [f"infra/{stage}/{f} is missing" for f in STAGE_FILES if f not in files]
    return problems


def check_variables_typed_and_described(model: Model) -> list[str]:
    problems = []
    for b in model.of("variable"):
        if not b.body.get("type"):
            problems.append(f"{b.address}: variable has no type")
        if not str(b.body.get("description", "")).strip():
            problems.append(f"{b.address}: variable has no description")
    return problems


def check_outputs_described(model: Model) -> list[str]:
    return [
        f"{b.address}: output has no description"
        for b in model.of("output")
        if not str(b.body.get("description", "")).strip()
    ]


def check_no_primitive_roles(model: Model) -> list[str]:
    problems = []
    for b in model.of("resource"):
        for key, value in walk(b.body):
            for role in PRIMITIVE_ROLES:
                if isinstance(value, str) and re.search(re.escape(role) + r"\b", value):
                    problems.append(f"{b.address}: primitive role {role} in {key}")
    for stage, files in model.sources.items():
        for name, text in files.items():
            for role in PRIMITIVE_ROLES:
                if f'"{role}"' in text:
                    problems.append(f"{stage}/{name}: primitive role {role}")
    return sorted(set(problems))


def check_no_public_members(model: Model) -> list[str]:
    problems = []
    for b in model.of("resource"):
        for key, value in walk(b.body):
            if key in ("member", "members"):
                for v in value if isinstance(value, list) else [value]:
                    if any(p in str(v) for p in PUBLIC_MEMBERS):
                        problems.append(f"{b.address}: public member {v}")
    for b in model.of("variable"):
        default = b.body.get("default")
        if any(p in json.dumps(default) for p in PUBLIC_MEMBERS):
            problems.append(f"{b.address}: default contains a public member")
    # run_http's invoker list must reject public members at plan time.
    invokers = [b for b in model.of("variable") if b.name == "run_http_invokers"]
    if not invokers:
        problems.append("app: variable run_http_invokers is missing")
    for b in invokers:
        conditions = json.dumps([v.get("condition") for v in b.body.get("validation", [])])
        if not all(p in conditions for p in PUBLIC_MEMBERS):
            problems.append(f"{b.address}: validation does not reject allUsers/allAuthenticatedUsers")
    return problems


#: The lock of every third-party image and fetched manifest (retrain_ops.pins).
PINS = json.loads((INFRA / "pins.json").read_text())
#: Settings the app stage passes whose values are third-party images, and the local pinning each.
PINNED_SETTINGS = {
    "RETRAIN_IMAGE": "local.training_image",
    "RETRAIN_BRIDGE_IMAGE": "local.bridge_training_image",
    "RETRAIN_TCPX_IMAGE": "local.tcpx_image",
}


def check_third_party_pinned(model: Model) -> list[str]:
    """Nothing third-party deploys unpinned: every image variable's default is an image of the lock (or
    empty: the project's own registry), the settings carry the pinned locals, the plan is refused while
    one of them has no digest, every fetched manifest is checked against its sha256 in the lock, and
    every document applied from one is refused while it names an image by tag alone."""
    problems = []
    for b in model.of("variable"):
        default = b.body.get("default")
        if b.name.endswith("_image") and default and default not in PINS["images"]:
            problems.append(f"{b.address}: default image {default} is not in infra/pins.json")
    app = "\n".join(model.sources.get("app", {}).values())
    for setting, pinned in PINNED_SETTINGS.items():
        if not re.search(rf"^\s*{setting}\s*=\s*{re.escape(pinned)}\s*$", app, re.M):
            problems.append(f"app: {setting} is not {pinned}")
    guards = [b for b in model.of("resource", "terraform_data") if b.name == "pinned_images"]
    if not guards or "local.unpinned_images" not in json.dumps(guards[0].body.get("lifecycle")):
        problems.append("app: no terraform_data.pinned_images precondition on local.unpinned_images")
    for b in model.of("data", "http"):
        pinned_sum = r"sha256\(self\.response_body\) == (lookup\(local\.pins\.files|each\.value\.sha256)"
        if not any(re.search(pinned_sum, c) for c in conditions(b, "postcondition")):
            problems.append(f"{b.address}: fetched without a sha256 postcondition")
    refuses_tags = "length(regexall(local.tag_only_image, each.value)) == 0"
    for b in model.of("resource", "kubectl_manifest"):
        if b.name == "retrain":
            continue  # the rendered k8s/ templates: the project's own images
        refused = any(refuses_tags in c for c in conditions(b, "precondition"))
        if "local.pinned_documents" not in json.dumps(b.body.get("for_each")) or not refused:
            problems.append(f"{b.address}: applied without pinning its images by digest")
    return problems


def conditions(block: Block, kind: str) -> list[str]:
    """The conditions of a block's lifecycle preconditions or postconditions, as text."""
    return [
        str(check.get("condition"))
        for lifecycle in block.body.get("lifecycle", [])
        for check in lifecycle.get(kind, [])
    ]


def check_no_default_compute_sa(model: Model) -> list[str]:
    problems = []
    for stage, files in model.sources.items():
        for name, text in files.items():
            if re.search(
                r"-compute@developer\.gserviceaccount\.com|google_compute_default_service_account", text
            ):
                problems.append(f"{stage}/{name}: refers to the default compute service account")
    sa_ref = re.compile(r"\$\{google_service_account\.\w+\.(email|id|name)\}|\$\{local\.sa(_id)?\.\w+\}")
    for b in model.of("resource", "google_container_cluster"):
        if not sa_ref.fullmatch(str(one(b.body.get("node_config")).get("service_account", ""))):
            problems.append(
                f"{b.address}: node_config (transient default pool) lacks a dedicated service_account"
            )
    for b in model.of("resource", "google_container_node_pool"):
        if not sa_ref.fullmatch(str(one(b.body.get("node_config")).get("service_account", ""))):
            problems.append(f"{b.address}: node pool lacks a dedicated service_account")
    for b in model.of("resource", "google_cloudfunctions2_function"):
        if not sa_ref.fullmatch(str(one(b.body.get("build_config")).get("service_account", ""))):
            problems.append(f"{b.address}: builds would run as the default (compute) build account")
    for b in model.of("resource", "google_workflows_workflow"):
        if not sa_ref.fullmatch(str(b.body.get("service_account", ""))):
            problems.append(f"{b.address}: workflow lacks a dedicated service_account")
    return problems


def check_functions(model: Model) -> list[str]:
    problems = []
    if list(model.of("resource", "google_cloudfunctions_function")):
        problems.append("gen1 google_cloudfunctions_function present; functions must be gen2")
    functions = list(model.of("resource", "google_cloudfunctions2_function"))
    entry_points = {str(one(b.body.get("build_config")).get("entry_point")) for b in functions}
    if entry_points != ENTRY_POINTS:
        problems.append(f"function entry points {sorted(entry_points)} != {sorted(ENTRY_POINTS)}")
    runtime_sas = {}
    for b in functions:
        service = one(b.body.get("service_config"))
        if service.get("ingress_settings") != "ALLOW_INTERNAL_ONLY":
            problems.append(f"{b.address}: ingress_settings is {service.get('ingress_settings')!r}")
        m = re.fullmatch(r"\$\{local\.sa\.(\w+)\}", str(service.get("service_account_email", "")))
        if not m:
            problems.append(f"{b.address}: no dedicated runtime service account")
            continue
        runtime_sas[b.name] = m.group(1)
        trigger = one(b.body.get("event_trigger"))
        if trigger and trigger.get("service_account_email") == service.get("service_account_email"):
            problems.append(f"{b.address}: trigger identity should not be the runtime identity")
    declared = {b.name for b in model.of("resource", "google_service_account")}
    for fn, sa in runtime_sas.items():
        if sa != "functions" or sa not in declared:
            problems.append(f"{fn}: runs as {sa!r}, expected the dedicated 'functions' account")
    # Only run.invoker grants on specific functions; never a function-level IAM binding to a
    # group that could be public, and no project-wide invoker role.
    for g in grants(model)[0]:
        if g.role in ("roles/run.invoker", "roles/cloudfunctions.invoker") and not g.scope.startswith(
            "function:"
        ):
            problems.append(f"{g.address}: {g.role} granted on {g.scope}, not on one function")
    return problems


def check_gpu_pool(model: Model) -> list[str]:
    pools = [
        b
        for b in model.of("resource", "google_container_node_pool")
        if one(b.body.get("queued_provisioning")).get("enabled") is True
    ]
    if len(pools) != 1:
        return [f"expected exactly one queued-provisioning node pool, found {len(pools)}"]
    b = pools[0]
    problems = []

    def expect(what: str, actual: Any, wanted: Any) -> None:
        if actual != wanted:
            problems.append(f"{b.address}: {what} is {actual!r}, expected {wanted!r}")

    autoscaling = one(b.body.get("autoscaling"))
    expect("autoscaling.total_min_node_count", autoscaling.get("total_min_node_count"), 0)
    if "min_node_count" in autoscaling and resolve(model, b.stage, autoscaling["min_node_count"]) != 0:
        problems.append(f"{b.address}: autoscaling.min_node_count keeps nodes alive")
    max_nodes = resolve(model, b.stage, autoscaling.get("total_max_node_count"))
    if not isinstance(max_nodes, int) or max_nodes < 1:
        problems.append(f"{b.address}: total_max_node_count {max_nodes!r} is not a positive bound")
    expect("autoscaling.location_policy", autoscaling.get("location_policy"), "ANY")
    expect("initial_node_count", b.body.get("initial_node_count"), 0)
    if "node_count" in b.body:
        problems.append(f"{b.address}: a fixed node_count fights the autoscaler")
    management = one(b.body.get("management"))
    expect("management.auto_repair", management.get("auto_repair"), False)
    expect("management.auto_upgrade", management.get("auto_upgrade"), False)
    node = one(b.body.get("node_config"))
    # GKE creates DWS pools with --flex-start beside --enable-queued-provisioning today
    # (cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest).
    expect("node_config.flex_start", node.get("flex_start"), True)
    expect(
        "reservation_affinity.consume_reservation_type",
        one(node.get("reservation_affinity")).get("consume_reservation_type"),
        "NO_RESERVATION",
    )
    machine = str(resolve(model, b.stage, node.get("machine_type")))
    if not machine.startswith("a3-"):
        problems.append(f"{b.address}: machine type {machine!r} is not an A3 machine")
    if not one(node.get("guest_accelerator")):
        problems.append(f"{b.address}: no guest_accelerator")
    taints = node.get("taint") or []
    if not any(t.get("key") == "nvidia.com/gpu" and t.get("effect") == "NO_SCHEDULE" for t in taints):
        problems.append(f"{b.address}: no nvidia.com/gpu NO_SCHEDULE taint")
    return problems


def check_sa_roles(model: Model) -> list[str]:
    problems = list(grants(model)[1])
    table = grants_by_principal(model)
    declared = {b.name for b in model.of("resource", "google_service_account")}
    if declared != set(EXPECTED_SA_ROLES):
        problems.append(f"service accounts {sorted(declared)} != expected {sorted(EXPECTED_SA_ROLES)}")
    for sa, expected in EXPECTED_SA_ROLES.items():
        actual = table.get("sa:" + sa, set())
        for extra in sorted(actual - expected):
            problems.append(f"{sa}: unexpected grant {extra}")
        for missing in sorted(expected - actual):
            problems.append(f"{sa}: missing grant {missing}")
    for principal, actual in sorted(table.items()):
        if principal.startswith("sa:"):
            if principal[3:] not in EXPECTED_SA_ROLES:
                problems.append(f"grant to unknown service account {principal}: {sorted(actual)}")
            continue
        expected = EXPECTED_OTHER_GRANTS.get(principal)
        if expected is None:
            problems.append(f"grant to unexpected principal {principal}: {sorted(actual)}")
        elif actual != expected:
            problems.append(f"{principal}: grants {sorted(actual)} != expected {sorted(expected)}")
    return problems


def _resource(model: Model, rtype: str, name: str) -> Block | None:
    return next((b for b in model.of("resource", rtype) if b.name == name), None)


# Who lists what: (service account, bucket, a prefix it lists objects under) and the code that lists.
# objects.list is checked on the bucket, or on a managed folder holding the prefix: a grant conditioned
# on resource.name never allows it (cloud.google.com/storage/docs/access-control/iam, "Since the
# storage.objects.list permission is granted at the bucket level ...").
LISTINGS = {
    ("sa:functions", "artifacts", "runs/RUN/"): "retrain/steps.py trainer_outputs (run_step's results)",
    ("sa:functions", "artifacts", "bigquery/"): "retrain/exports.py written_files (an export's files)",
    ("sa:functions", "landing", "incoming/"): "retrain/audit.py landed (the audit job)",
    ("sa:dataflow", "artifacts", "shards/_tmp/"): "retrain_tokenize/pipeline.py (temporary parts)",
    # a run's pods, by their namespace's principal set (their own write grant is the workflow's)
    ("namespace:k8s_namespace", "artifacts", "runs/RUN/"): "Cloud Storage FUSE (the trainer's run folder)",
}
LIST_ROLES = {
    "roles/storage.objectViewer",
    "roles/storage.objectUser",
    "roles/storage.objectAdmin",
    "roles/storage.admin",
}


def check_listings(model: Model) -> list[str]:
    """Every prefix a runtime account lists is listable by it: an unconditioned grant carrying
    storage.objects.list on the bucket, or on a managed folder whose path holds the prefix."""
    blocks = {b.address: b for b in model.of("resource")}
    folders = {}
    for b in model.of("resource", "google_storage_managed_folder"):
        bucket = re.search(r"google_storage_bucket\.(\w+)\.", str(b.body.get("bucket", "")))
        folders[b.name] = (bucket.group(1) if bucket else "?", str(b.body.get("name", "")))
    problems = []
    for (principal, bucket, prefix), lister in LISTINGS.items():
        granted = False
        for g in grants(model)[0]:
            if (
                g.principal != principal
                or g.role not in LIST_ROLES
                or blocks[g.address].body.get("condition")
            ):
                continue
            kind, _, name = g.scope.partition(":")
            on_folder = kind == "managed_folder" and name in folders and folders[name][0] == bucket
            if (kind == "bucket" and name == bucket) or (on_folder and prefix.startswith(folders[name][1])):
                granted = True
        if not granted:
            problems.append(
                f"{principal} lists gs://{bucket}/{prefix} ({lister}) without storage.objects.list there"
            )
    return problems


def check_app_applies_only_its_own_manifests_and_images(model: Model) -> list[str]:
    """The app stage plans nothing from build/k8s unless `retrain deploy` rendered it for this project
    (an error, not a check block's warning), and no image of this project's runs by a tag."""
    problems = []

    def conditions(block: Block | None) -> str:
        lifecycle = one(block.body.get("lifecycle")) if block is not None else {}
        return " ".join(str(p.get("condition")) for p in lifecycle.get("precondition") or [])

    gate = _resource(model, "terraform_data", "k8s_manifests_rendered")
    if "== var.project_id" not in conditions(gate):
        problems.append("infra/app does not refuse manifests rendered for another project (or none)")
    if [b for b in model.of("check") if b.name == "k8s_manifests_rendered"]:
        problems.append("k8s_manifests_rendered is a check block: it only warns")
    applied = _resource(model, "kubectl_manifest", "retrain")
    if "regexall(local.tag_only_image, each.value)" not in conditions(applied):
        problems.append("kubectl_manifest.retrain applies an image named by tag (the notifier's)")
    if applied is None or "terraform_data.k8s_manifests_rendered" not in str(applied.body.get("depends_on")):
        problems.append("kubectl_manifest.retrain does not wait for the render check")
    template = _resource(model, "google_storage_bucket_object", "tokenize_template")
    if "local.dataflow_image" not in conditions(template):
        problems.append("the tokenize template may name no image")
    return problems


def check_apply_readiness(model: Model) -> list[str]:
    """What makes a first `terraform apply` (or a later destroy) fail although `plan` passes."""
    problems = []
    # Cloud Functions gen2 builds read the source from Google's gcf-v2-sources bucket as the builder.
    gcf = [
        g
        for g in grants(model)[0]
        if g.principal == "sa:builder" and g.role == "roles/storage.objectViewer" and g.scope == "project"
    ]
    builder = [b for b in model.of("resource") if gcf and b.address in {g.address for g in gcf}]
    if not any("gcf-v2-sources-" in str(one(b.body.get("condition")).get("expression")) for b in builder):
        problems.append("the builder account cannot read the gcf-v2-sources bucket (provider issue #20571)")
    # Deletion protection of the workflow is a choice (provider 6.x defaults it to true).
    wf = _resource(model, "google_workflows_workflow", "retrain")
    if wf is None or wf.body.get("deletion_protection") != "${var.workflow_deletion_protection}":
        problems.append(
            "google_workflows_workflow.retrain: deletion_protection is not var.workflow_deletion_protection"
        )
    # Usage logs are written by Google's analytics group, into every bucket a bucket logs to.
    analytics = grants_by_principal(model).get("literal:group:cloud-storage-analytics@google.com", set())
    for b in model.of("resource", "google_storage_bucket"):
        sink = re.search(
            r"google_storage_bucket\.(\w+)\.", str(one(b.body.get("logging")).get("log_bucket", ""))
        )
        if sink and ("roles/storage.objectCreator", f"bucket:{sink.group(1)}") not in analytics:
            problems.append(
                f"{b.address} logs to {sink.group(1)}, where cloud-storage-analytics@google.com cannot write"
            )
    # The GKE version is looked up by prefix, never pinned.
    cluster = _resource(model, "google_container_cluster", "retrain")
    versions = [b for b in model.of("data", "google_container_engine_versions") if "version_prefix" in b.body]
    if (
        cluster is None
        or not versions
        or "google_container_engine_versions" not in str(cluster.body.get("min_master_version"))
    ):
        problems.append("the cluster's version is not taken from google_container_engine_versions by prefix")
    # ... a prefix that matches nothing stops the plan (the provider leaves the version empty), and the
    # default minor is one GKE supports with flex-start (1.32.2-gke.1652000 or later; 1.31 and 1.32 are
    # out of support since January and April 2026).
    if versions and "postcondition" not in str(versions[0].body.get("lifecycle")):
        problems.append("a kubernetes_version prefix GKE does not offer would not stop the plan")
    default = next(
        (v.body.get("default") for v in model.of("variable") if v.name == "kubernetes_version"), ""
    )
    if not re.fullmatch(r"1\.\d+", str(default)) or int(str(default).split(".")[1]) < 33:
        problems.append(f"kubernetes_version defaults to {default!r}, a minor out of GKE's support")
    pool = _resource(model, "google_container_node_pool", "gpu_dws")
    if pool is None or "flex_start_min_version" not in str(pool.body.get("lifecycle")):
        problems.append("the DWS pool does not refuse a GKE version below flex-start's 1.32.2-gke.1652000")
    # Node pools wait for their service account's roles.
    for pool in model.of("resource", "google_container_node_pool"):
        deps = str(pool.body.get("depends_on", ""))
        if "gke_nodes_default_node_sa" not in deps:
            problems.append(f"{pool.address}: does not wait for its service account's node role")
    # The Pub/Sub service agent is created before roles are granted to it.
    identity = [
        b
        for b in model.of("resource", "google_project_service_identity")
        if b.body.get("service") == "pubsub.googleapis.com"
    ]
    main = model.sources["platform"].get("main.tf", "")
    if not identity or "google_project_service_identity.pubsub" not in main:
        problems.append("the Pub/Sub service agent is granted roles without being created first")
    return problems


def check_no_authoritative_iam(model: Model) -> list[str]:
    return [
        f"{b.address}: authoritative IAM ({b.type}) can silently drop or hide bindings; use *_iam_member"
        for b in model.of("resource")
        if re.search(r"_iam_(binding|policy)$", b.type)
    ]


def check_custom_roles(model: Model) -> list[str]:
    problems = []
    roles = {b.name: b for b in model.of("resource", "google_project_iam_custom_role")}
    if set(roles) != set(EXPECTED_CUSTOM_ROLE_PERMISSIONS):
        problems.append(f"custom roles {sorted(roles)} != {sorted(EXPECTED_CUSTOM_ROLE_PERMISSIONS)}")
    for name, b in roles.items():
        perms = set(b.body.get("permissions", []))
        if perms != EXPECTED_CUSTOM_ROLE_PERMISSIONS.get(name):
            problems.append(f"{b.address}: permissions {sorted(perms)}")
    return problems


# ---------------------------------------------------------------------------------------------
# Tests on the real tree
# ---------------------------------------------------------------------------------------------


def test_readme_describes_stages() -> None:
    readme = (INFRA / "README.md").read_text()
    for stage in STAGES:
        assert f"infra/{stage}" in readme or f"`{stage}`" in readme, stage


def test_stage_layout(model: Model) -> None:
    assert check_stage_layout(model) == []


def test_every_variable_has_type_and_description(model: Model) -> None:
    assert len(list(model.of("variable"))) > 20
    assert check_variables_typed_and_described(model) == []


def test_every_output_has_description(model: Model) -> None:
    assert check_outputs_described(model) == []


def test_no_primitive_roles(model: Model) -> None:
    assert check_no_primitive_roles(model) == []


def test_no_public_members(model: Model) -> None:
    assert check_no_public_members(model) == []


def test_no_default_compute_service_account(model: Model) -> None:
    assert check_no_default_compute_sa(model) == []


def test_functions_internal_only_with_dedicated_identity(model: Model) -> None:
    assert check_functions(model) == []


def test_gpu_pool_is_dws_and_scales_to_zero(model: Model) -> None:
    assert check_gpu_pool(model) == []


def test_service_account_roles_are_exactly_least_privilege(model: Model) -> None:
    assert check_sa_roles(model) == []


def test_every_prefix_an_account_lists_is_listable_by_it(model: Model) -> None:
    assert check_listings(model) == []


def check_run_folders_scoped(model: Model) -> list[str]:
    """The workflow's grant to make each run's folder and set its policy reaches the folders nested in
    runs/ and never runs/ itself (whose policy Terraform owns: a setIamPolicy there would replace the
    functions' and the Dataflow account's grants, or grant anyone anything under runs/)."""
    found = [g for g in grants(model)[0] if g.principal == "sa:workflow" and g.role == "custom:run_folders"]
    blocks = {b.address: b for b in model.of("resource")}
    problems = []
    for g in found:
        expression = str(one(blocks[g.address].body.get("condition")).get("expression"))
        runs = '\\"projects/_/buckets/${google_storage_bucket.artifacts.name}/managedFolders/runs/\\"'
        nested, itself = f"resource.name.startsWith({runs})", f"resource.name != {runs}"
        if nested not in expression or f"&& {itself}" not in expression or "||" in expression:
            problems.append(
                f"{g.address}: not conditioned on the folders nested in runs/ alone: {expression}"
            )
    return problems or ([] if found else ["the workflow holds no grant to make a run's folder"])


def test_the_workflow_may_set_the_policy_of_run_folders_only(model: Model) -> None:
    assert check_run_folders_scoped(model) == []


def test_no_authoritative_iam(model: Model) -> None:
    assert check_no_authoritative_iam(model) == []


def test_first_apply_readiness(model: Model) -> None:
    assert check_apply_readiness(model) == []


def test_the_app_stage_applies_only_its_own_manifests_and_images_by_digest(model: Model) -> None:
    assert check_app_applies_only_its_own_manifests_and_images(model) == []


def test_custom_role_permissions(model: Model) -> None:
    assert check_custom_roles(model) == []


def test_every_setting_the_app_stage_passes_is_one_retrain_reads() -> None:
    """A RETRAIN_* name in app/main.tf's retrain_env that retrain.config does not know would be
    silently ignored by every function and job: a typo there must fail here."""
    from dataclasses import fields

    from retrain.config import Settings

    block = re.search(r"\n  retrain_env = \{\n(.*?)\n  \}\n", (INFRA / "app" / "main.tf").read_text(), re.S)
    assert block, "app/main.tf has no retrain_env local"
    passed = set(re.findall(r"^\s+(RETRAIN_\w+)\s+=", block.group(1), re.M))
    assert {"RETRAIN_BIGQUERY_TABLES", "RETRAIN_PROJECT"} <= passed
    assert passed - {"RETRAIN_" + f.name.upper() for f in fields(Settings)} == set()


def test_third_party_artifacts_are_pinned(model: Model) -> None:
    assert check_third_party_pinned(model) == []


def test_the_tag_only_image_pattern_finds_exactly_the_unpinned_image_lines(model: Model) -> None:
    """The app stage's pattern (RE2, read here as Terraform reads the HCL string) picks the reference out
    of an ``image:`` line naming a tag, and leaves digest-pinned lines and schema keys alone."""
    (literal,) = re.findall(r'tag_only_image = "(.+)"\n', model.sources["app"]["k8s.tf"])
    pattern = re.compile(literal.replace('\\"', '"').replace("\\\\", "\\"))
    manifest = "\n".join(
        [
            "      containers:",
            "      - image: registry.k8s.io/kueue/kueue:v0.10.2",
            '        - image: "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/nccl-plugin:v3.1.9"',
            '        - image: "gke.gcr.io/pause:3.8@sha256:' + "8" * 64 + '"',
            "                  image:",
            "                    description: Container image name.",
        ]
    )
    assert [m.group(2) for m in pattern.finditer(manifest)] == [
        "registry.k8s.io/kueue/kueue:v0.10.2",
        "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/nccl-plugin:v3.1.9",
    ]


def test_outputs_the_cli_reads(model: Model) -> None:
    outputs = {(b.stage, b.name) for b in model.of("output")}
    for wanted in [
        ("bootstrap", "state_bucket"),
        ("platform", "cluster_name"),
        ("platform", "gpu_node_pool"),
        ("platform", "landing_bucket"),
        ("platform", "artifacts_bucket"),
        ("platform", "jobset_topic"),
        ("platform", "service_accounts"),
        ("app", "retrain_env"),
        ("app", "workflow_name"),
        ("app", "function_uris"),
        ("app", "dataflow_template_path"),
    ]:
        assert wanted in outputs, wanted


# ---------------------------------------------------------------------------------------------
# The checks can fail: broken copies of the real files are caught
# ---------------------------------------------------------------------------------------------

MUTATIONS: list[tuple[str, Callable[[Model], list[str]], str, str, str, str]] = [
    (
        "the workflow may set the policy of runs/ itself",
        check_run_folders_scoped,
        "platform",
        "iam.tf",
        ' && resource.name != \\"projects/_/buckets/${google_storage_bucket.artifacts.name}'
        '/managedFolders/runs/\\""',
        '"',
    ),
    (
        "builder cannot read gcf-v2-sources",
        check_apply_readiness,
        "platform",
        "iam.tf",
        "gcf-v2-sources-${data",
        "fn-sources-${data",
    ),
    (
        "workflow deletion protection left to the provider",
        check_apply_readiness,
        "app",
        "workflow.tf",
        "  deletion_protection = var.workflow_deletion_protection\n",
        "",
    ),
    (
        "access logs not writable by the analytics group",
        check_apply_readiness,
        "platform",
        "storage.tf",
        'member = "group:cloud-storage-analytics@google.com"',
        'member = "group:someone-else@example.com"',
    ),
    (
        "the state bucket's access logs not writable by the analytics group",
        check_apply_readiness,
        "bootstrap",
        "main.tf",
        'member = "group:cloud-storage-analytics@google.com"',
        'member = "group:someone-else@example.com"',
    ),
    (
        "GKE version pinned",
        check_apply_readiness,
        "platform",
        "gke.tf",
        "min_master_version = data.google_container_engine_versions.gke.latest_master_version",
        "min_master_version = var.kubernetes_version",
    ),
    (
        "node pool does not wait for its roles",
        check_apply_readiness,
        "platform",
        "gke.tf",
        "  depends_on = [\n    google_project_iam_member.gke_nodes_default_node_sa,",
        "  depends_on = [\n",
    ),
    (
        "Pub/Sub agent granted before it exists",
        check_apply_readiness,
        "platform",
        "main.tf",
        '"serviceAccount:${google_project_service_identity.pubsub.email}"',
        '"serviceAccount:service-${data.google_project.this.number}@gcp-sa-pubsub.iam.gserviceaccount.com"',
    ),
    (
        "gpu pool min 1",
        check_gpu_pool,
        "platform",
        "gke.tf",
        "total_min_node_count = 0",
        "total_min_node_count = 1",
    ),
    (
        "the DWS pool without flex-start",
        check_gpu_pool,
        "platform",
        "gke.tf",
        "    flex_start      = true\n",
        "",
    ),
    (
        "a kubernetes_version default GKE no longer supports",
        check_apply_readiness,
        "platform",
        "variables.tf",
        'default     = "1.35"',
        'default     = "1.31"',
    ),
    (
        "a kubernetes_version prefix matching nothing goes unnoticed",
        check_apply_readiness,
        "platform",
        "gke.tf",
        "  lifecycle {\n    postcondition {\n      condition     = try(self.latest_master_version",
        "  lifecycle {\n    precondition {\n      condition     = try(self.latest_master_version",
    ),
    (
        "queued provisioning off",
        check_gpu_pool,
        "platform",
        "gke.tf",
        "queued_provisioning {\n    enabled = true",
        "queued_provisioning {\n    enabled = false",
    ),
    (
        "reservation consumed",
        check_gpu_pool,
        "platform",
        "gke.tf",
        '"NO_RESERVATION"',
        '"ANY_RESERVATION"',
    ),
    (
        "function ingress all",
        check_functions,
        "app",
        "functions.tf",
        '"ALLOW_INTERNAL_ONLY"',
        '"ALLOW_ALL"',
    ),
    (
        "function as default account",
        check_functions,
        "app",
        "functions.tf",
        "service_account_email          = local.sa.functions",
        'service_account_email          = "123-compute@developer.gserviceaccount.com"',
    ),
    (
        "public invoker",
        check_no_public_members,
        "app",
        "events.tf",
        'member   = "serviceAccount:${local.sa.scheduler}"',
        'member   = "allUsers"',
    ),
    (
        "primitive role",
        check_no_primitive_roles,
        "platform",
        "iam.tf",
        '"roles/datastore.user"',
        '"roles/editor"',
    ),
    (
        "widened role",
        check_sa_roles,
        "platform",
        "iam.tf",
        '"roles/storage.objectViewer"',
        '"roles/storage.objectAdmin"',
    ),
    (
        "bucket grant moved to project",
        check_sa_roles,
        "platform",
        "iam.tf",
        'resource "google_storage_bucket_iam_member" "training_artifacts_viewer" {\n'
        "  bucket = google_storage_bucket.artifacts.name",
        'resource "google_project_iam_member" "training_artifacts_viewer" {\n  project = var.project_id',
    ),
    (
        "runtime account given the whole artifacts bucket",
        check_sa_roles,
        "platform",
        "iam.tf",
        'resource "google_storage_managed_folder_iam_member" "dataflow_runs_admin" {\n'
        "  bucket         = google_storage_managed_folder.runs.bucket\n"
        "  managed_folder = google_storage_managed_folder.runs.name",
        'resource "google_storage_bucket_iam_member" "dataflow_runs_admin" {\n'
        "  bucket         = google_storage_bucket.artifacts.name",
    ),
    (
        "node pool on default account",
        check_no_default_compute_sa,
        "platform",
        "gke.tf",
        "    disk_size_gb    = 100\n    service_account = google_service_account.gke_nodes.email\n",
        "    disk_size_gb    = 100\n",
    ),
    (
        "undescribed variable",
        check_variables_typed_and_described,
        "platform",
        "variables.tf",
        '  description = "GKE cluster name (RETRAIN_CLUSTER)."\n',
        "",
    ),
    (
        "untyped variable",
        check_variables_typed_and_described,
        "app",
        "variables.tf",
        'variable "trainer_profile" {\n  type        = string\n',
        'variable "trainer_profile" {\n',
    ),
    (
        "a fetched manifest's checksum unchecked",
        check_third_party_pinned,
        "app",
        "k8s.tf",
        'condition     = sha256(self.response_body) == lookup(local.pins.files, self.url, "unpinned")',
        "condition     = self.status_code == 200",
    ),
    (
        "the training image by tag",
        check_third_party_pinned,
        "app",
        "main.tf",
        "RETRAIN_IMAGE = local.training_image",
        "RETRAIN_IMAGE = var.training_image",
    ),
    (
        "a default image outside the lock",
        check_third_party_pinned,
        "app",
        "variables.tf",
        'default     = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.12"',
        'default     = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.13"',
    ),
    (
        "a controller manifest applied by tag",
        check_third_party_pinned,
        "app",
        "k8s.tf",
        "  for_each = local.pinned_documents.jobset\n",
        "  for_each = local.fetched_documents.jobset\n",
    ),
    (
        "the results step's listing of runs/RUN/ granted through a condition on object names",
        check_listings,
        "platform",
        "iam.tf",
        'resource "google_storage_managed_folder_iam_member" "functions_runs" {\n'
        "  bucket         = google_storage_managed_folder.runs.bucket\n"
        "  managed_folder = google_storage_managed_folder.runs.name\n",
        'resource "google_storage_bucket_iam_member" "functions_runs" {\n'
        "  bucket = google_storage_bucket.artifacts.name\n"
        '  condition {\n    title = "runs"\n    description = "runs/ only"\n'
        '    expression = "resource.name.startsWith(\\"projects/_/buckets/x/objects/runs/\\")"\n  }\n',
    ),
    (
        "build/k8s of another project applied",
        check_app_applies_only_its_own_manifests_and_images,
        "app",
        "k8s.tf",
        'trimspace(file("${local.k8s_dir}/.rendered-for")) == var.project_id',
        "true",
    ),
    (
        "the notifier applied by tag",
        check_app_applies_only_its_own_manifests_and_images,
        "app",
        "k8s.tf",
        "condition     = length(regexall(local.tag_only_image, each.value)) == 0\n"
        '      error_message = "An image of ${each.key}',
        'condition     = true\n      error_message = "An image of ${each.key}',
    ),
    (
        "run_http invokers unvalidated",
        check_no_public_members,
        "app",
        "variables.tf",
        '!contains(["allUsers", "allAuthenticatedUsers"], m)',
        "true",
    ),
]


@pytest.mark.parametrize(
    ("label", "check", "stage", "filename", "old", "new"), MUTATIONS, ids=[m[0] for m in MUTATIONS]
)
def test_mutation_is_detected(
    model: Model,
    label: str,
    check: Callable[[Model], list[str]],
    stage: str,
    filename: str,
    old: str,
    new: str,
) -> None:
    assert check(model) == [], f"{label}: the unmodified tree must pass"
    broken = model.with_replacement(stage, filename, old, new)
    assert check(broken), f"{label}: the check did not notice the change"


# ---------------------------------------------------------------------------------------------
# Tools: terraform fmt and checkov (offline; skipped when not installed)
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_terraform_fmt_check() -> None:
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.skip("terraform binary not installed")
    result = subprocess.run(
        [terraform, "fmt", "-check", "-recursive", "-diff", str(INFRA)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _checkov_command() -> list[str] | None:
    explicit = os.environ.get("CHECKOV")
    if explicit:
        return [explicit]
    try:
        import checkov  # noqa: F401
    except ImportError:
        pass
    else:
        return [sys.executable, "-m", "checkov.main"]
    found = shutil.which("checkov")
    return [found] if found else None


@pytest.mark.integration
def test_checkov_has_no_unexplained_failures(tmp_path: Path) -> None:
    command = _checkov_command()
    if command is None:
        pytest.skip("checkov not installed (pip install checkov, or set CHECKOV=/path/to/checkov)")
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
    result = subprocess.run(
        [
            *command,
            "-d",
            str(INFRA),
            "--framework",
            "terraform",
            "--compact",
            "-o",
            "json",
            "--skip-download",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(
            f"checkov output is not JSON (rc={result.returncode}):\n"
            f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    reports = report if isinstance(report, list) else [report]
    summary = {"passed": 0, "failed": 0, "skipped": 0}
    failed: list[str] = []
    skipped: list[dict[str, Any]] = []
    for r in reports:
        for k in summary:
            summary[k] += r["summary"][k]
        failed += [
            f"{c['check_id']} {c['resource']} ({c['file_path']})" for c in r["results"]["failed_checks"]
        ]
        skipped += r["results"]["skipped_checks"]
    assert summary["passed"] > 50, summary
    assert failed == [], "\n".join(failed)
    # Every suppression carries a reason worth reading.
    unexplained = [
        f"{c['check_id']} {c['resource']}"
        for c in skipped
        if len(str(c.get("check_result", {}).get("suppress_comment", "")).strip()) < 30
    ]
    assert unexplained == [], unexplained


def test_run_http_invokers_are_validated_by_kind(model: Model) -> None:
    """The variable's own validation (its RE2 pattern, evaluated here as Terraform would) accepts one
    person, group or service account by email, and rejects public members, domains and bare names."""
    (variable,) = [b for b in model.of("variable") if b.name == "run_http_invokers"]
    conditions = [v["condition"] for v in variable.body["validation"]]
    (literal,) = [m.group(1) for c in conditions if (m := re.search(r'can\(regex\("(.+?)", m\)\)', c))]
    pattern = re.compile(literal.replace("\\\\", "\\"))  # HCL's string escape, as Terraform reads it
    for member in (
        "user:ops@example.com",
        "group:ml-team@example.com",
        "serviceAccount:ci@p.iam.gserviceaccount.com",
    ):
        assert pattern.search(member), member
    for member in (
        "allUsers",
        "allAuthenticatedUsers",
        "domain:example.com",
        "user:ops",
        "ops@example.com",
        "principalSet://goog/public:all",
        "user:ops@example.com allUsers",
    ):
        assert not pattern.search(member), member


def test_the_training_namespace_is_retrains_own(model: Model) -> None:
    """Not ``default``: the workflow may create JobSets in the namespace, and a JobSet's pods may run as
    any service account there (other workloads' Workload Identity accounts included). The setting's
    default is Terraform's, the variable refuses ``default`` and kube-*, and the app stage creates it."""
    from retrain import config

    default = model.variable_default("platform", "k8s_namespace")
    assert default == config.Settings().namespace and default != "default"
    (variable,) = [b for b in model.of("variable") if b.stage == "platform" and b.name == "k8s_namespace"]
    refused = json.dumps([v.get("condition") for v in variable.body.get("validation", [])])
    assert '\\"default\\"' in refused and 'startswith(var.k8s_namespace, \\"kube-\\")' in refused, refused
    assert [b.name for b in model.of("resource", "kubernetes_namespace_v1")] == ["retrain"]
