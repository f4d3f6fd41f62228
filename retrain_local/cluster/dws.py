"""GKE's DWS queued provisioning and the cluster autoscaler, for the twin's node pool.

For each ProvisioningRequest (autoscaling.x-k8s.io/v1) of the twin's namespace and node pool: ``Accepted``
at once; after ``provision_delay_s``, ``podSets[0].count`` nodes and ``Provisioned=True``; ``Failed=True``
for a request beyond the pool's autoscaling maximum or under ``Faults(provisioning="fail")``; a
provisioned request's capacity taken back (``CapacityRevoked``) or its booking expired (``BookingExpired``:
no pod on its nodes within the booking window).  A deleted request's nodes go once unneeded for
``scale_down_delay_s`` (the autoscaler's scale-down delay); a lost (preempted) node is replaced after the
provisioning delay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from retrain_local.cluster.faults import Faults
from retrain_local.cluster.nodes import NODEPOOL_LABEL, NodePool
from retrain_local.cluster.status import is_true, set_condition

PR_GROUP, PR_VERSION, PR_PLURAL = "autoscaling.x-k8s.io", "v1", "provisioningrequests"


@dataclass
class Request:
    """What the provisioner holds of one ProvisioningRequest (by uid: one deleted and made again under its
    name is another request)."""

    uid: str
    name: str
    count: int
    seen: float
    provisioned: bool = False
    short_since: float | None = None
    provisioned_at: float = 0.0
    stuck: bool = False
    ended: bool = False
    """Its capacity was taken back (CapacityRevoked) or its booking expired (BookingExpired)."""


class DwsProvisioner:
    def __init__(
        self,
        objects: Any,
        core: Any,
        pool: NodePool,
        *,
        faults: Faults,
        busy: Callable[[], set[str]],
        provision_delay_s: float,
        scale_down_delay_s: float,
        booking_window_s: float,
    ) -> None:
        """``busy``: the nodes a running pod is on (scaling down to the pool's maximum spares those)."""
        self.objects, self.core, self.pool = objects, core, pool
        self.faults = faults
        self.busy = busy
        self.provision_delay_s = provision_delay_s
        self.scale_down_delay_s = scale_down_delay_s
        self.booking_window_s = booking_window_s
        self.requests: dict[str, Request] = {}
        self._stuck_names: set[str] = set()
        self._unneeded: dict[str, float] = {}  # node -> since when no ProvisioningRequest holds it

    @property
    def namespace(self) -> str:
        return self.pool.namespace

    def reconcile(self) -> int:
        """One pass over the ProvisioningRequests; how many there are."""
        listing = self.objects.list_namespaced_custom_object(PR_GROUP, PR_VERSION, self.namespace, PR_PLURAL)
        now = time.monotonic()
        live = set()
        for pr in listing.get("items", []):
            live.add(pr["metadata"]["uid"])
            self._reconcile_request(pr, now)
        self._scale_down(live, now)
        return len(live)

    def _reconcile_request(self, pr: dict[str, Any], now: float) -> None:
        uid = pr["metadata"]["uid"]
        conds = list((pr.get("status") or {}).get("conditions") or [])
        state = self.requests.get(uid)
        if state is None:
            if not is_true(conds, "Failed") and self._targets_pool(pr):
                self._accept(pr, conds, now)
        elif is_true(conds, "Failed") or state.ended:
            return
        elif not state.provisioned:
            self._provision(state, conds, now)
        else:
            self._keep(state, conds, now)

    def _accept(self, pr: dict[str, Any], conds: list[dict[str, Any]], now: float) -> None:
        uid, name = pr["metadata"]["uid"], pr["metadata"]["name"]
        count = int(pr["spec"]["podSets"][0]["count"])
        state = self.requests[uid] = Request(uid, name, count, now)
        if self.faults.provisioning == "stuck_once" and name not in self._stuck_names:
            self._stuck_names.add(name)
            state.stuck = True
        conds = set_condition(
            conds, "Accepted", "True", "Accepted", "ProvisioningRequest is accepted by queued provisioning"
        )
        conds = set_condition(
            conds,
            "Provisioned",
            "False",
            "CapacityNotYetAvailable",
            f"waiting for {count} {self.pool.machine_type} nodes in pool {self.pool.name}",
        )
        self._status(name, conds)

    def _provision(self, state: Request, conds: list[dict[str, Any]], now: float) -> None:
        waiting = self.faults.provisioning == "never" or state.stuck
        if waiting or now - state.seen < self.provision_delay_s:
            return
        others = len([n for n, uid in self.pool.owner.items() if uid != state.uid])
        failure = None
        if state.count + others > self.pool.max_nodes:
            failure = (
                "MaxNodesExceeded",
                f"{state.count} nodes requested but node pool {self.pool.name} autoscaling allows "
                f"at most {self.pool.max_nodes} ({others} in use)",
            )
        elif self.faults.provisioning == "fail":
            failure = (
                "ResourcePoolExhausted",
                f"GCE out of resources: not enough {self.pool.machine_type} capacity for {state.count} "
                "nodes in the zone",
            )
        if failure:
            conds = set_condition(conds, "Provisioned", "False", failure[0], failure[1])
            conds = set_condition(conds, "Failed", "True", failure[0], failure[1])
            self._status(state.name, conds)
            return
        for _ in range(state.count):
            self.pool.create(state.uid, state.name)
        state.provisioned, state.provisioned_at = True, now
        conds = set_condition(
            conds,
            "Provisioned",
            "True",
            "Provisioned",
            f"Provisioning Request was successfully provisioned: {state.count} nodes",
        )
        self._status(state.name, conds)

    def _keep(self, state: Request, conds: list[dict[str, Any]], now: float) -> None:
        """A provisioned request: its capacity ends, or its lost (preempted) nodes are replaced after the
        provisioning delay, within the pool's maximum."""
        ended = self._capacity_ended(state, now)
        if ended is not None:
            state.ended = True
            self._status(state.name, set_condition(conds, ended[0], "True", ended[0], ended[1]))
            for node in sorted(self.pool.owned_by(state.uid)):
                self.pool.delete(node)
            return
        if len(self.pool.owned_by(state.uid)) >= state.count:
            return
        if state.short_since is None:
            state.short_since = now
        elif now - state.short_since >= self.provision_delay_s:
            while (
                len(self.pool.owned_by(state.uid)) < state.count
                and len(self.pool.created) < self.pool.max_nodes
            ):
                self.pool.create(state.uid, state.name)
            state.short_since = None

    def _capacity_ended(self, state: Request, now: float) -> tuple[str, str] | None:
        """(condition, message) when DWS ends a provisioned request's capacity: revoked by a fault, or its
        booking expired with no pod started on its nodes within the booking window."""
        revoke = self.faults.revoke_capacity_after_s
        if revoke is not None and now - state.provisioned_at >= revoke:
            return (
                "CapacityRevoked",
                f"the capacity of {state.count} {self.pool.machine_type} node(s) was revoked",
            )
        if (
            now - state.provisioned_at >= self.booking_window_s
            and not self.pool.owned_by(state.uid) & self.pool.consumed
        ):
            return (
                "BookingExpired",
                f"no Pod consumed the {state.count} provisioned node(s) within the booking",
            )
        return None

    def _scale_down(self, live: set[str], now: float) -> None:
        """The autoscaler: a deleted request's nodes go after the scale-down delay, and idle nodes above the
        pool's maximum go at once."""
        for uid in [u for u in self.requests if u not in live]:
            for node in sorted(self.pool.owned_by(uid)):
                self._unneeded.setdefault(node, now)
            del self.requests[uid]
        for node, since in list(self._unneeded.items()):
            if node not in self.pool.created:
                self._unneeded.pop(node)
            elif now - since >= self.scale_down_delay_s:
                self._unneeded.pop(node)
                self.pool.delete(node)
        if len(self.pool.created) > self.pool.max_nodes:
            busy = self.busy()
            for node in self.pool.names():
                if len(self.pool.created) <= self.pool.max_nodes:
                    break
                if node not in busy:
                    self.pool.delete(node)

    def _targets_pool(self, pr: dict[str, Any]) -> bool:
        from kubernetes.client import ApiException

        try:
            ref = pr["spec"]["podSets"][0]["podTemplateRef"]["name"]
            tmpl = self.core.read_namespaced_pod_template(ref, self.namespace)
        except (KeyError, IndexError, ApiException):
            return True
        selector = (tmpl.template.spec.node_selector if tmpl.template and tmpl.template.spec else None) or {}
        return selector.get(NODEPOOL_LABEL, self.pool.name) == self.pool.name

    def _status(self, name: str, conditions: list[dict[str, Any]]) -> None:
        self.objects.patch_namespaced_custom_object_status(
            PR_GROUP,
            PR_VERSION,
            self.namespace,
            PR_PLURAL,
            name,
            {"status": {"conditions": conditions}},
            _content_type="application/merge-patch+json",
        )
