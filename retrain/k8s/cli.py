"""``retrain render ...``: print the manifests of a run, as the workflow would submit them."""

from __future__ import annotations

import argparse
import json
import sys

from retrain import config
from retrain.k8s.render import render_jobset, render_provisioning_request, to_yaml


def main(argv: list[str] | None = None) -> int:
    settings = config.load()
    parser = argparse.ArgumentParser(prog="retrain render", description=__doc__)
    kinds = parser.add_subparsers(dest="kind", required=True)

    js = kinds.add_parser("jobset", help="the NeMo JobSet of a run")
    js.add_argument("--run-id", required=True)
    js.add_argument("--nodes", type=int, default=settings.nodes)
    js.add_argument("--gpus-per-node", type=int, default=settings.gpus_per_node)
    js.add_argument(
        "--data-prefix",
        nargs="+",
        required=True,
        help="Megatron blend: prefixes, or alternating weight prefix pairs",
    )
    js.add_argument("--checkpoint-dir", default=None, help="default: <artifacts>/runs/RUN_ID/checkpoints")
    js.add_argument("--resume-from", default=None)
    js.add_argument("--max-steps", type=int, default=None)
    js.add_argument("--image", default=settings.image)
    js.add_argument("--queue", default=settings.local_queue)
    js.add_argument("--node-pool", default=settings.node_pool)
    js.add_argument("--namespace", default=settings.namespace)
    js.add_argument("--max-restarts", type=int, default=2)
    js.add_argument("--tcpx", action="store_true", help="add the A3 GPUDirect-TCPX sidecar")
    js.add_argument("--json", action="store_true", help="JSON instead of YAML")

    pr = kinds.add_parser("provisioning-request", help="the PodTemplate + ProvisioningRequest of a run")
    pr.add_argument("--run-id", required=True)
    pr.add_argument("--nodes", type=int, default=settings.nodes)
    pr.add_argument("--gpus-per-node", type=int, default=settings.gpus_per_node)
    pr.add_argument("--node-pool", default=settings.node_pool)
    pr.add_argument("--namespace", default=settings.namespace)
    pr.add_argument("--json", action="store_true")

    args = parser.parse_args(argv)
    try:
        if args.kind == "jobset":
            blend: list[str | float] = []
            for item in args.data_prefix:
                try:
                    blend.append(float(item))
                except ValueError:
                    blend.append(item)
            docs = [
                render_jobset(
                    args.run_id,
                    nodes=args.nodes,
                    gpus_per_node=args.gpus_per_node,
                    image=args.image,
                    data_prefix=blend,
                    checkpoint_dir=args.checkpoint_dir
                    or f"{settings.artifacts_uri}/runs/{args.run_id}/checkpoints",
                    resume_from=args.resume_from,
                    max_steps=args.max_steps,
                    queue=args.queue,
                    node_pool=args.node_pool,
                    namespace=args.namespace,
                    max_restarts=args.max_restarts,
                    tcpx=args.tcpx,
                )
            ]
        else:
            docs = list(
                render_provisioning_request(
                    args.run_id,
                    nodes=args.nodes,
                    gpus_per_node=args.gpus_per_node,
                    namespace=args.namespace,
                    node_pool=args.node_pool,
                )
            )
    except ValueError as e:
        print(f"retrain render: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(docs if len(docs) > 1 else docs[0], indent=2))
    else:
        sys.stdout.write("---\n".join(to_yaml(d) for d in docs))
    return 0
