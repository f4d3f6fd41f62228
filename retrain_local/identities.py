"""Who each local part runs as, and the one check every front of the local stack makes.

Each part runs as the identity infra/ deploys it with (:class:`Deployed`): a function as the
``service_account_email`` of its ``google_cloudfunctions2_function``, the workflow as the
``service_account`` of ``google_workflows_workflow.retrain``, a Dataflow job as the
``serviceAccountEmail`` its launch names, a pod as the Google account its Kubernetes service account maps
to through Workload Identity, or as that account's own principal where it maps to none (a run's pods;
:meth:`Guard.workload_member`), the CLI as the operator.  The stack gives
each part a token of its own (:meth:`Guard.token`; a process is handed only its own), and every front maps
the token back to the member and asks :meth:`Guard.check`, which evaluates infra/'s IAM
(``retrain_local.iam``), logs each refusal (who was refused what) and counts each permission used, from
which least privilege is measured (:meth:`Guard.least_privilege`).

``RETRAIN_LOCAL_IAM=off`` (``Settings.local_iam``) keeps the identities and the log but refuses nothing:
a refusal is logged as one Google would make, and the call goes on.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrain.k8s.render import run_principal
from retrain_local.iam import Binding, Decision, Kind, Policy, Resource, policy_of
from retrain_ops.hcl import LOCAL_PROJECT_NUMBER

log = logging.getLogger("retrain.iam")

#: The operator: whoever deployed the project and runs the CLI.  infra/ grants it nothing; it owns the
#: project (``roles/owner``), so it holds every permission (cloud.google.com/iam/docs/roles-overview#basic).
OPERATOR = "user:operator@retrain_local"

#: What the local stack cannot exercise, by permission prefix, and why (the least-privilege report
#: lists these grants apart: unused here says nothing about the cloud).
NOT_EXERCISED_LOCALLY = {
    "logging.": "no Cloud Logging locally (logs are files)",
    "artifactregistry.": "no registry locally: images are local stand-ins, never pulled",
    "container.nodes.": "GKE's nodes are the cluster twin",
    "bigquery.": "BigQuery runs only in the optional bqemulator tier",
    "storage.buckets.": "buckets are created by the stack, as Terraform creates them",
    "cloudbuild.": "no Cloud Build locally",
}
#: Roles the local stack cannot exercise as a whole, and why.
ROLES_NOT_EXERCISED_LOCALLY = {
    "roles/dataflow.worker": "Dataflow's workers need it to work for the service (not modelled locally)",
    "roles/container.defaultNodeServiceAccount": "GKE's nodes are the cluster twin",
}


#: Calls Google's client libraries make on their own and expect to be refused: google-cloud-storage 3.x
#: reads each bucket's metadata in the background and, on 403, "cache[s] fallback values permanently"
#: (google/cloud/storage/_bucket_metadata_cache.py).  Refused as Google refuses them, counted apart.
TOLERATED_PROBES = frozenset({"storage.buckets.get"})
#: The binding that stands for the owner's basic role.
OWNER = "the project's owner (roles/owner)"


class PermissionDenied(PermissionError):
    """A call IAM refuses: its :class:`Decision` names who lacked which permission on what."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.reason)
        self.decision = decision


@dataclass(frozen=True)
class Caller:
    """One identity that a part of the stack's own process calls as (the workflow's connectors, the
    notifier), with the check Google makes of its calls."""

    guard: Guard
    member: str

    @property
    def token(self) -> str:
        return self.guard.token(self.member)

    def require(self, permission: str, resource: Resource) -> None:
        """PermissionDenied unless ``member`` holds ``permission`` on ``resource``."""
        self.guard.require(self.member, permission, resource)


