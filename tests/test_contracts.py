"""Every seam has one contract (retrain.contracts), and both sides of it are held to it.

These tests read the other side as it deploys: ``workflows/retrain.yaml`` (the argument fields it
names, the record fields and statuses it writes, the report fields it reads, the completion states it
tests), ``infra/`` (the settings Terraform sets, the Scheduler payloads, the manifests' values) and
the Dataflow REST definition in google-api-python-client's discovery documents.  Each check is a
function returning problems, and each is shown to fail on a broken copy of the real file.
"""

from __future__ import annotations

import ast
import base64
import json
import re
import shutil
from collections import ChainMap
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from retrain import config, contracts
from retrain.contracts import (
    Accounting,
    Begun,
    CallbackPayload,
    CancelRequest,
    CompletionState,
    ExecutionArgument,
    Handover,
    JobSetCompletion,
    RunManifest,
    RunRecord,
    RunStatus,
    SchedulerJob,
    SchedulerTick,
    StepName,
    StepRequest,
    TokenizeReport,
    WorkflowArgument,
    field_names,
)
from retrain.domain import datasets
from retrain.domain.errors import Rejected
from retrain.domain.events import ObjectVersion
from retrain_ops.deployment import Deployment, cron_period_s, local_settings

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / "workflows" / "retrain.yaml"


# --- reading workflows/retrain.yaml -------------------------------------------------------------------


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def _calls(node: Any, name: str) -> Iterator[dict[str, Any]]:
    """Every step (dict) that calls ``name``."""
    if isinstance(node, dict):
        if node.get("call") == name:
            yield node
        for v in node.values():
            yield from _calls(v, name)
    elif isinstance(node, list):
        for v in node:
            yield from _calls(v, name)


def _literal(value: Any) -> str | None:
    """The string a YAML value stands for when it is a literal (not an expression)."""
    if isinstance(value, str) and not value.startswith("${"):
        return value
    return None


def _assigned(wf: Any, name: str) -> dict[str, Any]:
    """What the workflow puts into variable ``name``: a map literal assigned to it, and ``name.key``
    assignments."""
    out: dict[str, Any] = {}
    for node in _nodes(wf):
        if isinstance(node, dict) and isinstance(node.get("assign"), list):
            for item in node["assign"]:
                for target, value in item.items():
                    if target == name and isinstance(value, dict):
                        out.update(value)
                    elif target.startswith(name + "."):
                        out[target[len(name) + 1 :]] = value
    return out


