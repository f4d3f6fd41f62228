"""The whole loop on one machine, through the real CLI: drop data, get a trained run, GPUs back to zero.

Everything is real but the GKE data plane and Cloud Workflows (twins); see docs/local-stack.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from retrain.k8s.render import run_account_name, run_principal
from retrain_local import emulators
from retrain_local.envtest import envtest_unavailable_reason
from retrain_local.iam import RUNTIME_POLICY
from retrain_ops.deployment import Deployment

pytestmark = [pytest.mark.e2e, pytest.mark.emulators, pytest.mark.envtest]

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_ACCOUNT = "serviceAccount:retrain-workflow@retrain-local.iam.gserviceaccount.com"
CORPUS = Path(os.environ.get("RETRAIN_SHARED", REPO.parent / "shared")) / "corpus"


@pytest.fixture(autouse=True)
def _needs_everything() -> None:
    for reason in (emulators.java_emulators_unavailable_reason(), envtest_unavailable_reason()):
        if reason:
            pytest.skip(reason)


BOOKS = (
    "the-devil-s-dictionary_972.txt",
    "the-complete-angler-1653_9198.txt",
    "katrine-a-novel_14263.txt",
    "jack-sheppard-a-romance_16215.txt",
)


def small_corpus(into: Path) -> Path:
    """Four books, cut to ~30 KB each: enough for real tokens and training, quick on two cores, and
    enough objects for the dataset's first run to carve its eval set (one book)."""
    into.mkdir()
    for name in BOOKS:
        text = (CORPUS / name).read_text(encoding="utf-8")
        (into / name).write_text(text[20_000:50_000], encoding="utf-8")
    return into


def retrain(args: list[str], state: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "retrain_ops.cli", *args],
        env={
            **os.environ,
            "RETRAIN_STATE_DIR": str(state),
            "RETRAIN_STEPS_PER_RUN": "10",
            "RETRAIN_PROVISION_DELAY_S": "1",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )


def test_demo_trains_and_returns_every_node(tmp_path: Path) -> None:
    state = tmp_path / "state"
    demo = retrain(["demo", "--data", str(small_corpus(tmp_path / "data")), "--json"], state)
    assert demo.returncode == 0, demo.stderr[-4000:]
    run = json.loads(demo.stdout)
    assert run["status"] == "succeeded", run
    assert run["tokens"] > 10_000 and run["documents"] == 4 and run["objects"] == 4
    assert run["nodes_at_end"] == 0 and run["gpu_node_seconds"] > 0
    # the nodes stayed up after training until the autoscaler's scale-down delay (600 s / 60 locally)
    assert 10 <= run["idle_node_seconds"] < run["gpu_node_seconds"], run
    assert run["checkpoint"].endswith("-last") and "/megatron_gpt/checkpoints/" in run["checkpoint"], run
    # the exact NeMo command that deploys, its data on the command line (no @file), in the stand-in image
    command = run["command"]
    assert command[:2] == ["bash", "-c"] and "megatron_gpt_pretraining.py" in command[2]
    (data,) = [a for a in command if a.startswith("model.data.data_prefix={")]
    # three objects' shards, packed into one dataset (retrain_tokenize.packs), train; the fourth, held
    # out (chosen by its content) as the dataset's eval set, validates: NeMo's {train, validation, test}
    assert "@" not in data and "trainer.devices=8" in command
    assert run["blend"][0] == 1.0 and "/shards/pack-" in run["blend"][1]
    eval_set = run["eval_set"].replace("gs://", "/gcs/")
    assert "/shards/eval-" in eval_set and eval_set.endswith("/data_text_document")  # one book, its own
    train = run["blend"][1].replace("gs://", "/gcs/")
    assert (
        data
        == f"model.data.data_prefix={{train:[1.0,{train}],validation:[1.0,{eval_set}],test:[1.0,{eval_set}]}}"
    )
    assert run["image"] == "retrain.local/nemo-24.12-standin" and run["profile"] == "nemo-24.12"
    assert run["base_checkpoint"] is None and run["base_step"] == 0  # the dataset's first run
    assert run["metrics"]["steps"] == 10 and run["metrics"]["final_loss"] > 0, run
    # the eval gate: a dataset's first checkpoint is promoted with nothing to compare it with, its
    # validation loss measured on the held-out book (the champion's, which the next run is judged against)
    assert run["eval"] == {
        "val_loss": run["metrics"]["val_loss"],
        "champion_val_loss": None,
        "champion_run": None,
        "compared_on": None,
        "promoted": True,
        "reason": "the dataset's first checkpoint",
    }, run["eval"]
    assert run["metrics"]["val_loss"] > 0, run["metrics"]
    for needle in ("tokenizing", "provisioning", "training", "succeeded"):
        assert needle in demo.stderr  # progress was shown
    # and the run's whole life as a subscriber of the run events topic received it, in order, each once
    # (retrain.contracts.RunEvent; the demo prints them as they come, as `retrain events --follow` does)
    told = re.findall(rf"run event: \S+ (\w+) +{run['run_id']}\b", demo.stderr)
    assert told == [
        "queued",
        "tokenizing",
        "provisioning",
        "training",
        "promoted",
        "releasing",
        "succeeded",
    ], demo.stderr[-3000:]
    # the run's page (retrain report): its timeline has every stage this run went through, and its loss
    # curve the trainer's scalars (tests/test_report.py looks at such a page in Chromium)
    (page,) = re.findall(r"the run's report: (\S+)", demo.stderr)
    html = Path(page).read_text()
    assert f"Run {run['run_id']}" in html and "<polyline" in html, html[:2000]
    for stage in ("queued", "tokenizing", "waiting for capacity", "training", "releasing"):
        assert f"<title>{stage}: " in html, stage

    # the run's pods were the run's own principal: they read through their namespace's grant and wrote
    # only through the grant the workflow set on runs/RUN/ (and Google was asked nothing it would refuse)
    iam = json.loads((state / "iam-report.json").read_text())
    assert iam["refusals"] == []
    settings = Deployment().settings()
    pods = run_principal(
        settings.project_number, settings.project, settings.namespace, run_account_name(run["run_id"])
    )
    folder = f"projects/_/buckets/{settings.artifacts_bucket}/managedFolders/runs/{run['run_id']}/"
    used = iam["workloads"][pods]
    assert used["storage.objects.create"] == [f"{RUNTIME_POLICY} by {WORKFLOW_ACCOUNT}: {folder}"], used
    assert used["storage.objects.list"] == [
        "infra/platform: google_storage_bucket_iam_member.training_artifacts_viewer"
    ]

    # the record outlives the stack
    runs = retrain(["runs", "--json"], state)
    assert runs.returncode == 0, runs.stderr
    (listed,) = json.loads(runs.stdout)
    assert listed["run_id"] == run["run_id"] and listed["status"] == "succeeded"
    for key in (
        "run_id",
        "status",
        "trigger",
        "objects",
        "documents",
        "tokens",
        "gpu_node_seconds",
        "nodes_at_end",
        "checkpoint",
        "reason",
    ):
        assert key in listed
