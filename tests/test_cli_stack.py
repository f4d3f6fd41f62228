"""`retrain up`, `drop`, `runs`, `status`, `down`: the background stack, driven as a person would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from retrain.adapters.ledger import FirestoreLedger
from retrain.domain.runs import Run, RunStatus
from retrain.k8s.render import jobset_name
from retrain.trainers.hydra import hydra_string
from retrain_local import emulators
from retrain_local.envtest import envtest_unavailable_reason
from retrain_local.stack import Endpoints
from retrain_ops.deployment import LOCAL_PROJECT

pytestmark = [pytest.mark.e2e, pytest.mark.emulators, pytest.mark.envtest]
REPO = Path(__file__).resolve().parents[1]


def retrain(args: list[str], state: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "RETRAIN_STATE_DIR": str(state),
        "RETRAIN_GPUS_PER_NODE": "1",
        "RETRAIN_STEPS_PER_RUN": "4",
        "RETRAIN_GLOBAL_BATCH_SIZE": "2",  # scaled for tests as tests/stack_support's stacks are
        "RETRAIN_PROVISION_DELAY_S": "0.5",
        "RETRAIN_SCALE_DOWN_DELAY_S": "1",  # a released run's nodes go a second after (tests/stack_support)
        "RETRAIN_QUIET_PERIOD_S": "5",
        "RETRAIN_PROFILES": "bridged=megatron-bridge",
        **settings,
    }
    return subprocess.run(
        [sys.executable, "-m", "retrain_ops.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def delivered_by_the_notifier(state: Path, jobset: str, within_s: float = 120.0) -> bool:
    """Whether the stack's notifier published ``jobset``'s terminal state (its state file's record of
    what it delivered), waiting a while for it: its watch may trail the workflow's own read."""
    deadline = time.monotonic() + within_s
    while True:
        kept = state / "notifier.json"
        if kept.exists() and jobset in json.loads(kept.read_text())["delivered"].values():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(1)


def wait_for_run(state: Path, dataset: str, after: str = "") -> dict[str, Any]:
    """The dataset's one run (created after run ``after``), once it ended, as `retrain runs --json` shows
    it; it must have succeeded.  A run takes about a minute alone and went past three on two cores shared
    with two other test workers: the deadline is for a run that never ends, not a slow one."""
    deadline, ledger = time.monotonic() + 600, stack_ledger(state)
    while True:
        runs = [r for r in ledger.list_runs() if r.dataset == dataset and r.run_id > after]
        if runs and runs[0].status.terminal and runs[0].nodes_at_end is not None:
            break
        assert time.monotonic() < deadline, runs
        time.sleep(1)
    (run,) = [r for r in runs_of(state, dataset) if r["run_id"] > after]
    assert run["status"] == "succeeded", run
    return run


def stack_ledger(state: Path) -> FirestoreLedger:
    """The ledger of the stack `retrain up` started, read in this process (one client for a whole wait):
    polling with `retrain runs` costs two to three seconds of CPU a call, which a test polling every
    second took from every other test sharing the machine's two cores."""
    endpoints = Endpoints.load(state / "stack.json")
    with mock.patch.dict(os.environ, endpoints.env()):  # the client finds its emulator when it is made
        return FirestoreLedger(LOCAL_PROJECT)


def training(ledger: FirestoreLedger, dataset: str) -> list[Run]:
    return [r for r in ledger.list_runs() if r.dataset == dataset and r.status == RunStatus.TRAINING]


