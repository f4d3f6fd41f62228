"""retrain's own interpreter of the Google Cloud Workflows language (see ``engine``)."""

from .callbacks import CallbackHub
from .clock import Clock, RealClock, VirtualClock
from .engine import ConnectorRegistry, Workflow, load_workflow
from .errors import ExecutionCancelled, WorkflowError, WorkflowSyntaxError, http_error
from .server import ExecutionsServer

__all__ = [
    "CallbackHub",
    "Clock",
    "ConnectorRegistry",
    "ExecutionCancelled",
    "ExecutionsServer",
    "RealClock",
    "VirtualClock",
    "Workflow",
    "WorkflowError",
    "WorkflowSyntaxError",
    "http_error",
    "load_workflow",
]
