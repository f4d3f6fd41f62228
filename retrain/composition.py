"""The composition root: the one place that picks the adapter behind each port.

Cloud and emulator differ only by endpoint (the client libraries' ``*_EMULATOR_HOST`` variables;
``RETRAIN_WORKFLOWS_ENDPOINT``, ``RETRAIN_WORKFLOWS_GRPC_ENDPOINT`` and ``RETRAIN_CONTAINER_ENDPOINT`` for
the services without one), so there is one adapter per port and no switch here. The functions and the
operator's CLI (``retrain --target``) build theirs here alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from retrain.config import Settings
from retrain.ingest import Ingest
from retrain.steps import Steps

if TYPE_CHECKING:
    from retrain.adapters.cluster import GkeCluster
    from retrain.adapters.events import PubSubRunEvents
    from retrain.adapters.ledger import FirestoreLedger
    from retrain.adapters.workflows import WorkflowsExecutions


def ledger(settings: Settings) -> FirestoreLedger:
    """The Firestore ledger (:class:`retrain.ports.Ledger`)."""
    from retrain.adapters.ledger import FirestoreLedger

    return FirestoreLedger(settings.project)


def orchestrator(settings: Settings) -> WorkflowsExecutions:
    """Workflow executions (:class:`retrain.ports.Orchestrator`)."""
    from retrain.adapters.workflows import WorkflowsExecutions

    return WorkflowsExecutions(
        settings.project, settings.region, settings.workflow, project_number=settings.project_number
    )


def cluster(settings: Settings) -> GkeCluster:
    """The GKE cluster (:class:`retrain.ports.Cluster`), found through the GKE API."""
    from retrain.adapters.cluster import GkeCluster

    return GkeCluster(settings)


def run_events(settings: Settings) -> PubSubRunEvents:
    """The run events topic (:class:`retrain.ports.RunEvents`)."""
    from retrain.adapters.events import PubSubRunEvents

    return PubSubRunEvents(settings.project, settings.events_topic)


def steps(settings: Settings) -> Steps:
    """The workflow's steps in Python, with their real adapters."""
    from retrain.adapters import objects

    lineage = None
    if settings.lineage_location:
        from retrain.adapters.lineage import DataLineage

        lineage = DataLineage(settings.project, settings.lineage_location)
    return Steps(settings, ledger(settings), objects, run_events(settings), lineage)


def ingest(settings: Settings) -> Ingest:
    """Every trigger's handler with its real adapters."""
    from retrain.adapters import objects

    warehouse = None
    if settings.bigquery_tables:
        from retrain.adapters.warehouse import BigQueryWarehouse

        warehouse = BigQueryWarehouse(settings.project, call_timeout_s=settings.bigquery_call_timeout_s)
    return Ingest(
        settings,
        ledger(settings),
        orchestrator(settings),
        objects,
        warehouse,
        cluster(settings),
        run_events(settings),
    )
