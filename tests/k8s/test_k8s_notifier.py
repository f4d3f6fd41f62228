"""The notifier publishes each terminal JobSet state exactly once, across its own restarts."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from retrain.k8s.notifier import NOTIFIED_ANNOTATION, Notifier
from retrain.k8s.render import render_jobset, render_provisioning_request
from retrain.trainers import Command
from retrain_local.cluster import ClusterTwin

from .waiting import wait_for

pytestmark = pytest.mark.envtest

JS = ("jobset.x-k8s.io", "v1alpha2", "jobsets")


class Recorder:
    def __init__(self) -> None:
        self.messages: list[tuple[dict[str, Any], dict[str, str]]] = []
        self.lock = threading.Lock()

    def __call__(self, data: bytes, attributes: dict[str, str]) -> None:
        with self.lock:
            self.messages.append((json.loads(data), dict(attributes)))


def submit(api: Any, ns: str, pool: str, run_id: str, code: str, **kw: Any) -> dict[str, Any]:
    from kubernetes import client

    tmpl, pr = render_provisioning_request(run_id, nodes=1, namespace=ns, node_pool=pool)
    client.CoreV1Api(api).create_namespaced_pod_template(ns, tmpl)
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        "autoscaling.x-k8s.io", "v1", ns, "provisioningrequests", pr
    )
    js = render_jobset(
        run_id,
        nodes=1,
        image="local",
        command=Command(["python", "-c", code], []),
        namespace=ns,
        node_pool=pool,
        **kw,
    )
    return dict(client.CustomObjectsApi(api).create_namespaced_custom_object(*JS[:2], ns, JS[2], js))


def get_js(api: Any, ns: str, name: str) -> dict[str, Any]:
    from kubernetes import client

    return dict(client.CustomObjectsApi(api).get_namespaced_custom_object(*JS[:2], ns, JS[2], name))


def test_exactly_once_across_notifier_restarts(api: Any, namespace: str, tmp_path: Path) -> None:
    pool = f"pool-{namespace}"
    rec = Recorder()
    state = tmp_path / "notifier-state.json"
    twin = ClusterTwin(
        api, namespace=namespace, node_pool=pool, workdir=tmp_path / "twin", provision_delay_s=0.2, poll_s=0.1
    )
    with twin:
        first = Notifier(api, rec, namespace=namespace, state_path=state, watch_timeout_s=1).start()
        js = submit(
            api,
            namespace,
            pool,
            "notify-1",
            "import time; time.sleep(2)",
            callback_url="https://cb.example/run/notify-1",
        )
        name = js["metadata"]["name"]
        wait_for(lambda: twin.pods())
        first.stop()  # restarted mid-run
        assert rec.messages == []
        second = Notifier(api, rec, namespace=namespace, state_path=state, watch_timeout_s=1).start()
        wait_for(lambda: rec.messages)
        wait_for(
            lambda: (get_js(api, namespace, name)["metadata"].get("annotations") or {}).get(
                NOTIFIED_ANNOTATION
            )
        )
        second.stop()
        # A third incarnation (fresh relist from the state file's resourceVersion, and one with no state
        # at all, relying on the annotation) must not publish again.
        Notifier(api, rec, namespace=namespace, state_path=state, watch_timeout_s=1).start().stop()
        stateless = Notifier(api, rec, namespace=namespace, watch_timeout_s=1).start()
        time.sleep(1.5)
        stateless.stop()

    assert len(rec.messages) == 1
    body, attrs = rec.messages[0]
    obj = get_js(api, namespace, name)
    assert obj["metadata"]["annotations"][NOTIFIED_ANNOTATION] == "Completed"
    assert attrs["dedupe_key"] == f"{obj['metadata']['uid']}:Completed" == body["dedupe_key"]
    assert attrs["run_id"] == body["run_id"] == "notify-1"
    assert body["state"] == "Completed" and body["succeeded"] is True
    assert body["reason"] == "AllJobsCompleted"
    assert body["callback_url"] == "https://cb.example/run/notify-1"
    assert body["jobset"] == {"name": name, "namespace": namespace, "uid": obj["metadata"]["uid"]}
    assert body["start_time"] and body["finish_time"]


def test_failed_state_published_with_reason(api: Any, namespace: str, tmp_path: Path) -> None:
    pool = f"pool-{namespace}"
    rec = Recorder()
    with ClusterTwin(
        api, namespace=namespace, node_pool=pool, workdir=tmp_path / "twin", provision_delay_s=0.2, poll_s=0.1
    ):
        notifier = Notifier(api, rec, namespace=namespace, watch_timeout_s=1).start()
        submit(api, namespace, pool, "notify-fail", "raise SystemExit(2)", max_restarts=0)
        wait_for(lambda: rec.messages)
        time.sleep(0.5)
        notifier.stop()
    assert len(rec.messages) == 1
    body, attrs = rec.messages[0]
    assert attrs["state"] == body["state"] == "Failed" and body["succeeded"] is False
    assert body["reason"] == "ReachedMaxRestarts" and "first failed job" in body["message"]


def test_gone_watch_relists(api: Any, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """List first, watch from the list's resourceVersion; a 410 Gone relists before watching again."""
    from kubernetes.client import ApiException

    notifier = Notifier(api, Recorder(), namespace=namespace)
    calls: list[str] = []
    stop = threading.Event()
    real_relist = notifier._relist

    def watch(rv: str, _stop: threading.Event) -> str:
        calls.append(f"watch:{rv}")
        if len(calls) == 2:
            raise ApiException(status=410, reason="Gone")
        stop.set()
        return rv

    def relist() -> str:
        calls.append("relist")
        return real_relist()

    monkeypatch.setattr(notifier, "_watch", watch)
    monkeypatch.setattr(notifier, "_relist", relist)
    notifier.run(stop)
    assert [c.split(":")[0] for c in calls] == ["relist", "watch", "relist", "watch"]
    assert notifier.resource_version is not None


