"""Render the Kubernetes objects of one training run: the NeMo JobSet and the DWS ProvisioningRequest.

The JobSet (jobset.x-k8s.io/v1alpha2) has one replicated job ``trainer`` holding one Indexed Job of
``nodes`` pods, one pod per A3 node with all its GPUs.  Ranks rendezvous through the JobSet headless
service: the coordinator is ``<jobset>-trainer-0-0.<jobset>`` and every pod's node rank is its Job
completion index.  The default container runs NeMo's Megatron GPT pre-training script under torchrun
with Hydra overrides for the data blend, node/device counts, checkpoint directory and resume point.

GCS paths (``gs://bucket/path``) given to the NeMo command are read through Cloud Storage FUSE CSI
volumes mounted at ``/gcs/<bucket>``; the original URIs are also passed as ``RETRAIN_*`` variables for
trainers that talk to GCS themselves (the local trainer does).

Run ``python -m retrain.k8s.render > k8s/examples/jobset.example.yaml`` to regenerate the sample
(never applied).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from typing import Any

import yaml

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
PROVREQ_API = "autoscaling.x-k8s.io/v1"
DWS_CLASS = "queued-provisioning.gke.io"
GPU = "nvidia.com/gpu"
RUN_ID_LABEL = "retrain.dev/run-id"
RUN_ID_ANNOTATION = "retrain.dev/run-id"
CALLBACK_ANNOTATION = "retrain.dev/callback-url"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
QUEUED_LABEL = "cloud.google.com/gke-queued"
CONSUME_PR_ANNOTATION = "autoscaling.x-k8s.io/consume-provisioning-request"
PR_CLASS_ANNOTATION = "autoscaling.x-k8s.io/provisioning-class-name"
REPLICATED_JOB = "trainer"
MASTER_PORT = 29500
NEMO_SCRIPT = "/opt/NeMo/examples/nlp/language_modeling/megatron_gpt_pretraining.py"
GCS_MOUNT_ROOT = "/gcs"
TTL_AFTER_FINISHED_S = 3600
TCPX_DAEMON_IMAGE = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.9"

_MAX_JOBSET_NAME = 40  # <jobset>-trainer-<i>-<j> must stay a DNS label (63)


def _slug(value: str, limit: int) -> str:
    s = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-") or "run"
    if len(s) > limit or s != value.lower():
        digest = hashlib.sha256(value.encode()).hexdigest()[:6]
        s = s[: limit - 7].rstrip("-") + "-" + digest
    return s


def jobset_name(run_id: str) -> str:
    """``retrain-<run id>`` as a DNS-1035 label short enough for the pods' hostnames."""
    name = _slug("retrain-" + run_id, _MAX_JOBSET_NAME)
    return name if name[0].isalpha() else "r" + name[1:]


def provisioning_request_name(run_id: str) -> str:
    return jobset_name(run_id) + "-dws"


def label_value(value: str) -> str:
    """A valid label value for ``value`` (the full value is kept in an annotation)."""
    v = re.sub(r"[^A-Za-z0-9_.-]+", "-", value).strip("-_.")
    if len(v) > 63 or v != value:
        digest = hashlib.sha256(value.encode()).hexdigest()[:6]
        v = v[:56].rstrip("-_.") + "-" + digest
    return v.strip("-_.") or "x"


def coordinator_address(name: str) -> str:
    """The stable DNS name of rank 0 inside the JobSet's headless service."""
    return f"{name}-{REPLICATED_JOB}-0-0.{name}"


def _gcs_path(uri: str) -> tuple[str | None, str]:
    """(bucket, path seen by the pod) of ``uri``; bucket None for non-GCS paths."""
    if uri.startswith("gs://"):
        bucket, _, rest = uri[5:].partition("/")
        return bucket, f"{GCS_MOUNT_ROOT}/{bucket}/{rest}".rstrip("/")
    return None, uri


def nemo_overrides(
    *,
    nodes: int,
    gpus_per_node: int,
    data_prefix: list[str | float],
    checkpoint_dir: str,
    resume_from: str | None,
    max_steps: int | None,
    run_id: str,
) -> list[str]:
    """Hydra overrides for ``megatron_gpt_pretraining.py`` (NeMo 1.x/2.x Megatron GPT config)."""
    blend = []
    for item in data_prefix:
        blend.append(_gcs_path(item)[1] if isinstance(item, str) else repr(float(item)))
    ckpt = _gcs_path(checkpoint_dir)[1]
    out = [
        f"trainer.num_nodes={nodes}",
        f"trainer.devices={gpus_per_node}",
        "trainer.accelerator=gpu",
        "trainer.precision=bf16-mixed",
        f"model.data.data_prefix=[{','.join(blend)}]",
        f"exp_manager.exp_dir={ckpt}",
        f"exp_manager.name={run_id}",
        "exp_manager.create_checkpoint_callback=true",
        "exp_manager.resume_if_exists=true",
        "exp_manager.resume_ignore_no_checkpoint=true",
        "exp_manager.checkpoint_callback_params.save_top_k=1",
        "exp_manager.checkpoint_callback_params.always_save_nemo=false",
    ]
    if max_steps is not None:
        out.append(f"trainer.max_steps={max_steps}")
    if resume_from:
        out.append(f"model.resume_from_checkpoint={_gcs_path(resume_from)[1]}")
    return out


