"""Workflow executions through the documented Workflow Executions REST API (v1).

One adapter for both worlds: in the cloud it calls workflowexecutions.googleapis.com with Google
credentials; locally ``RETRAIN_WORKFLOWS_ENDPOINT`` points it at retrain's own executions service
(``retrain.workflows.server``), which serves the same paths, including callbacks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

import requests

from retrain.domain.errors import ExecutionLost

CLOUD_ENDPOINT = "https://workflowexecutions.googleapis.com"


class WorkflowsExecutions:
    """:class:`retrain.ports.Orchestrator` over the Workflow Executions REST API."""

    def __init__(
        self,
        project: str,
        region: str,
        workflow: str,
        endpoint: str | None = None,
        *,
        project_number: str = "",
    ) -> None:
        self.endpoint = (endpoint or os.environ.get("RETRAIN_WORKFLOWS_ENDPOINT") or CLOUD_ENDPOINT).rstrip(
            "/"
        )
        self.parent = f"projects/{project}/locations/{region}/workflows/{workflow}"
        # Execution names (and the callback URLs made from them) may carry the project number instead.
        self.parents = tuple(
            f"projects/{p}/locations/{region}/workflows/{workflow}" for p in (project, project_number) if p
        )
        self._session: requests.Session | None = None

    @property
    def local(self) -> bool:
        return self.endpoint != CLOUD_ENDPOINT

    def session(self) -> requests.Session:
        if self._session is None:
            if self.local:
                self._session = requests.Session()
            else:  # pragma: no cover - needs Google credentials
                import google.auth
                from google.auth.transport.requests import AuthorizedSession

                creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
                self._session = AuthorizedSession(creds)
        return self._session

    def start(self, argument: Mapping[str, Any]) -> str:
        """Create an execution; returns its resource name."""
        resp = self.session().post(
            f"{self.endpoint}/v1/{self.parent}/executions",
            json={"argument": json.dumps(argument), "callLogLevel": "LOG_ERRORS_ONLY"},
            timeout=30,
        )
        resp.raise_for_status()
        return str(resp.json()["name"])

    def get(self, execution: str) -> dict[str, Any]:
        """The execution's resource; ExecutionLost when there is no such execution (404)."""
        resp = self.session().get(f"{self.endpoint}/v1/{execution}", timeout=30)
        if resp.status_code == 404:
            raise ExecutionLost(execution)
        resp.raise_for_status()
        return dict(resp.json())

    def cancel(self, execution: str) -> None:
        self.session().post(f"{self.endpoint}/v1/{execution}:cancel", json={}, timeout=30).raise_for_status()

    def is_callback_url(self, url: str) -> bool:
        """Only callback URLs of our own workflow's executions may be called with our credentials."""
        parsed, ours = urlparse(url), urlparse(self.endpoint)
        return (
            parsed.scheme == ours.scheme
            and parsed.netloc == ours.netloc
            and any(parsed.path.startswith(f"/v1/{parent}/executions/") for parent in self.parents)
            and "/callbacks/" in parsed.path
            and ".." not in parsed.path
        )

    def send_callback(self, url: str, payload: Mapping[str, Any]) -> int:
        """POST a payload to a callback endpoint; returns the HTTP status."""
        if not self.is_callback_url(url):
            raise ValueError(f"refusing callback to {url!r}: not an execution of {self.parent}")
        return int(self.session().post(url, json=dict(payload), timeout=30).status_code)