def _nodes(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from _nodes(v)
    elif isinstance(node, list):
        for v in node:
            yield from _nodes(v)


def check_workflow(source: str) -> list[str]:
    """What the workflow names that the contracts do not declare."""
    wf = yaml.safe_load(source)
    problems = []
    text = "\n".join(_strings(wf))
    argument = field_names(WorkflowArgument)
    for name in sorted(set(re.findall(r"(?<![\w.])(?:args|run)\.([A-Za-z_]\w*)", text)) - argument):
        problems.append(f"argument field {name!r} is not a WorkflowArgument field")
    report = field_names(TokenizeReport)
    for name in sorted(set(re.findall(r"\breport\.([A-Za-z_]\w*)", text)) - report):
        problems.append(f"report field {name!r} is not a TokenizeReport field")
    for name in sorted(set(re.findall(r"\bhandover\.([A-Za-z_]\w*)", text)) - field_names(Handover)):
        problems.append(f"handover field {name!r} is not a Handover field")
    for name in sorted(set(re.findall(r"\bstart\.([A-Za-z_]\w*)", text)) - field_names(ExecutionArgument)):
        problems.append(f"execution argument field {name!r} is not an ExecutionArgument field")
    for name in sorted(set(re.findall(r"\bbegun\.([A-Za-z_]\w*)", text)) - field_names(Begun)):
        problems.append(f"begin's answer field {name!r} is not a Begun field")
    for name in sorted(set(re.findall(r"\bcancel\.([A-Za-z_]\w*)", text)) - field_names(CancelRequest)):
        problems.append(f"cancel's answer field {name!r} is not a CancelRequest field")
    for name in sorted(set(re.findall(r"\baccounting\.([A-Za-z_]\w*)", text)) - field_names(Accounting)):
        problems.append(f"account's answer field {name!r} is not an Accounting field")
    to_python = [*_calls(wf, "python_step")]
    to_python += [c for c in _calls(wf, "http.post") if c.get("args", {}).get("url") == "${steps_url}"]
    for call in to_python:
        body = call.get("args", {}).get("body", {})
        for key in sorted(set(body) - field_names(StepRequest)):
            problems.append(f"python_step body field {key!r} is not a StepRequest field")
        if (step := _literal(body.get("step"))) not in {s.value for s in StepName}:
            problems.append(f"python_step {step!r} is not a StepName")
    record = field_names(RunRecord)
    statuses = {s.value for s in RunStatus}
    for call in _calls(wf, "record"):
        written = call.get("args", {}).get("fields", {})
        if isinstance(written, str):  # fields: ${final}, the map the workflow built
            written = _assigned(wf, written.removeprefix("${").removesuffix("}"))
        for key, value in written.items():
            if key not in record:
                problems.append(f"record field {key!r} is not a Run field")
            if key == "status" and (lit := _literal(value)) is not None and lit not in statuses:
                problems.append(f"status {lit!r} is not a RunStatus")
    # The main workflow's own status variable ends up in the record: its literals must be statuses.
    for assign in re.findall(r"""\bstatus:\s*"([^"]*)\"""", source):
        if assign not in statuses:
            problems.append(f"status {assign!r} is not a RunStatus")
    states = {s.value for s in CompletionState}
    for state in re.findall(r"""\btraining\.state\s*[!=]=\s*"([^"]*)\"""", text):
        if state not in states:
            problems.append(f"completion state {state!r} is not a CompletionState")
    return problems


def test_the_workflow_names_only_what_the_contracts_declare() -> None:
    assert check_workflow(WORKFLOW.read_text()) == []


@pytest.mark.parametrize(
    ("old", "new", "complaint"),
    [
        ("${run.dataflow_template}", "${run.dataflow_templat}", "dataflow_templat"),
        ("claim: ${start.claim}", "claim: ${start.token}", "token"),
        ("args: ${begun.plan}", "args: ${begun.argument}", "argument"),
        ("jobset: ${handover.jobset}", "jobset: ${handover.job_set}", "job_set"),
        ('step: "results"', 'step: "result"', "result"),
        (
            "run_id: ${args.run_id}\n                    callback_url",
            "run: ${args.run_id}\n                    callback_url",
            "run",
        ),
        ("idle_node_seconds: ${idle_seconds}", "idle_seconds: ${idle_seconds}", "idle_seconds"),
        ("- final.reason: ${reason}", "- final.why: ${reason}", "why"),
        ("documents: ${report.documents}", "documents: ${report.document_count}", "document_count"),
        ('status: "tokenizing"', 'status: "tokenising"', "tokenising"),
        ("quarantined: ${report.quarantined}", "quarantine: ${report.quarantined}", "quarantine"),
        ('training.state == "Cancelled"', 'training.state == "Canceled"', "Canceled"),
        ('- status: "cancelled"', '- status: "canceled"', "canceled"),
        ("${cancel.requested_by != null}", "${cancel.requester != null}", "requester"),
        ('step: "cancel"', 'step: "cancelled"', "cancelled"),
        ("${accounting.cost_usd}", "${accounting.cost}", "cost"),
        ('step: "account"', 'step: "accounting"', "accounting"),
    ],
)
def test_a_drifted_workflow_is_caught(old: str, new: str, complaint: str) -> None:
    source = WORKFLOW.read_text()
    assert old in source, f"the workflow no longer contains {old!r}: update this test"
    problems = check_workflow(source.replace(old, new, 1))
    assert any(complaint in p for p in problems), problems


def test_the_plan_produces_exactly_the_argument_the_workflow_reads() -> None:
    from retrain.domain.runs import Run
    from retrain.plan import workflow_argument
    from retrain.trainers import TrainingPlan

    settings = local_settings({})
    arg = workflow_argument(settings, Run("r-1", "default", "manual", objects=3), None).to_dict()
    assert set(arg) == field_names(WorkflowArgument)
    assert arg["dataflow_service_account"] == settings.dataflow_service_account != ""
    assert TrainingPlan.parse(arg["training"]).to_dict() == arg["training"]  # what handover parses back
    assert len(json.dumps(arg)) < 32 * 1024  # the Executions API's argument limit


def test_the_tokenize_report_is_what_the_pipeline_writes() -> None:
    from retrain_tokenize.pipeline import incremental_report

    report = incremental_report([], {}, 0.5, {"type": "GPT2BPETokenizer"})
    assert set(report) == field_names(TokenizeReport)


# --- the workflow's environment: what it reads with sys.get_env is what Terraform gives it ---------


#: The built-in variables of every execution
#: (cloud.google.com/workflows/docs/reference/environment-variables).
BUILT_IN_ENV = {
    "GOOGLE_CLOUD_LOCATION",
    "GOOGLE_CLOUD_PROJECT_ID",
    "GOOGLE_CLOUD_PROJECT_NUMBER",
    "GOOGLE_CLOUD_SERVICE_ACCOUNT_NAME",
    "GOOGLE_CLOUD_WORKFLOW_EXECUTION_ID",
    "GOOGLE_CLOUD_WORKFLOW_ID",
    "GOOGLE_CLOUD_WORKFLOW_REVISION_ID",
}


def check_workflow_env(source: str, infra: Path) -> list[str]:
    names = set(re.findall(r"""sys\.get_env\(\s*["']([A-Z_]+)["']""", source)) - BUILT_IN_ENV
    workflow = Deployment(infra=infra).app.resource("google_workflows_workflow", "retrain")
    given = {str(k).strip('"') for k in workflow.get("user_env_vars", {})}
    # User variables "can't contain the prefix GOOGLE_" or "WORKFLOWS_" (the same docs, "Use environment
    # variables"): Google refuses such a workflow.
    reserved = sorted(n for n in given if n.startswith(("GOOGLE_", "WORKFLOWS_")))
    return (
        [f"the workflow reads {n}, which workflow.tf does not give it" for n in sorted(names - given)]
        + [f"workflow.tf gives {n}, which the workflow never reads" for n in sorted(given - names)]
        + [
            f"workflow.tf gives {n}: user variables may not start with GOOGLE_ or WORKFLOWS_"
            for n in reserved
        ]
    )


def test_the_workflow_reads_only_the_environment_terraform_gives_it(tmp_path: Path) -> None:
    assert check_workflow_env(WORKFLOW.read_text(), REPO / "infra") == []
    infra = tmp_path / "infra"
    shutil.copytree(REPO / "infra", infra, ignore=shutil.ignore_patterns(".terraform*"))
    tf = infra / "app" / "workflow.tf"
    original = tf.read_text()
    tf.write_text(original.replace("RETRAIN_STEPS_URL =", "RETRAIN_STEP_URL ="))
    assert len(check_workflow_env(WORKFLOW.read_text(), infra)) == 2
    tf.write_text(original.replace("RETRAIN_STEPS_URL =", "RETRAIN_STEPS_URL = 1\n    WORKFLOWS_MODE ="))
    assert check_workflow_env(WORKFLOW.read_text(), infra) == [
        "workflow.tf gives WORKFLOWS_MODE, which the workflow never reads",
        "workflow.tf gives WORKFLOWS_MODE: user variables may not start with GOOGLE_ or WORKFLOWS_",
    ]


def test_an_execution_sees_the_built_ins_of_the_deployed_workflow() -> None:
    """sys.get_env in the local executions: the project, its number and the workflow's own service account
    as infra/app/workflow.tf deploys it, beside its user variables; nothing else."""
    from cloudworkflows import load_workflow

    deployment = Deployment()
    env = deployment.execution_env({"RETRAIN_STEPS_URL": "http://127.0.0.1:1/steps"})
    assert set(env) == {
        "GOOGLE_CLOUD_PROJECT_ID",
        "GOOGLE_CLOUD_PROJECT_NUMBER",
        "GOOGLE_CLOUD_SERVICE_ACCOUNT_NAME",
        "RETRAIN_STEPS_URL",
    }
    account = deployment.manifest_values().workflow_user
    reads = load_workflow(
        "- r:\n    return:\n"
        '      - ${sys.get_env("GOOGLE_CLOUD_SERVICE_ACCOUNT_NAME")}\n'
        '      - ${sys.get_env("RETRAIN_STEPS_URL")}\n'
    )
    assert reads.run(env=env) == [
        f"projects/{deployment.project}/serviceAccounts/{account}",
        "http://127.0.0.1:1/steps",
    ]
    assert env["GOOGLE_CLOUD_PROJECT_NUMBER"] == local_settings().project_number


# --- Dataflow: the launch body against Google's API definition --------------------------------------


def _dataflow_schema(name: str) -> dict[str, Any]:
    googleapiclient = pytest.importorskip("googleapiclient")
    docs = Path(googleapiclient.__file__).parent / "discovery_cache" / "documents"
    return json.loads((docs / "dataflow.v1b3.json").read_text())["schemas"][name]["properties"]


def test_the_flex_template_launch_passes_the_deployment_environment() -> None:
    """LaunchFlexTemplateParameter / FlexTemplateRuntimeEnvironment as the Dataflow v1b3 discovery
    document defines them: the workflow's launch names only fields that exist, and passes the service
    account, the subnetwork, the temp location and private IPs."""
    wf = yaml.safe_load(WORKFLOW.read_text())
    (launch,) = _calls(wf, "googleapis.dataflow.v1b3.projects.locations.flexTemplates.launch")
    parameter = launch["args"]["body"]["launchParameter"]
    assert set(parameter) <= set(_dataflow_schema("LaunchFlexTemplateParameter"))
    environment = parameter["environment"]
    assert set(environment) <= set(_dataflow_schema("FlexTemplateRuntimeEnvironment"))
    assert environment == {
        "serviceAccountEmail": "${run.dataflow_service_account}",
        "subnetwork": "${run.dataflow_subnetwork}",
        "tempLocation": "${run.dataflow_temp_location}",
        "ipConfiguration": "WORKER_IP_PRIVATE",
    }
    assert (
        "WORKER_IP_PRIVATE" in _dataflow_schema("FlexTemplateRuntimeEnvironment")["ipConfiguration"]["enum"]
    )


def test_the_workflow_never_resizes_the_pool() -> None:
    """Terraform owns the GPU pool's bounds; a run asks DWS for its nodes through the request."""
    assert "setAutoscaling" not in WORKFLOW.read_text()


# --- the Scheduler ---------------------------------------------------------------------------------


def test_each_scheduler_job_infra_declares_is_a_tick_the_function_runs() -> None:
    jobs = Deployment().scheduler_jobs()
    assert {j.name for j in jobs} == {j.value for j in SchedulerJob}
    for job in jobs:
        tick = SchedulerTick.parse(json.loads(job.data))
        assert tick.job == job.name and job.attributes == {"job": job.name}
        assert job.period_s >= 60 and job.topic.endswith("/topics/retrain-scheduler-ticks")


def test_a_renamed_payload_key_in_scheduler_tf_is_caught(tmp_path: Path) -> None:
    infra = tmp_path / "infra"
    shutil.copytree(REPO / "infra", infra, ignore=shutil.ignore_patterns(".terraform*"))
    tf = infra / "app" / "scheduler.tf"
    tf.write_text(
        tf.read_text().replace("jsonencode({ job = each.key })", "jsonencode({ action = each.key })")
    )
    job = Deployment(infra=infra).scheduler_jobs()[0]
    with pytest.raises(Rejected, match="unknown field"):
        SchedulerTick.parse(json.loads(job.data))


def test_ticks_are_validated() -> None:
    assert SchedulerTick.parse({"job": "seal", "dataset": "news"}) == SchedulerTick(SchedulerJob.SEAL, "news")
    assert json.loads(SchedulerTick(SchedulerJob.REAPER).to_json()) == {"job": "reaper"}
    for bad in ({"action": "sweep"}, {"job": "sweep"}, {}, {"job": "seal", "dataset": "../x"}):
        with pytest.raises(Rejected):
            SchedulerTick.parse(bad)


def test_cron_periods() -> None:
    assert cron_period_s("*/5 * * * *") == 300
    assert cron_period_s("0 * * * *") == 3600
    assert cron_period_s("30 2 * * *") == 86400
    assert cron_period_s("0 */6 * * *") == 6 * 3600
    for irregular in ("0,10 * * * *", "0 0 1 * *", "* *"):
        with pytest.raises(ValueError):
            cron_period_s(irregular)


# --- settings: what Terraform sets is what retrain reads, and the other way round ------------------


def _settings_used_in_code() -> set[str]:
    """Settings fields read somewhere (``settings.x``, ``s.x``, ``self.x`` in config's properties)."""
    names = {f.name for f in fields(config.Settings)}
    used = set()
    for path in [*(REPO / "retrain").rglob("*.py"), *(REPO / "retrain_local").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in names:
                used.add(node.attr)
    return used


def check_settings(env: dict[str, str]) -> list[str]:
    declared = {"RETRAIN_" + f.name.upper() for f in fields(config.Settings)}
    needed = {"RETRAIN_" + n.upper() for n in {f.name for f in fields(config.Settings)} - config.LOCAL_ONLY}
    problems = [f"Terraform sets {k}, which is no Settings field" for k in sorted(set(env) - declared)]
    problems += [f"the cloud needs {k}, which Terraform does not set" for k in sorted(needed - set(env))]
    return problems


def test_terraform_sets_every_setting_and_only_settings() -> None:
    assert check_settings(Deployment().env) == []


def test_every_setting_is_used() -> None:
    unused = {f.name for f in fields(config.Settings)} - _settings_used_in_code()
    assert unused == set(), f"settings nothing reads: {sorted(unused)}"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (r"\n *RETRAIN_NAMESPACE *= local.platform.k8s_namespace\n", "\n"),
        (r"\n *RETRAIN_SEQ_LENGTH *= tostring\(var.seq_length\)\n", "\n"),
        (r"RETRAIN_DATAFLOW_SUBNETWORK ", "RETRAIN_DATAFLOW_SUBNET "),
    ],
)
def test_a_dropped_or_misspelled_variable_is_caught(tmp_path: Path, old: str, new: str) -> None:
    infra = tmp_path / "infra"
    shutil.copytree(REPO / "infra", infra, ignore=shutil.ignore_patterns(".terraform*"))
    main = infra / "app" / "main.tf"
    broken, n = re.subn(old, new, main.read_text())
    assert n == 1
    main.write_text(broken)
    assert check_settings(Deployment(infra=infra).env) != []


