"""BigQuery audit-log CloudEvents (Eventarc ``google.cloud.audit.log.v1.written``) as retrain sees them.

Two things matter, both logged under ``google.cloud.bigquery.v2.JobService.InsertJob`` in the
``data_access`` audit log with a ``BigQueryAuditMetadata`` payload:

* :class:`TableWritten` -- rows were written to a table: a ``tableDataChange`` (resourceName is the
  table), or a finished load / query / copy job (``jobChange``, ``after: DONE``) whose
  ``destinationTable`` is it.  One load produces both, so handling them must be idempotent.
* :class:`ExportFinished` -- an extract job (``jobConfig.type: EXPORT``) finished, successfully or not.

Of the jobs the functions' own account runs, one thing matters: :class:`OwnExportDone`, one of
retrain's export jobs ended (``retrain.exports`` finishes its export at once, not at the next tick).

Everything else (job insertions, jobs still running, reads, other services) is :class:`NotRelevant`,
acknowledged without work.  Malformed events raise :class:`~retrain.domain.events.Rejected`.
Field names and enum spellings follow Google's BigQueryAuditMetadata reference; 64-bit counts arrive
as JSON strings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from retrain.domain.errors import Rejected
from retrain.domain.events import event_id_of

AUDIT_LOG_WRITTEN = "google.cloud.audit.log.v1.written"
BIGQUERY_SERVICE = "bigquery.googleapis.com"
INSERT_JOB = "google.cloud.bigquery.v2.JobService.InsertJob"
QUERY = "google.cloud.bigquery.v2.JobService.Query"  # jobs.query (bq query, the console): same payloads
AUDIT_SOURCE_RE = re.compile(r"^//cloudaudit\.googleapis\.com/projects/[a-z0-9.:-]{1,100}/logs/[a-z_]+$")
METADATA_TYPE = "type.googleapis.com/google.cloud.audit.BigQueryAuditMetadata"

_TABLE_RE = re.compile(
    r"^projects/(?P<p>[a-z0-9.:-]{1,100})/datasets/(?P<d>[A-Za-z0-9_]{1,1024})/tables/(?P<t>[^/\x00-\x1f]{1,1024})$"
)
_JOB_RE = re.compile(r"^projects/[a-z0-9.:-]{1,100}/jobs/[A-Za-z0-9_-]{1,1024}$")
#: The job ids retrain gives its export jobs (``retrain.exports``).
EXPORT_JOB_PREFIX = "retrain-export-"
_WRITING_JOB_TYPES = {"IMPORT": "loadConfig", "QUERY": "queryConfig", "COPY": "tableCopyConfig"}


def table_id(resource: str) -> str:
    """``projects/P/datasets/D/tables/T`` -> ``P.D.T`` (how settings and SQL name a table)."""
    m = _TABLE_RE.match(resource)
    if not m:
        raise Rejected(f"{resource[:200]!r} is not a BigQuery table name")
    return f"{m['p']}.{m['d']}.{m['t']}"


@dataclass(frozen=True)
class TableWritten:
    event_id: str
    table: str  # project.dataset.table
    job: str | None


@dataclass(frozen=True)
class ExportFinished:
    event_id: str
    job: str
    destination_uris: tuple[str, ...]
    source_table: str | None
    error: str | None  # the job's errorResult message: the export did not complete


@dataclass(frozen=True)
class OwnExportDone:
    """One of retrain's own export jobs ended (its ``jobChange`` to DONE): its export can be finished."""

    event_id: str
    job_id: str


@dataclass(frozen=True)
class NotRelevant:
    reason: str


BigQueryChange = TableWritten | ExportFinished | OwnExportDone | NotRelevant


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise Rejected(f"{what} is not a JSON object")
    return value


def _own_export_done(event_id: str, payload: Mapping[str, Any]) -> OwnExportDone | None:
    """The end of one of retrain's export jobs, from its own ``jobChange``; None for anything else."""
    metadata = payload.get("metadata")
    change = metadata.get("jobChange") if isinstance(metadata, Mapping) else None
    job = change.get("job") if isinstance(change, Mapping) else None
    if not isinstance(change, Mapping) or not isinstance(job, Mapping):
        return None
    name, status = job.get("jobName"), job.get("jobStatus")
    state = status.get("jobState") if isinstance(status, Mapping) else None
    if not isinstance(name, str) or not _JOB_RE.match(name) or "DONE" not in (change.get("after"), state):
        return None
    job_id = name.rsplit("/", 1)[1]
    return OwnExportDone(event_id, job_id) if job_id.startswith(EXPORT_JOB_PREFIX) else None


