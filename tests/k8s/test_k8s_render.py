"""Rendered JobSet / ProvisioningRequest: content, CRD schemas, the checked-in example (no API server)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from retrain.domain.runs import Champion, ProfileName
from retrain.k8s.render import (
    EXAMPLES,
    TCPX_NETWORKS,
    coordinator_address,
    example_jobset,
    jobset_name,
    render_provisioning_request,
    run_account_name,
    to_yaml,
)
from retrain.plan import render_training, training_plan
from retrain.trainers import PlanError, TokenizerFiles
from retrain_local.envtest import crds_dir
from retrain_ops.deployment import Deployment
from retrain_ops.k8s_schema import load_crds, validate, validate_resource

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def crds() -> list[dict[str, Any]]:
    found = load_crds(crds_dir())
    if not found:
        pytest.skip(f"no CRDs in {crds_dir()} (set RETRAIN_CRDS_DIR)")
    return found


def nemo_jobset(nodes: int = 4, tcpx: bool = False, **plan: Any) -> dict[str, Any]:
    """The NeMo 24.12 JobSet of a run, rendered as the handover renders it (deployment settings)."""
    settings = dataclasses.replace(
        Deployment().settings(), nodes=nodes, global_batch_size=8 * nodes, gpudirect_tcpx=tcpx
    )
    base = training_plan(settings, "Run_7", Champion("Run_6", "gs://b/runs/Run_6/megatron_gpt/x-last", 60))
    blend = [0.6, "gs://b/shards/new/data_text_document", 0.4, "gs://b/shards/old/data_text_document"]
    tok = TokenizerFiles("GPT2BPETokenizer", "gs://b/shards/_tokenizer/f/vocab.json", "gs://b/t/merges.txt")
    full = dataclasses.replace(base.with_data(blend, tok), **plan)
    jobset, _ = render_training(settings, full, "https://cb.example/x")
    return jobset


def pod_spec(js: dict[str, Any]) -> dict[str, Any]:
    return dict(js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"])


def env_of(js: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod_spec(js)["containers"][0]["env"]}


def test_jobset_metadata_and_dws_scheduling() -> None:
    js = nemo_jobset()
    meta = js["metadata"]
    assert meta["name"] == jobset_name("Run_7") and len(meta["name"]) <= 40
    assert meta["labels"]["retrain.dev/run-id"].startswith("Run_7")
    # The workflow's own ProvisioningRequest holds the capacity: the pods consume it, Kueue asks for none.
    assert "kueue.x-k8s.io/queue-name" not in meta["labels"]
    pod_annotations = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert pod_annotations["autoscaling.x-k8s.io/consume-provisioning-request"] == meta["name"] + "-dws"
    assert pod_annotations["autoscaling.x-k8s.io/provisioning-class-name"] == "queued-provisioning.gke.io"
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
    assert ps["nodeSelector"] == {
        "cloud.google.com/gke-nodepool": "a3-dws",
        "cloud.google.com/gke-flex-start": "true",
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in ps["tolerations"]
    res = ps["containers"][0]["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "8"


def test_nemo_command_and_rendezvous() -> None:
    js = nemo_jobset()
    c = pod_spec(js)["containers"][0]
    assert c["command"][:2] == ["bash", "-c"] and "exec torchrun" in c["command"][2]
    assert "/opt/NeMo/examples/nlp/language_modeling/megatron_gpt_pretraining.py" in c["command"][2]
    args = c["args"]
    assert "trainer.num_nodes=4" in args and "trainer.devices=8" in args
    assert (
        "model.data.data_prefix=[0.6,/gcs/b/shards/new/data_text_document,0.4,/gcs/b/shards/old/data_text_document]"
        in args
    )
    assert "model.tokenizer.vocab_file=/gcs/b/shards/_tokenizer/f/vocab.json" in args
    art = Deployment().settings().artifacts_bucket
    assert f"model.data.index_mapping_dir=/gcs/{art}/runs/Run_7/index_mapping" in args
    assert f"exp_manager.exp_dir=/gcs/{art}/runs/Run_7" in args
    assert "model.restore_from_ckpt=/gcs/b/runs/Run_6/megatron_gpt/x-last" in args
    assert "trainer.max_steps=120" in args  # the base's 60 steps and this run's 60
    assert "trainer.val_check_interval=60" in args and "model.optim.sched.warmup_steps=6" in args
    env = env_of(js)
    name = js["metadata"]["name"]
    assert env["MASTER_ADDR"] == coordinator_address(name) == f"{name}-trainer-0-0.{name}"
    assert env["NNODES"] == "4" and env["WORLD_SIZE"] == "32" and env["GPUS_PER_NODE"] == "8"
    assert env["RETRAIN_RUN_CHECKPOINTS"] == f"/gcs/{art}/runs/Run_7/megatron_gpt/checkpoints"
    assert "job-completion-index" in json.dumps(env["NODE_RANK"])
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    mounts = {m["mountPath"]: m["readOnly"] for m in c["volumeMounts"] if m["mountPath"].startswith("/gcs/")}
    assert mounts == {"/gcs/b": True, f"/gcs/{art}": False}  # written where checkpoints go
    assert pod_spec(js)["serviceAccountName"] == run_account_name("Run_7")  # the run's own: its write grant


def test_every_override_is_one_nemo_accepts() -> None:
    """Each argument names a key of NeMo 24.12's megatron_gpt_config.yaml (or adds one with +), with a
    value of the default's type; Hydra itself composes them (``retrain.trainers.hydra``)."""
    from omegaconf import OmegaConf

    from retrain.trainers.nemo import CONFIG_DIR, CONFIG_NAME

    config = OmegaConf.load(CONFIG_DIR / f"{CONFIG_NAME}.yaml")
    for arg in pod_spec(nemo_jobset())["containers"][0]["args"]:
        key, _, _ = arg.partition("=")
        assert not key.startswith("+"), arg
        assert OmegaConf.select(config, key, default="<absent>") != "<absent>" or key.endswith(
            "data_prefix"
        ), f"{key} is not in NeMo's config"