@pytest.mark.long
@pytest.mark.timeout(1800)  # eight runs, two trainers, on two cores shared with other tests (903 s seen)
def test_background_stack_round_trip(tmp_path: Path) -> None:
    for reason in (emulators.java_emulators_unavailable_reason(), envtest_unavailable_reason()):
        if reason:
            pytest.skip(reason)
    state = tmp_path / "state"
    assert retrain(["drop", str(tmp_path)], state).returncode == 1  # no stack yet: a clear error
    # the hourly seal tick paused (`gcloud scheduler jobs pause seal`): it would seal the quiet batch below
    # before the sweeper could (it ticks every 60 s here); the sweeper, reaper and audit jobs tick as
    # deployed
    up = retrain(["up", "--pause", "seal"], state)
    assert up.returncode == 0, up.stderr
    try:
        endpoints = json.loads((state / "stack.json").read_text())
        # Two datasets train side by side (separate runs, one node each): "notes" on the NeMo profile,
        # "bridged" on Megatron-Bridge (RETRAIN_PROFILES), each a first run and a second that continues it.
        data = tmp_path / "notes.jsonl"
        data.write_text("\n".join(json.dumps({"text": f"note {i}: the river ran on"}) for i in range(20)))
        for dataset in ("notes", "bridged"):
            dropped = retrain(["drop", str(data), "--dataset", dataset], state)
            assert dropped.returncode == 0, dropped.stderr
        run, first = wait_for_run(state, "notes"), wait_for_run(state, "bridged")
        assert run["status"] == "succeeded" and run["trigger"] == "gcs-marker" and run["tokens"] > 0, run
        shown = retrain(["status", run["run_id"]], state)
        assert shown.returncode == 0 and "succeeded" in shown.stdout and run["run_id"] in shown.stdout
        assert retrain(["status", "no-such-run"], state).returncode == 1
        assert run["checkpoint"] and run["metrics"]["steps"] == 4, run  # type: ignore[index]
        # Megatron-Bridge's run_recipe.py, in its stand-in image under PyTorch's torchrun, left Bridge's
        # layout (its weights-only pretrained checkpoint), which the record and the report read
        assert first["profile"] == "megatron-bridge", first
        assert first["image"] == "retrain.local/megatron-bridge-standin", first
        command = first["command"]
        script = command.index("/opt/Megatron-Bridge/scripts/training/run_recipe.py")
        assert command[script - 2 : script] == ["--nnodes=1", "--nproc-per-node=1"], command
        assert command[script + 1 : script + 3] == ["--recipe", "vanilla_gpt_pretrain_config"], command
        assert "train.train_iters=4" in command and first["base_checkpoint"] is None, first
        assert str(first["checkpoint"]).endswith("/checkpoints/iter_0000004"), first
        metrics = first["metrics"]
        assert metrics["steps"] == 4 and metrics["final_loss"] > 0, metrics
        assert metrics["consumed_samples"] == 4 * 2, metrics  # ``lm loss vs samples``, 2 a step
        page = retrain(["report", str(first["run_id"])], state)
        assert page.returncode == 0, page.stderr
        assert "<polyline" in Path(page.stdout.strip()).read_text()  # its loss curve, Bridge's ``lm loss``

        # continual training: a different file makes a second run, which continues from the first's
        # checkpoint (NeMo's model.restore_from_ckpt) and trains on to its step plus this run's steps
        more = tmp_path / "more.jsonl"
        more.write_text("\n".join(json.dumps({"text": f"more {i}: and the sea"}) for i in range(20)))
        for dataset in ("notes", "bridged"):
            assert retrain(["drop", str(more), "--dataset", dataset], state).returncode == 0
        second = wait_for_run(state, "notes", after=str(run["run_id"]))
        after = wait_for_run(state, "bridged", after=str(first["run_id"]))
        assert second["base_checkpoint"] == run["checkpoint"] and second["base_step"] == 4, second
        mounted = str(run["checkpoint"]).replace("gs://", "/gcs/")
        assert f"model.restore_from_ckpt={hydra_string(mounted)}" in second["command"]
        assert "trainer.max_steps=8" in second["command"]  # type: ignore[operator]
        assert second["metrics"]["steps"] == 8 and second["metrics"]["run_steps"] == 4  # type: ignore[index]
        # the eval gate compared it with the champion on its own validation data: the stand-in validated
        # the base checkpoint before training, as NeMo's script does not (there the champion's own val_loss)
        verdict = second["eval"]
        assert verdict["compared_on"] == "this run's validation data", verdict  # type: ignore[index]
        assert verdict["champion_run"] == run["run_id"] and verdict["champion_val_loss"] > 0, verdict  # type: ignore[index]
        # the same under Megatron-Bridge
        assert after["base_checkpoint"] == first["checkpoint"] and after["base_step"] == 4, after
        mounted = str(first["checkpoint"]).replace("gs://", "/gcs/")
        assert f"checkpoint.pretrained_checkpoint={hydra_string(mounted)}" in after["command"]
        assert "train.train_iters=4" in after["command"]  # Bridge counts from 0 after a pretrained load
        assert after["metrics"]["steps"] == 8 and after["metrics"]["run_steps"] == 4, after  # type: ignore[index]
        assert after["eval"]["compared_on"] == "this run's validation data", after  # type: ignore[index]

        # what a subscriber of the run events topic was told of both runs: each state once, the first
        # run's checkpoint promoted (`retrain events`: what the topic retains, as JSON lines)
        told = retrain(["events", "--dataset", "notes", "--json"], state)
        assert told.returncode == 0, told.stderr
        events = [json.loads(line) for line in told.stdout.splitlines()]
        lived = ["queued", "tokenizing", "provisioning", "training", "releasing", "succeeded"]
        for r in (run, second):
            promoted = ["promoted"] if r["eval"]["promoted"] else []  # type: ignore[index]
            types = sorted(e["type"] for e in events if e["run_id"] == r["run_id"])
            assert types == sorted(lived + promoted), (r["run_id"], events)
        assert {e["dataset"] for e in events} == {"notes"}
        (champion,) = [e for e in events if e["run_id"] == run["run_id"] and e["type"] == "promoted"]
        assert champion["checkpoint"] == run["checkpoint"] and champion["verdict"]["promoted"] is True

        # no marker, no manual seal: the Scheduler twin's sweep ticks seal it once it has been quiet (5 s;
        # the sweeper ticks every 5 s).  (The manual trigger is the second stack's, below: here the sweeper
        # could seal a batch before a `retrain run` started on a loaded machine had reached the ledger.)
        (quiet_file := tmp_path / "quiet.jsonl").write_text(json.dumps({"text": "a quiet batch"}) + "\n")
        assert retrain(["drop", str(quiet_file), "--dataset", "quiet", "--no-seal"], state).returncode == 0
        assert wait_for_run(state, "quiet")["trigger"] == "quiet-period"

        # the Scheduler twin runs infra/'s reaper job too (every 15 minutes / 60): the function reaped
        ticks = (state / "function-on_scheduler_tick.log").read_text()
        assert "reaped deleted" in ticks and "GPU nodes up" in ticks, ticks[-2000:]

        # every object dropped above is accounted for
        audited = retrain(["audit", "--settle", "30"], state)
        assert audited.returncode == 0 and "every object is accounted for" in audited.stdout, audited.stdout

    finally:
        down = retrain(["down"], state)
    assert down.returncode == 0, down.stderr
    assert not (state / "stack.json").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(endpoints["pid"], 0)

    # up again on the same state: the kept ledger, a fresh control plane; the next run is not slowed by
    # anything the last stack left (a stale notifier resourceVersion once cost a run its completion)
    # (this stack seals only on request: `retrain plan` is asked before and after a drop without the
    # marker, and neither the sweeper nor the hourly tick may seal it meanwhile)
    assert retrain(["up", "--pause", "seal", "--pause", "sweeper"], state).returncode == 0
    try:

        def plan() -> dict[str, Any]:
            answer = retrain(["plan", "--dataset", "again", "--json"], state)
            assert answer.returncode == 0, answer.stderr
            (forecast,) = json.loads(answer.stdout)
            return forecast  # type: ignore[no-any-return]

        assert (plan()["objects"], plan()["would_run"]) == (0, False)
        again = tmp_path / "again.jsonl"
        again.write_text("\n".join(json.dumps({"text": f"again {i}: after a restart"}) for i in range(20)))
        assert retrain(["drop", str(again), "--dataset", "again", "--no-seal"], state).returncode == 0
        forecast = plan()  # writes nothing: the data is still pending afterwards
        assert (forecast["objects"], forecast["bytes"], forecast["would_run"]) == (
            1,
            again.stat().st_size,
            True,
        )
        assert forecast["estimated_cost_usd"] > 0 and forecast["training_tokens"] > 0
        # the manual trigger: `retrain run` seals it and names the run it started
        started = retrain(["run", "--dataset", "again"], state)
        after_restart = wait_for_run(state, "again")
        said = started.stderr
        assert started.returncode == 0 and f"started: {after_restart['run_id']}" in said, said
        assert after_restart["trigger"] == "manual", after_restart
        # the new stack's notifier delivered its completion: one the last stack left a stale resourceVersion
        # once missed it, and the run then ended only at the workflow's own periodic read of the JobSet
        assert delivered_by_the_notifier(state, jobset_name(after_restart["run_id"]))
        kept = [r["run_id"] for r in json.loads(retrain(["runs", "--json"], state).stdout)]
        assert run["run_id"] in kept and after_restart["run_id"] in kept  # the ledger outlived the stack
    finally:
        assert retrain(["down"], state).returncode == 0