@pytest.mark.parametrize("variables", [{}, {"function_timeout_seconds": 120}])
def test_a_handlers_bigquery_calls_fit_in_the_functions_timeout(variables: dict[str, Any]) -> None:
    """The timeout BigQuery requests are planned against is each function's own: at worst (every
    request at twice its bound, the wait for an export and its last poll at twice its bound) they take
    config.BIGQUERY_SHARE of it, and an export job outlives its handler."""
    deployment = Deployment(variables=variables)
    s = deployment.settings()
    for name in ("on_bigquery_event", "on_scheduler_tick"):
        function = deployment.app.resource("google_cloudfunctions2_function", name)
        (service,) = deployment.app.evaluate(function["service_config"])
        assert (
            service["timeout_seconds"]
            == s.function_timeout_s
            == variables.get("function_timeout_seconds", 300)
        )
    call, wait = s.bigquery_call_timeout_s, s.bigquery_export_wait_s
    worst = config.BIGQUERY_CALLS_PER_HANDLER * 2 * call + wait + 2 * call
    assert worst == pytest.approx(config.BIGQUERY_SHARE * s.function_timeout_s)
    assert call >= 2.0  # still room for a query to answer
    assert s.bigquery_export_timeout_s > s.function_timeout_s


def test_the_local_stack_runs_on_the_deployments_settings() -> None:
    deployed = Deployment().settings()
    local = local_settings({})
    assert local.landing_bucket == deployed.landing_bucket and local.jobset_topic == deployed.jobset_topic
    assert local.quiet_period_s * 60 == deployed.quiet_period_s
    assert local_settings({"RETRAIN_NODES": "2"}).nodes == 2  # the operator's environment wins


