"""The JobSet notifier: publishes each training JobSet's terminal state (Completed / Failed) exactly once.

It watches JobSets labelled ``retrain.dev/run-id`` and, for each one that reaches a terminal condition,
publishes one JSON message carrying the run id, the state (with reason and message), start and finish
times, the JobSet's name/uid and its ``retrain.dev/callback-url`` annotation.

It follows the informer pattern, so that no completion is lost across restarts or compaction: it lists
first and watches from the list's resourceVersion (a resourceVersion kept from another run of the
notifier, or another etcd, says nothing about this one), relists on 410 Gone, on any error and every
``resync_s``, and on every list reconciles each terminal JobSet not marked as published yet.

Exactly once across restarts of the notifier:
- delivery is recorded durably twice: in the state file (``state_path``: delivered keys) and on the
  JobSet itself, ``retrain.dev/notified=<state>``, written with a resourceVersion-conditioned merge patch
  (a 409 is re-read and retried);
- a JobSet already carrying that annotation, or whose key is in the state file, is never published again.
The window between a successful publish and its recording (a crash right there) can still produce a
second publish; every message carries ``dedupe_key`` = ``<jobset uid>:<state>`` in its attributes (and
body) so subscribers drop duplicates.  A lost message costs at most one period of the workflow's own
check of the JobSet (``completion_check_s``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from retrain.contracts import CompletionState, JobSetCompletion, JobSetRef
from retrain.k8s.render import CALLBACK_ANNOTATION, RUN_ID_ANNOTATION, RUN_ID_LABEL

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
NOTIFIED_ANNOTATION = "retrain.dev/notified"
TERMINAL = ("Completed", "Failed")
#: Delivered keys kept in the state file (the oldest go first).
MAX_REMEMBERED = 1000

Publish = Callable[[bytes, dict[str, str]], None]


def terminal_state(jobset: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """("Completed" | "Failed", the condition) of a finished JobSet, else None."""
    status = jobset.get("status") or {}
    conds = status.get("conditions") or []
    for c in conds:
        if c.get("type") in TERMINAL and c.get("status") == "True":
            return c["type"], c
    ts = status.get("terminalState")
    if ts in TERMINAL:
        return ts, {"type": ts, "reason": "", "message": ""}
    return None


def message_for(jobset: dict[str, Any], state: str, cond: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """The :class:`JobSetCompletion` of ``jobset`` reaching ``state`` (its JSON), and the message's
    attributes."""
    meta = jobset["metadata"]
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    status = jobset.get("status") or {}
    run_id = annotations.get(RUN_ID_ANNOTATION) or labels.get(RUN_ID_LABEL, "")
    key = f"{meta['uid']}:{state}"
    completion = JobSetCompletion(
        type=JobSetCompletion.TYPE,
        run_id=run_id,
        state=CompletionState(state),
        succeeded=state == CompletionState.COMPLETED,
        reason=cond.get("reason", ""),
        message=cond.get("message", ""),
        start_time=meta.get("creationTimestamp"),
        finish_time=cond.get("lastTransitionTime"),
        restarts=int(status.get("restarts") or 0),
        jobset=JobSetRef(meta["name"], str(meta.get("namespace") or ""), meta["uid"]),
        callback_url=annotations.get(CALLBACK_ANNOTATION),
        dedupe_key=key,
    )
    attributes = {"dedupe_key": key, "run_id": run_id, "state": state, "jobset": meta["name"]}
    return completion.to_json(), attributes


class Notifier:
    def __init__(
        self,
        api: Any,
        publish: Publish,
        namespace: str = "default",
        state_path: Path | None = None,
        *,
        watch_timeout_s: int = 2,
        resync_s: float = 300.0,
    ) -> None:
        from kubernetes import client

        self.api = api
        self.publish = publish
        self.namespace = namespace
        self.state_path = Path(state_path) if state_path else None
        self.watch_timeout_s = watch_timeout_s
        self.resync_s = resync_s
        self._objects: Any = client.CustomObjectsApi(api)
        self._state: dict[str, Any] = {"delivered": {}}
        self._resource_version: str | None = None
        self._load_state()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # --- durable state -------------------------------------------------------------------------
    def _load_state(self) -> None:
        if self.state_path and self.state_path.exists():
            try:
                data = json.loads(self.state_path.read_text())
                self._state["delivered"] = dict(data.get("delivered") or {})
            except (OSError, ValueError) as e:
                log.warning("ignoring unreadable notifier state %s: %s", self.state_path, e)

    def _save_state(self) -> None:
        if not self.state_path:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(self.state_path.suffix + ".tmp")
        tmp.write_text(json.dumps(self._state, sort_keys=True))
        os.replace(tmp, self.state_path)

    @property
    def resource_version(self) -> str | None:
        """The last resourceVersion seen (in memory only: it means nothing to another notifier)."""
        return self._resource_version

    def _seen(self, rv: str | None) -> None:
        if rv:
            self._resource_version = rv

    def _delivered(self, key: str, name: str) -> None:
        delivered = self._state["delivered"]
        delivered[key] = name
        while len(delivered) > MAX_REMEMBERED:  # the JobSet's own mark is the lasting record
            delivered.pop(next(iter(delivered)))
        self._save_state()

    # --- reconcile one JobSet --------------------------------------------------------------------
    def handle(self, jobset: dict[str, Any]) -> bool:
        """Publish ``jobset``'s terminal state unless already delivered; True when it published."""
        term = terminal_state(jobset)
        if term is None:
            return False
        state, cond = term
        meta = jobset["metadata"]
        key = f"{meta['uid']}:{state}"
        notified = (meta.get("annotations") or {}).get(NOTIFIED_ANNOTATION)
        if notified == state:
            if key not in self._state["delivered"]:
                self._delivered(key, meta["name"])
            return False
        published = False
        if key not in self._state["delivered"]:
            data, attributes = message_for(jobset, state, cond)
            self.publish(data, attributes)  # raises on failure: nothing recorded, retried on relist
            published = True
            self._delivered(key, meta["name"])
            log.info("published %s for jobset %s/%s", state, meta.get("namespace"), meta["name"])
        self._annotate(jobset, state)
        return published

    def _annotate(self, jobset: dict[str, Any], state: str) -> None:
        from kubernetes.client import ApiException

        meta = jobset["metadata"]
        name, rv = meta["name"], meta.get("resourceVersion")
        for _ in range(5):
            body: dict[str, Any] = {"metadata": {"annotations": {NOTIFIED_ANNOTATION: state}}}
            if rv:
                body["metadata"]["resourceVersion"] = rv
            try:
                self._objects.patch_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    self.namespace,
                    PLURAL,
                    name,
                    body,
                    _content_type="application/merge-patch+json",
                )
                return
            except ApiException as e:
                if e.status == 404:
                    return
                if e.status != 409:
                    log.warning("could not annotate jobset %s: %s %s", name, e.status, e.reason)
                    return
            try:
                fresh = self._objects.get_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, name
                )
            except ApiException as e:
                if e.status == 404:
                    return
                raise
            if fresh["metadata"].get("uid") != meta.get("uid"):
                return
            if (fresh["metadata"].get("annotations") or {}).get(NOTIFIED_ANNOTATION) == state:
                return
            rv = fresh["metadata"].get("resourceVersion")

    # --- list / watch loop -----------------------------------------------------------------------
    def _relist(self) -> str:
        listing = self._objects.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, label_selector=RUN_ID_LABEL
        )
        for item in listing.get("items", []):
            self.handle(item)
        rv = str(listing["metadata"]["resourceVersion"])
        self._seen(rv)
        return rv

    def _watch(self, rv: str, stop: threading.Event) -> str:
        from kubernetes import watch

        w = watch.Watch()
        stream = w.stream(
            self._objects.list_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            label_selector=RUN_ID_LABEL,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout_s,
            _request_timeout=self.watch_timeout_s + 10,
        )
        for event in stream:
            obj = event.get("object") or {}
            if event.get("type") == "ERROR":  # a Status, e.g. 410 Gone or "too large resource version"
                from kubernetes.client import ApiException

                status = obj if isinstance(obj, dict) else {}
                raise ApiException(status=int(status.get("code") or 500), reason=str(status.get("message")))
            if event.get("type") in ("ADDED", "MODIFIED") and isinstance(obj, dict):
                self.handle(obj)
            new_rv = (obj.get("metadata") or {}).get("resourceVersion") if isinstance(obj, dict) else None
            if new_rv:
                rv = str(new_rv)
                self._seen(rv)
            if stop.is_set():
                w.stop()
                break
        return rv

    def run(self, stop: threading.Event) -> None:
        """List, then watch from the list's resourceVersion, until ``stop`` is set; relist on 410 Gone,
        on errors and every ``resync_s``."""
        import time

        from kubernetes.client import ApiException

        rv: str | None = None  # always list first: a stored resourceVersion may belong to another etcd
        listed_at = 0.0
        backoff = 0.2
        while not stop.is_set():
            try:
                if rv is None or time.monotonic() - listed_at >= self.resync_s:
                    rv = self._relist()
                    listed_at = time.monotonic()
                rv = self._watch(rv, stop)
                backoff = 0.2
            except ApiException as e:
                if e.status == 410:
                    log.info("watch expired (410 Gone) at resourceVersion %s; relisting", rv)
                    rv = None
                    continue
                log.warning("notifier: API error %s %s; retrying", e.status, e.reason)
                rv = None
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception as e:  # network errors, publish failures: relist and retry
                log.warning("notifier: %s: %s; retrying", type(e).__name__, e)
                rv = None
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def start(self) -> Notifier:
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, args=(self._stop,), name="notifier", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout_s)
            self._thread = None