def test_the_vendored_config_is_nemos_own() -> None:
    from retrain.trainers.nemo import CONFIG_DIR

    shared = Path(os.environ.get("RETRAIN_SHARED", REPO.parent / "shared")) / "specs" / "nemo-24.12"
    if not shared.exists():
        pytest.skip(f"no {shared}")
    vendored = (CONFIG_DIR / "megatron_gpt_config.yaml").read_bytes()
    assert vendored == (shared / "megatron_gpt_config.yaml").read_bytes()


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (
            {"global_batch_size": 12},
            "global batch size 12 is not divisible by micro batch size 1 x data-parallel size 8",
        ),
        (
            {"micro_batch_size": 4},
            "global batch size 8 is not divisible by micro batch size 4 x data-parallel size 8",
        ),
        ({"tensor_parallel": 3}, "8 GPUs is not divisible by tensor parallel 3"),
    ],
)
def test_impossible_plans_are_refused_before_capacity_with_the_reason(
    change: dict[str, Any], complaint: str
) -> None:
    from retrain.domain.runs import Run
    from retrain.plan import workflow_argument

    settings = dataclasses.replace(Deployment().settings(), **change)
    with pytest.raises(PlanError, match=complaint):
        workflow_argument(settings, Run("r1", "default", "manual"), None)