# --- the Kubernetes manifests ------------------------------------------------------------------------


def test_nothing_deployable_names_the_local_project() -> None:
    offenders = [
        str(p.relative_to(REPO))
        for root in ("k8s", "infra")
        for p in (REPO / root).rglob("*")
        if p.is_file() and "retrain-local" in p.read_text(errors="replace")
    ]
    assert offenders == []


def test_manifests_are_rendered_from_the_deployment() -> None:
    from retrain_ops.deployment import manifest_values
    from retrain_ops.manifests import documents

    platform = {
        "project_id": "acme-ml",
        "k8s_namespace": "training",
        "notifier_ksa": "jobset-notifier",
        "artifact_registry": "europe-west4-docker.pkg.dev/acme-ml/retrain",
        "gpu_node_pool": "a3-dws",
        "gpu_max_nodes": 2,
        "gpus_per_node": 8,
        "service_accounts": {
            "notifier": "n@acme-ml.iam.gserviceaccount.com",
            "functions": "f@acme-ml.iam.gserviceaccount.com",
            "workflow": "w@acme-ml.iam.gserviceaccount.com",
        },
    }
    docs = documents(manifest_values(platform, {}))
    text = yaml.safe_dump_all(docs)
    assert "retrain-local" not in text and "${" not in text
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    notifier = by[("Deployment", "retrain-notifier")]["spec"]["template"]["spec"]
    assert notifier["serviceAccountName"] == "jobset-notifier"
    assert notifier["containers"][0]["image"] == "europe-west4-docker.pkg.dev/acme-ml/retrain/retrain:unbuilt"
    assert by[("ServiceAccount", "jobset-notifier")]["metadata"]["annotations"] == {
        "iam.gke.io/gcp-service-account": "n@acme-ml.iam.gserviceaccount.com"
    }
    # each run's pods run as a service account of their own, the workflow's to create (k8s/workflow.yaml)
    assert [name for kind, name in by if kind == "ServiceAccount"] == ["jobset-notifier"]
    assert not [d for d in docs if d["apiVersion"].startswith("kueue.x-k8s.io/")]  # no Kueue (docs/runs.md)
    assert by[("RoleBinding", "retrain-reaper")]["subjects"][0]["name"] == "f@acme-ml.iam.gserviceaccount.com"
    workflow = by[("RoleBinding", "retrain-workflow")]
    assert workflow["subjects"][0]["name"] == "w@acme-ml.iam.gserviceaccount.com"
    assert workflow["metadata"]["namespace"] == "training"


