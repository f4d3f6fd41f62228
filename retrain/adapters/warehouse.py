"""BigQuery through the real client library: a table's rows (all, or those a watched table gained),
exported as newline-delimited JSON objects that the tokenizer reads like any other input.

Locally ``BIGQUERY_EMULATOR_HOST`` (``http://127.0.0.1:PORT``, as the other emulators' variables)
points the same client at a BigQuery emulator, so the cloud and the emulator differ only by endpoint.
Table and column names come from settings, never from events, and are checked before they reach SQL.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

from retrain.adapters import objects
from retrain.config import TABLE_RE

log = logging.getLogger(__name__)

_COLUMN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,299}$")
ROWS_PER_PAGE = 5000
QUERY_TIMEOUT_S = 300.0  # a bound on every call, so a stuck query fails the invocation (which retries)


def _checked(table: str, column: str | None = None) -> str:
    if not TABLE_RE.match(table):
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
        retry = bigquery.DEFAULT_RETRY.with_deadline(QUERY_TIMEOUT_S)
        job = self.client.query(sql, job_config=config, retry=retry, timeout=QUERY_TIMEOUT_S)
        return job.result(page_size=ROWS_PER_PAGE, retry=retry, timeout=QUERY_TIMEOUT_S)

    def high_watermark(self, table: str, column: str, not_after: dt.datetime | None = None) -> Any:
        """The largest value of ``column`` now (None: an empty table).  For a time column, never past
        ``not_after`` (the export's own start): one row stamped in the future would otherwise move the
        watermark past every row still to come, and they would never be exported.  Such rows wait for
        their time, with a warning."""
        checked = _checked(table, column)
        (row,) = list(self._query(f"SELECT MAX(`{column}`) AS hi FROM {checked}", {}))
        hi = row["hi"]
        if not_after is None or not isinstance(hi, dt.datetime) or hi <= not_after:
            return hi
        bound = {"not_after": not_after}
        below = f"SELECT MAX(`{column}`) AS hi FROM {checked} WHERE `{column}` <= @not_after"
        (row,) = list(self._query(below, bound))
        above = f"SELECT COUNT(*) AS n FROM {checked} WHERE `{column}` > @not_after"
        (late,) = list(self._query(above, bound))
        log.warning(
            "%s: %s row(s) have %s after %s (up to %s): they wait for their time",
            table,
            late["n"],
            column,
            not_after,
            hi,
        )
        return row["hi"]

    def rows(
        self, table: str, column: str | None = None, after: Any = None, through: Any = None
    ) -> Iterator[dict[str, Any]]:
        """Rows with ``after < column <= through`` in ``column`` order (a query), or with no column the
        whole table in its own order (tabledata.list: no query, no bytes billed); page by page."""
        if column is None:
            pages = self.client.list_rows(_checked(table).strip("`"), page_size=ROWS_PER_PAGE)
            return (dict(row.items()) for row in pages)
        where, params = f"`{column}` <= @through", {"through": through}
        if after is not None:
            where, params["after"] = f"`{column}` > @after AND {where}", after
        sql = f"SELECT * FROM {_checked(table, column)} WHERE {where} ORDER BY `{column}`"
        return (dict(row.items()) for row in self._query(sql, params))

    def export(
        self, table: str, uri: str, column: str | None = None, after: Any = None, through: Any = None
    ) -> int:
        """Write :meth:`rows` to one newline-delimited JSON object at ``uri``, streamed (memory stays at a
        page); returns the number of rows. The object appears only once every row is written."""
        count = 0
        with objects.open_write(uri, "application/jsonl") as out:
            for row in self.rows(table, column, after, through):
                out.write(json.dumps(row, default=_json_value, ensure_ascii=False).encode() + b"\n")
                count += 1
        return count


def _json_value(value: Any) -> Any:
    """BigQuery values JSON has no type for: timestamps, dates, numerics, bytes."""
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
