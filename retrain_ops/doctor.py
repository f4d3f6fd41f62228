"""``retrain doctor``: what a project needs for a DWS run, checked before anything is spent, with fixes.

Checked against the deployment a target names (Google's APIs, Application Default Credentials) or the
local stack (the same reads served by its GKE API front, ``retrain_local.gke_api``):

- the APIs the bootstrap stage enables are enabled (Service Usage ``services.list``);
- the region's **preemptible** GPU quota covers a run's nodes: "All VMs provisioned by Provisioning
  Request requests use preemptible quotas" (cloud.google.com/kubernetes-engine/docs/how-to/
  provisioningrequest), read from Compute Engine's ``regions.get`` quotas;
- ``active_resize_requests`` ("The number of ProvisioningRequests that are in Accepted state is limited
  by a dedicated quota", the same page): not readable through an API retrain calls, so it is named with
  where to look;
- the cluster runs GKE 1.32.2-gke.1652000 or later (flex-start with queued provisioning) and has the DWS
  pool with queued provisioning and flex-start, able to hold a run's nodes;
- the tokenize template spec is readable and names its image by digest.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from retrain.config import Settings

#: Flex-start with queued provisioning: "a GKE cluster in version 1.32.2-gke.1652000 or later".
FLEX_START_MIN = (1, 32, 2, 1652000)
#: GKE accelerator type -> Compute Engine's preemptible quota metric for it (compute.v1 Quota.metric).
PREEMPTIBLE_GPU_QUOTA = {
    "nvidia-h100-80gb": "PREEMPTIBLE_NVIDIA_H100_GPUS",
    "nvidia-a100-80gb": "PREEMPTIBLE_NVIDIA_A100_80GB_GPUS",
    "nvidia-tesla-a100": "PREEMPTIBLE_NVIDIA_A100_GPUS",
    "nvidia-l4": "PREEMPTIBLE_NVIDIA_L4_GPUS",
}
#: Machine family -> the GPU it carries (GKE's accelerator names).
MACHINE_GPUS = {
    "a3-highgpu": "nvidia-h100-80gb",
    "a2-ultragpu": "nvidia-a100-80gb",
    "a2-highgpu": "nvidia-tesla-a100",
    "g2-standard": "nvidia-l4",
}


class Verdict(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    UNKNOWN = "unknown"
    """Not readable from here: the finding says where to look."""


@dataclass(frozen=True)
class Finding:
    check: str
    verdict: Verdict
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"check": self.check, "verdict": str(self.verdict), "detail": self.detail, "fix": self.fix}


class ProjectApis(Protocol):
    """The project-level reads the doctor makes (Service Usage, Compute Engine)."""

    def enabled_services(self, project: str) -> set[str]: ...

    def region_quotas(self, project: str, region: str) -> dict[str, tuple[float, float]]:
        """Quota metric -> (limit, usage)."""
        ...


def gke_version(text: str) -> tuple[int, ...]:
    """``1.35.8-gke.1225000`` -> (1, 35, 8, 1225000); a version without its GKE build counts it as 0."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)(?:-gke\.(\d+))?", text)
    if m is None:
        raise ValueError(f"not a GKE version: {text!r}")
    return tuple(int(g or 0) for g in m.groups())


def _gpu_of(machine_type: str) -> str:
    return next((g for prefix, g in MACHINE_GPUS.items() if machine_type.startswith(prefix)), "")


def check_apis(apis: ProjectApis, project: str, required: Iterable[str]) -> Finding:
    enabled = apis.enabled_services(project)
    missing = sorted(set(required) - enabled)
    if missing:
        return Finding(
            "apis",
            Verdict.FAIL,
            f"not enabled: {', '.join(missing)}",
            f"apply infra/bootstrap (it enables them), or `gcloud services enable {' '.join(missing)} "
            f"--project {project}`",
        )
    return Finding("apis", Verdict.PASS, f"{len(set(required))} API(s) enabled")


def check_gpu_quota(apis: ProjectApis, s: Settings) -> Finding:
    gpu = _gpu_of(s.machine_type)
    metric = PREEMPTIBLE_GPU_QUOTA.get(gpu)
    needed = s.nodes * s.gpus_per_node
    if metric is None:
        return Finding(
            "gpu-quota",
            Verdict.UNKNOWN,
            f"no known preemptible quota metric for {s.machine_type}",
            f"check its GPUs' preemptible quota in {s.region} (IAM & Admin > Quotas): at least {needed}",
        )
    limit, usage = apis.region_quotas(s.project, s.region).get(metric, (0.0, 0.0))
    fix = (
        f"request {metric} >= {needed} in {s.region} (IAM & Admin > Quotas & System Limits): DWS's VMs use "
        "preemptible quota, and a new project has little or none"
    )
    if limit - usage < needed:
        return Finding(
            "gpu-quota",
            Verdict.FAIL,
            f"{metric} in {s.region}: {limit - usage:g} free of {limit:g}, a run needs {needed}",
            fix,
        )
    return Finding(
        "gpu-quota", Verdict.PASS, f"{metric} in {s.region}: {limit - usage:g} free, a run needs {needed}"
    )


def check_resize_requests(s: Settings) -> Finding:
    return Finding(
        "active-resize-requests",
        Verdict.UNKNOWN,
        "ProvisioningRequests in Accepted state are capped by the regional quota active_resize_requests "
        "(default 100), which no API retrain calls reads",
        f"in the console's Quotas page, filter active_resize_requests for {s.region}: one per concurrent run",
    )


