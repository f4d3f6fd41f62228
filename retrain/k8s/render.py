"""Render the Kubernetes objects of one training run: the training JobSet and the DWS ProvisioningRequest.

The JobSet (jobset.x-k8s.io/v1alpha2) has one replicated job ``trainer`` holding one Indexed Job of
``nodes`` pods, one pod per A3 node with all its GPUs.  Ranks rendezvous through the JobSet headless
service: the coordinator is ``<jobset>-trainer-0-0.<jobset>`` and every pod's node rank is its Job
completion index.  The container's command comes from the run's trainer profile (``retrain.trainers``);
the ``gs://`` paths it names are read and written through Cloud Storage FUSE CSI volumes mounted at
``/gcs/<bucket>`` (:class:`GcsMounts`).

Run ``python -m retrain.k8s.render`` to regenerate the samples in ``k8s/examples/``
(never applied).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from retrain.config import Settings
from retrain.domain.runs import DEFAULT_PROFILE, ProfileName
from retrain.trainers import BatchShape, Command, TokenizerFiles, TrainingPlan

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
PROVREQ_API = "autoscaling.x-k8s.io/v1"
DWS_CLASS = "queued-provisioning.gke.io"
GPU = "nvidia.com/gpu"
RUN_ID_LABEL = "retrain.dev/run-id"
RUN_ID_ANNOTATION = "retrain.dev/run-id"
CALLBACK_ANNOTATION = "retrain.dev/callback-url"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
QUEUED_LABEL = "cloud.google.com/gke-queued"
#: Flex-start nodes carry this label; GKE's samples select it beside the node pool
#: (cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest).
FLEX_START_LABEL = "cloud.google.com/gke-flex-start"
#: "This label is necessary for GKE to calculate node resource requirements for your Pods": GKE applies
#: its Pod validations and mutations to the PodTemplate (the same page).
WARDEN_LABEL = "cloud.google.com/apply-warden-policies"
CONSUME_PR_ANNOTATION = "autoscaling.x-k8s.io/consume-provisioning-request"
PR_CLASS_ANNOTATION = "autoscaling.x-k8s.io/provisioning-class-name"
REPLICATED_JOB = "trainer"
MASTER_PORT = 29500
GCS_MOUNT_ROOT = "/gcs"
TTL_AFTER_FINISHED_S = 3600

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


def run_account_name(run_id: str) -> str:
    """The Kubernetes service account a run's pods run as: one per run, so that the run's own write grant
    (:func:`run_principal`, which names the account) reaches no other run's pods.  The whole run id
    (a DNS-1123 label of up to 63 characters: it is no pod's hostname, unlike the JobSet's shortened
    name), so two runs never share one."""
    return _slug("retrain-" + run_id, 63)


def run_principal(project_number: str, project: str, namespace: str, ksa: str) -> str:
    """The IAM principal of every pod that runs as Kubernetes service account ``ksa``, with no Google
    service account between (Workload Identity Federation for GKE: "All GKE Pods that use a specific
    Kubernetes service account", cloud.google.com/iam/docs/principal-identifiers)."""
    pool = f"projects/{project_number}/locations/global/workloadIdentityPools/{project}.svc.id.goog"
    return f"principal://iam.googleapis.com/{pool}/subject/ns/{namespace}/sa/{ksa}"


def render_run_account(run_id: str, namespace: str) -> dict[str, Any]:
    """The run's Kubernetes service account (:func:`run_account_name`), which the workflow creates before
    training and deletes at release.  It maps to no Google service account: Google knows its pods by
    :func:`run_principal`, which may read the artifacts bucket (the namespace's grant) and write only
    under the run's own managed folder (the grant the workflow sets there)."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {
            "name": run_account_name(run_id),
            "namespace": namespace,
            "labels": {RUN_ID_LABEL: label_value(run_id)},
            "annotations": {RUN_ID_ANNOTATION: run_id},
        },
        "automountServiceAccountToken": False,
    }


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


class GcsMounts:
    """The Cloud Storage FUSE volumes a pod needs, collected as its command names ``gs://`` paths.

    A bucket is mounted at ``/gcs/<bucket>`` by GKE's Cloud Storage FUSE CSI driver (authenticating as
    the pod's Kubernetes service account through Workload Identity), read-only unless some path in it
    is written."""

    def __init__(self) -> None:
        self.buckets: dict[str, bool] = {}
        """bucket -> read-only"""

    def path(self, uri: str, write: bool = False) -> str:
        """The pod's path of ``uri`` (the bucket joins the mounts); other paths are returned as they are."""
        if not uri.startswith("gs://"):
            return uri
        bucket, _, rest = uri[5:].partition("/")
        self.buckets[bucket] = self.buckets.get(bucket, True) and not write
        return f"{GCS_MOUNT_ROOT}/{bucket}/{rest}".rstrip("/")

    def volumes(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(pod volumes, container volume mounts)."""
        volumes, mounts = [], []
        for bucket, read_only in sorted(self.buckets.items()):
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
        return volumes, mounts


#: The GPU networks of an A3 High node: ``Network`` objects vpc1..vpc4 (k8s/tcpx.yaml) on eth1..eth4.
TCPX_NETWORKS = ("vpc1", "vpc2", "vpc3", "vpc4")
#: NCCL's GPUDirect-TCPX settings for a3-highgpu-8g, as container-engine-accelerators'
#: gpudirect-tcpx/nccl-config.yaml sets them for GKE 1.34+ (commit 0e5609b0).
TCPX_NCCL_ENV = {
    "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_ALGO": "Ring,Tree",
    "NCCL_PROTO": "Simple",
    "NCCL_CROSS_NIC": "0",
    "NCCL_NET_GDR_LEVEL": "PIX",
    "NCCL_P2P_PXN_LEVEL": "0",
    "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": "eth1,eth2,eth3,eth4",
    "NCCL_GPUDIRECTTCPX_CTRL_DEV": "eth0",
    "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
    "NCCL_P2P_NET_CHUNKSIZE": "524288",
    "NCCL_P2P_PCI_CHUNKSIZE": "524288",
    "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
    "NCCL_BUFFSIZE": "4194304",
    "NCCL_NSOCKS_PERTHREAD": "4",
    "NCCL_SOCKET_NTHREADS": "1",
    "NCCL_GPUDIRECTTCPX_TX_BINDINGS": (
        "eth1:8-21,112-125;eth2:8-21,112-125;eth3:60-73,164-177;eth4:60-73,164-177"
    ),
    "NCCL_GPUDIRECTTCPX_RX_BINDINGS": (
        "eth1:22-35,126-139;eth2:22-35,126-139;eth3:74-87,178-191;eth4:74-87,178-191"
    ),
    "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS": "500000",
}


def _tcpx(
    pod_spec: dict[str, Any], container: dict[str, Any], annotations: dict[str, str], rxdm: str
) -> None:
    """GPUDirect-TCPX on A3 High, the shape of container-engine-accelerators' gpudirect-tcpx/
    nccl-test-latest.yaml: no hostNetwork (eth1..eth4 come from GKE multi-networking), the RxDM daemon with
    NET_ADMIN and its GPUs injected by the NRI device injector, the NCCL plugin from the host's
    /home/kubernetes/bin/nvidia/lib64 (where nccl-tcpx-installer puts it).  RxDM runs as a native sidecar
    (an init container that always restarts), as AI-Hypercomputer/xpk's TCPX decorator places it, so the
    pod completes when training does."""
    annotations["devices.gke.io/container.tcpx-daemon"] = "".join(
        f"- path: /dev/{dev}\n" for dev in [*(f"nvidia{i}" for i in range(8)), "nvidiactl", "nvidia-uvm"]
    )
    annotations["networking.gke.io/default-interface"] = "eth0"
    annotations["networking.gke.io/interfaces"] = json.dumps(
        [{"interfaceName": "eth0", "network": "default"}]
        + [{"interfaceName": f"eth{i}", "network": net} for i, net in enumerate(TCPX_NETWORKS, 1)]
    )
    pod_spec["volumes"] += [
        {"name": "libraries", "hostPath": {"path": "/home/kubernetes/bin/nvidia/lib64"}},
        {"name": "tcpx-socket", "emptyDir": {}},
        {"name": "sys", "hostPath": {"path": "/sys"}},
        {"name": "proc-sys", "hostPath": {"path": "/proc/sys"}},
    ]
    pod_spec.setdefault("initContainers", []).append(
        {
            "name": "tcpx-daemon",
            "image": rxdm,
            "restartPolicy": "Always",
            "command": ["/tcpgpudmarxd/build/app/tcpgpudmarxd"],
            "args": [
                "--gpu_nic_preset",
                "a3vm",
                "--gpu_shmem_type",
                "fd",
                "--uds_path",
                "/run/tcpx",
                "--setup_param",
                '"--verbose 128 2 0 "',
            ],
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
    container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    container["volumeMounts"] += [
        {"name": "tcpx-socket", "mountPath": "/tmp"},
        {"name": "libraries", "mountPath": "/usr/local/nvidia/lib64"},
    ]
    container["env"] += [{"name": k, "value": v} for k, v in TCPX_NCCL_ENV.items()]


def render_jobset(
    run_id: str,
    *,
    nodes: int,
    gpus_per_node: int = 8,
    image: str,
    command: Command,
    mounts: GcsMounts | None = None,
    node_pool: str = "a3-dws",
    namespace: str = "default",
    callback_url: str | None = None,
    max_restarts: int = 2,
    tcpx_image: str | None = None,
    provisioning_request: str | None = None,
    service_account: str | None = None,
) -> dict[str, Any]:
    """The JobSet of run ``run_id``: ``nodes`` pods, one per GPU node, each running ``command``.

    ``mounts`` are the Cloud Storage FUSE volumes the command's paths need (:class:`GcsMounts`).
    ``service_account`` is the Kubernetes service account the pods run as: the run's own
    (:func:`run_account_name`), whose Workload Identity principal the Cloud Storage FUSE CSI driver
    authenticates as (no Google service account between: GoogleCloudPlatform/gcs-fuse-csi-driver,
    docs/authentication.md).
    ``provisioning_request`` names the ProvisioningRequest the run's workflow created, which the pods
    consume (GKE's ``consume-provisioning-request`` annotations).  ``tcpx_image`` is the RxDM sidecar of
    a run on GPUDirect-TCPX (``Settings.tcpx_image``); None runs on the nodes' primary network only.
    """
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError("nodes and gpus_per_node must be positive")
    if not command.command:
        raise ValueError("the container needs a command")
    name = jobset_name(run_id)
    labels = {RUN_ID_LABEL: label_value(run_id)}
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
    for k, v in sorted(command.env.items()):
        container_env.append({"name": k, "value": v})

    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    volume_mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    gcs_volumes, gcs_mounts = (mounts or GcsMounts()).volumes()
    volumes += gcs_volumes
    volume_mounts += gcs_mounts
    if gcs_volumes:
        pod_annotations["gke-gcsfuse/volumes"] = "true"

    container: dict[str, Any] = {
        "name": "trainer",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT}],
        "command": list(command.command),
        "args": list(command.args),
        "env": container_env,
        "resources": {"requests": {GPU: str(gpus_per_node)}, "limits": {GPU: str(gpus_per_node)}},
        "volumeMounts": volume_mounts,
    }
    if not container["args"]:
        del container["args"]

    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 30,
        "nodeSelector": {NODEPOOL_LABEL: node_pool, FLEX_START_LABEL: "true"},
        "tolerations": [
            {"key": GPU, "operator": "Exists", "effect": "NoSchedule"},
            {"key": QUEUED_LABEL, "operator": "Exists", "effect": "NoSchedule"},
        ],
        "containers": [container],
        "volumes": volumes,
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    if tcpx_image:
        _tcpx(pod_spec, container, pod_annotations, tcpx_image)

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
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**labels, WARDEN_LABEL: "true"},
            "annotations": {RUN_ID_ANNOTATION: run_id},  # the full id: the workflow adopts only its own
        },
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "nodeSelector": {NODEPOOL_LABEL: node_pool, FLEX_START_LABEL: "true"},
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


def example_plan() -> TrainingPlan:
    """A two-node run continuing from an earlier checkpoint (the sample's plan)."""
    return TrainingPlan(
        run_id="example-run-0001",
        shape=BatchShape(nodes=2, gpus_per_node=8, micro_batch_size=1, global_batch_size=16),
        steps=60,
        seq_length=2048,
        output_dir="gs://retrain-artifacts/runs/example-run-0001",
        base_checkpoint="gs://retrain-artifacts/runs/previous/megatron_gpt/checkpoints/"
        "megatron_gpt--val_loss=4.12-step=60-consumed_samples=960.0-last",
        base_step=60,
        blend=(
            0.7,
            "gs://retrain-artifacts/shards/1f0e3d/data_text_document",
            0.3,
            "gs://retrain-artifacts/shards/9a8b7c/data_text_document",
        ),
        tokenizer=TokenizerFiles(
            "GPT2BPETokenizer",
            vocab_file="gs://retrain-artifacts/shards/_tokenizer/0123456789abcdef/vocab.json",
            merge_file="gs://retrain-artifacts/shards/_tokenizer/0123456789abcdef/merges.txt",
        ),
    )


#: The samples in ``k8s/examples/``: file -> (profile, image); a test checks each file equals
#: :func:`example_jobset` of its profile.
EXAMPLES = {
    "jobset.example.yaml": (DEFAULT_PROFILE, "nvcr.io/nvidia/nemo:24.12"),
    "jobset.megatron-bridge.example.yaml": (ProfileName.MEGATRON_BRIDGE, "nvcr.io/nvidia/nemo:26.08"),
}


def example_jobset(file: str = "jobset.example.yaml") -> dict[str, Any]:
    """The sample ``k8s/examples/<file>``."""
    from retrain.trainers import profile

    name, image = EXAMPLES[file]
    plan = example_plan()
    if name == ProfileName.MEGATRON_BRIDGE:  # its lineage's base is Bridge's own checkpoint folder
        plan = replace(
            plan,
            profile=name,
            base_checkpoint="gs://retrain-artifacts/runs/previous/checkpoints/iter_0000060",
        )
    mounts = GcsMounts()
    return render_jobset(
        plan.run_id,
        nodes=plan.shape.nodes,
        gpus_per_node=plan.shape.gpus_per_node,
        image=image,
        command=profile(name).render(plan, mounts.path),
        mounts=mounts,
        callback_url="https://workflowexecutions.googleapis.com/v1/projects/example-project/locations/us-central1/workflows/retrain/executions/example/callbacks/example",
        tcpx_image=Settings().tcpx_image,
        service_account=run_account_name(plan.run_id),
        provisioning_request=provisioning_request_name(plan.run_id),
    )


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)
_Dumper.add_multi_representer(str, _str)  # a str subclass (a StrEnum) is a string too


def to_yaml(obj: dict[str, Any]) -> str:
    """Block-style YAML (multi-line strings as literal blocks), keys in rendering order."""
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def main() -> None:
    """Write the samples of :data:`EXAMPLES` into ``k8s/examples/``."""
    folder = Path(__file__).resolve().parents[2] / "k8s" / "examples"
    for file in EXAMPLES:
        (folder / file).write_text(
            "# Generated by `python -m retrain.k8s.render` (render_jobset); do not edit by hand.\n"
            + to_yaml(example_jobset(file))
        )


if __name__ == "__main__":
    main()
