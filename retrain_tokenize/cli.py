"""``retrain tokenize``: raw text -> Megatron .bin/.idx (one prefix, or incremental content-hash shards).

    retrain tokenize INPUT... --output-prefix PREFIX [--vocab-file V --merge-file M | --tokenizer-json T]
        (INPUT: a path, glob, folder, gs:// URI, or bq://project.dataset.table, exported then read)
        [--json-keys text ...] [--append-eod | --no-append-eod] [--runner FnApiRunner|DataflowRunner]
        [--workers N] [--max-document-bytes B] [--keep-empty] [beam pipeline options...]
    retrain tokenize OBJECT... --shard-root ROOT [--report URI] [same options]
    retrain tokenize --manifest URI --shard-root ROOT [--report URI] [--hold-out-objects N]
        (the workflow's launch)

Progress goes to stderr, the report JSON to stdout.  Unknown ``--options`` are Beam pipeline options
(``--project``, ``--region``, ``--temp_location`` ... for Dataflow).  ``--append-eod`` is on unless
``--no-append-eod`` (Megatron's preprocess_data.py has it off by default).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from google.api_core.exceptions import GoogleAPICallError

from retrain.contracts import RunManifest
from retrain_tokenize import packs, records
from retrain_tokenize.options import PackOptions, TokenizeOptions
from retrain_tokenize.pipeline import tokenize_incremental, tokenize_to_prefix


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="retrain tokenize", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="paths, globs, folders, gs:// URIs or bq://project.dataset.table",
    )
    p.add_argument(
        "--manifest",
        help="a run's manifest (JSON file or gs:// object): its objects, named literally, each read at its "
        "generation",
    )
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--output-prefix", help="write PREFIX_{key}_document.bin/.idx, PREFIX_report.json")
    out.add_argument("--shard-root", help="incremental: one shard per object at ROOT/<sha256>/data")
    p.add_argument("--report", help="incremental: also write the aggregate report here")
    p.add_argument(
        "--pack-bytes",
        type=int,
        default=packs.PACK_BYTES,
        help="incremental: the trainer reads the shards through packs of at least this many bytes",
    )
    p.add_argument(
        "--max-packs", type=int, default=packs.MAX_PACKS, help="incremental: the most packs a blend holds"
    )
    p.add_argument(
        "--hold-out-objects",
        type=int,
        default=0,
        help="incremental: hold this many objects' shards out of the blend, as the report's held_out "
        "dataset (chosen by content; one object always trains)",
    )
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--tokenizer-json")
    p.add_argument("--eod-id", type=int, help="end-of-document id (default: the tokenizer's eod/eos token)")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--keep-empty", action="store_true", help='write "" texts as empty documents (Megatron)')
    p.add_argument("--max-document-bytes", type=int, default=records.DEFAULT_MAX_DOCUMENT_BYTES)
    p.add_argument("--runner", default="FnApiRunner")
    p.add_argument(
        "--workers", type=int, default=2, help="Dataflow's max_num_workers (locally: one worker, every core)"
    )
    p.add_argument("--no-wait", action="store_true", help="return once the job is submitted (templates)")
    return p


def read_manifest(uri: str) -> RunManifest:
    """The run's manifest (``retrain.contracts.RunManifest``, at the generation a ``#GENERATION`` suffix
    names: the version its run started with): the objects it trains, names taken literally, each read at
    the generation it had when it arrived."""
    from retrain.adapters import objects

    manifest, generation = objects.split_generation(uri)
    try:
        return RunManifest.parse(objects.read_bytes(manifest, generation))
    except FileNotFoundError as e:
        after = ": the manifest was replaced or deleted after its run started" if generation else ""
        raise SystemExit(f"retrain tokenize: {e}{after}") from None
    except ValueError as e:
        raise SystemExit(f"retrain tokenize: {uri} is not a run manifest: {e}") from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tokenize"]:
        argv = argv[1:]
    args, beam_args = parser().parse_known_args(argv)
    bad = [a for a in beam_args if not a.startswith("--")]
    if bad:
        parser().error(f"unrecognized arguments: {' '.join(bad)}")
    if bool(args.vocab_file) != bool(args.merge_file):
        parser().error("--vocab-file and --merge-file go together")
    if args.report and not args.shard_root:
        parser().error("--report goes with --shard-root")
    if args.manifest and not args.shard_root:
        parser().error("--manifest goes with --shard-root")
    if args.hold_out_objects < 0 or (args.hold_out_objects and not args.shard_root):
        parser().error("--hold-out-objects is a count (0 or more) and goes with --shard-root")
    manifest = read_manifest(args.manifest) if args.manifest else None
    pinned = manifest.objects if manifest else []
    if not args.inputs and not pinned:
        parser().error("no inputs: give INPUT... or --manifest")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("apache_beam", "google", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    options = TokenizeOptions(
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_json=args.tokenizer_json,
        eod_id=args.eod_id,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        keep_empty=args.keep_empty,
        max_document_bytes=args.max_document_bytes,
        runner=args.runner,
        workers=args.workers,
        pipeline_args=tuple(beam_args),
        wait=not args.no_wait,
    )
    try:
        if args.shard_root:
            packing = PackOptions(
                pack_bytes=args.pack_bytes,
                max_packs=args.max_packs,
                hold_out_objects=args.hold_out_objects,
                held_out_for=manifest.run_id if manifest else "",
            )
            report = tokenize_incremental(
                args.inputs, args.shard_root, options, pinned=pinned, report_uri=args.report, packing=packing
            )
        else:
            report = tokenize_to_prefix(args.inputs, args.output_prefix, options)
    except (FileNotFoundError, ValueError, GoogleAPICallError) as e:
        print(f"retrain tokenize: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