def parse_bigquery_audit(attributes: Mapping[str, Any], data: Any, own_principal: str = "") -> BigQueryChange:
    """Validate an Eventarc audit-log CloudEvent from BigQuery and say what it means for retrain.

    ``own_principal`` is the functions' own service account: the jobs it runs (watermark queries,
    exports) are logged like anyone's, and acting on them would loop.  Eventarc cannot filter on the
    caller, so it is done here, from ``protoPayload.authenticationInfo.principalEmail`` (the AuditLog
    type, google/cloud/audit/audit_log.proto)."""
    event_id = event_id_of(attributes, AUDIT_LOG_WRITTEN)
    source = str(attributes.get("source", ""))
    if not AUDIT_SOURCE_RE.match(source):
        raise Rejected(f"event source {source[:200]!r} is not a Cloud Audit Logs source")
    payload = _mapping(_mapping(data, "event data").get("protoPayload"), "protoPayload")
    if payload.get("serviceName") != BIGQUERY_SERVICE:
        raise Rejected(f"audit log of {str(payload.get('serviceName'))[:100]!r}, not BigQuery")
    method = payload.get("methodName")
    principal = _mapping(payload.get("authenticationInfo") or {}, "authenticationInfo").get("principalEmail")
    if own_principal and principal == own_principal:
        done = _own_export_done(event_id, payload)
        return done or NotRelevant(f"a job of retrain's own account {own_principal}")
    if method not in (INSERT_JOB, QUERY):
        return NotRelevant(f"method {str(method)[:100]} writes no rows")
    metadata = _mapping(payload.get("metadata"), "protoPayload.metadata")
    if metadata.get("@type") != METADATA_TYPE:
        raise Rejected("protoPayload.metadata is not BigQueryAuditMetadata")

    if "tableDataChange" in metadata:
        change = _mapping(metadata["tableDataChange"], "tableDataChange")
        table = table_id(str(payload.get("resourceName", "")))
        try:
            inserted = int(change.get("insertedRowsCount") or 0)
        except (TypeError, ValueError):
            raise Rejected("tableDataChange.insertedRowsCount is not an integer") from None
        if inserted <= 0 and not change.get("truncated"):
            return NotRelevant(f"{table}: no rows inserted")
        job = change.get("jobName")
        return TableWritten(event_id, table, job if isinstance(job, str) else None)

    if "jobChange" not in metadata:
        return NotRelevant("not a job change or a table data change")
    job_change = _mapping(metadata["jobChange"], "jobChange")
    job = _mapping(job_change.get("job"), "jobChange.job")
    job_name = job.get("jobName")
    if not isinstance(job_name, str) or not _JOB_RE.match(job_name):
        raise Rejected("jobChange.job.jobName missing or malformed")
    status = _mapping(job.get("jobStatus") or {}, "jobStatus")
    if job_change.get("after") != "DONE" and status.get("jobState") != "DONE":
        return NotRelevant(f"job {job_name} is not done")
    config = _mapping(job.get("jobConfig"), "jobConfig")
    error = status.get("errorResult")
    message = str(_mapping(error, "errorResult").get("message") or "unknown error") if error else None
    job_type = config.get("type")

    if job_type == "EXPORT":
        extract = _mapping(config.get("extractConfig"), "extractConfig")
        uris = extract.get("destinationUris")
        if not isinstance(uris, list) or not uris or not all(isinstance(u, str) for u in uris):
            raise Rejected("extractConfig.destinationUris missing or not a list of strings")
        if extract.get("destinationUrisTruncated"):
            raise Rejected("extractConfig.destinationUris was truncated in the audit log")
        source_table = extract.get("sourceTable")
        return ExportFinished(
            event_id,
            job_name,
            tuple(uris),
            table_id(source_table) if isinstance(source_table, str) else None,
            message,
        )

    if job_type in _WRITING_JOB_TYPES:
        destination = _mapping(config.get(_WRITING_JOB_TYPES[job_type]) or {}, "jobConfig").get(
            "destinationTable"
        )
        if message:
            return NotRelevant(f"job {job_name} failed: {message}")
        if isinstance(destination, str):
            return TableWritten(event_id, table_id(destination), job_name)
        return NotRelevant(f"job {job_name} wrote no table")
    return NotRelevant(f"job {job_name} is a {str(job_type)[:40]} job")
