"""The GKE cluster's Kubernetes API: the reaper run by the Scheduler's ``reaper`` job, and the relay's
confirmation that a completion message is true.

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

    def confirm_completion(self, namespace: str, name: str, uid: str, run_id: str, state: str) -> str | None:
        from kubernetes import client
        from kubernetes.client import ApiException

        from retrain.k8s.notifier import terminal_state
        from retrain.k8s.render import JOBSET_API, RUN_ID_LABEL, label_value

        group, version = JOBSET_API.split("/")
        api = self.api_client()
        objects: Any = client.CustomObjectsApi(api)
        try:
            jobset: dict[str, Any] = objects.get_namespaced_custom_object(
                group, version, namespace, "jobsets", name
            )
        except ApiException as e:
            if e.status == 404:
                return f"JobSet {name} does not exist"
            raise
        finally:
            api.close()
        meta = jobset.get("metadata") or {}
        if meta.get("uid") != uid or (meta.get("labels") or {}).get(RUN_ID_LABEL) != label_value(run_id):
            return f"JobSet {name} is not run {run_id}'s (its label or uid differ)"
        terminal = terminal_state(jobset)
        if terminal is None or terminal[0] != state:
            return f"JobSet {name} is {terminal[0] if terminal else 'not finished'}, not {state}"
        return None
