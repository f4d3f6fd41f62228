"""Google Cloud IAM as ``infra/`` grants it, for the local stack: may this identity do this, on that?

The policy is read from the deployment itself: every ``*_iam_member`` resource of the platform and app
stages and the custom roles, evaluated by ``retrain_ops.hcl`` as Terraform would evaluate them.  A role
expands to its permissions from a vendored copy of Google's predefined roles (``iam_roles.json``: the
role resources of iann0036/iam-dataset's ``gcp/roles``, its commit and date inside) or from infra's
custom role.  Bindings apply where Google applies them: a project binding to everything in the project, a
bucket binding to the bucket and its objects, a managed folder binding to the objects under its path
("the access granted in the policy applies to any object within the bucket that uses the managed folder
path as a prefix", cloud.google.com/storage/docs/managed-folders), and a binding on a topic,
subscription, service account or service to that resource alone.  Conditions are evaluated in the CEL
subset infra uses (``resource.name.startsWith``, ``resource.type ==``, ``&&``, ``||``, ``!``) against the
resource the permission is checked on: ``storage.objects.list`` is checked on the bucket
(``projects/_/buckets/B``), so a condition on object names never grants it, Google's rule.

What is not modelled: organisation policies, deny policies, IAM's own eventual consistency, and the
permissions Google-managed agents hold; docs/local-stack.md says where each is enforced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any

from retrain_ops.hcl import LOCAL_PROJECT_NUMBER

ROLES_FILE = Path(__file__).with_name("iam_roles.json")


class Kind(StrEnum):
    """The kind of resource a permission is checked on (and a binding is set on)."""

    PROJECT = "project"
    BUCKET = "bucket"
    OBJECT = "object"
    MANAGED_FOLDER = "managed_folder"
    TOPIC = "topic"
    SUBSCRIPTION = "subscription"
    SERVICE_ACCOUNT = "service_account"
    SERVICE = "service"
    """A Cloud Run service (a gen2 function)."""
    TABLE = "table"
    REPOSITORY = "repository"
    WORKFLOW = "workflow"
    """A workflow (its executions and their callbacks are checked on it)."""


#: CEL's ``resource.type`` of each kind (cloud.google.com/iam/docs/conditions-resource-attributes).
RESOURCE_TYPES = {
    Kind.BUCKET: "storage.googleapis.com/Bucket",
    Kind.OBJECT: "storage.googleapis.com/Object",
    Kind.MANAGED_FOLDER: "storage.googleapis.com/ManagedFolder",
    Kind.PROJECT: "cloudresourcemanager.googleapis.com/Project",
}


@dataclass(frozen=True)
class Resource:
    """What a permission is checked on."""

    kind: Kind
    key: str
    """Project id, bucket name, ``bucket/object name`` (or ``bucket/prefix`` for a listing), topic id,
    subscription id, service account email, service name, table or repository id."""

    @property
    def bucket(self) -> str:
        return self.key.split("/", 1)[0]

    @property
    def name(self) -> str:
        """Google's full resource name, as IAM conditions see it (``resource.name``)."""
        if self.kind == Kind.BUCKET:
            return f"projects/_/buckets/{self.key}"
        if self.kind in (Kind.OBJECT, Kind.MANAGED_FOLDER):
            bucket, _, path = self.key.partition("/")
            collection = "objects" if self.kind == Kind.OBJECT else "managedFolders"
            return f"projects/_/buckets/{bucket}/{collection}/{path}"
        return self.key


def bucket(name: str) -> Resource:
    return Resource(Kind.BUCKET, name)


def storage_object(bucket_name: str, name: str) -> Resource:
    return Resource(Kind.OBJECT, f"{bucket_name}/{name}")