def test_an_unknown_placeholder_in_a_manifest_is_caught(tmp_path: Path) -> None:
    from retrain_ops.manifests import TEMPLATES, render

    for name in TEMPLATES:
        shutil.copy(REPO / "k8s" / name, tmp_path / name)
    notifier = tmp_path / "notifier.yaml"
    notifier.write_text(notifier.read_text().replace("${notifier_image}", "${notifier_img}"))
    with pytest.raises(KeyError, match="notifier_img"):
        render(Deployment().manifest_values(), tmp_path)


def test_terraform_applies_only_rendered_manifests() -> None:
    main = (REPO / "infra" / "app" / "variables.tf").read_text()
    assert re.search(r'variable "k8s_manifests_dir" \{[^}]*default\s+= "build/k8s"', main)
    assert (REPO / "k8s" / "examples" / "jobset.example.yaml").exists()
    assert not (REPO / "k8s" / "jobset.example.yaml").exists()


# --- messages ------------------------------------------------------------------------------------------


def test_the_notifier_message_is_a_completion_and_relays_as_a_callback() -> None:
    from retrain.k8s.notifier import message_for

    jobset = {
        "metadata": {
            "name": "retrain-r1",
            "namespace": "default",
            "uid": "u-1",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "annotations": {"retrain.dev/run-id": "r1", "retrain.dev/callback-url": "http://cb/1"},
        },
        "status": {"restarts": 1},
    }
    cond = {"type": "Completed", "reason": "AllJobsCompleted", "lastTransitionTime": "2026-01-01T01:00:00Z"}
    data, attributes = message_for(jobset, "Completed", cond)
    body = json.loads(data)
    assert set(body) == field_names(JobSetCompletion)
    completion = JobSetCompletion.parse(body)
    assert completion.to_json() == data
    payload = CallbackPayload.of(completion).to_dict()
    assert payload["state"] == "Completed" and payload["run_id"] == "r1" and payload["restarts"] == 1
    assert attributes["dedupe_key"] == completion.dedupe_key == "u-1:Completed"