def test_a_resource_version_from_another_etcd_loses_no_completion(
    api: Any, namespace: str, tmp_path: Path
) -> None:
    """A state file from before ``retrain down``/``up`` (a fresh etcd, whose resourceVersions are far
    below the stored one): the notifier lists first, so the next completion is published."""
    pool = f"pool-{namespace}"
    rec = Recorder()
    state = tmp_path / "notifier-state.json"
    state.write_text(json.dumps({"resourceVersion": "987654321", "delivered": {}}))
    with ClusterTwin(
        api, namespace=namespace, node_pool=pool, workdir=tmp_path / "twin", provision_delay_s=0.2, poll_s=0.1
    ):
        notifier = Notifier(api, rec, namespace=namespace, state_path=state, watch_timeout_s=1).start()
        try:
            submit(api, namespace, pool, "notify-stale", "pass")
            wait_for(lambda: rec.messages, timeout=30)
        finally:
            notifier.stop()
    assert [m[0]["run_id"] for m in rec.messages] == ["notify-stale"]


def test_a_completion_missed_while_down_is_found_by_the_next_list(
    api: Any, namespace: str, tmp_path: Path
) -> None:
    """The JobSet finishes while no notifier runs: the next one publishes it from its first list."""
    pool = f"pool-{namespace}"
    rec = Recorder()
    with ClusterTwin(
        api, namespace=namespace, node_pool=pool, workdir=tmp_path / "twin", provision_delay_s=0.2, poll_s=0.1
    ):
        js = submit(api, namespace, pool, "notify-missed", "pass")
        wait_for(
            lambda: (get_js(api, namespace, js["metadata"]["name"]).get("status") or {}).get("terminalState")
        )
        notifier = Notifier(api, rec, namespace=namespace, watch_timeout_s=1).start()
        try:
            wait_for(lambda: rec.messages, timeout=30)
        finally:
            notifier.stop()
    assert [m[0]["state"] for m in rec.messages] == ["Completed"]