@dataclass(frozen=True)
class Binding:
    """One grant of one role to one member on one resource, as one Terraform resource declares it."""

    member: str
    role: str
    on: Resource
    condition: str | None
    address: str
    """Its Terraform address (``infra/platform: google_storage_bucket_iam_member.x``)."""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    member: str
    permission: str
    resource: Resource
    by: Binding | None = None

    @property
    def reason(self) -> str:
        """As Google words a refusal: who lacks which permission on what."""
        if self.allowed:
            return (
                f"{self.member} has {self.permission} on {self.resource.name} ({self.by and self.by.address})"
            )
        who = self.member.partition(":")[2] or self.member
        return f"{who} does not have {self.permission} access to {self.resource.name}"

    @property
    def message(self) -> str:
        """A refusal as Google's APIs word ``IAM_PERMISSION_DENIED`` (AIP-193 ``ErrorInfo``), with the
        caller named."""
        return (
            f"Permission '{self.permission}' denied on resource '{self.resource.name}' "
            f"(or it may not exist). [caller: {self.member}]"
        )


@cache
def predefined_roles() -> dict[str, frozenset[str]]:
    """Google's predefined roles this deployment grants -> their permissions (the vendored dataset)."""
    data = json.loads(ROLES_FILE.read_text())
    return {name: frozenset(role["includedPermissions"]) for name, role in data["roles"].items()}


# --- conditions: the CEL subset infra uses --------------------------------------------------------

_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<op>&&|\|\||==|!=|[!().,])|(?P<id>[A-Za-z_][\w.]*))'
)


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"condition {text!r}: cannot read at {pos}: {text[pos : pos + 20]!r}")
        out.append(m.group(0).strip())
        pos = m.end()
    return out


def condition_holds(expression: str, resource: Resource) -> bool:
    """``expression`` (``resource.name.startsWith("...")``, ``resource.type == "..."``, ``&&``, ``||``,
    ``!``, parentheses) for ``resource``; ValueError for anything else (a condition this twin cannot read
    is a bug to fix here, never a silent grant)."""
    tokens = _tokens(expression)
    values = {"resource.name": resource.name, "resource.type": RESOURCE_TYPES.get(resource.kind, "")}

    def expect(t: str) -> None:
        if not tokens or tokens.pop(0) != t:
            raise ValueError(f"condition {expression!r}: expected {t!r}")

    def string() -> str:
        t = tokens.pop(0) if tokens else ""
        if not t.startswith('"'):
            raise ValueError(f"condition {expression!r}: expected a string, got {t!r}")
        return str(json.loads(t))

    def atom() -> bool:
        t = tokens.pop(0) if tokens else ""
        if t == "!":
            return not atom()
        if t == "(":
            v = disjunction()
            expect(")")
            return v
        if t.endswith(".startsWith") and t.removesuffix(".startsWith") in values:
            expect("(")
            prefix = string()
            expect(")")
            return values[t.removesuffix(".startsWith")].startswith(prefix)
        if t in values and tokens and tokens[0] in ("==", "!="):
            op = tokens.pop(0)
            equal = values[t] == string()
            return equal if op == "==" else not equal
        raise ValueError(f"condition {expression!r}: {t!r} is not in the subset this twin reads")

    def conjunction() -> bool:
        v = atom()
        while tokens and tokens[0] == "&&":
            tokens.pop(0)
            v = atom() and v
        return v

    def disjunction() -> bool:
        v = conjunction()
        while tokens and tokens[0] == "||":
            tokens.pop(0)
            v = conjunction() or v
        return v

    result = disjunction()
    if tokens:
        raise ValueError(f"condition {expression!r}: unexpected {tokens[0]!r}")
    return result


# --- the policy -----------------------------------------------------------------------------------


#: How the address of a binding set at run time begins (``setIamPolicy`` on a managed folder).
RUNTIME_POLICY = "setIamPolicy at run time"

#: How much a binding set on each kind reaches (narrowest first).
_BREADTH = {kind: 2 for kind in Kind} | {Kind.OBJECT: 0, Kind.MANAGED_FOLDER: 1, Kind.PROJECT: 3}