_TORCHRUN = (
    "set -euo pipefail\n"
    'echo "node rank ${NODE_RANK}/${NNODES}, coordinator ${MASTER_ADDR}:${MASTER_PORT}"\n'
    'exec torchrun --nnodes="${NNODES}" --nproc-per-node="${GPUS_PER_NODE}" '
    '--node-rank="${NODE_RANK}" --master-addr="${MASTER_ADDR}" --master-port="${MASTER_PORT}" '
    f'{NEMO_SCRIPT} "$@"\n'
)


def _tcpx(pod_spec: dict[str, Any], container: dict[str, Any], annotations: dict[str, str]) -> None:
    """GPUDirect-TCPX on A3 (a3-highgpu-8g): the RxDM daemon as a native sidecar, NCCL plugin env."""
    annotations["devices.gke.io/container.tcpx-daemon"] = (
        "- path: /dev/nvidia0\n- path: /dev/nvidia1\n- path: /dev/nvidia2\n- path: /dev/nvidia3\n"
        "- path: /dev/nvidia4\n- path: /dev/nvidia5\n- path: /dev/nvidia6\n- path: /dev/nvidia7\n"
        "- path: /dev/nvidiactl\n- path: /dev/nvidia-uvm\n"
    )
    annotations["networking.gke.io/default-interface"] = "eth0"
    annotations["networking.gke.io/interfaces"] = json.dumps(
        [{"interfaceName": "eth0", "network": "default"}]
        + [{"interfaceName": f"eth{i}", "network": f"vpc{i}"} for i in range(1, 5)]
    )
    pod_spec["hostNetwork"] = True
    pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    pod_spec["volumes"] += [
        {"name": "libraries", "hostPath": {"path": "/home/kubernetes/bin/nvidia/lib64"}},
        {"name": "sys", "hostPath": {"path": "/sys"}},
        {"name": "proc-sys", "hostPath": {"path": "/proc/sys"}},
        {"name": "tcpx-socket", "emptyDir": {}},
    ]
    pod_spec.setdefault("initContainers", []).append(
        {
            "name": "tcpx-daemon",
            "image": TCPX_DAEMON_IMAGE,
            "restartPolicy": "Always",
            "command": ["/tcpgpudmarxd/build/app/tcpgpudmarxd"],
            "args": ["--gpu_nic_preset", "a3vm", "--gpu_shmem_type", "fd", "--uds_path", "/run/tcpx"],
            "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}},
            "env": [{"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"}],
            "volumeMounts": [
                {"name": "libraries", "mountPath": "/usr/local/nvidia/lib64"},
                {"name": "tcpx-socket", "mountPath": "/run/tcpx"},
                {"name": "sys", "mountPath": "/hostsysfs"},
                {"name": "proc-sys", "mountPath": "/hostprocsysfs"},
            ],
        }
    )
    container["volumeMounts"] += [
        {"name": "tcpx-socket", "mountPath": "/run/tcpx"},
        {"name": "libraries", "mountPath": "/usr/local/nvidia/lib64"},
    ]
    container["env"] += [
        {"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"},
        {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"},
        {"name": "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "value": "eth1,eth2,eth3,eth4"},
        {"name": "NCCL_GPUDIRECTTCPX_CTRL_DEV", "value": "eth0"},
        {"name": "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX", "value": "/run/tcpx"},
        {"name": "NCCL_GPUDIRECTTCPX_FORCE_ACK", "value": "0"},
        {"name": "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS", "value": "1000000"},
        {"name": "NCCL_CROSS_NIC", "value": "0"},
        {"name": "NCCL_ALGO", "value": "Ring"},
        {"name": "NCCL_PROTO", "value": "Simple"},
        {"name": "NCCL_NSOCKS_PERTHREAD", "value": "4"},
        {"name": "NCCL_SOCKET_NTHREADS", "value": "1"},
        {"name": "NCCL_DYNAMIC_CHUNK_SIZE", "value": "524288"},
        {"name": "NCCL_P2P_NET_CHUNKSIZE", "value": "524288"},
        {"name": "NCCL_P2P_PCI_CHUNKSIZE", "value": "524288"},
        {"name": "NCCL_P2P_NVL_CHUNKSIZE", "value": "1048576"},
        {"name": "NCCL_BUFFSIZE", "value": "4194304"},
        {"name": "NCCL_MAX_NCHANNELS", "value": "8"},
        {"name": "NCCL_MIN_NCHANNELS", "value": "8"},
    ]


def render_jobset(
    run_id: str,
    *,
    nodes: int,
    gpus_per_node: int = 8,
    image: str,
    command: list[str] | None = None,
    data_prefix: list[str | float],
    checkpoint_dir: str,
    resume_from: str | None = None,
    max_steps: int | None = None,
    queue: str = "dws-local-queue",
    node_pool: str = "a3-dws",
    namespace: str = "default",
    callback_url: str | None = None,
    max_restarts: int = 2,
    tcpx: bool = False,
    env: dict[str, str] | None = None,
    provisioning_request: str | None = None,
    service_account: str | None = None,
) -> dict[str, Any]:
    """The JobSet of run ``run_id``.

    ``service_account`` is the Kubernetes service account the pods run as: the training KSA that
    Workload Identity binds to the training Google service account (the Cloud Storage FUSE CSI driver
    authenticates as it; see GKE's "Access Cloud Storage buckets with the Cloud Storage FUSE CSI driver").
    ``command`` None runs NeMo under torchrun with Hydra overrides; a given ``command`` (the local
    trainer) replaces the container command and gets no args, everything else stays.
    ``provisioning_request`` names a ProvisioningRequest created outside Kueue that the pods consume
    (GKE's ``consume-provisioning-request`` annotations) and then carries no Kueue queue label, so Kueue
    does not ask for the same capacity again; leave it None when Kueue's ProvisioningRequest admission
    check provisions the capacity.
    """
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError("nodes and gpus_per_node must be positive")
    if not data_prefix:
        raise ValueError("data_prefix is empty")
    name = jobset_name(run_id)
    labels = {RUN_ID_LABEL: label_value(run_id)}
    if not provisioning_request:  # with Kueue, its admission check creates the request instead
        labels[QUEUE_LABEL] = queue
    annotations = {RUN_ID_ANNOTATION: run_id}
    if callback_url:
        annotations[CALLBACK_ANNOTATION] = callback_url
    pod_labels = {RUN_ID_LABEL: label_value(run_id)}
    pod_annotations: dict[str, str] = {}
    if provisioning_request:
        pod_annotations[CONSUME_PR_ANNOTATION] = provisioning_request
        pod_annotations[PR_CLASS_ANNOTATION] = DWS_CLASS

    container_env: list[dict[str, Any]] = [
        {"name": "RETRAIN_RUN_ID", "value": run_id},
        {"name": "RETRAIN_DATA_PREFIX", "value": json.dumps(data_prefix)},
        {"name": "RETRAIN_CHECKPOINT_DIR", "value": checkpoint_dir},
    ]
    if resume_from:
        container_env.append({"name": "RETRAIN_RESUME_FROM", "value": resume_from})
    if max_steps is not None:
        container_env.append({"name": "RETRAIN_MAX_STEPS", "value": str(max_steps)})
    container_env += [
        {"name": "NNODES", "value": str(nodes)},
        {"name": "GPUS_PER_NODE", "value": str(gpus_per_node)},
        {"name": "WORLD_SIZE", "value": str(nodes * gpus_per_node)},
        {"name": "MASTER_ADDR", "value": coordinator_address(name)},
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
        {
            "name": "NODE_RANK",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
            },
        },
    ]
    for k, v in sorted((env or {}).items()):
        container_env.append({"name": k, "value": v})

    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    buckets: dict[str, bool] = {}  # bucket -> read-only
    for item in data_prefix:
        if isinstance(item, str) and (b := _gcs_path(item)[0]):
            buckets.setdefault(b, True)
    for uri in (checkpoint_dir, resume_from):
        if uri and (b := _gcs_path(uri)[0]):
            buckets[b] = False if uri == checkpoint_dir else buckets.get(b, True)
    for bucket, read_only in sorted(buckets.items()):
        vol = "gcs-" + _slug(bucket, 50)
        volumes.append(
            {
                "name": vol,
                "csi": {
                    "driver": "gcsfuse.csi.storage.gke.io",
                    "readOnly": read_only,
                    "volumeAttributes": {"bucketName": bucket, "mountOptions": "implicit-dirs"},
                },
            }
        )
        mounts.append({"name": vol, "mountPath": f"{GCS_MOUNT_ROOT}/{bucket}", "readOnly": read_only})
    if buckets:
        pod_annotations["gke-gcsfuse/volumes"] = "true"

    container: dict[str, Any] = {
        "name": "nemo",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT}],
        "env": container_env,
        "resources": {"requests": {GPU: str(gpus_per_node)}, "limits": {GPU: str(gpus_per_node)}},
        "volumeMounts": mounts,
    }
    if command is None:
        container["command"] = ["bash", "-c", _TORCHRUN, "nemo"]
        container["args"] = nemo_overrides(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            data_prefix=data_prefix,
            checkpoint_dir=checkpoint_dir,
            resume_from=resume_from,
            max_steps=max_steps,
            run_id=run_id,
        )
    else:
        container["command"] = list(command)

    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 30,
        "nodeSelector": {NODEPOOL_LABEL: node_pool},
        "tolerations": [
            {"key": GPU, "operator": "Exists", "effect": "NoSchedule"},
            {"key": QUEUED_LABEL, "operator": "Exists", "effect": "NoSchedule"},
        ],
        "containers": [container],
        "volumes": volumes,
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    if tcpx:
        _tcpx(pod_spec, container, pod_annotations)

    pod_meta: dict[str, Any] = {"labels": pod_labels}
    if pod_annotations:
        pod_meta["annotations"] = dict(sorted(pod_annotations.items()))
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
        "spec": {
            "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_S,
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": max_restarts},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": nodes,
                            "completions": nodes,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "template": {"metadata": pod_meta, "spec": pod_spec},
                        }
                    },
                }
            ],
        },
    }