def runs_of(state: Path, dataset: str) -> list[dict[str, Any]]:
    return [r for r in json.loads(retrain(["runs", "--json"], state).stdout) if r["dataset"] == dataset]


def test_a_stack_killed_in_training_leaves_nothing_and_the_next_up_ends_the_run(tmp_path: Path) -> None:
    """SIGKILL of the stack process mid-training: `retrain down` stops every process it had started;
    the next `retrain up` finds the run's execution gone, records the run failed with the reason and
    zero nodes, and the next drop trains."""
    import signal

    from retrain_local import processes
    from retrain_local.stack import PROCESS_REGISTRY

    for reason in (emulators.java_emulators_unavailable_reason(), envtest_unavailable_reason()):
        if reason:
            pytest.skip(reason)
    state = tmp_path / "state"
    os.environ["RETRAIN_TWIN_FAULTS"] = "hold_training_s=600"  # training that outlasts the kill
    try:
        up = retrain(["up"], state)
    finally:
        del os.environ["RETRAIN_TWIN_FAULTS"]
    assert up.returncode == 0, up.stderr
    try:
        pid = json.loads((state / "stack.json").read_text())["pid"]
        data = tmp_path / "long.jsonl"
        data.write_text("\n".join(json.dumps({"text": f"a long run {i}"}) for i in range(10)))
        assert retrain(["drop", str(data), "--dataset", "long"], state).returncode == 0
        deadline, ledger = time.monotonic() + 180, stack_ledger(state)
        while not training(ledger, "long"):
            assert time.monotonic() < deadline, runs_of(state, "long")
            time.sleep(1)
        time.sleep(6)  # one ledger export after training began (it is exported every 5 s)
        os.kill(pid, signal.SIGKILL)
        children = [p for p in processes.recorded(state / PROCESS_REGISTRY) if processes.alive(p)]
        assert len(children) >= 8, children  # emulators, functions, etcd, apiserver, the pod's trainer...

        down = retrain(["down"], state)
        assert down.returncode == 0, down.stderr
        assert [p for p in children if processes.alive(p)] == []

        up = retrain(["up"], state)
        assert up.returncode == 0, up.stderr
        deadline, ledger = time.monotonic() + 180, stack_ledger(state)  # the new stack's emulator
        while training(ledger, "long"):
            assert time.monotonic() < deadline, runs_of(state, "long")
            time.sleep(1)
        run = runs_of(state, "long")[0]
        assert run["status"] == "failed" and run["reason"].startswith("execution lost"), run
        more = tmp_path / "after.jsonl"
        more.write_text("\n".join(json.dumps({"text": f"after the crash {i}"}) for i in range(10)))
        assert retrain(["drop", str(more), "--dataset", "long"], state).returncode == 0
        assert wait_for_run(state, "long", after=str(run["run_id"]))["nodes_at_end"] == 0
        # nothing lost across the crash: the killed run's content waits for its retry, named as such
        audited = retrain(["audit", "--json", "--settle", "30"], state)
        assert audited.returncode == 0, audited.stdout
        waiting = json.loads(audited.stdout)["waiting"]
        assert [(w["uri"].rsplit("/", 1)[-1], w["run_id"]) for w in waiting] == [
            ("long.jsonl", run["run_id"])
        ]
    finally:
        retrain(["down"], state)
