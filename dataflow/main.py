"""Dataflow flex template entry point: ``retrain tokenize`` with DataflowRunner.

The launcher calls ``python main.py --name=value ...`` with the parameters of metadata.json plus Dataflow's
own pipeline options (--project, --region, --temp_location, --job_name ...).  Template parameter names
use underscores; they are mapped to the CLI's flags here, everything else goes to Beam as is.  The job
is submitted without waiting: the shard reports and the aggregate ``report`` are written by the job.
"""

from __future__ import annotations

import glob
import sys

from retrain_tokenize.cli import main

#: template parameter -> CLI flag (None: positional inputs, comma-separated)
PARAMS = {
    "inputs": None,
    "manifest": "--manifest",
    "output_prefix": "--output-prefix",
    "shard_root": "--shard-root",
    "report": "--report",
    "vocab_file": "--vocab-file",
    "merge_file": "--merge-file",
    "tokenizer_json": "--tokenizer-json",
    "json_keys": "--json-keys",
    "max_document_bytes": "--max-document-bytes",
    "hold_out_objects": "--hold-out-objects",
}


def to_cli(argv: list[str]) -> list[str]:
    positional: list[str] = []
    out: list[str] = []
    for arg in argv:
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if eq and name in PARAMS:
            flag = PARAMS[name]
            items = [v for v in value.split(",") if v]
            if flag is None:
                positional += items
            elif name == "json_keys":
                out += [flag, *items]
            else:
                out.append(f"{flag}={value}")
        elif eq and name == "append_eod":
            out.append("--append-eod" if value.lower() in ("1", "true", "yes") else "--no-append-eod")
        else:
            out.append(arg)
    if not any(a.startswith("--runner") for a in out):
        out.append("--runner=DataflowRunner")
    out.append("--no-wait")
    wheels = sorted(glob.glob("/template/dist/retrain-*.whl"))
    staged = ("--sdk_container_image", "--extra_package", "--setup_file")
    if wheels and not any(a.startswith(staged) for a in out):
        out.append(f"--extra_package={wheels[-1]}")  # workers install retrain (and its deps) from this wheel
    return positional + out


if __name__ == "__main__":
    raise SystemExit(main(to_cli(sys.argv[1:])))
