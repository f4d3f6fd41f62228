"""A run's lineage as OpenLineage run events, as Google's Data Lineage API takes them
(``ProcessOpenLineageRunEvent``; cloud.google.com/dataplex/docs/open-lineage).

The job is the dataset's training (``retrain`` : ``DATASET.train``, which Data Lineage shows as one
process); each run of it is an OpenLineage run whose id is derived from the run id, so a retried finish
step reports the same run.  Its inputs are the landed objects it trained (or, for rows a watched BigQuery
table gained, that table) and the champion checkpoint it continued from; its outputs are its Megatron
shards and its checkpoint, which the next run takes as its input: the champion chain reads as one
lineage.  Names follow OpenLineage's naming, which Data Lineage maps to its own
(docs.cloud.google.com/dataplex/docs/openlineage-mapping): ``gs://BUCKET`` + ``PATH`` is
``gcs:BUCKET.PATH``, ``bigquery`` + ``PROJECT.DATASET.TABLE`` is ``bigquery:PROJECT.DATASET.TABLE``.

Data Lineage takes at most 100 links (inputs x outputs) in an event and 1,000 in all, and 5 MB a
message: the inputs travel in RUNNING events of at most LINKS_PER_EVENT links, and a run with more
objects than fit is reported by the folders that hold them (one input per folder).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from retrain.domain.runs import Run, RunStatus

#: OpenLineage's RunEvent schema, spec 2-0-2 (the version openlineage-python 1.x writes).
SCHEMA_URL = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent"
#: Who wrote the events (a URI, as the spec asks).
PRODUCER = "https://retrain.dev/openlineage"
#: "a maximum of 100 links per event", "The maximum aggregate number of table-level links is 1000"
#: (cloud.google.com/dataplex/docs/open-lineage, Limitations).
LINKS_PER_EVENT = 100
MAX_LINKS = 1000
JOB_NAMESPACE = "retrain"
#: Where a run keeps its events, in its folder.
LINEAGE_OBJECT = "openlineage.json"
#: How each ended status closes its OpenLineage run.
TERMINAL = {RunStatus.SUCCEEDED: "COMPLETE", RunStatus.FAILED: "FAIL", RunStatus.CANCELLED: "ABORT"}


def run_uuid(run_id: str) -> str:
    """The OpenLineage runId of a run (a UUID, as the spec requires): the same for every report of it."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"https://retrain.dev/runs/{run_id}"))


def dataset(uri: str, tables: dict[str, str] | None = None) -> dict[str, str]:
    """A ``gs://`` URI (or a folder, ending in ``/``) as an OpenLineage dataset; an export file of a
    watched BigQuery table (``tables``: the table for each export folder) as that table."""
    for folder, table in (tables or {}).items():
        if uri.startswith(folder):
            return {"namespace": "bigquery", "name": table}
    bucket, _, path = uri.removeprefix("gs://").partition("/")
    return {"namespace": f"gs://{bucket}", "name": path.rstrip("/") or "/"}


def _folders(uris: Iterable[str], most: int) -> list[str]:
    """The fewest parent folders (at most ``most``) that hold every URI: each one's folder, then their
    parents', up to the bucket."""
    given = sorted(set(uris))
    found, keep = given, max((u.count("/") for u in given), default=0)  # path parts kept: its folder
    while len(found) > most and keep >= 3:  # gs://bucket/ keeps 3
        found = sorted({"/".join(u.split("/")[:keep]) + "/" for u in given})
        keep -= 1
    return found[:most]


def _unique(items: Iterable[dict[str, str]]) -> list[dict[str, str]]:
    seen, out = set(), []
    for item in items:
        key = (item["namespace"], item["name"])
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


def openlineage_events(
    run: Run, objects: Sequence[str], tables: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """An ended run as OpenLineage run events: START (when it began), RUNNING events carrying its inputs
    and outputs, and COMPLETE, FAIL or ABORT (when it ended).  ``objects``: the ``gs://`` URIs of what
    it trained; ``tables``: the export folder of each watched BigQuery table."""
    outputs = _unique(
        [
            dataset(re.sub(r"/[^/]*$", "/", prefix))
            for prefix in (run.blend or [])[1::2]
            if isinstance(prefix, str)
        ]
        + ([dataset(run.checkpoint)] if run.checkpoint else [])
    )
    room = max(1, MAX_LINKS // max(1, len(outputs)))
    base = [dataset(run.base_checkpoint)] if run.base_checkpoint else []
    given = _unique([dataset(u, tables) for u in objects])
    if len(given) + len(base) > room:  # reported by the folders that hold them
        given = _unique([dataset(f, tables) for f in _folders(objects, room - len(base))])
    inputs = base + given
    per_event = max(1, LINKS_PER_EVENT // max(1, len(outputs)))
    began = run.tokenizing_at or run.created_at
    ended = run.finished_at or run.updated_at

    def event(kind: str, at: str, ins: list[dict[str, str]], outs: list[dict[str, str]]) -> dict[str, Any]:
        return {
            "eventType": kind,
            "eventTime": at,
            "producer": PRODUCER,
            "schemaURL": SCHEMA_URL,
            "run": {"runId": run_uuid(run.run_id)},
            "job": {"namespace": JOB_NAMESPACE, "name": f"{run.dataset}.train"},
            "inputs": ins,
            "outputs": outs,
        }

    chunks = [inputs[i : i + per_event] for i in range(0, len(inputs), per_event)] or [[]]
    return [
        event("START", began, [], []),
        *(event("RUNNING", ended, chunk, outputs) for chunk in chunks),
        event(TERMINAL.get(run.status, "OTHER"), ended, [], []),
    ]
