"""``retrain deploy`` against a stand-in ``terraform`` that records every call and replays outputs.

The real terraform cannot download providers here, so the tests put a small Python script named
``terraform`` first on PATH. It appends each invocation (argv, cwd, -chdir stage) to a JSON-lines
file and answers like terraform does: ``output -json`` with the ``{name: {sensitive, type, value}}``
map, ``show -json PLAN`` with a plan whose ``resource_changes`` and ``planned_values`` have the
documented shape. The repository's ``infra/`` and ``functions/`` are copied into a temporary
checkout so that the function build folder is written there.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gcloud_stand_in
import pytest

from retrain_local import processes
from retrain_ops import builds, deploy, hcl, pins, targets  # hcl: python-hcl2's parse, kept by content
from retrain_ops.deployment import Deployment

REPO = Path(__file__).resolve().parents[2]
PROJECT = "acme-retrain-01"
REGION = "europe-west4"
STATE_BUCKET = f"{PROJECT}-retrain-tfstate"

STAND_IN = """\
#!{python}
import json, os, sys

args = sys.argv[1:]
chdir = args.pop(0)[len("-chdir="):] if args and args[0].startswith("-chdir=") else None
stage = os.path.basename(os.path.normpath(chdir)) if chdir else ""
cmd = args[0] if args else ""
with open(os.environ["FAKE_TF_LOG"], "a") as log:
    log.write(json.dumps({{
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "chdir": chdir,
        "stage": stage,
        "cmd": cmd,
        "functions_built": os.path.isfile("build/functions/retrain/__init__.py"),
    }}) + "\\n")
with open(os.environ["FAKE_TF_SPEC"]) as f:
    spec = json.load(f)

def die(msg):
    sys.stderr.write(msg)
    sys.exit(1)

if spec.get("fail") == stage + ":" + cmd:
    die(
        "\\nError: Error creating Network: googleapi: Error 403: Permission denied on resource "
        "project " + spec.get("project", "?") + ".\\n\\n  with google_compute_network.retrain,\\n"
        "  on network.tf line 5, in resource \\"google_compute_network\\" \\"retrain\\":\\n"
    )
if chdir is not None and not os.path.isdir(chdir):
    die("Error: Invalid -chdir option: " + chdir + " does not exist\\n")
if cmd == "init":
    print("Initializing the backend...\\n\\nTerraform has been successfully initialized!")
elif cmd == "plan":
    out = [a[len("-out="):] for a in args if a.startswith("-out=")]
    if len(out) != 1:
        die("Error: plan without -out\\n")
    with open(out[0], "w") as f:
        f.write("PK fake plan of " + stage)
    print("Plan: 3 to add, 0 to change, 0 to destroy.")
elif cmd == "show":
    if args[1:2] != ["-json"] or not os.path.isfile(args[-1]):
        die("Error: Failed to read the given file as a state or plan file\\n")
    print(json.dumps(spec["plans"][stage]))
elif cmd == "apply":
    if not os.path.isfile(args[-1]):
        die("Error: Failed to load plan file\\n")
    print("Apply complete! Resources: 3 added, 0 changed, 0 destroyed.")
elif cmd == "output":
    print(json.dumps(spec["outputs"].get(stage, {{}})))
else:
    die("stand-in terraform: unexpected command " + repr(sys.argv[1:]) + "\\n")