def check_cluster(cluster: Any, s: Settings) -> list[Finding]:
    """The cluster's version and its DWS pool (a ``container_v1.Cluster``)."""
    out = []
    version = str(cluster.current_master_version or "")
    try:
        ok = gke_version(version) >= FLEX_START_MIN
    except ValueError:
        ok = False
    fix = "set kubernetes_version (infra/platform) to a supported minor such as 1.35 and apply the platform"
    out.append(
        Finding(
            "gke-version", Verdict.PASS if ok else Verdict.FAIL, f"the control plane runs {version or '?'}"
        )
        if ok
        else Finding(
            "gke-version",
            Verdict.FAIL,
            f"{version or 'no version'} is below 1.32.2-gke.1652000 (flex-start)",
            fix,
        )
    )
    pool = next((p for p in cluster.node_pools if p.name == s.node_pool), None)
    if pool is None:
        out.append(
            Finding(
                "dws-pool",
                Verdict.FAIL,
                f"no node pool {s.node_pool} (runs would wait Accepted for good: kubernetes/autoscaler#9490)",
                "apply infra/platform, which creates it",
            )
        )
        return out
    problems = []
    if not pool.queued_provisioning.enabled:
        problems.append("queued provisioning is off")
    if not pool.config.flex_start:
        problems.append("it is not flex-start")
    if pool.autoscaling.total_max_node_count < s.nodes:
        problems.append(
            f"it scales to {pool.autoscaling.total_max_node_count} node(s), a run needs {s.nodes}"
        )
    if problems:
        out.append(
            Finding("dws-pool", Verdict.FAIL, f"{s.node_pool}: {'; '.join(problems)}", "apply infra/platform")
        )
    else:
        out.append(Finding("dws-pool", Verdict.PASS, f"{s.node_pool}: flex-start, queued provisioning"))
    return out


def check_template(read: Callable[[str], bytes], s: Settings) -> Finding:
    uri = s.template_uri
    fix = "apply infra/app with `retrain deploy` (it builds the image and writes the spec)"
    try:
        spec = json.loads(read(uri))
    except (FileNotFoundError, ValueError) as e:
        return Finding("template", Verdict.FAIL, f"cannot read {uri}: {e}", fix)
    image = str(spec.get("image") or "")
    if not re.search(r"@sha256:[0-9a-f]{64}$", image):
        return Finding("template", Verdict.FAIL, f"{uri} names its image {image!r}, not by digest", fix)
    return Finding("template", Verdict.PASS, f"{uri}: {image}")


@dataclass(frozen=True)
class RestProjectApis:
    """Service Usage and Compute Engine over REST: Google's, or (``RETRAIN_CONTAINER_ENDPOINT`` set) the
    local stack's GKE API front, which serves the same two reads."""

    session: Any
    serviceusage: str = "https://serviceusage.googleapis.com"
    compute: str = "https://compute.googleapis.com"

    @classmethod
    def from_environment(cls) -> RestProjectApis:
        from retrain.adapters.cluster import CONTAINER_ENDPOINT_VAR

        local = os.environ.get(CONTAINER_ENDPOINT_VAR)
        if local:
            import requests

            from retrain.adapters import credentials

            session = requests.Session()
            session.headers.update(credentials.bearer())
            return cls(session, local, local)
        import google.auth  # pragma: no cover - needs Google credentials
        from google.auth.transport.requests import AuthorizedSession

        creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
        return cls(AuthorizedSession(creds))

    def _get(self, url: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        answer = self.session.get(url, params=params, timeout=30)
        if answer.status_code != 200:
            raise RuntimeError(f"GET {url}: HTTP {answer.status_code}: {answer.text[:300]}")
        return dict(answer.json())

    def enabled_services(self, project: str) -> set[str]:
        """Service Usage ``services.list`` (v1), ``filter=state:ENABLED``, every page."""
        url, params, out = (
            f"{self.serviceusage}/v1/projects/{project}/services",
            {"filter": "state:ENABLED"},
            set(),
        )
        while True:
            page = self._get(url, params)
            out |= {
                str((s.get("config") or {}).get("name") or s["name"].rsplit("/", 1)[-1])
                for s in page.get("services") or []
            }
            if not page.get("nextPageToken"):
                return out
            params = {**params, "pageToken": str(page["nextPageToken"])}

    def region_quotas(self, project: str, region: str) -> dict[str, tuple[float, float]]:
        """Compute Engine ``regions.get`` (v1): its ``quotas``."""
        region_doc = self._get(f"{self.compute}/compute/v1/projects/{project}/regions/{region}")
        return {
            str(q["metric"]): (float(q.get("limit", 0)), float(q.get("usage", 0)))
            for q in region_doc.get("quotas") or []
        }


def examine(
    s: Settings,
    apis: ProjectApis,
    cluster: Any,
    read: Callable[[str], bytes],
    required_services: Iterable[str],
) -> list[Finding]:
    """Every check, in the order a first deployment meets them."""
    findings = [
        check_apis(apis, s.project, required_services),
        check_gpu_quota(apis, s),
        check_resize_requests(s),
    ]
    findings += check_cluster(cluster, s)
    findings.append(check_template(read, s))
    return findings
