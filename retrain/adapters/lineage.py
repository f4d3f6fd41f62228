"""Google's Data Lineage API (:class:`retrain.ports.Lineage`): a run's OpenLineage events, each through
``ProcessOpenLineageRunEvent`` (POST ``v1/{parent=projects/*/locations/*}:processOpenLineageRunEvent``,
the event as the body; cloud.google.com/dataplex/docs/reference/data-lineage/rest).

Each request carries a ``requestId`` derived from the run and the event's place ("This request is
idempotent only if a requestId is provided"), so a finish step retried reports nothing twice.  An
endpoint (``RETRAIN_LINEAGE_ENDPOINT``, ``http://host:port``) points the client's REST transport
elsewhere, as the other adapters' emulator variables do."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("retrain.lineage")

ENDPOINT_VAR = "RETRAIN_LINEAGE_ENDPOINT"


class DataLineage:
    """Reports to Data Lineage in ``projects/PROJECT/locations/LOCATION``."""

    def __init__(self, project: str, location: str) -> None:
        self.parent = f"projects/{project}/locations/{location}"
        self._client: Any = None

    def _lineage_client(self) -> Any:
        from google.cloud import datacatalog_lineage_v1

        endpoint = os.environ.get(ENDPOINT_VAR)
        if not endpoint:
            return datacatalog_lineage_v1.LineageClient()
        from google.auth.credentials import AnonymousCredentials
        from google.cloud.datacatalog_lineage_v1.services.lineage.transports.rest import LineageRestTransport

        scheme, _, host = endpoint.partition("://")
        transport = LineageRestTransport(host=host, url_scheme=scheme, credentials=AnonymousCredentials())
        return datacatalog_lineage_v1.LineageClient(transport=transport)

    def report(self, run_id: str, events: Sequence[dict[str, Any]]) -> None:
        try:
            if self._client is None:
                self._client = self._lineage_client()
            for i, event in enumerate(events):
                request_id = str(
                    uuid.uuid5(uuid.NAMESPACE_URL, f"https://retrain.dev/runs/{run_id}/lineage/{i}")
                )
                self._client.process_open_lineage_run_event(
                    request={"parent": self.parent, "open_lineage": event, "request_id": request_id}
                )
        except Exception as e:  # the run has ended; its lineage is kept in its folder all the same
            log.warning("run %s: lineage not reported to %s: %s", run_id, self.parent, e)