#: GKE's Workload Identity Federation principals (cloud.google.com/iam/docs/principal-identifiers: "All
#: GKE Pods that use a specific Kubernetes service account": ``principal://iam.googleapis.com/projects/
#: PROJECT_NUMBER/locations/global/workloadIdentityPools/PROJECT_ID.svc.id.goog/subject/ns/NAMESPACE/sa/
#: KUBERNETES_SERVICE_ACCOUNT``, "Legacy format: ``serviceAccount:PROJECT_ID.svc.id.goog[NAMESPACE/
#: KUBERNETES_SERVICE_ACCOUNT]``"; "All GKE Pods in a Kubernetes namespace": ``principalSet://.../
#: PROJECT_ID.svc.id.goog/namespace/NAMESPACE``).
_POOL = (
    r"iam\.googleapis\.com/projects/(?P<number>[^/]+)/locations/global/workloadIdentityPools/"
    r"(?P<pool>[^/]+\.svc\.id\.goog)"
)
_KSA_PRINCIPAL = re.compile(rf"^principal://{_POOL}/subject/ns/(?P<ns>[^/]+)/sa/(?P<ksa>[^/]+)$")
_KSA_LEGACY = re.compile(
    r"^serviceAccount:(?P<pool>[^\[]+\.svc\.id\.goog)\[(?P<ns>[^/\]]+)/(?P<ksa>[^\]]+)\]$"
)
_NAMESPACE_SET = re.compile(rf"^principalSet://{_POOL}/namespace/(?P<ns>[^/]+)$")


def _ksa(member: str) -> tuple[str, str, str, str] | None:
    """(project number, workload pool, namespace, KSA) of a Kubernetes service account's principal, in
    either form (the legacy one names no number: the local project's, ``retrain_ops.hcl``'s)."""
    if m := _KSA_PRINCIPAL.match(member):
        return (m["number"], m["pool"], m["ns"], m["ksa"])
    if m := _KSA_LEGACY.match(member):
        return (LOCAL_PROJECT_NUMBER, m["pool"], m["ns"], m["ksa"])
    return None


def member_matches(bound: str, member: str) -> bool:
    """Whether a binding's member names ``member``: itself, the same Kubernetes service account in the
    other form, or a namespace's principal set that holds it (the same project number and pool: a
    principal of another number is nobody Google knows here)."""
    if bound == member:
        return True
    caller = _ksa(member)
    if caller is None:
        return False
    if (named := _ksa(bound)) is not None:
        return named == caller
    every = _NAMESPACE_SET.match(bound)
    return every is not None and (every["number"], every["pool"], every["ns"]) == caller[:3]


def _applies(on: Resource, to: Resource) -> bool:
    """Whether a binding set on ``on`` reaches ``to`` (IAM's inheritance, as far as infra uses it)."""
    if on.kind == Kind.PROJECT:
        return True
    if on.kind == Kind.BUCKET:
        return to.kind in (Kind.BUCKET, Kind.OBJECT, Kind.MANAGED_FOLDER) and to.bucket == on.key
    if on.kind == Kind.MANAGED_FOLDER:
        # objects under the folder's path, and a listing whose prefix lies in it
        return to.kind in (Kind.OBJECT, Kind.MANAGED_FOLDER) and to.key.startswith(on.key)
    return on == to


@dataclass
class Policy:
    """Every binding of the deployment, and infra's custom roles."""

    bindings: list[Binding] = field(default_factory=list)
    custom_roles: dict[str, frozenset[str]] = field(default_factory=dict)

    def permissions_of(self, role: str) -> frozenset[str]:
        if role in self.custom_roles:
            return self.custom_roles[role]
        roles = predefined_roles()
        if role not in roles:
            raise KeyError(f"role {role} is in no vendored dataset (retrain_local/iam_roles.json)")
        return roles[role]

    def check(self, member: str, permission: str, resource: Resource) -> Decision:
        """Whether ``member`` holds ``permission`` on ``resource``, and through which binding: of several
        that grant it, the narrowest (the grant meant for this access; a broader one then shows as
        unused in the least-privilege report)."""
        granting = [
            b
            for b in self.bindings
            if member_matches(b.member, member)
            and permission in self.permissions_of(b.role)
            and _applies(b.on, resource)
            and (b.condition is None or condition_holds(b.condition, resource))
        ]
        if not granting:
            return Decision(False, member, permission, resource)
        return Decision(True, member, permission, resource, min(granting, key=lambda b: _BREADTH[b.on.kind]))

    def set_policy(self, on: Resource, grants: Iterable[tuple[str, str]], address: str) -> None:
        """The allow policy of ``on`` as a ``setIamPolicy`` call sets it while the stack runs: ``grants``
        ((role, member) pairs) replace whatever was set on ``on`` that way before (none: the policy is
        gone, as when its managed folder is deleted).  KeyError for a role no dataset knows.  The list is
        replaced, never changed in place, so a check running meanwhile sees one policy or the other."""
        added = [Binding(member, role, on, None, address) for role, member in grants]
        for b in added:
            self.permissions_of(b.role)
        kept = [b for b in self.bindings if not (b.on == on and b.address.startswith(RUNTIME_POLICY))]
        self.bindings = kept + added

    def granted(self, member: str) -> Iterator[tuple[Binding, str]]:
        """Each (binding, permission) ``member`` holds: what least privilege is measured against."""
        for b in self.bindings:
            if member_matches(b.member, member):
                for permission in sorted(self.permissions_of(b.role)):
                    yield b, permission


