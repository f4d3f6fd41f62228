"""A preempted training node: the JobSet restarts and the run resumes from its own last checkpoint.

The cluster twin runs the JobSet the NeMo 24.12 profile renders, in the local image (NeMo's script is
the stand-in, torchrun is PyTorch's), with the artifacts bucket of the GCS emulator mounted through the
twin's Cloud Storage FUSE.  The run continues from a base checkpoint (``model.restore_from_ckpt``).
Once its first checkpoint is in the bucket, the twin's ``preempt_node_after_s`` fault takes the pod's
node away; DWS replaces the node, the JobSet restarts, and the launcher must resume the run from its own
``-last`` checkpoint (``exp_manager.resume_if_exists``) instead of starting over from the base, which
NeMo's script would otherwise apply last.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from training_support import REPO, nemo_args, pattern_documents, standin_env, tiny_tokenizer, write_dataset

from retrain.adapters import objects
from retrain.k8s.render import GcsMounts, render_jobset, render_provisioning_request
from retrain.tensorboard import read_scalars
from retrain.trainers import BatchShape, TokenizerFiles, TrainingPlan
from retrain.trainers.nemo import NEMO_24_12, validation_interval
from retrain_local.cluster import ClusterTwin, Faults
from retrain_local.processes import free_port
from retrain_ops.deployment import NEMO_STANDIN

from .waiting import wait_for

pytestmark = pytest.mark.envtest
torch = pytest.importorskip("torch", reason="PyTorch is not installed: the stand-in trains with it")

PR = ("autoscaling.x-k8s.io", "v1", "provisioningrequests")
JS = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
BLEND = (1.0, "gs://b/shards/p/data_text_document")
TOKENIZER = TokenizerFiles("GPT2BPETokenizer", "gs://b/tok/vocab.json", "gs://b/tok/merges.txt")


def upload_tree(local: Path, uri: str) -> None:
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        objects.upload_file(path, f"{uri}/{path.relative_to(local).as_posix()}")


@pytest.fixture
def bucket(gcs_host: str, tmp_path: Path) -> str:
    """Bucket "b" with a dataset, a 16-id tokenizer and a base checkpoint at step 10 (trained here)."""
    client = objects.storage_client()
    if client.lookup_bucket("b") is None:
        client.create_bucket("b")
    local = tmp_path / "base"
    write_dataset(local / "b" / "shards" / "p" / "data_text_document", pattern_documents(60, 120))
    tiny_tokenizer(local / "b" / "tok")
    run = subprocess.run(
        [
            str(Path(sys.executable).with_name("torchrun")),
            "--nnodes=1",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(REPO / "retrain_local" / "train" / "standin.py"),
            *nemo_args(local, BLEND, steps=10, run_id="base"),
        ],
        env=standin_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    upload_tree(local / "b", "gs://b")
    return "gs://b"


def test_a_preempted_run_resumes_its_own_checkpoint_not_the_base(
    api: Any, namespace: str, bucket: str, tmp_path: Path
) -> None:
    from kubernetes import client

    core: Any = client.CoreV1Api(api)
    custom: Any = client.CustomObjectsApi(api)
    (base,) = [u.rsplit("/", 1)[0] for u in objects.list_uris("gs://b/runs/base/") if "-last/" in u]
    pool, run_id = f"pool-{namespace}", "preempt-1"
    plan = TrainingPlan(
        run_id,
        BatchShape(nodes=1, gpus_per_node=1, micro_batch_size=1, global_batch_size=8),
        steps=200,
        seq_length=32,
        output_dir=f"gs://b/runs/{run_id}",
        base_checkpoint=base,
        base_step=10,
        blend=BLEND,
        tokenizer=TOKENIZER,
    )
    mounts = GcsMounts()
    command = NEMO_24_12.render(plan, mounts.path)
    NEMO_24_12.validate(command)

    # Armed, but far off: brought forward once the run's first checkpoint is in the bucket (below).
    faults = Faults(preempt_node_after_s=3600.0)
    twin = ClusterTwin(
        api,
        namespace=namespace,
        node_pool=pool,
        gpus_per_node=1,
        workdir=tmp_path / "twin",
        provision_delay_s=0.3,
        poll_s=0.05,
        faults=faults,
    )
    with twin:
        tmpl, pr = render_provisioning_request(
            run_id, nodes=1, gpus_per_node=1, namespace=namespace, node_pool=pool
        )
        core.create_namespaced_pod_template(namespace, tmpl)
        custom.create_namespaced_custom_object(*PR[:2], namespace, PR[2], pr)
        wait_for(twin.node_names, timeout=60, every=0.05)
        first_node = twin.node_names()
        js = render_jobset(
            run_id,
            nodes=1,
            gpus_per_node=1,
            image=NEMO_STANDIN,
            command=command,
            mounts=mounts,
            namespace=namespace,
            node_pool=pool,
            provisioning_request=pr["metadata"]["name"],
        )
        name = js["metadata"]["name"]
        custom.create_namespaced_custom_object(*JS[:2], namespace, JS[2], js)

        def jobset() -> dict[str, Any]:
            return dict(custom.get_namespaced_custom_object(*JS[:2], namespace, JS[2], name))

        checkpoints = f"gs://b/runs/{run_id}/megatron_gpt/checkpoints/"
        wait_for(lambda: any("-last/" in u for u in objects.list_uris(checkpoints)), timeout=180, every=0.2)
        faults.preempt_node_after_s = 0.0  # the first checkpoint is in the bucket: preempt the node now
        assert (
            wait_for(lambda: (jobset().get("status") or {}).get("terminalState"), timeout=240, every=0.1)
            == "Completed"
        )
        status = jobset()["status"]
        assert status["restarts"] >= 1
        assert twin.node_names() and twin.node_names() != first_node  # DWS replaced the lost node
    assert not twin.errors

    interval = validation_interval(plan)
    assert interval == 70  # divides the last step, 210
    # each attempt's log, told apart by what it says (not by time: on a loaded machine two can end in
    # the same second): the first restored the base; the preempted one died there, never reaching the end
    logs = [p.read_text() for p in (tmp_path / "twin" / "logs").glob("*.log")]
    (first,) = [text for text in logs if "resuming this run from" not in text]
    resumed_logs = [text for text in logs if "resuming this run from" in text]
    assert "restored" in first and "base/megatron_gpt/checkpoints" in first and "at step 10" in first
    assert "done: step 210" not in first, first[-500:]  # its node was preempted: so was its process
    assert resumed_logs  # the launcher dropped model.restore_from_ckpt ...
    last = next(text for text in resumed_logs if "done: step 210" in text)
    resumed = re.search(rf"restored \S*/{run_id}/megatron_gpt/checkpoints/\S*-last at step (\d+)", last)
    assert resumed and int(resumed.group(1)) % interval == 0  # ... and resumed its own checkpoint
    assert f"steps {resumed.group(1)}->210" in last and "done: step 210" in last
    lasts = [u for u in objects.list_uris(checkpoints) if "-last/" in u]
    assert len(lasts) == 1 and "-step=210-consumed_samples=1680.0-last/model.pt" in lasts[0]
    events = [u for u in objects.list_uris(f"gs://b/runs/{run_id}/megatron_gpt/") if "tfevents" in u]
    steps = {s.step for u in events for s in read_scalars(objects.read_bytes(u)) if s.tag == "val_loss"}
    assert steps == {10, 70, 140, 210}  # the base checkpoint on this run's data first (the eval gate's)
