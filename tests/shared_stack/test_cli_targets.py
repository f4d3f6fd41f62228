"""The operator's CLI against a deployment (``--target``): the cloud code path, Google's clients with
their standard endpoint variables pointed at the emulators, and no local-stack state file involved.

The deployment here is the local stack's services playing Google's (they are the only ones reachable);
what the CLI knows of it is only the saved target (its RETRAIN_* settings) and the endpoints a client
library would take from its environment: FIRESTORE/PUBSUB/STORAGE_EMULATOR_HOST, and retrain's own
variables for the two services without one (Workflow executions, the GKE API with its cluster token).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from stack_support import (
    assert_released,
    finish,
    new_dataset,
    unique_lines,
    wait_for_run,
    wait_for_status,
)

from retrain import config
from retrain.adapters.cluster import CONTAINER_ENDPOINT_VAR
from retrain.adapters.credentials import LOCAL_TOKEN_VAR
from retrain_local.cluster import Faults
from retrain_local.landing import drop
from retrain_local.stack import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.emulators, pytest.mark.envtest]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def operator(stack: LocalStack, tmp_path: Path) -> dict[str, str]:
    """An operator's environment: no RETRAIN_* settings, no KUBECONFIG, an empty state folder; only the
    client libraries' endpoint variables and a private config folder for targets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETRAIN_") and k != "KUBECONFIG"}
    for key in ("FIRESTORE_EMULATOR_HOST", "PUBSUB_EMULATOR_HOST", "STORAGE_EMULATOR_HOST"):
        env[key] = stack.endpoints.env()[key]
    env["RETRAIN_WORKFLOWS_ENDPOINT"] = stack.endpoints.workflows
    env["RETRAIN_WORKFLOWS_GRPC_ENDPOINT"] = stack.endpoints.workflows_grpc
    env[CONTAINER_ENDPOINT_VAR] = stack.endpoints.container
    env[LOCAL_TOKEN_VAR] = stack.endpoints.token
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    env["RETRAIN_STATE_DIR"] = str(tmp_path / "no-stack")  # what the local target would look in
    return env


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "retrain_ops.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )


def test_the_cli_acts_on_a_saved_deployment_target(
    stack: LocalStack, operator: dict[str, str], tmp_path: Path
) -> None:
    # The deployment's settings, as the app stage's retrain_env output would give them.
    deployed = config.to_env(dataclasses.replace(stack.settings, state_dir=str(tmp_path / "elsewhere")))
    (tmp_path / "retrain_env.json").write_text(json.dumps(deployed))
    saved = cli(operator, "target", "save", "prod", "--env-file", str(tmp_path / "retrain_env.json"))
    assert saved.returncode == 0, saved.stderr
    assert "`retrain --target prod runs`" in saved.stderr
    assert cli(operator, "target", "list").stdout == "local\nprod\n"
    assert json.loads(cli(operator, "target", "show", "prod").stdout) == deployed

    # Data lands (uploaded without a seal); the operator asks what sealing would do, then seals.  Only the
    # CLI's `run` seals: the sweeper (quiet period, max age) and the hourly seal are paused meanwhile.
    dataset = new_dataset()
    data = tmp_path / "a.jsonl"
    data.write_text("\n".join(unique_lines()) + "\n")
    stack.paused_jobs.update({"sweeper", "seal"})
    try:
        drop(stack.settings, stack.endpoints.ingest_function, [data], dataset=dataset, seal=False)
        planned = cli(operator, "--target", "prod", "plan", "--dataset", dataset, "--json")
        assert planned.returncode == 0, planned.stderr
        (forecast,) = json.loads(planned.stdout)
        assert forecast["dataset"] == dataset and forecast["objects"] == 1 and forecast["would_run"]

        stack.twin.faults = Faults(hold_training_s=120)
        sealed = cli(operator, "--target", "prod", "run", "--dataset", dataset)
        assert sealed.returncode == 0, sealed.stderr
    finally:
        stack.paused_jobs.difference_update({"sweeper", "seal"})
    run = wait_for_run(stack, dataset)
    assert run.trigger == "manual" and run.run_id in sealed.stderr
    wait_for_status(stack, run, "training")
    status = cli(operator, "--target=prod", "status", run.run_id, "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["status"] == "training"

    cancel = cli(operator, "--target", "prod", "cancel", run.run_id, "--reason", "wrong data")
    assert cancel.returncode == 0, cancel.stderr
    cancelled = finish(stack, run, 120)
    assert_released(stack, cancelled, "cancelled")
    # Who asked: the Google account of the Application Default Credentials (none on this machine).
    assert cancelled.reason is not None and "(no Google credentials): wrong data" in cancelled.reason
    listed = json.loads(cli(operator, "--target", "prod", "runs", "--json").stdout)
    assert [r["status"] for r in listed if r["run_id"] == run.run_id] == ["cancelled"]
    stack.twin.faults = Faults()

    # The reaper finds the cluster through the GKE API and reports the GPU pool's bounds from it.
    reaped = cli(operator, "--target", "prod", "reap", "--json")
    assert reaped.returncode == 0, reaped.stderr
    pool = stack._deployment.platform
    assert json.loads(reaped.stdout)["node_pool_size"] == {
        "min_nodes": 0,
        "max_nodes": pool.var("gpu_max_nodes"),
        "per_zone": False,
    }

    # Local-stack commands refuse a deployment and say what does the same there; unknown targets too.
    dropped = cli(operator, "--target", "prod", "drop", str(data))
    assert dropped.returncode == 1
    assert "works on the local stack, not on target 'prod'" in dropped.stderr
    assert f"gcloud storage cp FILE gs://{stack.settings.landing_bucket}/" in dropped.stderr
    unknown = cli(operator, "--target", "nope", "runs")
    assert unknown.returncode == 1 and "no target 'nope' (known: local, prod)" in unknown.stderr
    assert not (tmp_path / "no-stack").exists()  # no local-stack state was looked up or written

    # Reached through this environment's endpoints: said every time; only some of them: refused, since
    # a reap would compare one world's ledger with the other's cluster.
    assert "target prod through this environment's endpoints, not Google's" in cancel.stderr
    partial = {k: v for k, v in operator.items() if k != CONTAINER_ENDPOINT_VAR}
    for command in (["reap", "--dry-run"], ["runs"]):
        mixed = cli(partial, "--target", "prod", *command)
        assert mixed.returncode == 1, mixed.stderr
        assert "set but not RETRAIN_CONTAINER_ENDPOINT: the command would mix local endpoints" in mixed.stderr


def test_a_target_file_with_foreign_settings_is_refused(operator: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "bad.env").write_text("RETRAIN_PROJECT=p\nRETRAIN_NOT_A_SETTING=1\n")
    bad = cli(operator, "target", "save", "prod", "--env-file", str(tmp_path / "bad.env"))
    assert bad.returncode == 1 and "not retrain settings: ['RETRAIN_NOT_A_SETTING']" in bad.stderr
    (tmp_path / "bad.env").write_text("RETRAIN_PROJECT=p\nRETRAIN_NODES=two\n")
    bad = cli(operator, "target", "save", "prod", "--env-file", str(tmp_path / "bad.env"))
    assert bad.returncode == 1 and "RETRAIN_NODES='two'" in bad.stderr
    local = cli(operator, "target", "save", "local", "--env-file", str(tmp_path / "bad.env"))
    assert local.returncode == 1 and "'local' is the local stack's target" in local.stderr
    assert cli(operator, "target", "list").stdout == "local\n"
