"""BigQuery through the real client library: the rows a watched table gained, exported by bounded
``EXPORT DATA`` jobs, and a whole table streamed for the tokenizer; either way newline-delimited JSON
objects that the tokenizer reads like any other input.

Locally ``BIGQUERY_EMULATOR_HOST`` (``http://127.0.0.1:PORT``, as the other emulators' variables)
points the same client at a BigQuery emulator, so the cloud and the emulator differ only by endpoint.
Table and column names come from settings, never from events, and are checked before they reach SQL.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import decimal
import json
import logging
import os
import re
import time
from typing import Any

from retrain.adapters import objects
from retrain.config import TABLE_RE
from retrain.ports import ExportJob, ExportRefused, ExportState, ExportStatus, RowRange

log = logging.getLogger(__name__)

_COLUMN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,299}$")
ROWS_PER_PAGE = 5000
CALL_TIMEOUT_S = 60.0
#: How often a wait for an export job asks for its state.
POLL_S = 1.0
"""Bound on every call, so a stuck one fails its invocation (which is retried)."""
#: Where an export job may write: BigQuery's one ``*`` wildcard, names that need no quoting in SQL.
_DESTINATION_RE = re.compile(r"gs://[a-z0-9][a-z0-9._-]{1,220}/[A-Za-z0-9._/-]*\*[A-Za-z0-9._-]*")
#: Column types a watermark may have (the REST API's legacy names and the SQL ones).
WATERMARK_TYPES = frozenset({"TIMESTAMP", "INTEGER", "INT64"})


def _checked(table: str, column: str | None = None) -> str:
    if not TABLE_RE.match(table):
        raise ValueError(f"{table!r} is not project.dataset.table")
    if column is not None and not _COLUMN_RE.match(column):
        raise ValueError(f"{column!r} is not a column name")
    return f"`{table}`"


def _parameters(params: dict[str, Any]) -> list[Any]:
    from google.cloud import bigquery

    return [bigquery.ScalarQueryParameter(k, _param_type(v), v) for k, v in params.items()]


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
    """:class:`retrain.ports.Warehouse` on BigQuery.  Every call is bounded by ``call_timeout_s`` (the
    functions pass a share of their own request timeout); exports run as BigQuery jobs that outlive the
    call that starts them and are bounded by their own ``jobTimeoutMs``."""

    def __init__(self, project: str, client: Any = None, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
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
        self.call_timeout_s = call_timeout_s

    def _retry(self) -> Any:
        from google.cloud import bigquery

        return bigquery.DEFAULT_RETRY.with_deadline(self.call_timeout_s)

    def _query(self, sql: str, params: dict[str, Any]) -> Any:
        from google.cloud import bigquery

        config = bigquery.QueryJobConfig(query_parameters=_parameters(params))
        retry, timeout = self._retry(), self.call_timeout_s
        job = self.client.query(sql, job_config=config, retry=retry, timeout=timeout, job_retry=None)
        return job.result(page_size=ROWS_PER_PAGE, retry=retry, timeout=timeout)

    def _row(self, sql: str, params: dict[str, Any]) -> Any:
        (row,) = list(self._query(sql, params))
        return row

    def export_range(
        self,
        table: str,
        column: str,
        after: Any = None,
        not_after: dt.datetime | None = None,
        max_rows: int | None = None,
        max_step: int | None = None,
    ) -> RowRange:
        """Up to which value of ``column`` the next export goes: the largest value above ``after``
        (None: no such row), in at most three queries.  For a time column, never past ``not_after`` (the
        export's start, less a lag): one row stamped in the future would otherwise move the watermark
        past every row still to come, and they would never be exported; such rows wait for their time,
        with a warning.  For an integer column, likewise never more than ``max_step`` past ``after`` (on
        a first export, past the column's smallest value): one huge value would hide every row still to
        come behind it just the same.  With ``max_rows``, the value that ends the first ``max_rows``
        rows above ``after`` (rows sharing it come along), so that one export job stays bounded however
        large the backlog.  Either way the range says rows wait above it."""
        checked = _checked(table, column)
        where, params = "TRUE", {}
        if after is not None:
            where, params = f"`{column}` > @after", {"after": after}
        top, rows = self._row(f"SELECT MAX(`{column}`), COUNT(*) FROM {checked} WHERE {where}", params)
        bound: Any = None
        if not_after is not None and isinstance(top, dt.datetime) and top > not_after:
            bound = not_after
        elif max_step is not None and isinstance(top, int) and not isinstance(top, bool):
            base = after if after is not None else self._row(f"SELECT MIN(`{column}`) FROM {checked}", {})[0]
            if top > int(base) + max_step:
                bound = int(base) + max_step
        if bound is not None:
            bounded = {**params, "not_after": bound}
            now_sql = (
                f"MAX(IF(`{column}` <= @not_after, `{column}`, NULL)), COUNTIF(`{column}` <= @not_after)"
            )
            late_sql = f"COUNTIF(`{column}` > @not_after), MIN(IF(`{column}` > @not_after, `{column}`, NULL))"
            sql = f"SELECT {now_sql}, {late_sql} FROM {checked} WHERE {where}"
            hi, rows, late, later = self._row(sql, bounded)
            log.warning(
                "%s: %s row(s) have %s after %s (up to %s): they wait", table, late, column, bound, top
            )
            where, params, top = f"{where} AND `{column}` <= @not_after", bounded, hi
        else:
            later = None
        if top is None or max_rows is None or rows <= max_rows:
            return RowRange(top, capped=later is not None, later=later)
        if max_rows < 1:
            raise ValueError("max_rows must be at least 1")
        first = (
            f"SELECT `{column}` AS v FROM {checked} WHERE {where} ORDER BY `{column}` LIMIT {int(max_rows)}"
        )
        return RowRange(self._row(f"SELECT MAX(v) FROM ({first})", params)[0], capped=True, later=later)

    def location(self, table: str, column: str) -> str:
        """Where ``table`` lives (its export job runs there, and is read back there); ExportRefused when
        the table or ``column`` is missing, or ``column`` is no TIMESTAMP or INT64: only those grow as
        rows are added and round-trip through the ledger as they are."""
        from google.api_core.exceptions import NotFound

        try:
            found = self.client.get_table(
                _checked(table, column).strip("`"), retry=self._retry(), timeout=self.call_timeout_s
            )
        except NotFound as e:
            raise ExportRefused(f"{table}: {e.message}") from e
        types = {f.name: f.field_type for f in found.schema}
        if column not in types:
            raise ExportRefused(f"{table} has no column {column!r} (the watermark column)")
        if types[column] not in WATERMARK_TYPES:
            raise ExportRefused(f"{table}.{column} is {types[column]}: a watermark is TIMESTAMP or INT64")
        return str(found.location or "")

    def start_export(self, job: ExportJob, column: str, timeout_s: float) -> None:
        """Start ``job``: an ``EXPORT DATA`` statement writing the rows in ``(after, through]`` of ``column``
        as newline-delimited JSON to ``job.destination``, limited to ``timeout_s`` by BigQuery itself
        (``jobTimeoutMs``).  Its id is the caller's: a job that exists already is left alone (409).
        ExportRefused when BigQuery refuses the request (4xx).
        Syntax: cloud.google.com/bigquery/docs/reference/standard-sql/export-statements."""
        from google.api_core.exceptions import ClientError, Conflict
        from google.cloud import bigquery

        if not _DESTINATION_RE.fullmatch(job.destination):
            raise ExportRefused(f"{job.destination!r} is not a gs:// export destination with one '*'")
        where, params = f"`{column}` <= @through", {"through": job.through}
        if job.after is not None:
            where, params["after"] = f"`{column}` > @after AND {where}", job.after
        sql = (
            f"EXPORT DATA OPTIONS (uri = '{job.destination}', format = 'JSON', overwrite = false) AS "
            f"SELECT * FROM {_checked(job.table, column)} WHERE {where} ORDER BY `{column}`"
        )
        config = bigquery.QueryJobConfig(
            query_parameters=_parameters(params), job_timeout_ms=int(timeout_s * 1000)
        )
        try:
            self.client.query(
                sql,
                job_config=config,
                job_id=job.job_id,
                location=job.location or None,
                job_retry=None,  # a job id names one job: a failed one is never retried under it
                retry=self._retry(),
                timeout=self.call_timeout_s,
            )
        except Conflict:
            log.info("export job %s exists already", job.job_id)
        except ClientError as e:
            raise ExportRefused(f"export job {job.job_id}: {e.message}") from e

    def export_status(self, job: ExportJob, wait_s: float = 0.0) -> ExportStatus:
        """Where ``job`` stands (after waiting up to ``wait_s`` for it to end)."""
        from google.api_core.exceptions import NotFound

        try:
            found = self.client.get_job(
                job.job_id, location=job.location or None, retry=self._retry(), timeout=self.call_timeout_s
            )
        except NotFound:
            return ExportStatus(ExportState.MISSING)
        until = time.monotonic() + wait_s  # polled against its own clock: result() may overrun it
        while found.state != "DONE" and time.monotonic() < until:
            time.sleep(min(POLL_S, max(0.0, until - time.monotonic())))
            found.reload(retry=self._retry(), timeout=self.call_timeout_s)
        if found.state != "DONE":
            return ExportStatus(ExportState.RUNNING)
        if found.error_result:
            return ExportStatus(
                ExportState.FAILED, error=str(found.error_result.get("message", found.error_result))
            )
        # exportDataStatistics (JobStatistics2, the discovery document): the client library keeps the
        # job's statistics only in its resource, which to_api_repr() leaves out.
        stats = (found._properties.get("statistics") or {}).get("query", {}).get("exportDataStatistics", {})
        files = stats.get("fileCount")
        return ExportStatus(ExportState.SUCCEEDED, files=None if files is None else int(files))

    def cancel_export(self, job: ExportJob) -> None:
        """Ask BigQuery to stop ``job`` (it may still finish: the caller reads its state again)."""
        from google.api_core.exceptions import NotFound

        with contextlib.suppress(NotFound):
            self.client.cancel_job(
                job.job_id, location=job.location or None, retry=self._retry(), timeout=self.call_timeout_s
            )

    def export_table(self, table: str, uri: str) -> int:
        """A whole table to one newline-delimited JSON object at ``uri`` (the tokenizer's ``bq://``
        inputs), streamed page by page through tabledata.list (no query, no bytes billed); returns the
        number of rows.  The object appears only once every row is written."""
        count = 0
        pages = self.client.list_rows(_checked(table).strip("`"), page_size=ROWS_PER_PAGE)
        with objects.open_write(uri, "application/jsonl") as out:
            for row in pages:
                out.write(
                    json.dumps(dict(row.items()), default=_json_value, ensure_ascii=False).encode() + b"\n"
                )
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
