"""Rendered JobSet / ProvisioningRequest: content, CRD schemas, the checked-in example (no API server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from retrain.k8s.render import (
    coordinator_address,
    example_jobset,
    jobset_name,
    render_jobset,
    render_provisioning_request,
)
from retrain.k8s.schema import load_crds, validate, validate_resource
from retrain.local.envtest import crds_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def crds() -> list[dict[str, Any]]:
    found = load_crds(crds_dir())
    if not found:
        pytest.skip(f"no CRDs in {crds_dir()} (set RETRAIN_CRDS_DIR)")
    return found


def nemo_jobset(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        nodes=4,
        image="nvcr.io/nvidia/nemo:24.12",
        command=None,
        data_prefix=[0.6, "gs://b/shards/new_text_document", 0.4, "/data/base_text_document"],
        checkpoint_dir="gs://b/ckpt/run-7",
        resume_from="gs://b/ckpt/run-6/last.ckpt",
        max_steps=100,
        callback_url="https://cb.example/x",
        env={"FOO": "bar"},
    )
    args.update(kw)
    return render_jobset("Run_7", **args)


def pod_spec(js: dict[str, Any]) -> dict[str, Any]:
    return dict(js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"])


def env_of(js: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod_spec(js)["containers"][0]["env"]}


def test_jobset_metadata_and_dws_scheduling() -> None:
    js = nemo_jobset()
    meta = js["metadata"]
    assert meta["name"] == jobset_name("Run_7") and len(meta["name"]) <= 40
    assert meta["labels"]["retrain.dev/run-id"].startswith("Run_7")
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "dws-local-queue"
    assert meta["annotations"] == {
        "retrain.dev/run-id": "Run_7",
        "retrain.dev/callback-url": "https://cb.example/x",
    }
    spec = js["spec"]
    assert spec["failurePolicy"] == {"maxRestarts": 2}
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["trainer"]}
    assert spec["ttlSecondsAfterFinished"] > 0
    job = spec["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"], job["backoffLimit"]) == (
        4,
        4,
        "Indexed",
        0,
    )
    ps = pod_spec(js)
    assert ps["nodeSelector"] == {"cloud.google.com/gke-nodepool": "a3-dws"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in ps["tolerations"]
    res = ps["containers"][0]["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "8"


def test_nemo_command_and_rendezvous() -> None:
    js = nemo_jobset()
    c = pod_spec(js)["containers"][0]
    assert c["command"][:2] == ["bash", "-c"] and "torchrun" in c["command"][2]
    assert "megatron_gpt_pretraining.py" in c["command"][2]
    args = c["args"]
    assert "trainer.num_nodes=4" in args and "trainer.devices=8" in args
    assert "model.data.data_prefix=[0.6,/gcs/b/shards/new_text_document,0.4,/data/base_text_document]" in args
    assert "exp_manager.exp_dir=/gcs/b/ckpt/run-7" in args
    assert "model.resume_from_checkpoint=/gcs/b/ckpt/run-6/last.ckpt" in args
    assert "trainer.max_steps=100" in args
    env = env_of(js)
    name = js["metadata"]["name"]
    assert env["MASTER_ADDR"] == coordinator_address(name) == f"{name}-trainer-0-0.{name}"
    assert env["NNODES"] == "4" and env["WORLD_SIZE"] == "32" and env["FOO"] == "bar"
    assert "job-completion-index" in json.dumps(env["NODE_RANK"])
    assert json.loads(env["RETRAIN_DATA_PREFIX"])[1] == "gs://b/shards/new_text_document"
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/gcs/b" in mounts and "/dev/shm" in mounts


def test_local_command_keeps_everything_else() -> None:
    nemo = nemo_jobset()
    local = nemo_jobset(command=["python", "-m", "retrain.train.gpt"])
    c = pod_spec(local)["containers"][0]
    assert c["command"] == ["python", "-m", "retrain.train.gpt"] and "args" not in c
    for js in (nemo, local):
        container = pod_spec(js)["containers"][0]
        container.pop("command")
        container.pop("args", None)
    assert local == nemo


def test_tcpx_adds_daemon_and_nccl_env(crds: list[dict[str, Any]]) -> None:
    js = nemo_jobset(tcpx=True)
    ps = pod_spec(js)
    assert ps["hostNetwork"] is True
    assert (
        ps["initContainers"][0]["name"] == "tcpx-daemon"
        and ps["initContainers"][0]["restartPolicy"] == "Always"
    )
    assert "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME" in env_of(js)
    assert validate_resource(js, crds) == []


def test_rendered_objects_match_crd_schemas(crds: list[dict[str, Any]]) -> None:
    assert validate_resource(nemo_jobset(), crds) == []
    assert validate_resource(nemo_jobset(command=["python", "-c", "pass"], tcpx=False), crds) == []
    tmpl, pr = render_provisioning_request("Run_7", nodes=3, max_run_duration_s=7200)
    assert validate_resource(pr, crds) == []
    assert pr["apiVersion"] == "autoscaling.x-k8s.io/v1"
    assert pr["spec"]["provisioningClassName"] == "queued-provisioning.gke.io"
    assert pr["spec"]["podSets"] == [{"podTemplateRef": {"name": tmpl["metadata"]["name"]}, "count": 3}]
    assert pr["spec"]["parameters"] == {"maxRunDurationSeconds": "7200"}
    assert tmpl["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "8"


def test_schema_checker_catches_mistakes(crds: list[dict[str, Any]]) -> None:
    js = nemo_jobset()
    js["spec"]["failurePolicy"]["maxRestart"] = 3  # typo: pruned by the server
    js["spec"]["successPolicy"]["operator"] = "Every"
    errs = validate_resource(js, crds)
    assert any("maxRestart" in e for e in errs) and any("Every" in e for e in errs)
    assert validate({"a": "x"}, {"type": "object", "properties": {"a": {"type": "integer"}}}) != []


def test_example_manifest_is_renderer_output() -> None:
    text = (REPO / "k8s" / "examples" / "jobset.example.yaml").read_text()
    assert yaml.safe_load(text) == example_jobset(), (
        "regenerate: python -m retrain.k8s.render > k8s/examples/jobset.example.yaml"
    )


def test_kueue_manifests_match_crd_schemas(crds: list[dict[str, Any]]) -> None:
    from retrain.deployment import Deployment
    from retrain.k8s.manifests import render

    docs = list(yaml.safe_load_all(render(Deployment().manifest_values())["kueue.yaml"]))
    assert [d["kind"] for d in docs] == [
        "ResourceFlavor",
        "ProvisioningRequestConfig",
        "AdmissionCheck",
        "ClusterQueue",
        "LocalQueue",
    ]
    for d in docs:
        assert validate_resource(d, crds) == [], d["kind"]
    by_kind = {d["kind"]: d for d in docs}
    assert by_kind["ProvisioningRequestConfig"]["spec"] == {
        "provisioningClassName": "queued-provisioning.gke.io",
        "managedResources": ["nvidia.com/gpu"],
        "retryStrategy": {"backoffLimitCount": 3, "backoffBaseSeconds": 60, "backoffMaxSeconds": 1800},
    }
    check = by_kind["AdmissionCheck"]
    assert check["spec"]["controllerName"] == "kueue.x-k8s.io/provisioning-request"
    assert check["spec"]["parameters"]["name"] == by_kind["ProvisioningRequestConfig"]["metadata"]["name"]
    cq = by_kind["ClusterQueue"]["spec"]
    assert cq["admissionChecksStrategy"]["admissionChecks"] == [{"name": check["metadata"]["name"]}]
    assert (
        by_kind["LocalQueue"]["metadata"]["name"]
        == nemo_jobset()["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    )