def test_a_manifest_round_trips() -> None:
    m = RunManifest("r", "d", "b", "s", [ObjectVersion("gs://x/a[1].jsonl", 17, 100)])
    assert RunManifest.parse(m.to_json()) == m and m.total_bytes == 100
    for bad in (b"[]", b'{"objects": "gs://x/a"}', b'{"objects": [1]}', b'{"objects": ["gs://x/a"]}'):
        with pytest.raises(ValueError):
            RunManifest.parse(bad)


def test_every_contract_field_is_documented() -> None:
    """Each boundary type documents every field where it is declared (a string right after it)."""
    tree = ast.parse(Path(contracts.__file__).read_text())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) or (
                isinstance(stmt, ast.Assign) and cls.name.endswith(("Job", "State"))
            ):
                nxt = body[i + 1] if i + 1 < len(body) else None
                documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                name = ast.unparse(stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target)
                assert documented, f"{cls.name}.{name} has no docstring"


def test_base64_of_the_tick_is_what_terraform_writes() -> None:
    """Cloud Scheduler's pubsub_target.data is base64 (the provider's documented contract)."""
    tick = Deployment().app.resource("google_cloud_scheduler_job", "tick")
    target = Deployment().app.evaluate(tick["pubsub_target"], each={"key": "sweeper", "value": {}})[0]
    assert json.loads(base64.b64decode(target["data"])) == {"job": "sweeper"}


