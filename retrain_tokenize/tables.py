"""BigQuery tables as tokenizer inputs: ``bq://project.dataset.table`` is exported first, then read.

The export path keeps the pipeline one pipeline: a table becomes a newline-delimited JSON object (one
row per line, every column a key) in the job's staging area, and from there on it is an input like any
other -- split by byte range, quarantined record by record, sharded by content hash.  The export
streams the table page by page (tabledata.list: no query, no bytes billed), so memory stays at a page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from retrain.adapters import objects
from retrain.config import TABLE_RE

BIGQUERY = "bq://"


@dataclass(frozen=True)
class StagedTable:
    source: str  # bq://project.dataset.table
    object: str  # where its rows were exported
    rows: int


def is_table(uri: str) -> bool:
    return uri.startswith(BIGQUERY)


def table_of(uri: str) -> tuple[str, str]:
    """``bq://p.d.t`` -> (``p``, ``p.d.t``); ValueError on anything else."""
    table = uri.removeprefix(BIGQUERY)
    if not is_table(uri) or not TABLE_RE.match(table):
        raise ValueError(f"{uri!r} is not bq://project.dataset.table")
    return table.rsplit(".", 2)[0], table  # dataset and table names have no dots; a project may


def stage(inputs: Sequence[str], staging: str) -> tuple[list[str], list[StagedTable]]:
    """Export every ``bq://`` input under ``staging``; the inputs with each table replaced by its object."""
    from retrain.adapters.warehouse import BigQueryWarehouse

    out: list[str] = []
    staged: list[StagedTable] = []
    for uri in inputs:
        if not is_table(uri):
            out.append(uri)
            continue
        project, table = table_of(uri)
        target = objects.join(staging, f"{len(staged):04d}-{table}.jsonl")
        rows = BigQueryWarehouse(project).export_table(table, target)
        staged.append(StagedTable(uri, target, rows))
        out.append(target)
    return out, staged


def unstage(staged: Sequence[StagedTable]) -> None:
    for t in staged:
        objects.delete(t.object)
