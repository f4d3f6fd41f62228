"""The JobSet relay (``on_jobset_event``) against the real API server (envtest), the real Firestore and
Pub/Sub emulators and the real functions-framework: a completion reaches the run's workflow only when the
JobSet itself confirms it, and one the relay keeps failing on ends in the dead-letter topic.

The workflow's callback endpoint is Google's control plane; here it is a recorder serving the documented
path (``POST /v1/projects/P/locations/L/workflows/W/executions/E/callbacks/C``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from google.cloud import pubsub_v1  # type: ignore[attr-defined]

from retrain import config
from retrain.adapters.cluster import CONTAINER_ENDPOINT_VAR, GkeCluster
from retrain.adapters.credentials import LOCAL_TOKEN_VAR
from retrain.adapters.ledger import FirestoreLedger
from retrain.adapters.workflows import WorkflowsExecutions
from retrain.domain.errors import Rejected
from retrain.domain.runs import Run, RunStatus
from retrain.domain.transitions import RunEnd
from retrain.ingest import Action, Ingest
from retrain.k8s.notifier import message_for, terminal_state
from retrain.k8s.render import JOBSET_API, render_jobset
from retrain.trainers import Command
from retrain_local import delivery
from retrain_local.gke_api import GkeApiServer
from retrain_local.processes import free_port, start_on_a_free_port
from retrain_local.serverless import function_server

pytestmark = [pytest.mark.envtest, pytest.mark.emulators]

GROUP, VERSION = JOBSET_API.split("/")


def callback_url(endpoint: str, settings: config.Settings, execution: str) -> str:
    """A callback URL of one of the workflow's executions, as events.create_callback_endpoint returns."""
    parent = f"projects/{settings.project}/locations/{settings.region}/workflows/{settings.workflow}"
    return f"{endpoint}/v1/{parent}/executions/{execution}/callbacks/c-{execution}"