#: The resource each IAM resource type binds on, and the attribute(s) naming it.
_SCOPES: dict[str, tuple[Kind, tuple[str, ...]]] = {
    "google_project_iam_member": (Kind.PROJECT, ("project",)),
    "google_storage_bucket_iam_member": (Kind.BUCKET, ("bucket",)),
    "google_storage_managed_folder_iam_member": (Kind.MANAGED_FOLDER, ("bucket", "managed_folder")),
    "google_pubsub_topic_iam_member": (Kind.TOPIC, ("topic",)),
    "google_pubsub_subscription_iam_member": (Kind.SUBSCRIPTION, ("subscription",)),
    "google_service_account_iam_member": (Kind.SERVICE_ACCOUNT, ("service_account_id",)),
    "google_cloud_run_v2_service_iam_member": (Kind.SERVICE, ("name",)),
    "google_bigquery_table_iam_member": (Kind.TABLE, ("table_id",)),
    "google_artifact_registry_repository_iam_member": (Kind.REPOSITORY, ("repository",)),
}


def _short(kind: Kind, value: str) -> str:
    """A binding's resource by the key requests use: a topic's id, a service account's email."""
    if kind in (Kind.TOPIC, Kind.SUBSCRIPTION, Kind.REPOSITORY, Kind.SERVICE):
        return value.rsplit("/", 1)[-1]
    if kind == Kind.SERVICE_ACCOUNT:
        return value.rsplit("/", 1)[-1]
    return value


def policy_of(stages: Mapping[str, Any]) -> Policy:
    """The policy the given Terraform stages (``retrain_ops.hcl.Stage`` by name) declare."""
    policy = Policy()
    for stage_name, stage in stages.items():
        for body in stage.resources("google_project_iam_custom_role").values():
            role = f"projects/{stage.evaluate(body['project'])}/roles/{stage.evaluate(body['role_id'])}"
            policy.custom_roles[role] = frozenset(str(p) for p in stage.evaluate(body["permissions"]))
        for rtype, (kind, attrs) in _SCOPES.items():
            for name, body in stage.resources(rtype).items():
                for each in _instances(stage, body):
                    parts = [str(stage.evaluate(body[a], **each)) for a in attrs]
                    key = "/".join(_short(kind, p) for p in parts)
                    (condition,) = body.get("condition") or [None]
                    policy.bindings.append(
                        Binding(
                            member=str(stage.evaluate(body["member"], **each)),
                            role=str(stage.evaluate(body["role"], **each)),
                            on=Resource(kind, key),
                            condition=str(stage.evaluate(condition["expression"], **each))
                            if condition
                            else None,
                            address=f"infra/{stage_name}: {rtype}.{name}",
                        )
                    )
    return policy


def _instances(stage: Any, body: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    """The ``each`` of a resource with ``for_each`` (one empty binding set without)."""
    if "for_each" not in body:
        return [{}]
    items = stage.evaluate(body["for_each"])
    pairs = items.items() if isinstance(items, Mapping) else ((v, v) for v in items)
    return [{"each": {"key": k, "value": v}} for k, v in pairs]
