"""The training job for machines without torch: check the run's data instead of training on it.

    python -m retrain.train.datacheck --data-prefix [W] PREFIX ... --checkpoint-dir URI

Every dataset of the blend is read and checked as a strict reader would (magic, version, dtype,
pointers, .bin size, document indices); documents and tokens are counted and
``CHECKPOINT_DIR/metrics.json`` is written ({"trainer": "datacheck", ...}).  Exits 0, or 2 with a
message naming the bad dataset.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from retrain.adapters import objects
from retrain.train.data import DataError, env_blend, load_blend, write_json


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m retrain.train.datacheck", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--data-prefix",
        nargs="+",
        default=env_blend(),
        help="Megatron blend: PREFIX ... or WEIGHT PREFIX ...; @URI reads a tokenize report's blend "
        "(default: $RETRAIN_DATA_PREFIX)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=os.environ.get("RETRAIN_CHECKPOINT_DIR"),
        help="where metrics.json goes (default: $RETRAIN_CHECKPOINT_DIR)",
    )
    p.add_argument("--max-steps", type=int, help=argparse.SUPPRESS)  # accepted for the gpt trainer's argv
    return p


def check(data_prefix: list[Any]) -> dict[str, Any]:
    """The metrics of a blend whose every dataset reads back; raises DataError otherwise."""
    blend = load_blend(data_prefix)
    try:
        per = []
        for d in blend.datasets:
            if d.weight > 0 and d.data.tokens == 0:
                raise DataError("has no tokens but a weight > 0", d.prefix)
            per.append(
                {
                    "prefix": d.prefix,
                    "weight": d.weight,
                    "dtype": str(d.data.dtype.__name__),
                    "sequences": len(d.data),
                    "documents": d.data.documents,
                    "tokens": d.data.tokens,
                    "max_token_id": int(d.tokens.max()) if d.tokens.size else None,
                }
            )
        return {
            "trainer": "datacheck",
            "documents": blend.documents,
            "tokens": blend.tokens,
            "datasets": len(blend.datasets),
            "blend": per,
            "max_token_id": blend.max_token_id(),
            "checkpoint": None,
        }
    finally:
        blend.close()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.data_prefix:
        parser().error("--data-prefix is required (or $RETRAIN_DATA_PREFIX)")
    if not args.checkpoint_dir:
        parser().error("--checkpoint-dir is required (or $RETRAIN_CHECKPOINT_DIR)")
    started = time.time()
    try:
        metrics = check(args.data_prefix)
    except DataError as exc:
        print(f"datacheck: error: {exc}", file=sys.stderr, flush=True)
        return 2
    metrics["seconds"] = round(time.time() - started, 3)
    uri = objects.join(args.checkpoint_dir, "metrics.json")
    write_json(uri, metrics)
    print(
        f"datacheck: {metrics['datasets']} dataset(s), {metrics['documents']} documents, "
        f"{metrics['tokens']} tokens: ok -> {uri}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
