"""``retrain render ...``: print the manifests of a run, as the workflow would submit them.

    retrain render jobset --run-id R --data-prefix [W] PREFIX ... [--data-prefix ...]
        [--nodes N] [--gpus-per-node G] [--micro-batch-size M] [--global-batch-size B]
        [--tensor-parallel T] [--pipeline-parallel P] [--steps S] [--seq-length L]
        [--base-checkpoint URI --base-step N] [--vocab-file URI --merge-file URI] [--json]
    retrain render provisioning-request --run-id R [--nodes N] [--gpus-per-node G] [--json]

The JobSet is rendered by the same code as a run's (``retrain.plan.render_training``), from the
deployment's settings with the flags on top, and its command is checked against the trainer's own
configuration: a run the trainer would refuse (impossible batch arithmetic, say) exits 2 with the
reason.  Every ``--data-prefix`` adds to the blend.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from retrain import config
from retrain.k8s.render import render_provisioning_request, to_yaml
from retrain.trainers import PlanError, TokenizerFiles, profiles


def _blend(groups: list[list[str]]) -> list[Any]:
    out: list[Any] = []
    for group in groups:
        for item in group:
            try:
                out.append(float(item))
            except ValueError:
                out.append(item)
    return out


def _default_tokenizer(settings: config.Settings) -> TokenizerFiles:
    """GPT-2's files where a tokenize job with the default options keeps them beside the shards."""
    from retrain.plan import shard_root
    from retrain_tokenize.tokenizer import TokenizerSpec, fingerprint

    spec = TokenizerSpec()
    fp = fingerprint(spec, spec.load(), ("text",), True, False)
    folder = f"{shard_root(settings)}/_tokenizer/{fp}"
    return TokenizerFiles("GPT2BPETokenizer", f"{folder}/vocab.json", f"{folder}/merges.txt")


def render_jobset_command(args: argparse.Namespace, settings: config.Settings) -> dict[str, Any]:
    from retrain.domain.runs import Champion
    from retrain.plan import render_training, training_plan

    settings = dataclasses.replace(
        settings,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        tensor_parallel=args.tensor_parallel,
        pipeline_parallel=args.pipeline_parallel,
        steps_per_run=args.steps,
        seq_length=args.seq_length,
        profile=args.profile,
        profiles="",
        gpudirect_tcpx=not args.no_tcpx,
    )
    if args.image:  # the image of the profile rendered
        settings = dataclasses.replace(settings, image=args.image, bridge_image=args.image)
    base = (
        Champion("base", args.base_checkpoint, args.base_step, profile=args.profile)
        if args.base_checkpoint
        else None
    )
    if bool(args.vocab_file) != bool(args.merge_file):
        raise PlanError("--vocab-file and --merge-file go together")
    tokenizer = (
        TokenizerFiles("GPT2BPETokenizer", args.vocab_file, args.merge_file)
        if args.vocab_file
        else _default_tokenizer(settings)
    )
    plan = training_plan(settings, args.run_id, base).with_data(_blend(args.data_prefix), tokenizer)
    jobset, _ = render_training(settings, plan)
    return jobset


def main(argv: list[str] | None = None) -> int:
    settings = config.load()
    parser = argparse.ArgumentParser(prog="retrain render", description=__doc__.split("\n\n")[0])
    kinds = parser.add_subparsers(dest="kind", required=True)

    js = kinds.add_parser("jobset", help="the training JobSet of a run")
    js.add_argument("--run-id", required=True)
    js.add_argument(
        "--data-prefix",
        nargs="+",
        action="append",
        required=True,
        metavar="[WEIGHT] PREFIX",
        help="Megatron blend: prefixes, or alternating weight prefix pairs; repeat to add more",
    )
    js.add_argument("--nodes", type=int, default=settings.nodes)
    js.add_argument("--gpus-per-node", type=int, default=settings.gpus_per_node)
    js.add_argument("--micro-batch-size", type=int, default=settings.micro_batch_size)
    js.add_argument("--global-batch-size", type=int, default=settings.global_batch_size)
    js.add_argument("--tensor-parallel", type=int, default=settings.tensor_parallel)
    js.add_argument("--pipeline-parallel", type=int, default=settings.pipeline_parallel)
    js.add_argument("--steps", type=int, default=settings.steps_per_run, help="steps beyond the base")
    js.add_argument("--seq-length", type=int, default=settings.seq_length)
    js.add_argument("--base-checkpoint", help="continue from this checkpoint (gs://)")
    js.add_argument("--base-step", type=int, default=0, help="the base checkpoint's step")
    js.add_argument("--vocab-file", help="default: GPT-2's, where the tokenize job keeps it")
    js.add_argument("--merge-file")
    js.add_argument("--profile", default=settings.profile, choices=sorted(map(str, profiles())))
    js.add_argument("--image", help="default: the profile's image setting")
    js.add_argument("--no-tcpx", action="store_true", help="multi-node without GPUDirect-TCPX")
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
            docs = [render_jobset_command(args, settings)]
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
    except (PlanError, ValueError) as e:
        print(f"retrain render: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(docs if len(docs) > 1 else docs[0], indent=2))
    else:
        sys.stdout.write("---\n".join(to_yaml(d) for d in docs))
    return 0