def render_provisioning_request(
    run_id: str,
    *,
    nodes: int,
    gpus_per_node: int = 8,
    namespace: str = "default",
    node_pool: str = "a3-dws",
    max_run_duration_s: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(PodTemplate, ProvisioningRequest) asking DWS for ``nodes`` whole GPU nodes of ``node_pool``.

    GKE's queued provisioning accepts exactly one podSet; the PodTemplate describes one node's pod.
    """
    if nodes < 1:
        raise ValueError("nodes must be positive")
    name = provisioning_request_name(run_id)
    labels = {RUN_ID_LABEL: label_value(run_id)}
    podtemplate = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "nodeSelector": {NODEPOOL_LABEL: node_pool},
                "tolerations": [
                    {"key": GPU, "operator": "Exists", "effect": "NoSchedule"},
                    {"key": QUEUED_LABEL, "operator": "Exists", "effect": "NoSchedule"},
                ],
                "containers": [
                    {
                        "name": "pi",
                        "image": "registry.k8s.io/pause:3.9",
                        "resources": {
                            "requests": {GPU: str(gpus_per_node)},
                            "limits": {GPU: str(gpus_per_node)},
                        },
                    }
                ],
            },
        },
    }
    spec: dict[str, Any] = {
        "provisioningClassName": DWS_CLASS,
        "podSets": [{"podTemplateRef": {"name": name}, "count": nodes}],
    }
    if max_run_duration_s is not None:
        spec["parameters"] = {"maxRunDurationSeconds": str(int(max_run_duration_s))}
    provreq = {
        "apiVersion": PROVREQ_API,
        "kind": "ProvisioningRequest",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "annotations": {RUN_ID_ANNOTATION: run_id},
        },
        "spec": spec,
    }
    return podtemplate, provreq


def example_jobset() -> dict[str, Any]:
    """The sample in ``k8s/jobset.example.yaml`` (a test checks the file equals this)."""
    return render_jobset(
        "example-run-0001",
        nodes=2,
        gpus_per_node=8,
        image="nvcr.io/nvidia/nemo:24.12",
        command=None,
        data_prefix=[
            0.7,
            "gs://retrain-artifacts/shards/example/text_document",
            0.3,
            "gs://retrain-artifacts/shards/base/text_document",
        ],
        checkpoint_dir="gs://retrain-artifacts/checkpoints/example-run-0001",
        resume_from="gs://retrain-artifacts/checkpoints/previous/last.ckpt",
        max_steps=60,
        callback_url="https://workflowexecutions.googleapis.com/v1/projects/example-project/locations/us-central1/workflows/retrain/executions/example/callbacks/example",
        tcpx=True,
    )


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(obj: dict[str, Any]) -> str:
    """Block-style YAML (multi-line strings as literal blocks), keys in rendering order."""
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def main() -> None:
    sys.stdout.write(
        "# Generated by `python -m retrain.k8s.render` (render_jobset); do not edit by hand.\n"
        + to_yaml(example_jobset())
    )


if __name__ == "__main__":
    main()