def connector_require(caller: Caller | None, permission: str, resource: Resource) -> None:
    """``caller``'s permission for a workflow connector call: refused, the connector's ``HttpError`` 403
    carrying the API's ``PERMISSION_DENIED`` body (no caller: unchecked, for tests of the interpreter)."""
    if caller is None:
        return
    try:
        caller.require(permission, resource)
    except PermissionDenied as e:
        from cloudworkflows import WorkflowError, http_error

        message = e.decision.message
        body = {"error": {"code": 403, "message": message, "status": "PERMISSION_DENIED"}}
        raise WorkflowError(http_error(403, message, body=body)) from None


@dataclass(frozen=True)
class Function:
    """One deployed function, as infra/app/functions.tf declares it."""

    entry_point: str
    """``build_config.entry_point``: the Python function it runs (functions/main.py)."""
    service: str
    """The function's name, which is also its Cloud Run service's (what ``run.routes.invoke`` is
    checked on)."""
    member: str
    """``service_config.service_account_email`` as an IAM member: who the function runs as."""
    trigger_member: str | None
    """``event_trigger.service_account_email`` as a member: who Eventarc delivers events as."""


@dataclass(frozen=True)
class Push:
    """A push subscription of infra/app/events.tf."""

    name: str
    """Its id (``google_pubsub_subscription.name``)."""
    member: str
    """Who Pub/Sub pushes as: ``push_config.oidc_token.service_account_email``, as a member."""
    dead_letter_topic: str
    """The topic id undeliverable messages go to ("" for none)."""


@dataclass(frozen=True)
class Deployed:
    """Who runs what, read from the deployment's Terraform (``retrain_ops.deployment.Deployment``)."""

    project: str
    functions: dict[str, Function]
    """By entry point."""
    workflow: str
    """The workflow's service account, as a member."""
    pushes: dict[str, Push]
    """Topic id -> its push subscription to a function."""
    pubsub_agent: str
    """Pub/Sub's service agent, which forwards undeliverable messages to a dead-letter topic."""
    storage_agent: str
    """Cloud Storage's service agent, which publishes the landing bucket's notifications for Eventarc."""
    policy: Policy

    @classmethod
    def read(cls, deployment: Any) -> Deployed:
        app = deployment.app
        functions = {}
        for body in app.resources("google_cloudfunctions2_function").values():
            (build,) = body["build_config"]
            (service,) = body["service_config"]
            (trigger,) = body.get("event_trigger") or [None]
            f = Function(
                entry_point=str(app.evaluate(build["entry_point"])),
                service=str(app.evaluate(body["name"])),
                member=f"serviceAccount:{app.evaluate(service['service_account_email'])}",
                trigger_member=f"serviceAccount:{app.evaluate(trigger['service_account_email'])}"
                if trigger
                else None,
            )
            functions[f.entry_point] = f
        workflow = app.resource("google_workflows_workflow", "retrain")
        email = str(app.evaluate(workflow["service_account"])).rsplit("/", 1)[-1]
        pushes = {}
        for body in app.resources("google_pubsub_subscription").values():
            (push,) = body.get("push_config") or [None]
            if push and push.get("oidc_token"):
                (dead_letter,) = body.get("dead_letter_policy") or [{}]
                topic = str(app.evaluate(body["topic"])).rsplit("/", 1)[-1]
                pushes[topic] = Push(
                    name=str(app.evaluate(body["name"])),
                    member=f"serviceAccount:{app.evaluate(push['oidc_token'][0]['service_account_email'])}",
                    dead_letter_topic=str(app.evaluate(dead_letter.get("dead_letter_topic", ""))).rsplit("/")[
                        -1
                    ],
                )
        agents = f"{LOCAL_PROJECT_NUMBER}@%s.iam.gserviceaccount.com"
        policy = policy_of({"platform": deployment.platform, "app": app})
        return cls(
            deployment.project,
            functions,
            f"serviceAccount:{email}",
            pushes,
            "serviceAccount:service-" + agents % "gcp-sa-pubsub",
            "serviceAccount:service-" + agents % "gs-project-accounts",
            policy,
        )


