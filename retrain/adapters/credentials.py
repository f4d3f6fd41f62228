"""Who a caller is, when the services it calls are the local stack's.

In the cloud every adapter authenticates with Application Default Credentials: the identity the
deployment runs the code as (a function's service account, the Dataflow worker account, a pod's
Workload Identity).  Against the local stack there are no Google credentials, so each process is handed
the local stand-in of an access token for the identity it runs as (``RETRAIN_LOCAL_ACCESS_TOKEN``, set by
the stack when it starts the process); the adapters present it as a bearer token where Google's clients
send one (Cloud Storage, the GKE API and the cluster's Kubernetes API, workflow executions), and the
stack's fronts map it back to the identity and check infra/'s IAM (``retrain_local.iam``).  A part of a
process that runs as another identity (the cluster twin's Cloud Storage FUSE acting for a pod) says so
with :func:`acting_as`.  Nothing here is read in the cloud.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterator
from contextlib import contextmanager

#: The local stand-in of the access token of the identity this process runs as.
LOCAL_TOKEN_VAR = "RETRAIN_LOCAL_ACCESS_TOKEN"

_acting_as: contextvars.ContextVar[str | None] = contextvars.ContextVar("retrain_acting_as", default=None)


@contextmanager
def acting_as(token: str | None) -> Iterator[None]:
    """Within the block (this thread or task), calls present ``token`` instead of the process's own."""
    reset = _acting_as.set(token)
    try:
        yield
    finally:
        _acting_as.reset(reset)


def local_token() -> str | None:
    """The token this caller presents to the local stack (None: the process was given none)."""
    return _acting_as.get() or os.environ.get(LOCAL_TOKEN_VAR) or None


def bearer() -> dict[str, str]:
    """The ``Authorization`` header of this caller for a local service ({} without a token)."""
    token = local_token()
    return {"Authorization": f"Bearer {token}"} if token else {}
