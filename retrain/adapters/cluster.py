"""The GKE cluster's Kubernetes API, for the reaper run by the Scheduler's ``reaper`` job.

Where the API is: ``$KUBECONFIG`` when set (the local stack's envtest control plane), else the
cluster's DNS-based control-plane endpoint (``RETRAIN_CLUSTER_ENDPOINT``, the platform stage's
``cluster_dns_endpoint`` output), reached from the functions with the functions account's Google
access token: no VPC access is needed, and IAM plus Kubernetes RBAC (``k8s/reaper-rbac.yaml``) decide
what the caller may do.
"""

from __future__ import annotations

import os
from typing import Any

from retrain.config import Settings
from retrain.ports import RunLookup


class GkeCluster:
    """:class:`retrain.ports.Cluster` over the Kubernetes API (``retrain.k8s.reaper`` does the work)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def api_client(self) -> Any:
        from kubernetes import client, config

        kubeconfig = os.environ.get("KUBECONFIG")
        if kubeconfig:
            return config.new_client_from_config(config_file=kubeconfig)
        if not self.settings.cluster_endpoint:
            raise RuntimeError("no KUBECONFIG and no RETRAIN_CLUSTER_ENDPOINT: cannot reach the cluster")
        import google.auth
        import google.auth.transport.requests

        credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
        credentials.refresh(google.auth.transport.requests.Request())
        configuration = client.Configuration()
        configuration.host = f"https://{self.settings.cluster_endpoint}"
        configuration.api_key = {"authorization": f"Bearer {credentials.token}"}
        return client.ApiClient(configuration)

    def reap(self, runs: RunLookup) -> dict[str, Any]:
        from retrain.k8s.reaper import default_max_age_s, reap

        api = self.api_client()
        try:
            report = reap(
                api,
                runs,
                namespace=self.settings.namespace,
                node_pool=self.settings.node_pool,
                max_age_s=default_max_age_s(self.settings),
            )
        finally:
            api.close()
        return report.to_dict()
