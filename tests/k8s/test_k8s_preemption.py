"""A preempted training node: the JobSet restarts and the real trainer resumes from its last checkpoint.

The cluster twin runs the JobSet's pod as ``python -m retrain.train.gpt`` (the local trainer, as the
local stack does) on a tiny Megatron dataset.  Once the first periodic checkpoint is on disk, the twin's
``preempt_node_after_s`` fault takes the pod's node away (SIGKILL of the trainer, pod NodeLost); DWS
replaces the node, the JobSet restarts, and the same command must continue from the saved step and
stop exactly at ``--max-steps``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from retrain.k8s.render import render_jobset, render_provisioning_request
from retrain.local.cluster_twin import ClusterTwin, Faults
from retrain.megatron import IndexedDatasetWriter
from retrain.train import trainer_command

from .waiting import wait_for

pytestmark = pytest.mark.envtest
torch = pytest.importorskip("torch", reason="PyTorch is not installed: the gpt trainer needs it")

PR = ("autoscaling.x-k8s.io", "v1", "provisioningrequests")
JS = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
MAX_STEPS = 200
SAVE_EVERY = 20  # the trainer's default: not passed, so the default is what is tested
SMALL = ["--seq-len", "32", "--d-model", "32", "--layers", "1", "--heads", "2", "--batch-size", "8"]


def write_pattern(prefix: Path) -> Path:
    """A counting pattern (0..15 over and over) as PREFIX.bin/.idx."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(str(prefix) + ".bin", "wb") as f:
        w = IndexedDatasetWriter(f, np.uint16)
        for d in range(20):
            w.add_document([[(i + d) % 16 for i in range(200)]])
    Path(str(prefix) + ".idx").write_bytes(w.index_bytes())
    return prefix


def test_preempted_trainer_resumes_from_its_last_checkpoint(api: Any, namespace: str, tmp_path: Path) -> None:
    from kubernetes import client

    core: Any = client.CoreV1Api(api)
    custom: Any = client.CustomObjectsApi(api)
    pool, run_id = f"pool-{namespace}", "preempt-1"
    data = write_pattern(tmp_path / "data" / "pattern")
    ckpt = tmp_path / "ckpt"
    command = [*trainer_command("gpt", [str(data)], str(ckpt), MAX_STEPS), *SMALL, "--log-every", "10"]

    # Armed, but far off: it is brought forward once the first checkpoint exists (below), so the node
    # goes away between a checkpoint and the end however long the trainer took to start.
    faults = Faults(preempt_node_after_s=3600.0)
    twin = ClusterTwin(
        api,
        namespace=namespace,
        node_pool=pool,
        workdir=tmp_path / "twin",
        provision_delay_s=0.3,
        poll_s=0.05,
        faults=faults,
    )
    with twin:
        tmpl, pr = render_provisioning_request(run_id, nodes=1, namespace=namespace, node_pool=pool)
        core.create_namespaced_pod_template(namespace, tmpl)
        custom.create_namespaced_custom_object(*PR[:2], namespace, PR[2], pr)
        wait_for(twin.node_names, timeout=60, every=0.05)
        first_node = twin.node_names()
        js = render_jobset(
            run_id,
            nodes=1,
            image="local",
            command=command,
            data_prefix=[str(data)],
            checkpoint_dir=str(ckpt),
            namespace=namespace,
            node_pool=pool,
            provisioning_request=pr["metadata"]["name"],
        )
        name = js["metadata"]["name"]
        custom.create_namespaced_custom_object(*JS[:2], namespace, JS[2], js)

        def jobset() -> dict[str, Any]:
            return dict(custom.get_namespaced_custom_object(*JS[:2], namespace, JS[2], name))

        wait_for(lambda: (ckpt / "model.pt").exists(), timeout=60, every=0.05)
        faults.preempt_node_after_s = 0.0  # the first checkpoint is written: preempt the node now
        assert (
            wait_for(lambda: (jobset().get("status") or {}).get("terminalState"), timeout=60, every=0.05)
            == "Completed"
        )
        status = jobset()["status"]
        assert status["restarts"] >= 1
        assert twin.node_names() and twin.node_names() != first_node  # DWS replaced the lost node
    assert not twin.errors

    # The second attempt resumed from a periodic checkpoint of the first, not from 0 ...
    metrics = json.loads((ckpt / "metrics.json").read_text())
    resumed = metrics["start_step"]
    assert SAVE_EVERY <= resumed < MAX_STEPS and resumed % SAVE_EVERY == 0, metrics
    assert metrics["resumed_from"] == str(ckpt / "model.pt")
    logs = {p.name: p.read_text() for p in (tmp_path / "twin" / "logs").glob("*.log")}
    assert len(logs) == 1 + status["restarts"], logs
    firsts = [t for t in logs.values() if f"steps 0->{MAX_STEPS}" in t]
    lasts = [t for t in logs.values() if f"at step {resumed}" in t]
    assert len(firsts) == 1 and "resuming from" not in firsts[0] and f"step {resumed}/" in firsts[0]
    assert len(lasts) == 1 and f"steps {resumed}->{MAX_STEPS}" in lasts[0]
    assert f"step {resumed + 1}/{MAX_STEPS}" in lasts[0] and f"done: step {MAX_STEPS}," in lasts[0]
    # ... and ended exactly at --max-steps.
    assert (metrics["steps"], metrics["run_steps"]) == (MAX_STEPS, MAX_STEPS - resumed)
    assert metrics["tokens_seen"] == MAX_STEPS * 8 * 32
    state = torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True)
    assert state["step"] == MAX_STEPS
    # loss.jsonl: the first attempt's lines through the resumed step, then the second attempt's.
    steps = [json.loads(line)["step"] for line in (ckpt / "loss.jsonl").read_text().splitlines()]
    after = [resumed + 1, *range(resumed + 10, MAX_STEPS + 1, 10)]
    assert steps == [1, *range(10, resumed + 1, 10), *after]
    assert not list(ckpt.glob(".model.pt.*.tmp"))
