"""BigQuery through the real client library: the rows a watched table gained, and table exports.

Locally ``BIGQUERY_EMULATOR_HOST`` (``http://127.0.0.1:PORT``, as the other emulators' variables)
points the same client at a BigQuery emulator, so the cloud and the emulator differ only by endpoint.
Table and column names come from settings, never from events, and are checked before they reach SQL.
"""

from __future__ import annotations

import datetime as dt
import decimal
import os
import re
from collections.abc import Iterator
from typing import Any

from retrain.adapters import objects

_TABLE_RE = re.compile(r"^[a-z0-9][a-z0-9.:-]{0,99}\.[A-Za-z0-9_]{1,1024}\.[A-Za-z0-9_-]{1,1024}$")
_COLUMN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,299}$")
ROWS_PER_PAGE = 5000


def _checked(table: str, column: str | None = None) -> str:
    if not _TABLE_RE.match(table):
        raise ValueError(f"{table!r} is not project.dataset.table")
    if column is not None and not _COLUMN_RE.match(column):
        raise ValueError(f"{column!r} is not a column name")
    return f"`{table}`"


def _param_type(value: Any) -> str:
    if isinstance(value, dt.datetime):
        return "TIMESTAMP"
    if isinstance(value, dt.date):
        return "DATE"
    if isinstance(value, bool):
        raise ValueError("a BOOL column cannot be a watermark")
    if isinstance(value, int):
        return "INT64"
    if isinstance(value, float):
        return "FLOAT64"
    if isinstance(value, decimal.Decimal):
        return "NUMERIC"
    if isinstance(value, str):
        return "STRING"
    raise ValueError(f"a {type(value).__name__} value cannot be a watermark")


class BigQueryWarehouse:
    """:class:`retrain.ports.Warehouse` on BigQuery."""

    def __init__(self, project: str, client: Any = None) -> None:
        if client is None:
            from google.cloud import bigquery

            endpoint = os.environ.get("BIGQUERY_EMULATOR_HOST")
            if endpoint:
                from google.api_core.client_options import ClientOptions
                from google.auth.credentials import AnonymousCredentials

                client = bigquery.Client(
                    project=project,
                    credentials=AnonymousCredentials(),
                    client_options=ClientOptions(api_endpoint=endpoint),
                )
            else:
                client = bigquery.Client(project=project)
        self.client = client

    def _query(self, sql: str, params: dict[str, Any]) -> Any:
        from google.cloud import bigquery

        config = bigquery.QueryJobConfig(
            query_parameters=[bigquery.ScalarQueryParameter(k, _param_type(v), v) for k, v in params.items()]
        )
        return self.client.query(sql, job_config=config).result(page_size=ROWS_PER_PAGE)

    def high_watermark(self, table: str, column: str) -> Any:
        """The largest value of ``column`` now (None: an empty table)."""
        (row,) = list(self._query(f"SELECT MAX(`{column}`) AS hi FROM {_checked(table, column)}", {}))
        return row["hi"]

    def rows(self, table: str, column: str, after: Any, through: Any) -> Iterator[dict[str, Any]]:
        """Rows with ``after < column <= through`` (every row up to ``through`` when ``after`` is None),
        in ``column`` order, streamed page by page."""
        where, params = f"`{column}` <= @through", {"through": through}
        if after is not None:
            where, params["after"] = f"`{column}` > @after AND {where}", after
        sql = f"SELECT * FROM {_checked(table, column)} WHERE {where} ORDER BY `{column}`"
        for row in self._query(sql, params):
            yield dict(row.items())

    def export(self, table: str, destination_prefix: str) -> list[str]:
        """Export a whole table as newline-delimited JSON objects under ``destination_prefix``
        (an extract job, BigQuery's own export path); returns the objects written, in order."""
        from google.cloud import bigquery

        jsonl = bigquery.DestinationFormat.NEWLINE_DELIMITED_JSON
        config = bigquery.ExtractJobConfig(destination_format=jsonl)
        pattern = objects.join(destination_prefix, "part-*.jsonl")
        self.client.extract_table(_checked(table).strip("`"), pattern, job_config=config).result()
        return list(objects.list_uris(destination_prefix.rstrip("/") + "/"))