def pubsub_publisher(project: str, topic: str) -> Publish:
    """A publish callable for a Pub/Sub topic that blocks until the message is accepted."""
    from google.cloud import pubsub_v1  # type: ignore[attr-defined]

    publisher = pubsub_v1.PublisherClient()
    path = publisher.topic_path(project, topic)

    def publish(data: bytes, attributes: dict[str, str]) -> None:
        publisher.publish(path, data, **attributes).result(timeout=60)

    return publish


def main(argv: list[str] | None = None) -> int:
    """``retrain-notify`` (or the operator's ``retrain notify``): run the notifier in the cluster (or
    against $KUBECONFIG)."""
    from kubernetes import config

    from retrain.config import load

    settings = load()
    parser = argparse.ArgumentParser(prog="retrain notify")
    parser.add_argument("--namespace", default=settings.namespace)
    parser.add_argument("--project", default=settings.project)
    parser.add_argument("--topic", default=settings.jobset_topic)
    parser.add_argument("--state", default=os.environ.get("RETRAIN_NOTIFIER_STATE"))
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.kubeconfig:
        api = config.new_client_from_config(config_file=args.kubeconfig)
    else:
        config.load_incluster_config()
        from kubernetes import client

        api = client.ApiClient()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError):
            signal.signal(sig, lambda *_: stop.set())
    notifier = Notifier(
        api,
        pubsub_publisher(args.project, args.topic),
        namespace=args.namespace,
        state_path=Path(args.state) if args.state else None,
    )
    notifier.run(stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
