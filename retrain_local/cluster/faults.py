"""The faults a test or the operator injects into the cluster twin: what real GKE does on a bad day."""

from __future__ import annotations

from dataclasses import dataclass

PROVISIONING_FAULTS = ("ok", "fail", "never", "stuck_once")


@dataclass
class Faults:
    provisioning: str = "ok"
    """ok; fail (Failed=True); never (Accepted, never provisioned: a pool gone from under it,
    kubernetes/autoscaler#9490); stuck_once (a run's first request stays Accepted, a new one with its name
    is provisioned: kubernetes-sigs/kueue#3245)."""
    crash_pod_once: bool = False
    crash_pods_always: bool = False  # every attempt's rank 0 dies: the JobSet exhausts maxRestarts
    preempt_node_after_s: float | None = None
    hold_training_s: float = 0.0  # pods that exited 0 count as running until this long after their start
    revoke_capacity_after_s: float | None = None
    """DWS takes a provisioned request's capacity back this long after provisioning (CapacityRevoked)."""
    unschedulable: bool = False
    """Pods never land on the provisioned nodes: the booking expires (BookingExpired) after the window."""

    def __post_init__(self) -> None:
        if self.provisioning not in PROVISIONING_FAULTS:
            raise ValueError(
                f"Faults.provisioning must be one of {PROVISIONING_FAULTS}, not {self.provisioning!r}"
            )