def test_the_workflows_end_of_run_tick_is_a_scheduler_tick_published_as_pubsub_defines_it() -> None:
    """The workflow's last act publishes the sweeper tick (so a pending run starts at once): the message
    must parse as the Scheduler's own, and the call must match pubsub.v1's discovery document."""
    googleapiclient = pytest.importorskip("googleapiclient")
    docs = Path(googleapiclient.__file__).parent / "discovery_cache" / "documents"
    pubsub = json.loads((docs / "pubsub.v1.json").read_text())
    method = pubsub["resources"]["projects"]["resources"]["topics"]["methods"]["publish"]
    wf = yaml.safe_load(WORKFLOW.read_text())
    init = next(s["init"] for s in wf["main"]["steps"] if "init" in s)["assign"]
    (tick,) = [a["sweeper_tick"] for a in init if "sweeper_tick" in a]
    assert SchedulerTick.parse(tick) == SchedulerTick(SchedulerJob.SWEEPER)
    (call,) = [
        c for c in _calls(wf, "googleapis.pubsub.v1.projects.topics.publish") if "ticks" in c["args"]["topic"]
    ]
    args = call["args"]
    assert set(args) == {"topic", "body"} and set(method["parameters"]) == {"topic"}
    assert set(args["body"]) <= set(pubsub["schemas"]["PublishRequest"]["properties"])
    (message,) = args["body"]["messages"]
    assert set(message) <= set(pubsub["schemas"]["PubsubMessage"]["properties"])
    assert re.fullmatch(method["parameters"]["topic"]["pattern"], local_settings({}).scheduler_topic)


# --- GPUDirect-TCPX: the platform's GPU networks, the Network objects and the pods' interfaces --------


def test_gpudirect_tcpx_is_built_whole_or_not_at_all() -> None:
    from retrain.k8s.render import TCPX_NETWORKS
    from retrain_ops.deployment import INFRA, manifest_values
    from retrain_ops.hcl import Stage
    from retrain_ops.manifests import templates

    on = Deployment()
    networks = on.platform.output("gpu_networks")
    assert on.platform.output("gpudirect_tcpx") is True and on.settings().gpudirect_tcpx is True
    assert len(networks) == len(TCPX_NETWORKS) == 4
    assert "tcpx.yaml" in templates(on.manifest_values())
    gke = (INFRA / "platform" / "gke.tf").read_text()
    assert "enable_multi_networking = var.enable_gpudirect_tcpx" in gke
    pool = re.search(r'dynamic "additional_node_network_configs" \{\s*for_each\s*=\s*(.+)', gke)
    assert pool and pool.group(1) == "range(length(google_compute_network.gpu))"  # the pool gets them all

    off = Stage(INFRA / "platform", {"project_id": "p", "enable_gpudirect_tcpx": False})
    assert off.output("gpudirect_tcpx") is False and off.output("gpu_networks") == []
    platform_off = ChainMap({"gpu_networks": [], "gpudirect_tcpx": False}, Deployment().platform.outputs())
    assert "tcpx.yaml" not in templates(manifest_values(platform_off, {}))
    app = Stage(INFRA / "app", {"project_id": "p", "state_bucket": "s"}, platform=off.outputs())
    assert app.local("retrain_env")["RETRAIN_GPUDIRECT_TCPX"] == "false"


# --- a failed run's kind: the tags the workflow raises are the domain's FailureKind ------------------


def test_the_failure_kinds_the_workflow_records_are_the_domains() -> None:
    from retrain.domain.runs import FailureKind

    source = WORKFLOW.read_text()
    raised = set(re.findall(r'tags: \["(\w+)"\]', source))
    (kinds,) = [
        step["ours"]["switch"][0]["condition"]
        for step in yaml.safe_load(source)["failure_kind"]["steps"][2]["each_tag"]["for"]["steps"]
    ]
    recognised = set(re.findall(r'"(\w+)"', kinds))
    assert raised == recognised  # every tag it raises is one it records, and no other
    python_only = {FailureKind.REFUSED, FailureKind.EXECUTION_LOST}  # written by Ingest, not the workflow
    assert recognised | {"StepFailed"} == {str(k) for k in FailureKind} - python_only


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ("a bare string", "StepFailed"),
        ({"message": "no tags"}, "StepFailed"),
        ({"message": "an API refused", "tags": ["HttpError"], "code": 403}, "StepFailed"),
        ({"message": "DWS failed", "tags": ["CapacityError"]}, "CapacityError"),
        ({"message": "slow", "tags": ["TimeoutError", "TokenizeTimeout"]}, "TokenizeTimeout"),
        ({"message": "stopped", "tags": ["Cancelled"]}, "Cancelled"),
    ],
)
def test_the_workflow_records_the_kind_of_any_error(error: Any, kind: str) -> None:
    from cloudworkflows import load_workflow
    from retrain.domain.runs import FailureKind

    source = yaml.safe_load(WORKFLOW.read_text())
    source["main"] = {
        "params": ["e"],
        "steps": [
            {"kind": {"call": "failure_kind", "args": {"e": "${e}"}, "result": "k"}},
            {"done": {"return": "${k}"}},
        ],
    }
    assert FailureKind(load_workflow(yaml.safe_dump(source)).run(error)) == kind


