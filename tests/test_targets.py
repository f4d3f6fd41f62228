"""Deployment targets of the operator's CLI (``retrain_ops.targets``): read from an applied app stage's
``retrain_env`` output, saved privately, loaded exactly."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from retrain import config
from retrain_ops import targets
from retrain_ops.deployment import Deployment


@pytest.fixture(autouse=True)
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(targets.TARGET_ENV, raising=False)
    return tmp_path / "config"


def fake_terraform(tmp_path: Path, output: object, code: int = 0) -> Path:
    """A terraform that logs its argv and prints ``output`` as ``output -json NAME`` does."""
    script = tmp_path / "terraform"
    log = tmp_path / "argv.json"
    script.write_text(
        "#!/usr/bin/env python3\nimport json, sys\n"
        f"open({str(log)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        f"sys.stderr.write('state not found') if {code} else print({json.dumps(json.dumps(output))})\n"
        f"sys.exit({code})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.mark.integration
def test_the_app_stages_retrain_env_becomes_a_target(tmp_path: Path, config_home: Path) -> None:
    deployed = Deployment(project="acme-prod").env  # what infra/app's local.retrain_env evaluates to
    terraform = fake_terraform(tmp_path, deployed)
    env = targets.from_terraform(Path("infra/app"), terraform=str(terraform))
    assert json.loads((tmp_path / "argv.json").read_text()) == [
        "-chdir=infra/app",
        "output",
        "-json",
        "retrain_env",
    ]
    path = targets.save("prod", env)
    assert path == config_home / "retrain" / "targets" / "prod.json"
    target = targets.selected("prod")
    assert not target.local and target.env == deployed
    assert target.settings() == config.load(deployed) and target.settings().project == "acme-prod"
    assert targets.names() == ["prod"]


def test_retrain_target_selects_when_no_flag_and_local_is_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    targets.save("prod", {"RETRAIN_PROJECT": "acme-prod"})
    assert targets.selected(None).local
    monkeypatch.setenv(targets.TARGET_ENV, "prod")
    assert targets.selected(None).name == "prod"
    assert targets.selected("local").local  # the flag wins over the variable


@pytest.mark.integration
def test_a_failed_terraform_output_says_so(tmp_path: Path) -> None:
    terraform = fake_terraform(tmp_path, {}, code=1)
    with pytest.raises(ValueError, match="terraform output retrain_env in infra/app failed: state not found"):
        targets.from_terraform(Path("infra/app"), terraform=str(terraform))


def test_env_files_and_names_are_checked(tmp_path: Path) -> None:
    env_file = tmp_path / "prod.env"
    env_file.write_text("# the deployment\nRETRAIN_PROJECT=acme-prod\n\nRETRAIN_REGION = europe-west4\n")
    assert targets.from_env_file(env_file) == {
        "RETRAIN_PROJECT": "acme-prod",
        "RETRAIN_REGION": "europe-west4",
    }
    env_file.write_text("RETRAIN_PROJECT\n")
    with pytest.raises(ValueError, match=r"prod\.env:1: expected KEY=VALUE"):
        targets.from_env_file(env_file)
    with pytest.raises(ValueError, match="the settings name no RETRAIN_PROJECT"):
        targets.save("prod", {"RETRAIN_REGION": "europe-west4"})
    for bad in ("Prod", "../etc", "-x", ""):
        with pytest.raises(ValueError, match="target name"):
            targets.save(bad, {"RETRAIN_PROJECT": "p"})
    with pytest.raises(ValueError, match=r"no target 'staging' \(known: local, none saved\)"):
        targets.load("staging")


def test_endpoint_variables_for_a_deployment_are_all_or_none() -> None:
    prod = targets.Target("prod", {"RETRAIN_PROJECT": "acme-prod"})
    assert targets.endpoint_overrides(prod, {}) == {}
    every = {k: "http://127.0.0.1:1" for k in targets.ENDPOINT_VARS}
    assert targets.endpoint_overrides(prod, every) == every
    for left_out in targets.ENDPOINT_VARS:
        partial = {k: v for k, v in every.items() if k != left_out}
        with pytest.raises(ValueError, match=f"set but not {left_out}: the command would mix"):
            targets.endpoint_overrides(prod, partial)
    with pytest.raises(ValueError, match="BIGQUERY_EMULATOR_HOST set but not FIRESTORE_EMULATOR_HOST"):
        targets.endpoint_overrides(prod, {"BIGQUERY_EMULATOR_HOST": "http://127.0.0.1:1"})


def test_a_project_id_becomes_a_target_name() -> None:
    assert targets.name_for_project("acme-prod") == "acme-prod"
    assert targets.name_for_project("example.com:ml-prod") == "example-com-ml-prod"


def test_a_google_token_never_goes_to_a_cluster_a_local_gke_api_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With RETRAIN_CONTAINER_ENDPOINT set, the cluster's address comes from that endpoint, which nobody
    authenticates: only the local identity's token may go there, never Application Default Credentials
    (the security review's L9)."""
    import google.auth

    from retrain.adapters import cluster
    from retrain.adapters.credentials import LOCAL_TOKEN_VAR

    def adc(*args: object, **kwargs: object) -> None:
        raise AssertionError("Application Default Credentials were asked for")

    monkeypatch.setattr(google.auth, "default", adc)
    monkeypatch.setenv(cluster.CONTAINER_ENDPOINT_VAR, "http://127.0.0.1:1")
    monkeypatch.delenv(LOCAL_TOKEN_VAR, raising=False)
    with pytest.raises(RuntimeError, match="yet no local identity was given"):
        cluster._access_token()
    monkeypatch.setenv(LOCAL_TOKEN_VAR, "local-token")
    assert cluster._access_token() == "local-token"
