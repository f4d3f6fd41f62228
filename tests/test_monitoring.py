"""infra/app/monitoring.tf against what the code logs: every alert's filter matches an entry the code
writes when its condition happens (driven here, formatted as the functions format it), every Alert has a
policy saying what to do, and the dashboard's metrics read fields the workflow's entries carry."""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from run_events_support import announce

from retrain import config
from retrain.contracts import RunEvent, RunEventType, field_names
from retrain.domain.runs import Run, RunStatus, iso
from retrain.ingest import Ingest
from retrain.logs import SUMMARY, Alert, JsonLines
from retrain.ports import NodeUp, tell
from retrain.steps import Steps
from retrain_ops.deployment import Deployment

WORKFLOW = Path(__file__).resolve().parents[1] / "workflows" / "retrain.yaml"


def app() -> Any:
    return Deployment().app


def log_alerts() -> dict[str, dict[str, str]]:
    return dict(app().local("log_alerts"))


def matches(query: str, entry: dict[str, Any]) -> bool:
    """Whether a Logging query of the forms monitoring.tf uses (``a.b="v"``, ``a.b:*``, joined by AND and
    OR, parenthesised) matches a structured entry (``jsonPayload`` being the entry's own fields)."""

    def value(path: str) -> Any:
        node: Any = {"jsonPayload": entry, **entry}
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def term(text: str) -> bool:
        text = text.strip()
        if text.startswith("(") and text.endswith(")"):
            return expr(text[1:-1])
        if m := re.fullmatch(r'([\w.]+)="([^"]*)"', text):
            return str(value(m.group(1))) == m.group(2) if value(m.group(1)) is not None else False
        if m := re.fullmatch(r"([\w.]+):\*", text):
            return value(m.group(1)) is not None
        raise AssertionError(f"a query term this test cannot read: {text!r}")

    def split(text: str, word: str) -> list[str]:
        parts, depth, start = [], 0, 0
        for i, ch in enumerate(text):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0 and text.startswith(f" {word} ", i):
                parts.append(text[start:i])
                start = i + len(word) + 2
        return [*parts, text[start:]]

    def expr(text: str) -> bool:
        return any(all(term(t) for t in split(o, "AND")) for o in split(text, "OR"))

    return expr(query)