"""


def _out(value: Any, type_: Any = "string", sensitive: bool = False) -> dict[str, Any]:
    """One entry of `terraform output -json`."""
    return {"sensitive": sensitive, "type": type_, "value": value}


OUTPUTS: dict[str, dict[str, Any]] = {
    "bootstrap": {
        "project_id": _out(PROJECT),
        "region": _out(REGION),
        "state_bucket": _out(STATE_BUCKET),
        "enabled_services": _out(["compute.googleapis.com", "container.googleapis.com"], ["list", "string"]),
    },
    "platform": {
        "project_id": _out(PROJECT),
        "region": _out(REGION),
        "cluster_name": _out("retrain"),
        "cluster_endpoint": _out("10.0.0.2", sensitive=True),
        "landing_bucket": _out(f"{PROJECT}-retrain-landing"),
        "gpus_per_node": _out(8, "number"),
        "service_accounts": _out(
            {
                "functions": f"retrain-functions@{PROJECT}.iam.gserviceaccount.com",
                "notifier": f"retrain-notifier@{PROJECT}.iam.gserviceaccount.com",
                "workflow": f"retrain-workflow@{PROJECT}.iam.gserviceaccount.com",
                "builder": f"retrain-builder@{PROJECT}.iam.gserviceaccount.com",
            }
        ),
        "k8s_namespace": _out("retrain"),
        "notifier_ksa": _out("jobset-notifier"),
        "artifact_registry": _out(f"{REGION}-docker.pkg.dev/{PROJECT}/retrain"),
        "function_sources_bucket": _out(f"{PROJECT}-retrain-fn-sources"),
        "gpu_node_pool": _out("a3-dws"),
        "gpu_max_nodes": _out(4, "number"),
    },
    "app": {
        # What infra/app's local.retrain_env evaluates to for this project (the output the CLI saves).
        "retrain_env": _out(Deployment(project=PROJECT).env, ["map", "string"]),
        "workflow_name": _out("retrain"),
        "function_names": _out({"on_object_finalized": "retrain-on-object-finalized"}, ["map", "string"]),
    },
}


def _change(address: str, *actions: str) -> dict[str, Any]:
    type_, name = address.split("[")[0].split(".")[-2:]
    return {
        "address": address,
        "mode": "managed",
        "type": type_,
        "name": name,
        "provider_name": "registry.terraform.io/hashicorp/google",
        "change": {"actions": list(actions), "before": None, "after": {}, "after_unknown": {}},
    }


def _plan(changes: list[dict[str, Any]], outputs: dict[str, Any]) -> dict[str, Any]:
    """A `terraform show -json PLAN` document (format 1.2)."""
    return {
        "format_version": "1.2",
        "terraform_version": "1.11.4",
        "planned_values": {"outputs": outputs, "root_module": {}},
        "resource_changes": changes,
        "output_changes": {
            name: {
                "actions": ["create"],
                "before": None,
                "after": o.get("value"),
                "after_unknown": "value" not in o,
            }
            for name, o in outputs.items()
        },
        "configuration": {},
    }


PLANS: dict[str, dict[str, Any]] = {
    "bootstrap": _plan(
        [
            _change('google_project_service.enabled["compute.googleapis.com"]', "create"),
            _change("google_storage_bucket.state", "create"),
            _change("google_storage_bucket.state_access_logs", "create"),
        ],
        {
            "state_bucket": {"sensitive": False, "type": "string", "value": STATE_BUCKET},
            "enabled_services": {"sensitive": False},  # unknown until applied
        },
    ),
    "platform": _plan(
        [
            _change("google_container_cluster.retrain", "update"),
            _change("google_container_node_pool.gpu_dws", "delete", "create"),
            _change("google_compute_firewall.old", "delete"),
            {**_change("data.google_project.this", "read"), "mode": "data"},
            _change("google_pubsub_topic.jobset_events", "no-op"),
        ],
        {"cluster_name": {"sensitive": False, "type": "string", "value": "retrain"}},
    ),
    "app": _plan([_change("google_cloudfunctions2_function.run_http", "create", "delete")], {}),
}


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the repository parts deploy needs: infra/ (the .tf files), functions/ and k8s/."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(
        REPO / "infra",
        root / "infra",
        ignore=shutil.ignore_patterns(".terraform", ".build", "*.tfstate*", ".terraform.lock.hcl"),
    )
    shutil.copytree(REPO / "functions", root / "functions", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "k8s", root / "k8s")
    for rel in builds.context_files(REPO):  # what the image builds copy
        source, target = REPO / rel, root / rel
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    # An operator's lock, every artifact pinned (the app stage would otherwise resolve them first).
    lock = pins.Lock.load(root / "infra" / "pins.json")
    lock.images = {k: v or "sha256:" + hashlib.sha256(k.encode()).hexdigest() for k, v in lock.images.items()}
    lock.files = {k: v or hashlib.sha256(k.encode()).hexdigest() for k, v in lock.files.items()}
    lock.save(root / "infra" / "pins.json")
    return root


class FakeTerraform:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.log = tmp_path / "terraform-calls.jsonl"
        self.spec_path = tmp_path / "terraform-spec.json"
        self.spec: dict[str, Any] = {"outputs": OUTPUTS, "plans": PLANS, "project": PROJECT}
        exe = self.bin / "terraform"
        exe.write_text(STAND_IN.format(python=sys.executable))
        exe.chmod(0o755)
        monkeypatch.setenv("PATH", f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}")
        monkeypatch.setenv("FAKE_TF_LOG", str(self.log))
        monkeypatch.setenv("FAKE_TF_SPEC", str(self.spec_path))
        monkeypatch.delenv("CI", raising=False)
        self.gcloud_log = tmp_path / "gcloud-calls.jsonl"
        gcloud_stand_in.install(self.bin, monkeypatch, self.gcloud_log)
        monkeypatch.setattr(builds, "commit_tag", lambda _root: "c0ffee")
        self.save()

    def save(self) -> None:
        self.spec_path.write_text(json.dumps(self.spec))

    def fail(self, stage: str, cmd: str) -> None:
        self.spec["fail"] = f"{stage}:{cmd}"
        self.save()

    def calls(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def sequence(self) -> list[tuple[str, str]]:
        return [(c["stage"], c["cmd"]) for c in self.calls()]

    def call(self, stage: str, cmd: str) -> dict[str, Any]:
        found = [c for c in self.calls() if c["stage"] == stage and c["cmd"] == cmd]
        assert len(found) == 1, (stage, cmd, self.sequence())
        return found[0]


@pytest.fixture
def tf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeTerraform:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # not a terminal
    return FakeTerraform(tmp_path, monkeypatch)


Run = Callable[..., tuple[int, str, str]]
#: A dry run builds no image: it is given the images to plan with (a last deploy's, by digest).
GIVEN_IMAGES = (
    "--var",
    f"dataflow_image={REGION}-docker.pkg.dev/{PROJECT}/retrain_tokenize/@{gcloud_stand_in.DIGEST}",
    "--var",
    f"notifier_image={REGION}-docker.pkg.dev/{PROJECT}/retrain/retrain@{gcloud_stand_in.DIGEST}",
)


@pytest.fixture(autouse=True)
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where CLI targets are saved: this test's own folder, never the user's."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config"


@pytest.fixture
def run(checkout: Path, capsys: pytest.CaptureFixture[str]) -> Run:
    def _run(*extra: str, project: str = PROJECT, region: str = REGION) -> tuple[int, str, str]:
        rc = deploy.main(["--project", project, "--region", region, "--root", str(checkout), *extra])
        out, err = capsys.readouterr()
        return rc, out, err

    return _run


def plan_vars(call: dict[str, Any]) -> dict[str, str]:
    argv = call["argv"]
    result: dict[str, str] = {}
    for i, a in enumerate(argv):
        if a == "-var":
            key, _, value = argv[i + 1].partition("=")
            result[key] = value
    return result


def declared(stage: str) -> set[str]:
    names: set[str] = set()
    for f in (REPO / "infra" / stage).glob("*.tf"):
        for entry in hcl.parse(f.read_text()).get("variable", []):
            names |= {k.strip('"') for k in entry}
    return names


def _flag(call: dict[str, Any], prefix: str) -> str:
    found = [a[len(prefix) :] for a in call["argv"] if a.startswith(prefix)]
    assert len(found) == 1, call["argv"]
    return found[0]


# ---------------------------------------------------------------------------------------------
# A full deployment
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_stages_run_in_order_each_init_plan_apply(tf: FakeTerraform, run: Run, checkout: Path) -> None:
    rc, _out, err = run("--auto-approve")
    assert rc == 0, err
    per_stage = ["init", "plan", "show", "apply", "output"]
    assert tf.sequence() == [(s, c) for s in ("bootstrap", "platform", "app") for c in per_stage]
    for c in tf.calls():
        assert c["argv"][0] == f"-chdir=infra/{c['stage']}"
        assert Path(c["cwd"]).resolve() == checkout.resolve()
        assert c["argv"][1] == c["cmd"]
        if c["cmd"] in ("init", "plan", "apply"):
            assert "-input=false" in c["argv"]
    for stage in ("bootstrap", "platform", "app"):
        plan_file = _flag(tf.call(stage, "plan"), "-out=")
        assert Path(plan_file).is_absolute()
        assert tf.call(stage, "apply")["argv"][-1] == plan_file  # applies exactly what was planned
        assert tf.call(stage, "show")["argv"][-2:] == ["-json", plan_file]
        assert tf.call(stage, "output")["argv"][1:] == ["output", "-json"]
    # bootstrap runs on local state; the others get the bucket bootstrap created
    assert not any(a.startswith("-backend-config") for a in tf.call("bootstrap", "init")["argv"])
    for stage in ("platform", "app"):
        assert _flag(tf.call(stage, "init"), "-backend-config=") == f"bucket={STATE_BUCKET}"
    # progress: every stage and step named with an elapsed time
    for stage in ("bootstrap", "platform", "app"):
        for step in ("init", "plan", "apply"):
            assert f"{stage}: {step} done in" in err
        assert f"== stage {stage} done in" in err
    assert "platform: 0 to create, 1 to update, 1 to replace, 1 to delete" in err
    # The applied app stage's settings become the operator CLI's target, named after the project.
    target = targets.load(PROJECT)
    assert target.env == Deployment(project=PROJECT).env and target.settings().project == PROJECT
    assert f"CLI target {PROJECT} saved" in err


@pytest.mark.integration
def test_outputs_become_vars_of_later_stages_only_where_declared(tf: FakeTerraform, run: Run) -> None:
    rc, _out, err = run("--auto-approve")
    assert rc == 0, err
    vs = {s: plan_vars(tf.call(s, "plan")) for s in ("bootstrap", "platform", "app")}
    for stage, values in vs.items():
        assert values["project_id"] == PROJECT and values["region"] == REGION
        assert set(values) <= declared(stage), (stage, set(values) - declared(stage))
    assert set(vs["bootstrap"]) == {"project_id", "region"}
    # platform declares neither state_bucket nor enabled_services
    assert set(vs["platform"]) == {"project_id", "region"}
    # app: the bootstrap's state bucket (app declares state_bucket), the built function source, the
    # images Cloud Build built, by digest; none of the platform outputs app does not declare
    # (landing_bucket, cluster_name, ...), and never a sensitive one
    registry = f"{REGION}-docker.pkg.dev/{PROJECT}/retrain"
    assert vs["app"] == {
        "project_id": PROJECT,
        "region": REGION,
        "state_bucket": STATE_BUCKET,
        "functions_source_dir": deploy.FUNCTIONS_BUILD_DIR,
        "k8s_manifests_dir": deploy.K8S_BUILD_DIR,
        "dataflow_image": f"{registry}/tokenize@{gcloud_stand_in.DIGEST}",
        "notifier_image": f"{registry}/retrain@{gcloud_stand_in.DIGEST}",
    }
    assert "state_bucket" in declared("app") and "state_bucket" not in declared("platform")


@pytest.mark.integration
def test_manifests_are_rendered_from_the_platform_outputs(
    tf: FakeTerraform, run: Run, checkout: Path
) -> None:
    rc, _out, err = run("--auto-approve")
    assert rc == 0, err
    rendered = checkout / deploy.K8S_BUILD_DIR
    assert sorted(p.name for p in rendered.glob("*.yaml")) == sorted(
        ["notifier.yaml", "reaper.yaml", "workflow.yaml"]
    )
    notifier = (rendered / "notifier.yaml").read_text()
    assert f"retrain-notifier@{PROJECT}.iam.gserviceaccount.com" in notifier
    assert f"image: {REGION}-docker.pkg.dev/{PROJECT}/retrain/retrain@{gcloud_stand_in.DIGEST}" in notifier
    assert "namespace: retrain" in notifier and "retrain-local" not in notifier
    assert (rendered / deploy.RENDERED_FOR).read_text().strip() == PROJECT  # the app stage checks it


def test_forwarded_vars_types_sensitivity_and_declared_only() -> None:
    outputs = {
        "a": _out("text"),
        "n": _out(8, "number"),
        "flag": _out(True, "bool"),
        "names": _out(["x", "y"], ["list", "string"]),
        "m": _out({"k": "v"}, ["map", "string"]),
        "secret": _out("s3cr3t", sensitive=True),
        "unknown": {"sensitive": False},
        "undeclared": _out("nope"),
    }
    values, withheld = deploy.forwarded_vars(
        outputs, {"a", "n", "flag", "names", "m", "secret", "unknown", "other"}
    )
    assert values == {"a": "text", "n": "8", "flag": "true", "names": '["x", "y"]', "m": '{"k": "v"}'}
    assert withheld == ["secret"]


@pytest.mark.integration
def test_dry_run_plans_every_stage_and_never_applies(tf: FakeTerraform, run: Run) -> None:
    rc, out, err = run("--dry-run", *GIVEN_IMAGES)
    assert rc == 0, err
    assert gcloud_stand_in.calls(tf.gcloud_log) == []  # nothing built
    assert [c for _, c in tf.sequence()] == ["init", "plan", "show"] * 3
    assert all(c["cmd"] not in ("apply", "output") for c in tf.calls())
    # the bootstrap's planned (known) outputs stand in for its applied ones
    assert _flag(tf.call("platform", "init"), "-backend-config=") == f"bucket={STATE_BUCKET}"
    assert plan_vars(tf.call("app", "plan"))["state_bucket"] == STATE_BUCKET
    assert "Dry run: nothing was applied." in out
    assert "bootstrap: 3 to create, 0 to update, 0 to delete" in out
    assert "  +" in out and "google_storage_bucket.state_access_logs" in out
    assert 'google_project_service.enabled["compute.googleapis.com"]' in out
    # update, replace (either order of delete/create), delete; reads and no-ops are not changes
    assert "platform: 0 to create, 1 to update, 1 to replace, 1 to delete" in out
    assert "~ google_container_cluster.retrain" in out
    assert "-/+ google_container_node_pool.gpu_dws" in out
    assert "  - google_compute_firewall.old" in out
    assert "data.google_project.this" not in out and "jobset_events" not in out
    assert "app: 0 to create, 0 to update, 1 to replace, 0 to delete" in out


def test_summarize_plan_counts() -> None:
    s = deploy.summarize_plan(PLANS["platform"])
    assert s.counts() == {"create": 0, "update": 1, "replace": 1, "delete": 1}
    assert s.changes["replace"] == ["google_container_node_pool.gpu_dws"]
    assert s.has_changes
    empty = deploy.summarize_plan({"format_version": "1.2", "resource_changes": []})
    assert not empty.has_changes and empty.lines("app") == ["app: no changes"]


# ---------------------------------------------------------------------------------------------
# Failures and refusals
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_failing_stage_stops_the_run_and_names_it(tf: FakeTerraform, run: Run) -> None:
    tf.fail("platform", "plan")
    rc, _out, err = run("--auto-approve")
    assert rc == 1
    assert tf.sequence() == [
        ("bootstrap", "init"),
        ("bootstrap", "plan"),
        ("bootstrap", "show"),
        ("bootstrap", "apply"),
        ("bootstrap", "output"),
        ("platform", "init"),
        ("platform", "plan"),
    ]
    assert "stage platform failed at step 'plan'" in err
    assert "Error 403: Permission denied" in err  # terraform's stderr tail
    assert "later stages were not run" in err


@pytest.mark.integration
def test_failing_init_in_dry_run_stops_too(tf: FakeTerraform, run: Run) -> None:
    tf.fail("app", "init")
    rc, _out, err = run("--dry-run", *GIVEN_IMAGES)
    assert rc == 1
    assert tf.sequence()[-1] == ("app", "init")
    assert "stage app failed at step 'init'" in err
    assert "unapplied changes" in err  # earlier stages were only planned


@pytest.mark.parametrize(
    "project", ["1retrain", "ab-12", "My-Project", "retrain-", "retrain_prod", "a" * 31, "proj.x"]
)
def test_invalid_project_is_rejected_before_any_terraform_call(
    tf: FakeTerraform, run: Run, project: str
) -> None:
    rc, _out, err = run("--auto-approve", project=project)
    assert rc == 2
    assert "invalid project id" in err
    assert tf.calls() == []


@pytest.mark.parametrize(
    ("extra", "region", "message"),
    [
        ((), "us-central1-a", "invalid region"),
        ((), "US-CENTRAL1", "invalid region"),
        (("--var", "no_equals_sign"), REGION, "invalid --var"),
        (("--var", "=value"), REGION, "invalid --var"),
        (("--var", "1abc=x"), REGION, "invalid --var"),
        (("--var", "nope:name_prefix=x"), REGION, "unknown stage"),
        (("--var", "not_a_variable=x"), REGION, "no variable 'not_a_variable'"),
        (("--stage", "bootstrap", "--var", "gpu_max_nodes=2"), REGION, "no variable 'gpu_max_nodes'"),
        (("--var", "project_id=other"), REGION, "use --project"),
        (("--state-bucket", "Bad_Bucket!"), REGION, "invalid --state-bucket"),
    ],
)
def test_invalid_input_is_rejected_before_any_terraform_call(
    tf: FakeTerraform, run: Run, extra: tuple[str, ...], region: str, message: str
) -> None:
    rc, _out, err = run("--auto-approve", *extra, region=region)
    assert rc == 2
    assert message in err
    assert tf.calls() == []


def test_missing_terraform_is_a_clear_error(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    rc, _out, err = run("--dry-run")
    assert rc == 2
    assert "terraform not found on PATH" in err


def test_no_tty_without_auto_approve_refuses_to_apply(tf: FakeTerraform, run: Run) -> None:
    rc, _out, err = run()
    assert rc == 2
    assert "--auto-approve" in err
    assert tf.calls() == []  # refused before planning anything


def test_ci_without_auto_approve_refuses_even_on_a_tty(
    tf: FakeTerraform, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    rc, _out, _err = run()
    assert rc == 2
    assert tf.calls() == []


@pytest.mark.integration
def test_tty_asks_before_each_apply(tf: FakeTerraform, run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deploy, "_interactive", lambda: True)
    monkeypatch.setattr(sys, "stdin", io.StringIO("yes\nno\n"))
    rc, _out, err = run()
    assert rc == 1
    assert "Apply the plan for stage bootstrap" in err
    assert "apply of stage platform not confirmed" in err
    applied = [s for s, c in tf.sequence() if c == "apply"]
    assert applied == ["bootstrap"]
    assert ("app", "init") not in tf.sequence()


# ---------------------------------------------------------------------------------------------
# Stage selection, --var, --state-bucket
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_selected_stages_only_with_explicit_state_bucket(tf: FakeTerraform, run: Run, checkout: Path) -> None:
    """The app stage alone reads the applied platform stage's outputs (it renders the manifests and
    builds the images from them), and applies only itself."""
    rc, _out, err = run("--stage", "app", "--state-bucket", "my-state", "--auto-approve")
    assert rc == 0, err
    assert tf.sequence() == [("platform", "init"), ("platform", "output")] + [
        ("app", c) for c in ("init", "plan", "show", "apply", "output")
    ]
    assert _flag(tf.call("platform", "init"), "-backend-config=") == "bucket=my-state"
    assert _flag(tf.call("app", "init"), "-backend-config=") == "bucket=my-state"
    assert plan_vars(tf.call("app", "plan"))["state_bucket"] == "my-state"
    rendered = checkout / deploy.K8S_BUILD_DIR
    assert (rendered / deploy.RENDERED_FOR).read_text().strip() == PROJECT
    assert f"retrain-notifier@{PROJECT}.iam.gserviceaccount.com" in (rendered / "notifier.yaml").read_text()


@pytest.mark.integration
def test_the_app_stage_alone_refuses_when_the_manifests_cannot_be_rendered(
    tf: FakeTerraform, run: Run, checkout: Path
) -> None:
    """Never a plan over what an earlier render left (possibly another project's): an error."""
    stale = checkout / deploy.K8S_BUILD_DIR
    stale.mkdir(parents=True)
    (stale / "notifier.yaml").write_text("# another project's\n")
    (stale / deploy.RENDERED_FOR).write_text("someone-else\n")
    tf.spec["outputs"] = {
        **OUTPUTS,
        "platform": {k: v for k, v in OUTPUTS["platform"].items() if k != "k8s_namespace"},
    }
    tf.save()
    rc, _out, err = run("--stage", "app", "--state-bucket", "my-state", "--auto-approve")
    assert rc == 2
    assert f"cannot render k8s/ for {PROJECT}" in err and "k8s_namespace" in err
    assert ("app", "plan") not in tf.sequence()


@pytest.mark.integration
def test_a_dry_run_is_given_the_images_it_plans_with(tf: FakeTerraform, run: Run) -> None:
    rc, _out, err = run("--dry-run")
    assert rc == 2
    assert "a dry run builds no image" in err and "--var dataflow_image=" in err
    assert ("app", "plan") not in tf.sequence()


@pytest.mark.integration
def test_later_stages_alone_read_the_bucket_from_bootstrap_outputs(tf: FakeTerraform, run: Run) -> None:
    rc, _out, err = run("--stage", "app", "platform", "--dry-run", *GIVEN_IMAGES)
    assert rc == 0, err
    seq = tf.sequence()
    assert seq[0] == ("bootstrap", "output")
    assert [s for s, _ in seq[1:]] == ["platform"] * 3 + ["app"] * 3
    assert _flag(tf.call("platform", "init"), "-backend-config=") == f"bucket={STATE_BUCKET}"
    assert plan_vars(tf.call("app", "plan"))["state_bucket"] == STATE_BUCKET


@pytest.mark.integration
def test_later_stages_without_any_state_bucket_is_an_error(tf: FakeTerraform, run: Run) -> None:
    tf.spec["outputs"] = {"bootstrap": {}}
    tf.save()
    rc, _out, err = run("--stage", "platform", "--dry-run")
    assert rc == 2
    assert "--state-bucket" in err
    assert ("platform", "init") not in tf.sequence()


@pytest.mark.integration
def test_user_vars_go_to_the_stages_that_declare_them(tf: FakeTerraform, run: Run) -> None:
    rc, _out, err = run(
        "--auto-approve",
        "--var",
        "name_prefix=acme",
        "--var",
        "platform:gpu_max_nodes=2",
        "--var",
        'app:run_http_invokers=["user:ops@example.com"]',
    )
    assert rc == 0, err
    vs = {s: plan_vars(tf.call(s, "plan")) for s in ("bootstrap", "platform", "app")}
    assert "name_prefix" not in vs["bootstrap"]
    assert vs["platform"]["name_prefix"] == "acme" and vs["app"]["name_prefix"] == "acme"
    assert vs["platform"]["gpu_max_nodes"] == "2" and "gpu_max_nodes" not in vs["app"]
    assert vs["app"]["run_http_invokers"] == '["user:ops@example.com"]'


# ---------------------------------------------------------------------------------------------
# The function source folder
# ---------------------------------------------------------------------------------------------


def test_functions_build_folder_holds_main_requirements_and_the_package(checkout: Path) -> None:
    stale = checkout / deploy.FUNCTIONS_BUILD_DIR / "stale.txt"
    stale.parent.mkdir(parents=True)
    stale.write_text("left over from an earlier build")
    built = deploy.build_functions_source(checkout)
    assert built == checkout / deploy.FUNCTIONS_BUILD_DIR
    assert (built / "main.py").read_text() == (checkout / "functions" / "main.py").read_text()
    assert (built / "requirements.txt").is_file()
    # The runtime package whole, its data included; an emptied folder (a moved module's __pycache__) is not.
    (checkout / "retrain" / "moved" / "__pycache__").mkdir(parents=True)
    (checkout / "retrain" / "moved" / "__pycache__" / "old.cpython-311.pyc").write_bytes(b"")
    built = deploy.build_functions_source(checkout)

    def files(root: Path) -> set[str]:
        return {
            p.relative_to(root).as_posix()
            for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }

    assert files(built / "retrain") == files(checkout / "retrain")
    assert (built / "retrain" / "resources" / "nemo-24.12").is_dir()
    assert not (built / "retrain" / "moved").exists()
    assert not stale.exists()
    top = {p.name for p in built.iterdir()}
    assert top == {"main.py", "requirements.txt", "retrain"}
    everything = list(built.rglob("*"))
    assert not [p for p in everything if p.name in ("__pycache__", "tests") or p.suffix == ".pyc"]


@pytest.mark.integration
def test_a_target_that_cannot_be_saved_is_a_warning_not_a_failed_deploy(
    tf: FakeTerraform, run: Run, config_home: Path
) -> None:
    config_home.write_text("a file where the config folder should be")
    rc, _out, err = run("--auto-approve")
    assert rc == 0, err
    assert "warning: the CLI target was not saved" in err
    assert f"run `retrain target save {PROJECT} --from-terraform infra/app`" in err


@pytest.mark.integration
def test_function_source_is_built_before_the_app_stage(tf: FakeTerraform, run: Run, checkout: Path) -> None:
    rc, _out, err = run("--dry-run", *GIVEN_IMAGES)
    assert rc == 0, err
    built = {(c["stage"], c["cmd"]): c["functions_built"] for c in tf.calls()}
    assert built[("app", "init")] and built[("app", "plan")]
    assert (checkout / deploy.FUNCTIONS_BUILD_DIR / "main.py").is_file()


def test_app_stage_zips_the_build_folder() -> None:
    variables = hcl.parse((REPO / "infra" / "app" / "variables.tf").read_text())["variable"]
    source_dir = next(e['"functions_source_dir"'] for e in variables if '"functions_source_dir"' in e)
    assert source_dir["default"].strip('"') == deploy.FUNCTIONS_BUILD_DIR
    assert len(source_dir["description"]) > 20
    functions_tf = (REPO / "infra" / "app" / "functions.tf").read_text()
    assert 'source_dir  = "${local.repo_root}/${var.functions_source_dir}"' in functions_tf


@pytest.mark.integration
def test_built_function_source_imports_the_vendored_package(checkout: Path) -> None:
    built = deploy.build_functions_source(checkout)
    result = subprocess.run(
        [sys.executable, "-c", "import main, retrain; print(retrain.__file__)"],
        cwd=built,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == (built / "retrain" / "__init__.py").resolve()


# ---------------------------------------------------------------------------------------------
# The real terraform binary, offline
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_real_terraform_fmt_check() -> None:
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.skip("terraform binary not installed")
    result = subprocess.run(
        [terraform, "fmt", "-check", "-recursive", "infra"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.integration
def test_an_artifact_that_cannot_be_pinned_stops_deploy_before_the_app_stage(
    tf: FakeTerraform, run: Run, checkout: Path
) -> None:
    """The app stage refuses an unpinned image; deploy pins first, and one it cannot resolve (here a
    registry on a loopback port nothing listens on) ends the run with exit 2 and the image named,
    before the app stage's Terraform runs.  A dry run resolves nothing and leaves the lock as it was."""
    path = checkout / "infra" / "pins.json"
    lock = pins.Lock.load(path)
    unreachable = f"127.0.0.1:{processes.free_port()}/team/trainer:v9"
    lock.images[unreachable] = None
    lock.save(path)
    before = path.read_text()

    rc, _out, err = run("--dry-run")
    assert rc == 2 and f"not pinned in infra/pins.json: {unreachable}" in err, err
    assert path.read_text() == before

    rc, _out, err = run("--auto-approve")
    assert rc == 2 and f"cannot pin {unreachable}" in err, err
    assert [c["cmd"] for c in tf.calls() if c["stage"] == "app"] == []
    assert {c["stage"] for c in tf.calls() if c["cmd"] == "plan"} == {"bootstrap", "platform"}
