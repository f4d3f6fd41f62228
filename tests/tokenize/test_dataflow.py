"""The flex template's parameter mapping matches metadata.json and the CLI."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from retrain_tokenize.cli import parser

DATAFLOW = Path(__file__).resolve().parents[2] / "dataflow"


def _main():
    spec = importlib.util.spec_from_file_location("dataflow_main", DATAFLOW / "main.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_template_parameter_maps_to_the_cli():
    meta = json.loads((DATAFLOW / "metadata.json").read_text())
    names = {p["name"] for p in meta["parameters"]}
    assert names == set(_main().PARAMS) | {"append_eod"}


def test_template_args_parse_as_cli_args():
    argv = _main().to_cli(
        [
            "--inputs=gs://b/in/*.jsonl,gs://b/x.txt",
            "--shard_root=gs://a/shards",
            "--report=gs://a/r.json",
            "--append_eod=false",
            "--json_keys=text,title",
            "--project=p",
            "--region=us-central1",
            "--temp_location=gs://a/tmp",
        ]
    )
    args, beam_args = parser().parse_known_args(argv)
    assert args.inputs == ["gs://b/in/*.jsonl", "gs://b/x.txt"]
    assert (args.shard_root, args.report, args.append_eod) == ("gs://a/shards", "gs://a/r.json", False)
    assert args.json_keys == ["text", "title"] and args.runner == "DataflowRunner" and args.no_wait
    assert beam_args == ["--project=p", "--region=us-central1", "--temp_location=gs://a/tmp"]


def test_workers_size_dataflow_and_never_split_a_local_run_over_grpc():
    """Dataflow gets ``workers`` as max_num_workers (the pipeline's own flag wins); the local runners run one
    in-process worker whatever it says: multi-worker FnApiRunner's gRPC stream corrupts under load
    (apache/beam#23944): here a failed decode, and most likely a bench grown to 20 GB."""
    from apache_beam.options.pipeline_options import DirectOptions, WorkerOptions

    from retrain_tokenize.pipeline import LOCAL_RUNNERS, pipeline_options

    for runner in LOCAL_RUNNERS:
        direct = pipeline_options(runner, 8, []).view_as(DirectOptions)
        assert (direct.direct_num_workers, direct.direct_running_mode) == (1, "in_memory")
    assert pipeline_options("DataflowRunner", 8, []).view_as(WorkerOptions).max_num_workers == 8
    given = pipeline_options("DataflowRunner", 8, ["--max_num_workers=3"]).view_as(WorkerOptions)
    assert given.max_num_workers == 3