class Guard:
    """Tokens for members, and infra/'s IAM checked for every call a front sees."""

    def __init__(
        self, deployed: Deployed, *, enforce: bool = True, owners: Iterable[str] = (OPERATOR,)
    ) -> None:
        self.deployed = deployed
        self.policy = deployed.policy
        self.enforce = enforce
        self.owners = frozenset(owners)
        self._lock = threading.Lock()
        self._members: dict[str, str] = {}
        self._tokens: dict[str, str] = {}
        self.used: Counter[tuple[str, str, str]] = Counter()
        """(member, permission, the granting binding's address) -> calls."""
        self.refusals: list[Decision] = []
        self.tolerated: Counter[tuple[str, str]] = Counter()
        """Refusals of :data:`TOLERATED_PROBES`, by (member, permission)."""

    # -- identities ---------------------------------------------------------------------------

    def token(self, member: str) -> str:
        """The token ``member``'s processes present (made once per member and stack)."""
        with self._lock:
            if member not in self._tokens:
                token = "ya29.local." + secrets.token_urlsafe(24)
                self._tokens[member], self._members[token] = token, member
            return self._tokens[member]

    def member(self, token: str | None) -> str | None:
        """Whose ``token`` is (None: nobody's)."""
        with self._lock:
            return self._members.get(token or "")

    def workload_member(self, namespace: str, ksa: str, annotations: Mapping[str, str]) -> str:
        """Who a pod running as Kubernetes service account ``ksa`` is to Google.

        GKE's Workload Identity: a KSA annotated ``iam.gke.io/gcp-service-account: GSA`` acts as GSA when
        its workload identity member holds ``iam.serviceAccounts.getAccessToken`` on GSA (granted by
        ``roles/iam.workloadIdentityUser``); otherwise its calls carry its own federated principal
        (``principal://.../subject/ns/NAMESPACE/sa/KSA``), which holds what is granted to it or to its
        namespace's principal set (cloud.google.com/kubernetes-engine/docs/concepts/workload-identity,
        "Reference Kubernetes resources in IAM policies")."""
        project = self.deployed.project
        legacy = f"serviceAccount:{project}.svc.id.goog[{namespace}/{ksa}]"
        gsa = annotations.get("iam.gke.io/gcp-service-account")
        if gsa:
            decision = self.check(
                legacy, "iam.serviceAccounts.getAccessToken", Resource(Kind.SERVICE_ACCOUNT, gsa)
            )
            if decision.allowed:
                return f"serviceAccount:{gsa}"
        return run_principal(LOCAL_PROJECT_NUMBER, project, namespace, ksa)

    # -- the check ----------------------------------------------------------------------------

    def check(self, member: str, permission: str, resource: Resource, *more: Resource) -> Decision:
        """Whether ``member`` may on ``resource`` (or on any of ``more``: a permission Google checks at
        several levels, as a listing on the bucket or the managed folder); counted, and logged when
        refused (allowed anyway when not enforcing)."""
        decision = self._decide(member, permission, resource)
        for other in more:
            if decision.allowed:
                break
            alternative = self._decide(member, permission, other)
            decision = alternative if alternative.allowed else decision
        with self._lock:
            if decision.allowed:
                self.used[member, permission, decision.by.address if decision.by else ""] += 1
            elif permission in TOLERATED_PROBES:
                self.tolerated[member, permission] += 1
            else:
                self.refusals.append(decision)
        if not decision.allowed:
            if permission not in TOLERATED_PROBES:
                verb = "refused" if self.enforce else "would refuse (RETRAIN_LOCAL_IAM=off)"
                log.warning("IAM %s: %s", verb, decision.reason)
            if not self.enforce:
                return Decision(True, member, permission, resource)
        return decision

    def _decide(self, member: str, permission: str, resource: Resource) -> Decision:
        if member in self.owners:
            project = Resource(Kind.PROJECT, self.deployed.project)
            return Decision(
                True, member, permission, resource, Binding(member, "roles/owner", project, None, OWNER)
            )
        return self.policy.check(member, permission, resource)

    def authorize(self, token: str | None, permission: str, resource: Resource) -> str | None:
        """For a front that sees a bearer token: None when its member may, else the API's refusal."""
        member = self.member(token)
        if member is None:
            log.warning("IAM: a call for %s on %s without a known token", permission, resource.name)
            return "Request had invalid authentication credentials (no local identity's token)."
        decision = self.check(member, permission, resource)
        return None if decision.allowed else decision.message

    def require(self, member: str, permission: str, resource: Resource) -> None:
        """:meth:`check`, raising :class:`PermissionDenied` when refused."""
        decision = self.check(member, permission, resource)
        if not decision.allowed:
            raise PermissionDenied(decision)

    def refused(self, member: str | None = None) -> list[Decision]:
        with self._lock:
            return [d for d in self.refusals if member is None or d.member == member]

    # -- least privilege ----------------------------------------------------------------------

    def _used_through(self) -> dict[str, dict[str, set[str]]]:
        """Member -> each permission it used -> the addresses of the grants it used it through."""
        with self._lock:
            used = list(self.used)
        through: dict[str, dict[str, set[str]]] = {}
        for member, permission, address in used:
            through.setdefault(member, {}).setdefault(permission, set()).add(address)
        return through

    def least_privilege(self) -> dict[str, Any]:
        """Per service account infra/ grants anything: each permission it used and the grants it used it
        through, each grant it never used (a role whose permissions were unused, or used only through a
        narrower grant), and apart, the grants the local stack cannot exercise
        (:data:`NOT_EXERCISED_LOCALLY`, :data:`ROLES_NOT_EXERCISED_LOCALLY`, an identity that never runs
        locally)."""
        through = self._used_through()
        report: dict[str, Any] = {}
        for b in self.policy.bindings:
            if not b.member.startswith("serviceAccount:"):
                continue
            mine = through.get(b.member, {})
            entry = report.setdefault(
                b.member,
                {"used": {p: sorted(a) for p, a in sorted(mine.items())}, "unused": [], "not_exercised": []},
            )
            if any(b.address in addresses for addresses in mine.values()):
                continue
            grant = {"binding": b.address, "role": b.role, "on": b.on.name}
            why = (
                ROLES_NOT_EXERCISED_LOCALLY.get(b.role)
                or _not_exercised(self.policy.permissions_of(b.role))
                or (None if mine else "this identity never runs locally")
            )
            if why:
                entry["not_exercised"].append({**grant, "why": why})
            else:
                entry["unused"].append(grant)
        return report

    def write_usage(self, path: Path) -> None:
        """The least-privilege report, what each workload principal used through which grant, and every
        refusal, for `retrain doctor --local` and tests."""
        refusals = [
            {"member": d.member, "permission": d.permission, "resource": d.resource.name}
            for d in self.refused()
        ]
        workloads = {  # a pod's own principal (a run's pods)
            member: {p: sorted(a) for p, a in sorted(used.items())}
            for member, used in self._used_through().items()
            if member.startswith("principal://")
        }
        report = {"least_privilege": self.least_privilege(), "workloads": workloads, "refusals": refusals}
        path.write_text(json.dumps(report, indent=1))


def _not_exercised(permissions: Iterable[str]) -> str | None:
    """Why no local run can use any of ``permissions`` (None: a local run could)."""
    reasons = set()
    for p in permissions:
        if p.startswith("resourcemanager.projects."):  # every role carries these; nothing calls them
            continue
        reason = next((why for prefix, why in NOT_EXERCISED_LOCALLY.items() if p.startswith(prefix)), None)
        if reason is None:
            return None
        reasons.add(reason)
    return "; ".join(sorted(reasons)) or None