@pytest.mark.parametrize("name", ["news\n", "News", "-news", "a" * 41, "news/x", "", None, 7])
def test_a_dataset_name_is_checked_whole_wherever_it_comes_in(name: Any) -> None:
    """One check (``domain.datasets.is_dataset_name``) for every place a dataset name comes in; ``"news\\n"``
    passed the ``$``-anchored ``match`` it replaced (``$`` matches before a final newline)."""
    assert not datasets.is_dataset_name(name)
    with pytest.raises(Rejected, match="dataset must be a valid dataset name"):
        SchedulerTick.parse({"job": "seal", "dataset": name if name is not None else 1})
    assert datasets.is_dataset_name("news-2") and datasets.is_dataset_name("a" * 40)


def test_terraform_validates_dataset_names_as_retrain_does() -> None:
    """infra/app/variables.tf checks dataset names at plan time with the same pattern."""
    hcl = (REPO / "infra" / "app" / "variables.tf").read_text()
    patterns = set(re.findall(r'regex\("(\^\[a-z0-9\]\[a-z0-9-\][^"]*)", dataset\)', hcl))
    assert patterns == {f"^{datasets.DATASET_RE.pattern}$"}


# --- Cloud Storage's JSON API: the workflow's managed-folder calls ------------------------------------


def _url_template(expression: str) -> str:
    """A URL expression's shape: each non-literal term of ``"..." + x + "..."`` as ``{}``."""
    terms = re.split(r"\s\+\s", expression.removeprefix("${").removesuffix("}"))
    return "".join(json.loads(t) if t.startswith('"') else "{}" for t in terms)


def test_the_workflows_storage_calls_are_methods_of_the_json_api() -> None:
    """Every ``http.*`` call of workflows/retrain.yaml to Cloud Storage is a method of the storage v1
    discovery document: its verb and path, query parameters it declares, a body of its request schema,
    and an OAuth2 scope it accepts; and the local stack routes that origin to its storage front."""
    from retrain_local.storage_front import STORAGE_API

    googleapiclient = pytest.importorskip("googleapiclient")
    docs = Path(googleapiclient.__file__).parent / "discovery_cache" / "documents"
    storage = json.loads((docs / "storage.v1.json").read_text())
    base = storage["rootUrl"] + storage["servicePath"]
    methods = {
        (m["httpMethod"], re.sub(r"\{\w+\}", "{}", base + m["path"])): (name, m)
        for name, m in storage["resources"]["managedFolders"]["methods"].items()
    }
    wf = yaml.safe_load(WORKFLOW.read_text())
    called = []
    for verb in ("get", "post", "put", "delete", "patch"):
        for call in _calls(wf, f"http.{verb}"):
            url = _url_template(str(call["args"]["url"]))
            if not url.startswith("https://"):
                continue  # run_step's own URL (RETRAIN_STEPS_URL)
            assert url.startswith(STORAGE_API + "/"), f"{url}: an API the local stack does not route"
            assert (verb.upper(), url) in methods, f"{verb.upper()} {url} is no managedFolders method"
            name, method = methods[verb.upper(), url]
            called.append(name)
            assert set(call["args"].get("query") or {}) <= set(method["parameters"]), name
            auth = call["args"]["auth"]
            assert auth["type"] == "OAuth2" and set(auth["scopes"]) <= set(method["scopes"]), name
            body = call["args"].get("body")
            if body is not None:
                schema = storage["schemas"][method["request"]["$ref"]]["properties"]
                assert set(body) <= set(schema), name
                for binding in body.get("bindings", []):
                    assert set(binding) <= set(schema["bindings"]["items"]["properties"]), name
    assert sorted(called) == ["delete", "insert", "setIamPolicy"]
    assert storage["rootUrl"].rstrip("/") == STORAGE_API
