"""Workflow executions through Google's client, ``google.cloud.workflows.executions_v1.ExecutionsClient``
(create, get, cancel), and callbacks as authorised HTTP POSTs (no client library covers them).

One adapter for both worlds: in the cloud the client reaches workflowexecutions.googleapis.com with
Application Default Credentials; locally ``RETRAIN_WORKFLOWS_GRPC_ENDPOINT`` points it at retrain's
own executions service (``cloudworkflows.server``, over an insecure channel, as Google's clients reach
their emulators) and ``RETRAIN_WORKFLOWS_ENDPOINT`` is where that service's callback URLs live.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

import requests

from retrain.adapters import credentials
from retrain.domain.errors import ExecutionLost
from retrain.ports import ExecutionState, ExecutionStatus

CLOUD_ENDPOINT = "https://workflowexecutions.googleapis.com"

log = logging.getLogger(__name__)


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
        grpc_endpoint: str | None = None,
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
        self.grpc_endpoint = grpc_endpoint or os.environ.get("RETRAIN_WORKFLOWS_GRPC_ENDPOINT", "")
        self._client: Any = None

    @property
    def local(self) -> bool:
        return self.endpoint != CLOUD_ENDPOINT

    def session(self) -> requests.Session:
        if self._session is None:
            if self.local:
                self._session = requests.Session()
                self._session.headers.update(credentials.bearer())
            else:  # pragma: no cover - needs Google credentials
                import google.auth
                from google.auth.transport.requests import AuthorizedSession

                creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
                self._session = AuthorizedSession(creds)
        return self._session

    def client(self) -> Any:
        """The ``ExecutionsClient``: Google's endpoint and credentials, or the local service's."""
        if self._client is None:
            from google.cloud.workflows.executions_v1 import ExecutionsClient
            from google.cloud.workflows.executions_v1.services.executions.transports import (
                ExecutionsGrpcTransport,
            )

            if self.local:
                if not self.grpc_endpoint:
                    raise RuntimeError(
                        "RETRAIN_WORKFLOWS_GRPC_ENDPOINT is not set for the local executions service"
                    )
                import grpc

                channel = grpc.insecure_channel(self.grpc_endpoint)
                self._client = ExecutionsClient(transport=ExecutionsGrpcTransport(channel=channel))
            else:  # pragma: no cover - needs Google credentials
                self._client = ExecutionsClient()
        return self._client

    def start(self, argument: Mapping[str, Any]) -> str:
        """Create an execution; returns its resource name."""
        from google.cloud.workflows.executions_v1 import Execution

        execution = Execution(
            argument=json.dumps(argument), call_log_level=Execution.CallLogLevel.LOG_ERRORS_ONLY
        )
        created = self.client().create_execution(
            parent=self.parent, execution=execution, timeout=30, metadata=self._metadata()
        )
        return str(created.name)

    def _metadata(self) -> list[tuple[str, str]]:
        """The local caller's identity, as gRPC metadata (in the cloud the channel's credentials carry
        it)."""
        token = credentials.local_token() if self.local else None
        return [("authorization", f"Bearer {token}")] if token else []

    def get(self, execution: str) -> ExecutionStatus:
        """The execution's state and error; ExecutionLost when there is none (404)."""
        from google.api_core.exceptions import NotFound
        from google.cloud.workflows.executions_v1 import Execution

        try:
            found = self.client().get_execution(name=execution, timeout=30, metadata=self._metadata())
        except NotFound:
            raise ExecutionLost(execution) from None
        resource = Execution.to_dict(found, use_integers_for_enums=False, preserving_proto_field_name=False)
        error = (resource.get("error") or {}).get("payload")
        try:
            state = ExecutionState(resource.get("state") or "STATE_UNSPECIFIED")
        except ValueError:  # a state newer than this release: not one it may act on (not ended)
            log.warning(
                "execution %s is in a state this release does not know: %s", execution, resource.get("state")
            )
            state = ExecutionState.STATE_UNSPECIFIED
        return ExecutionStatus(state, error or None)

    def cancel(self, execution: str) -> None:
        self.client().cancel_execution(name=execution, timeout=30, metadata=self._metadata())

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
