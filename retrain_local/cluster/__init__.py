"""The local cluster twin: GKE's DWS provisioner, the JobSet controller and the kubelet, played against a
real API server, so runs and tests exercise the real objects and statuses (:mod:`.twin` composes them)."""

from retrain_local.cluster.faults import Faults
from retrain_local.cluster.twin import ClusterTwin

__all__ = ["ClusterTwin", "Faults"]