@pytest.mark.integration
def test_render_cli_adds_every_data_prefix_and_exits_2_on_impossible_batch_math() -> None:
    base = [sys.executable, "-m", "retrain_ops.cli", "render", "jobset", "--run-id", "r1", "--json"]
    blend = ["--data-prefix", "0.5", "gs://a/x", "--data-prefix", "0.5", "gs://a/y"]
    ok = subprocess.run([*base, *blend], capture_output=True, text=True, cwd=REPO, check=True)
    args = pod_spec(json.loads(ok.stdout))["containers"][0]["args"]
    assert "model.data.data_prefix=[0.5,/gcs/a/x,0.5,/gcs/a/y]" in args
    bad = subprocess.run([*base, *blend, "--micro-batch-size", "3"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "global batch size 8 is not divisible by micro batch size 3" in bad.stderr


def test_tcpx_follows_googles_pod_shape(crds: list[dict[str, Any]]) -> None:
    js = nemo_jobset(tcpx=True)
    ps = pod_spec(js)
    assert "hostNetwork" not in ps  # eth1..eth4 come from multi-networking
    (rxdm,) = ps["initContainers"]
    assert rxdm["name"] == "tcpx-daemon" and rxdm["restartPolicy"] == "Always"  # a native sidecar
    assert rxdm["image"].endswith("tcpgpudmarxd-dev:v2.0.12")
    assert rxdm["securityContext"] == {"capabilities": {"add": ["NET_ADMIN"]}}
    annotations = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["annotations"]
    interfaces = json.loads(annotations["networking.gke.io/interfaces"])
    assert [i["network"] for i in interfaces] == ["default", *TCPX_NETWORKS]
    assert "/dev/nvidia7" in annotations["devices.gke.io/container.tcpx-daemon"]
    env = env_of(js)
    assert env["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"] == "eth1,eth2,eth3,eth4"
    assert env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
    c = ps["containers"][0]
    assert {"name": "tcpx-socket", "mountPath": "/tmp"} in c["volumeMounts"]
    assert validate_resource(js, crds) == []


def test_tcpx_is_on_for_multi_node_runs_unless_switched_off() -> None:
    settings = Deployment().settings()
    assert settings.gpudirect_tcpx is True
    for nodes, switch, expect in ((2, True, True), (1, True, False), (2, False, False)):
        ps = pod_spec(nemo_jobset(nodes=nodes, tcpx=switch))
        assert ("initContainers" in ps) is expect


def test_the_tcpx_networks_are_the_ones_the_platform_builds() -> None:
    """The pods' interface annotation names the Network objects k8s/tcpx.yaml declares, and those point
    at the VPCs and subnets infra/platform attaches to the DWS pool."""
    from retrain_ops.manifests import render

    values = Deployment().manifest_values()
    docs = list(yaml.safe_load_all(render(values)["tcpx.yaml"]))
    networks = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Network"}
    params = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "GKENetworkParamSet"}
    assert sorted(networks) == sorted(params) == list(TCPX_NETWORKS)
    for i, name in enumerate(TCPX_NETWORKS):
        assert networks[name]["spec"]["parametersRef"]["name"] == name
        assert (params[name]["vpc"], params[name]["vpcSubnet"]) == values.gpu_networks[i]
        assert params[name]["deviceMode"] == "NetDevice"


def test_tcpx_objects_match_gkes_published_crds(crds: list[dict[str, Any]]) -> None:
    """Network and GKENetworkParamSet against GKE's own CRDs (GoogleCloudPlatform/gke-networking-api,
    config/crds, in ../shared/crds); the local stack applies them to its API server too."""
    from retrain_ops.manifests import render

    kinds = {c["spec"]["names"]["kind"] for c in crds if c["spec"]["group"] == "networking.gke.io"}
    assert {"Network", "GKENetworkParamSet"} <= kinds
    docs = list(yaml.safe_load_all(render(Deployment().manifest_values())["tcpx.yaml"]))
    assert {d["kind"] for d in docs} == {"Network", "GKENetworkParamSet"}
    for doc in docs:
        assert validate_resource(doc, crds) == [], doc["kind"]


def test_rendered_objects_match_crd_schemas(crds: list[dict[str, Any]]) -> None:
    assert validate_resource(nemo_jobset(), crds) == []
    assert validate_resource(nemo_jobset(nodes=2, tcpx=True), crds) == []
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


@pytest.mark.parametrize("file", sorted(EXAMPLES))
def test_example_manifests_are_renderer_output(file: str) -> None:
    text = (REPO / "k8s" / "examples" / file).read_text()
    assert yaml.safe_load(text) == example_jobset(file), "regenerate: python -m retrain.k8s.render"
    assert text.split("\n", 1)[1] == to_yaml(example_jobset(file))  # what the generator writes, byte for byte


def test_the_capacity_request_is_shaped_as_gke_documents_flex_start() -> None:
    """GKE's flex-start with queued provisioning page: the PodTemplate carries
    cloud.google.com/apply-warden-policies: "true" ("necessary for GKE to calculate node resource
    requirements for your Pods") and selects the pool and cloud.google.com/gke-flex-start: "true"; the
    ProvisioningRequest names the queued-provisioning class and one podSet."""
    podtemplate, request = render_provisioning_request(
        "run-1", nodes=2, node_pool="a3-dws", max_run_duration_s=600
    )
    assert podtemplate["metadata"]["labels"]["cloud.google.com/apply-warden-policies"] == "true"
    spec = podtemplate["template"]["spec"]
    assert spec["nodeSelector"] == {
        "cloud.google.com/gke-nodepool": "a3-dws",
        "cloud.google.com/gke-flex-start": "true",
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert request["spec"]["provisioningClassName"] == "queued-provisioning.gke.io"
    assert request["spec"]["podSets"] == [
        {"podTemplateRef": {"name": podtemplate["metadata"]["name"]}, "count": 2}
    ]
    assert request["spec"]["parameters"] == {"maxRunDurationSeconds": "600"}


def test_a_string_enum_renders_as_its_string() -> None:
    """A StrEnum (a profile's name, a status) reaching a manifest is written as its value, not refused."""
    assert to_yaml({"profile": ProfileName.MEGATRON_BRIDGE, "script": "a\nb\n"}) == (
        "profile: megatron-bridge\nscript: |\n  a\n  b\n"
    )
