"""What the orchestrator reads back from Cloud Storage, on the in-memory store (``tests/fakes``, held to
the real adapter by ``tests/ports/test_object_store.py``): an export's files, a run's set-aside objects."""

from __future__ import annotations

import dataclasses
import json

from fakes.objects import InMemoryObjects

from retrain import config
from retrain.contracts import tokenize_detail_uri
from retrain.domain.runs import ObjectSetAside, Run, Trigger
from retrain.exports import written_files
from retrain.plan import run_root, set_aside, tokenize_report_uri


def test_an_exports_files_are_the_ones_its_wildcard_names_among_hundreds() -> None:
    """BigQuery numbers a wildcard's files with 12 zero-padded digits; anything else under the prefix (a
    neighbour job's files, a name with fewer digits, a suffix) is not the job's."""
    store = InMemoryObjects(buckets=["art"])
    root = "gs://art/bigquery/events/job-7"
    ours = [f"{root}/part-{i:012d}.jsonl" for i in range(240)]
    others = [
        f"{root}/part-{7:06d}.jsonl",
        f"{root}/part-{3:012d}.jsonl.tmp",
        f"{root}-retry/part-{0:012d}.jsonl",
        f"{root}/other-{1:012d}.jsonl",
    ]
    for uri in [*others, *ours]:
        store.write_bytes(uri, b"{}\n")
    listed = written_files(store, f"{root}/part-*.jsonl")
    assert [info.uri for info in listed] == ours
    one = f"{root}/part-{5:012d}.jsonl"
    assert [info.uri for info in written_files(store, one)] == [one]  # no wildcard: the name, literally


def test_every_object_set_aside_is_read_from_the_detail_past_the_hundred_the_record_keeps() -> None:
    settings = dataclasses.replace(config.load({}), artifacts_bucket="art")
    store = InMemoryObjects(buckets=["art"])
    aside = [ObjectSetAside(f"gs://land/incoming/{i:03d}.txt", i + 1, "unreadable") for i in range(250)]
    run = Run("news-1", "news", Trigger.MANUAL, quarantined_objects=aside[:100], quarantined_object_count=250)
    detail = tokenize_detail_uri(tokenize_report_uri(run_root(settings, run.run_id)))
    store.write_bytes(detail, json.dumps({"quarantined_objects": [q.to_dict() for q in aside]}).encode())
    assert set_aside(settings, store, run) == aside
    whole = dataclasses.replace(run, quarantined_objects=aside[:3], quarantined_object_count=3)
    store.delete(detail)  # a record that names them all is not read past
    assert set_aside(settings, store, whole) == aside[:3]
