"""retrain's own interpreter of the Google Cloud Workflows language (see ``engine``)."""

from .callbacks import CallbackHub
from .engine import ConnectorRegistry, Workflow, load_workflow
from .errors import ExecutionCancelled, WorkflowError, WorkflowSyntaxError, http_error
from .server import ExecutionsServer

__all__ = [
    "CallbackHub",
    "ConnectorRegistry",
    "ExecutionCancelled",
    "ExecutionsServer",
    "Workflow",
    "WorkflowError",
    "WorkflowSyntaxError",
    "http_error",
    "load_workflow",
]