class CallbackRecorder:
    """Google's callback endpoint for one execution: records every POST, answers 200."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, Any]]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.received.append((self.path, json.loads(body)))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def recorder() -> Iterator[CallbackRecorder]:
    r = CallbackRecorder()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture()
def settings(firestore_host: str, project: str, namespace: str) -> config.Settings:
    return dataclasses.replace(config.load({}), project=project, namespace=namespace)


class Relay:
    """A live run with a JobSet in the API server, and the relay that confirms its completions."""

    def __init__(self, settings: config.Settings, api: Any, recorder: CallbackRecorder) -> None:
        from kubernetes import client

        self.settings, self.recorder = settings, recorder
        self.objects: Any = client.CustomObjectsApi(api)
        self.ledger = FirestoreLedger(settings.project)
        executions = WorkflowsExecutions(
            settings.project, settings.region, settings.workflow, endpoint=recorder.endpoint
        )
        self.ingest = Ingest(settings, self.ledger, executions, None, cluster=GkeCluster(settings))  # type: ignore[arg-type]

    def run(self, run_id: str, endpoint: str | None = None) -> Run:
        """A run in training whose execution's callbacks are served at ``endpoint`` (the recorder's)."""
        url = callback_url(endpoint or self.recorder.endpoint, self.settings, run_id)
        run = Run(
            run_id=run_id, dataset="news", trigger="manual", status=RunStatus.TRAINING, callback_url=url
        )
        self.ledger.db.collection("runs").document(run_id).set(run.to_dict())
        return run

    def jobset(self, run: Run, state: str | None) -> dict[str, Any]:
        """The run's JobSet as handover renders it; ``state`` ("Completed" | "Failed") is set on its
        status as the JobSet controller would, None leaves it running."""
        body = render_jobset(
            run.run_id,
            nodes=1,
            image="local",
            command=Command(["true"], []),
            namespace=self.settings.namespace,
            callback_url=run.callback_url,
        )
        ns = self.settings.namespace
        created = self.objects.create_namespaced_custom_object(GROUP, VERSION, ns, "jobsets", body)
        if state is None:
            return dict(created)
        condition = {
            "type": state,
            "status": "True",
            "reason": "AllJobsCompleted" if state == "Completed" else "FailedJobs",
            "message": "jobset completed" if state == "Completed" else "jobset failed",
            "lastTransitionTime": "2026-11-24T10:00:00Z",
        }
        patched = self.objects.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            ns,
            "jobsets",
            created["metadata"]["name"],
            {"status": {"conditions": [condition], "terminalState": state}},
        )
        return dict(patched)


@pytest.fixture()
def relay(
    settings: config.Settings,
    api: Any,
    recorder: CallbackRecorder,
    gke_api: GkeApiServer,
) -> Relay:
    return Relay(settings, api, recorder)


def notifier_message(jobset: dict[str, Any], state: str | None = None) -> dict[str, Any]:
    """What the notifier publishes for ``jobset`` (its terminal state, or a claimed ``state``)."""
    terminal = terminal_state(jobset)
    claimed, condition = terminal if terminal else (state, {"type": state, "reason": "", "message": ""})
    assert claimed is not None
    body, _ = message_for(jobset, state or claimed, condition)
    return dict(json.loads(body))


def test_a_confirmed_completion_reaches_the_runs_callback(relay: Relay) -> None:
    run = relay.run(f"r-{uuid.uuid4().hex[:6]}")
    jobset = relay.jobset(run, "Completed")
    outcome = relay.ingest.on_jobset_event(notifier_message(jobset))
    assert (outcome.action, outcome.run_id) == (Action.RELAYED, run.run_id)
    ((path, payload),) = relay.recorder.received
    assert relay.recorder.endpoint + path == run.callback_url
    assert payload["state"] == "Completed" and payload["run_id"] == run.run_id
    assert payload["jobset"] == jobset["metadata"]["name"]


def test_a_forged_failure_of_a_running_jobset_is_rejected_and_never_posted(relay: Relay) -> None:
    run = relay.run(f"r-{uuid.uuid4().hex[:6]}")
    jobset = relay.jobset(run, None)  # still running
    with pytest.raises(Rejected, match="not finished, not Failed"):
        relay.ingest.on_jobset_event(notifier_message(jobset, state="Failed"))
    assert relay.recorder.received == []


def test_a_message_contradicting_the_jobsets_state_is_rejected(relay: Relay) -> None:
    run = relay.run(f"r-{uuid.uuid4().hex[:6]}")
    message = notifier_message(relay.jobset(run, "Completed"))
    message["state"], message["succeeded"] = "Failed", False
    with pytest.raises(Rejected, match="is Completed, not Failed"):
        relay.ingest.on_jobset_event(message)
    assert relay.recorder.received == []


def test_a_message_naming_another_jobset_uid_is_rejected(relay: Relay) -> None:
    run = relay.run(f"r-{uuid.uuid4().hex[:6]}")
    message = notifier_message(relay.jobset(run, "Completed"))
    message["jobset"]["uid"] = str(uuid.uuid4())  # a JobSet of the same name, deleted and recreated
    with pytest.raises(Rejected, match="label or uid differ"):
        relay.ingest.on_jobset_event(message)
    assert relay.recorder.received == []


def test_a_message_for_a_jobset_that_does_not_exist_is_rejected(relay: Relay) -> None:
    run = relay.run(f"r-{uuid.uuid4().hex[:6]}")
    jobset = relay.jobset(run, "Completed")
    message = notifier_message(jobset)
    relay.objects.delete_namespaced_custom_object(
        GROUP, VERSION, relay.settings.namespace, "jobsets", jobset["metadata"]["name"]
    )
    with pytest.raises(Rejected, match="does not exist"):
        relay.ingest.on_jobset_event(message)
    assert relay.recorder.received == []


def test_a_message_redirecting_the_callback_is_rejected(relay: Relay) -> None:
    run, other = relay.run(f"r-{uuid.uuid4().hex[:6]}"), relay.run(f"o-{uuid.uuid4().hex[:6]}")
    message = notifier_message(relay.jobset(run, "Completed"))
    message["callback_url"] = other.callback_url
    with pytest.raises(Rejected, match="callback that is not run"):
        relay.ingest.on_jobset_event(message)
    assert relay.recorder.received == []


def test_a_completion_of_an_ended_run_is_ignored(relay: Relay) -> None:
    run = relay.run(f"r-{uuid.uuid4().hex[:6]}")
    message = notifier_message(relay.jobset(run, "Completed"))
    relay.ledger.record(run.run_id, RunEnd(RunStatus.SUCCEEDED, "trained"))
    assert relay.ingest.on_jobset_event(message).action == Action.IGNORED
    assert relay.recorder.received == []


def test_a_message_the_function_keeps_failing_on_is_dead_lettered_and_bad_ones_are_not(
    relay: Relay, tmp_path: Path, pubsub_host: str, firestore_host: str
) -> None:
    """A confirmed completion whose workflow endpoint is down fails every delivery (500) and is
    dead-lettered after MAX_DELIVERY_ATTEMPTS; a malformed message is acknowledged at once."""
    down = f"http://127.0.0.1:{free_port()}"
    run = relay.run(f"r-{uuid.uuid4().hex[:6]}", endpoint=down)
    poison = notifier_message(relay.jobset(run, "Completed"))
    env = {
        **config.to_env(relay.settings),
        "FIRESTORE_EMULATOR_HOST": firestore_host,
        CONTAINER_ENDPOINT_VAR: os.environ[CONTAINER_ENDPOINT_VAR],
        LOCAL_TOKEN_VAR: os.environ[LOCAL_TOKEN_VAR],
        "RETRAIN_WORKFLOWS_ENDPOINT": down,
    }
    proc, url = start_on_a_free_port(
        lambda port: function_server("on_jobset_event", tmp_path / "relay.log", env, "cloudevent", port)
    )
    try:
        publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        project = f"dl-{uuid.uuid4().hex[:8]}"
        topic = publisher.topic_path(project, "jobset-events")
        dead = publisher.topic_path(project, "dead-letter")
        delivery.push_subscription(subscriber, publisher, topic, f"{url}/{topic}", dead)
        inbox = delivery.dead_letter_subscription(subscriber, publisher, dead)
        publisher.publish(topic, json.dumps(poison).encode()).result(timeout=30)
        publisher.publish(topic, b'{"state": "Completed"}').result(timeout=30)  # malformed

        def pull() -> list[Any]:
            request = {"subscription": inbox, "max_messages": 10, "return_immediately": True}
            return list(subscriber.pull(request=request, timeout=10).received_messages)

        deadline, received = time.monotonic() + 90, list[Any]()
        while not received and time.monotonic() < deadline:
            time.sleep(0.5)
            received = pull()
        log = (tmp_path / "relay.log").read_text(errors="replace")
        assert len(received) == 1, f"the poison message never reached the dead-letter topic:\n{log[-3000:]}"
        message = received[0].message
        assert json.loads(message.data) == poison
        assert message.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] == str(
            delivery.MAX_DELIVERY_ATTEMPTS
        )
        subscriber.acknowledge(request={"subscription": inbox, "ack_ids": [received[0].ack_id]})
        time.sleep(3)  # nothing else follows: the malformed message was acknowledged, not retried
        assert not subscriber.pull(
            request={"subscription": inbox, "max_messages": 10}, timeout=10
        ).received_messages
    finally:
        proc.stop()


def test_re_pointing_an_existing_subscription_moves_its_endpoint(pubsub_host: str) -> None:
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    project = f"dl-{uuid.uuid4().hex[:8]}"
    topic, dead = publisher.topic_path(project, "ticks"), publisher.topic_path(project, "dead")
    name = delivery.push_subscription(subscriber, publisher, topic, "http://127.0.0.1:1/old", dead)
    delivery.push_subscription(subscriber, publisher, topic, "http://127.0.0.1:1/new", dead)
    assert subscriber.get_subscription(subscription=name).push_config.push_endpoint.endswith("/new")