def entries(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """What the captured records are as the functions write them (retrain.logs.JsonLines)."""
    formatter = JsonLines("functions")
    return [json.loads(formatter.format(r)) for r in caplog.records]


def settings() -> config.Settings:
    return config.load({})


def test_every_alert_has_a_policy_that_says_what_to_do() -> None:
    alerts = log_alerts()
    named = {
        m.group(1) for a in alerts.values() if (m := re.search(r'jsonPayload\.alert="(\w+)"', a["filter"]))
    }
    assert named == {str(a) for a in Alert}
    for name, spec in alerts.items():
        assert len(spec["todo"]) > 100 and "`retrain" in spec["todo"], name  # a command to run, not a shrug
        assert re.fullmatch(r"\d+s", spec["period"]), name  # a log-match policy must limit its notifications
    policies = app().resources("google_monitoring_alert_policy")
    assert set(policies) == {"log", "dead_letters", "function_errors"}
    for name, policy in policies.items():
        assert policy["notification_channels"] == "${local.alert_channels}", name
        (doc,) = policy["documentation"]
        assert app().evaluate(doc["mime_type"]) == "text/markdown" and doc["content"], name


def test_the_capacity_wait_alert_matches_what_the_sweeper_logs(caplog: pytest.LogCaptureFixture) -> None:
    ingest = Ingest(settings(), None, None, None)  # type: ignore[arg-type]
    now = datetime.now(UTC)
    waited = timedelta(seconds=ingest.settings.alert_capacity_wait_s + 60)

    def provisioning(run_id: str, since: datetime, status: RunStatus = RunStatus.PROVISIONING) -> Run:
        return Run(run_id=run_id, dataset="ds", trigger="manual", status=status, provisioning_at=iso(since))

    run, fresh = provisioning("ds-r1", now - waited), provisioning("ds-r2", now)
    training = provisioning("ds-r3", now - waited, RunStatus.TRAINING)
    with caplog.at_level(logging.INFO):
        for r in (run, fresh, training):
            ingest.sweeper.note_capacity_wait(r, now)
    (entry,) = entries(caplog)
    assert matches(log_alerts()["capacity_wait"]["filter"], entry)
    assert entry["severity"] == "WARNING" and entry["run_id"] == "ds-r1" and entry["dataset"] == "ds"


class _RecentRuns:
    def __init__(self, *runs: Run) -> None:
        self.runs = list(runs)

    def list_runs(self, limit: int = 100) -> list[Run]:
        return self.runs[:limit]


def test_the_idle_nodes_alert_matches_what_the_reaper_logs_and_only_past_the_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limit = settings().alert_idle_nodes_s
    ended_long_ago = Run(
        run_id="ds-a", dataset="ds", trigger="manual", finished_at=iso(datetime.now(UTC) - timedelta(hours=5))
    )
    ended_just_now = Run(run_id="ds-b", dataset="ds", trigger="manual", finished_at=iso(datetime.now(UTC)))
    old_nodes = [NodeUp("gke-a3-1", limit * 3, ""), NodeUp("gke-a3-2", limit * 2, "")]
    young_nodes = [NodeUp("gke-a3-3", limit / 2, "")]
    with caplog.at_level(logging.INFO):
        Ingest(settings(), _RecentRuns(ended_just_now, ended_long_ago), None, None).sweeper.note_idle_nodes(
            old_nodes
        )  # type: ignore[arg-type]
        Ingest(settings(), _RecentRuns(ended_long_ago), None, None).sweeper.note_idle_nodes(young_nodes)  # type: ignore[arg-type]
        assert entries(caplog) == []  # a run just ended; the nodes just came up: neither idle that long
        Ingest(settings(), _RecentRuns(ended_long_ago), None, None).sweeper.note_idle_nodes(old_nodes)  # type: ignore[arg-type]
    (entry,) = entries(caplog)
    assert matches(log_alerts()["idle_nodes"]["filter"], entry)
    assert "gke-a3-1, gke-a3-2" in entry["message"] and entry["severity"] == "WARNING"


def test_the_cost_alert_matches_what_a_runs_finish_logs(caplog: pytest.LogCaptureFixture) -> None:
    steps = Steps(settings(), None, None)  # type: ignore[arg-type]
    factor = steps.settings.alert_cost_factor
    over = Run(
        run_id="ds-c1", dataset="ds", trigger="manual", estimated_cost_usd=10.0, cost_usd=10.0 * factor + 0.01
    )
    within = Run(
        run_id="ds-c2", dataset="ds", trigger="manual", estimated_cost_usd=10.0, cost_usd=10.0 * factor
    )
    unestimated = Run(run_id="ds-c3", dataset="ds", trigger="manual", cost_usd=99.0)
    with caplog.at_level(logging.INFO):
        for r in (over, within, unestimated):
            steps._note_cost(r)
    (entry,) = entries(caplog)
    assert matches(log_alerts()["cost_over_estimate"]["filter"], entry) and entry["run_id"] == "ds-c1"


def test_the_run_failed_alert_matches_a_failed_run_event_and_nothing_else(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = Run(run_id="ds-f1", dataset="ds", trigger="manual")
    with caplog.at_level(logging.INFO):
        for type in RunEventType:
            tell(None, type, run, reason="why", failure="ExecutionLost" if type == "failed" else None)
    matched = [e for e in entries(caplog) if matches(log_alerts()["run_failed"]["filter"], e)]
    assert [e["run_event"]["type"] for e in matched] == ["failed"]
    assert matched[0]["severity"] == "WARNING" and matched[0]["run_event"]["failure"] == "ExecutionLost"


def test_the_run_events_metric_reads_what_the_workflows_entries_carry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The workflow's announce logs the event (sys.log json): the run-events metric counts those
    entries, labelled by their type."""
    from cloudworkflows import ConnectorRegistry

    registry = ConnectorRegistry()
    registry.register("googleapis.pubsub.v1.projects.topics.publish", lambda args, _: {"messageIds": ["1"]})
    with caplog.at_level(logging.INFO, logger="cloudworkflows.sys.log"):
        announce("succeeded", {"status": "succeeded", "cost_usd": 1.5}, registry)
    (logged,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "cloudworkflows.sys.log"]
    assert logged["component"] == "workflow" and logged["run_event"]["type"] == "succeeded"
    assert set(logged["run_event"]) == field_names(RunEvent)
    metrics = app().resources("google_logging_metric")
    resource, events_filter = str(app().evaluate(metrics["run_events"]["filter"])).split(" AND ", 1)
    assert resource == 'resource.type="workflows.googleapis.com/Workflow"'
    assert matches(events_filter, logged)
    assert "EXTRACT(jsonPayload.run_event.type)" in str(metrics["run_events"]["label_extractors"])


def test_the_dashboards_run_numbers_are_what_a_runs_finish_logs(caplog: pytest.LogCaptureFixture) -> None:
    """Each per-run metric (tokens, node time busy and idle, cost, time waited for capacity) extracts a
    number the finish step's summary entry carries."""
    run = Run(
        run_id="ds-s1",
        dataset="ds",
        trigger="manual",
        status=RunStatus.SUCCEEDED,
        tokens=1234,
        cost_usd=2.5,
        gpu_node_seconds=600.0,
        idle_node_seconds=60.0,
        provisioning_at="2026-11-27T10:00:00.000000Z",
        training_at="2026-11-27T10:05:00.000000Z",
    )
    with caplog.at_level(logging.INFO, logger="retrain.steps"):
        Steps(settings(), None, None)._log_summary(run)  # type: ignore[arg-type]
    (entry,) = [e for e in entries(caplog) if "run_summary" in e]
    metric = app().resources("google_logging_metric")["run_record"]
    resource, summary_filter = str(app().evaluate(metric["filter"])).split(" AND ", 1)
    assert resource == 'resource.type="cloud_run_revision"' and matches(summary_filter, entry)
    per_run = app().evaluate(metric["for_each"])
    assert set(per_run) == set(SUMMARY)
    assert {k: entry["run_summary"][k] for k in per_run} == {
        "tokens": 1234,
        "cost_usd": 2.5,
        "gpu_node_seconds": 600.0,
        "idle_node_seconds": 60.0,
        "waited_for_capacity_s": 300.0,
    }
    assert str(app().evaluate(metric["value_extractor"].replace("each.key", '"tokens"'))) == (
        "EXTRACT(jsonPayload.run_summary.tokens)"
    )
