"""The workflow's steps in Python (retrain.steps, the run_step function) on the ledger's and Cloud
Storage's fakes (the function's own server on the emulators): handover turns the tokenize report into the
trainer's command and JobSet, results turns what the trainer wrote into the record's metrics and checkpoint
and promotes it."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import requests
from fakes.ledger import InMemoryLedger
from fakes.objects import InMemoryObjects
from run_events_support import Told
from stack_support import overwrite_run

from retrain import config
from retrain.contracts import StepName, StepRequest, tokenize_detail_uri
from retrain.domain.errors import PlanError, Rejected
from retrain.domain.events import ObjectVersion
from retrain.domain.runs import Champion, Run, TrainingMetrics
from retrain.domain.transitions import RunPlanned
from retrain.k8s.render import run_account_name
from retrain.plan import estimate, run_root, tokenize_report_uri, training_plan
from retrain.steps import Steps, checkpoint_fingerprint
from retrain.tensorboard import EventWriter
from retrain.trainers import TrainingPlan

#: Shards as the tokenize job names them (``<format>-<sha256>``).
A, B, C = (f"text-{c * 64}" for c in "abc")


@pytest.fixture
def steps(project: str) -> Steps:
    """The steps on the ledger's and Cloud Storage's fakes (``tests/fakes``, held to the real adapters by
    ``tests/test_ledger.py`` and ``tests/ports/test_object_store.py``)."""
    settings = dataclasses.replace(config.load({}), project=project, artifacts_bucket=f"art-{project}")
    store = InMemoryObjects(buckets=[settings.artifacts_bucket, settings.landing_bucket])
    return Steps(settings, InMemoryLedger(), store, Told())


def fake_ledger(steps: Steps) -> InMemoryLedger:
    """The steps' ledger, to store a run record as a test's setup."""
    assert isinstance(steps.ledger, InMemoryLedger)
    return steps.ledger


def new_run(steps: Steps, dataset: str = "news", champion: Champion | None = None) -> dict[str, Any]:
    """A run record in the ledger with the plan its start keeps (the workflow argument's ``training``),
    and that plan."""
    run_id = f"{dataset}-{uuid.uuid4().hex[:8]}"
    run = Run(run_id=run_id, dataset=dataset, trigger="manual", service_account=run_account_name(run_id))
    fake_ledger(steps).put_run(run)
    return keep_plan(steps, run_id, champion, dataset)


def keep_plan(
    steps: Steps, run_id: str, champion: Champion | None = None, dataset: str = ""
) -> dict[str, Any]:
    """The run's plan, kept in its record as its start keeps it (only the part the steps read)."""
    plan = training_plan(steps.settings, run_id, champion, dataset or None).to_dict()
    overwrite_run(steps.ledger, run_id, {"plan": {"run_id": run_id, "training": plan}})
    return plan


def request(step: StepName, plan: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """What the workflow posts: the step and the run, never its plan (the steps read the ledger's)."""
    return {"step": str(step), "run_id": plan["run_id"], **extra}


def write_report(store: InMemoryObjects, plan: dict[str, Any], **override: Any) -> None:
    art = plan["output_dir"].split("/")[2]
    report = {
        "documents": 3,
        "tokens": 900,
        "quarantined": 0,
        "quarantine_reasons": {},
        "quarantined_objects": [],
        "quarantined_object_count": 0,
        "input_records": 3,
        "bytes": 4000,
        "seconds": 1.0,
        "new_objects": 2,
        "reused_objects": 0,
        "tokenized": {},
        "shards_uri": f"{plan['output_dir']}/tokenize_report_shards.json",
        "packs": [
            {
                "data_prefix": f"gs://{art}/shards/{A}/data_text_document",
                "tokens": 1,
                "shards": 1,
                "written": False,
            },
            {
                "data_prefix": f"gs://{art}/shards/{B}/data_text_document",
                "tokens": 3,
                "shards": 1,
                "written": False,
            },
        ],
        "data_prefix_blend": [
            0.25,
            f"gs://{art}/shards/{A}/data_text_document",
            0.75,
            f"gs://{art}/shards/{B}/data_text_document",
        ],
        "tokenizer": {
            "type": "GPT2BPETokenizer",
            "vocab_file": f"gs://{art}/shards/_tokenizer/f/vocab.json",
            "merge_file": f"gs://{art}/shards/_tokenizer/f/merges.txt",
        },
        "held_out": None,
        **override,
    }
    store.write_bytes(f"{plan['output_dir']}/tokenize_report.json", json.dumps(report).encode())


def test_a_run_planned_before_runs_had_accounts_of_their_own_is_refused_at_handover(steps: Steps) -> None:
    """Its workflow opened no account for its pods (the plan named none): a JobSet would ask for an
    account that does not exist, whose pods Kubernetes refuses, while its GPUs wait. Refused first."""
    plan = new_run(steps)
    overwrite_run(steps.ledger, plan["run_id"], {"service_account": None})
    write_report(steps.store, plan)
    with pytest.raises(Rejected, match="planned before runs had service accounts of their own"):
        steps.handle(request(StepName.HANDOVER, plan, callback_url="https://cb/1"))


def test_handover_renders_the_command_from_the_report_and_records_it(steps: Steps) -> None:
    plan = new_run(steps)
    write_report(steps.store, plan)
    answer = steps.handle(request(StepName.HANDOVER, plan, callback_url="https://cb/1"))
    art = steps.settings.artifacts_bucket
    shards = f"/gcs/{art}/shards"
    blend = f"[0.25,{shards}/{A}/data_text_document,0.75,{shards}/{B}/data_text_document]"
    assert f"model.data.data_prefix={blend}" in answer["command"]
    assert f"model.tokenizer.vocab_file=/gcs/{art}/shards/_tokenizer/f/vocab.json" in answer["command"]
    assert not any(a.startswith("model.restore_from_ckpt=") for a in answer["command"])  # a first run
    jobset = answer["jobset"]
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert [*container["command"], *container["args"]] == answer["command"]
    assert jobset["metadata"]["annotations"]["retrain.dev/callback-url"] == "https://cb/1"
    record = steps.ledger.get_run(plan["run_id"])
    assert record is not None and record.command == answer["command"] and record.image == steps.settings.image
    assert record.blend == [
        0.25,
        f"gs://{art}/shards/{A}/data_text_document",
        0.75,
        f"gs://{art}/shards/{B}/data_text_document",
    ]
    assert record.profile == "nemo-24.12"
    pods = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pods["serviceAccountName"] == record.service_account  # the account its workflow made


@pytest.mark.parametrize(
    ("report", "complaint"),
    [
        ({"data_prefix_blend": []}, "empty blend"),
        (
            {"tokenizer": {"type": "HuggingFaceTokenizer", "tokenizer_json": "gs://ART/shards/t.json"}},
            "HuggingFaceTokenizer",
        ),
        # the report is written where trainers write too: it may name only the shard root's objects
        ({"data_prefix_blend": [1.0, "gs://ART/runs/other/ckpt"]}, r"names data outside gs://\S+/shards/"),
        ({"data_prefix_blend": [1.0, "gs://ART/shards/../runs/x"]}, "names data outside"),
        ({"data_prefix_blend": [1.0, "gs://elsewhere/shards/x"]}, "names data outside"),
        (
            {
                "tokenizer": {
                    "type": "GPT2BPETokenizer",
                    "vocab_file": "gs://ART/v.json",
                    "merge_file": "gs://ART/m",
                }
            },
            "names data outside",
        ),
    ],
)
def test_handover_refuses_data_the_trainer_cannot_take(
    steps: Steps, report: dict[str, Any], complaint: str
) -> None:
    plan = new_run(steps)
    art = steps.settings.artifacts_bucket
    write_report(steps.store, plan, **json.loads(json.dumps(report).replace("gs://ART/", f"gs://{art}/")))
    with pytest.raises(Rejected, match=complaint):
        steps.handle(request(StepName.HANDOVER, plan))


def test_handover_without_a_report_says_so(steps: Steps) -> None:
    plan = new_run(steps)
    with pytest.raises(Rejected, match="cannot read the tokenize report"):
        steps.handle(request(StepName.HANDOVER, plan))


def upload_outputs(
    store: InMemoryObjects,
    plan: dict[str, Any],
    tmp_path: Path,
    *,
    events: bool,
    val_loss: float = 3.1,
    base_val: float | None = None,
    planted: dict[int, dict[str, float]] | None = None,
) -> str:
    """What NeMo leaves under <exp_dir>/megatron_gpt for a run of 60 steps from the plan's base step:
    checkpoint folders and (optionally) events; ``base_val`` is the base checkpoint validated on the
    run's data before training (as the local trainer logs it); ``planted`` adds scalars at other steps."""
    run_dir = f"{plan['output_dir']}/megatron_gpt"
    end = plan["base_step"] + 60
    name = f"megatron_gpt--val_loss={val_loss:.2f}-step={end}-consumed_samples={end * 8}.0"
    for folder in (name, f"{name}-last"):
        store.write_bytes(f"{run_dir}/checkpoints/{folder}/common.pt", b"weights")
    if events:
        writer = EventWriter(tmp_path / f"events.out.tfevents.{uuid.uuid4().hex[:6]}.host.1.0")
        if base_val is not None:
            writer.scalars(plan["base_step"], {"val_loss": base_val})
        for step in (plan["base_step"] + 10, end):
            writer.scalars(step, {"reduced_train_loss": 9.0 - step / 10, "consumed_samples": step * 8.0})
        writer.scalars(end, {"val_loss": val_loss})
        for step, values in (planted or {}).items():
            writer.scalars(step, values)
        store.write_bytes(f"{run_dir}/{writer.path.name}", writer.path.read_bytes())
    return f"{run_dir}/checkpoints/{name}-last"


def test_results_record_the_trainers_metrics_and_promote_its_checkpoint(steps: Steps, tmp_path: Path) -> None:
    plan = new_run(steps, "results")
    last = upload_outputs(steps.store, plan, tmp_path, events=True)
    answer = steps.handle(request(StepName.RESULTS, plan))
    assert answer["checkpoint"] == last and answer["promoted"] is True and answer["reason"] == ""
    metrics = answer["metrics"]
    assert metrics == {
        "steps": 60,
        "run_steps": 60,
        "final_loss": 3.0,
        "val_loss": pytest.approx(3.1),
        "consumed_samples": 480,
        "tokens_seen": 480 * steps.settings.seq_length,
        "base_val_loss": None,  # a first run: no base checkpoint to validate
        "outside_plan": 0,
    }
    record = steps.ledger.get_run(plan["run_id"])
    assert record is not None and record.checkpoint == last and record.metrics is not None
    assert record.metrics.to_dict() == answer["metrics"]
    champion = steps.ledger.champion("results")
    fingerprint = checkpoint_fingerprint(steps.store, last)  # the files promoted: a restore checks them
    assert champion == Champion(
        plan["run_id"], last, 60, pytest.approx(3.1), consumed_samples=480, fingerprint=fingerprint
    )
    assert steps.handle(request(StepName.RESULTS, plan))["promoted"] is True  # a retried step: same answer
    # the next run continues from it
    nxt = training_plan(steps.settings, "results-next", champion)
    assert (nxt.base_checkpoint, nxt.base_step, nxt.final_step) == (
        last,
        60,
        60 + steps.settings.steps_per_run,
    )


def test_the_eval_gate_promotes_a_checkpoint_only_when_it_is_not_worse_than_the_champion(
    steps: Steps, tmp_path: Path
) -> None:
    def result(
        val_loss: float, margin: float = 0.0, base_val: float | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        steps.settings = dataclasses.replace(steps.settings, promotion_margin=margin)
        plan = new_run(steps, "gated", steps.ledger.champion("gated"))
        upload_outputs(steps.store, plan, tmp_path, events=True, val_loss=val_loss, base_val=base_val)
        answer = steps.handle(request(StepName.RESULTS, plan))
        record = steps.ledger.get_run(plan["run_id"])
        assert record is not None and record.eval is not None
        return answer, record.eval.to_dict()

    first, first_eval = result(3.1)
    assert first["promoted"] and first_eval["reason"] == "the dataset's first checkpoint"
    champion = steps.ledger.champion("gated")
    assert champion is not None

    worse, worse_eval = result(3.5)
    assert not worse["promoted"] and steps.ledger.champion("gated") == champion  # the next run starts there
    assert worse_eval == {
        "val_loss": pytest.approx(3.5),
        "champion_val_loss": pytest.approx(3.1),
        "champion_run": champion.run_id,
        "compared_on": "the champion's own validation data",
        "promoted": False,
        "reason": "val_loss 3.5000 is worse than the champion's 3.1000 on the champion's own validation data "
        "by more than the margin of 0 (bound 3.1000)",
    }
    # 2% worse, inside a 5% margin: promoted, and the champion moves
    _, within = result(3.162, margin=0.05)
    assert within["promoted"] and within["reason"].endswith(
        "within the margin of the champion's 3.1000 on the champion's own validation data"
    )
    moved = steps.ledger.champion("gated")
    assert moved is not None and moved.run_id != champion.run_id and moved.val_loss == pytest.approx(3.162)

    # The trainer validated the champion on this run's data before training (the local trainer does):
    # that is what the new checkpoint is compared with, not the champion's own (3.162).
    beats_it_here, here = result(3.3, base_val=3.4)
    assert beats_it_here["promoted"] and here["compared_on"] == "this run's validation data"
    assert here["champion_val_loss"] == pytest.approx(3.4) and beats_it_here["metrics"][
        "val_loss"
    ] == pytest.approx(3.3)
    # each promotion told once, with its checkpoint and verdict; the refused checkpoint not at all
    assert isinstance(steps.events, Told)
    told = [e for e in steps.events.events if e.dataset == "gated"]
    assert [str(e.type) for e in told] == ["promoted"] * 3
    assert [e.verdict["reason"] for e in told if e.verdict] == [
        first_eval["reason"],
        within["reason"],
        here["reason"],
    ]
    assert all(e.checkpoint and e.checkpoint.startswith("gs://") for e in told)


def test_a_loss_that_is_not_a_number_never_promotes_and_the_answer_stays_json(
    steps: Steps, tmp_path: Path
) -> None:
    plan = new_run(steps, "nan")
    upload_outputs(steps.store, plan, tmp_path, events=True, val_loss=float("nan"))
    answer = steps.handle(request(StepName.RESULTS, plan))
    json.dumps(answer, allow_nan=False)  # the workflow parses the answer as JSON, which has no NaN
    assert answer["promoted"] is False and answer["metrics"]["val_loss"] is None
    assert steps.ledger.champion("nan") is None  # never a champion, so never a gate that compares nothing
    record = steps.ledger.get_run(plan["run_id"])
    assert record is not None and record.eval is not None
    assert (record.eval.promoted, record.eval.reason) == (
        False,
        "val_loss nan is not a finite number: refused",
    )


def test_scalars_at_steps_outside_the_plan_are_left_out_and_counted(steps: Steps, tmp_path: Path) -> None:
    plan = new_run(steps, "planted")
    planted = {10**12: {"consumed_samples": 1.0, "reduced_train_loss": 0.1}, -5: {"val_loss": 0.01}}
    upload_outputs(steps.store, plan, tmp_path, events=True, planted=planted)
    metrics = steps.handle(request(StepName.RESULTS, plan))["metrics"]
    assert (metrics["steps"], metrics["run_steps"], metrics["outside_plan"]) == (60, 60, 3)
    assert (metrics["consumed_samples"], metrics["final_loss"]) == (480, 3.0)
    # a count no run of this plan could reach (60 steps of 8 sequences from nothing): not the lineage's
    inflated = new_run(steps, "inflated")
    upload_outputs(steps.store, inflated, tmp_path, events=True, planted={60: {"consumed_samples": 1e15}})
    metrics = steps.handle(request(StepName.RESULTS, inflated))["metrics"]
    assert (metrics["consumed_samples"], metrics["tokens_seen"], metrics["outside_plan"]) == (None, None, 1)
    champion = steps.ledger.champion("planted")
    assert champion is not None and champion.step == 60  # the next run trains on from the plan's step


def test_with_an_eval_set_the_champion_is_judged_on_the_same_documents(steps: Steps, tmp_path: Path) -> None:
    def result(val_loss: float) -> dict[str, Any]:
        plan = new_run(steps, "judged", steps.ledger.champion("judged"))
        upload_outputs(steps.store, plan, tmp_path, events=True, val_loss=val_loss)
        steps.handle(request(StepName.RESULTS, plan))
        record = steps.ledger.get_run(plan["run_id"])
        assert record is not None and record.eval is not None
        return record.eval.to_dict()

    result(3.4)  # before the dataset had an eval set: validated on its own split
    eval_set = f"gs://{steps.settings.artifacts_bucket}/eval/judged_text_document"
    steps.settings = dataclasses.replace(steps.settings, eval_sets=f"judged={eval_set}")
    # the champion's loss was on other documents: compared all the same, and the record says so
    assert result(3.3)["compared_on"] == "the champion's own validation data"
    champion = steps.ledger.champion("judged")
    assert champion is not None and champion.eval_set == eval_set  # promoted, judged on the eval set
    on_it = result(3.25)
    assert (on_it["compared_on"], on_it["champion_val_loss"]) == (
        "the dataset's eval set",
        pytest.approx(3.3),
    )
    assert on_it["promoted"] is True


def test_missing_metrics_are_recorded_as_missing_not_as_a_failure(steps: Steps, tmp_path: Path) -> None:
    plan = new_run(steps, "quiet")
    last = upload_outputs(steps.store, plan, tmp_path, events=False)
    answer = steps.handle(request(StepName.RESULTS, plan))
    assert answer["metrics"] is None and answer["checkpoint"] == last
    assert "no TensorBoard events under" in answer["reason"]
    record = steps.ledger.get_run(plan["run_id"])
    assert record is not None and record.reason == answer["reason"] and str(record.status) == "pending"


def test_a_step_reads_the_ledgers_plan_never_the_requests(steps: Steps, tmp_path: Path) -> None:
    """A plan in the request (as earlier releases' workflows send one) is ignored: a forged output_dir
    would have results read, and promote, whatever checkpoint lies there.  A kept plan whose paths are not
    the ones the settings and the run id give (a record written by hand) is refused."""
    victim = new_run(steps, "forged")
    upload_outputs(steps.store, victim, tmp_path, events=True)
    forger = new_run(steps, "forged")
    forged = {**forger, "output_dir": victim["output_dir"]}
    answer = steps.handle({**request(StepName.RESULTS, forger), "training": forged})
    assert answer["metrics"] is None and answer["promoted"] is False  # its own folder: nothing trained
    assert steps.ledger.champion("forged") is None
    overwrite_run(steps.ledger, forger["run_id"], {"plan": {"training": forged}})
    with pytest.raises(Rejected, match=r"kept plan is run \S+'s, writing to " + forged["output_dir"]):
        steps.handle(request(StepName.RESULTS, forger))
    assert steps.ledger.champion("forged") is None


def test_a_step_of_a_run_with_no_kept_plan_is_rejected(steps: Steps) -> None:
    with pytest.raises(Rejected, match="run nobody-1 has no plan in the ledger"):
        steps.handle({"step": "handover", "run_id": "nobody-1"})


def test_malformed_requests_are_rejected_with_the_reason() -> None:
    for body, complaint in (
        ([], "JSON object"),
        ({"step": "train", "run_id": "r", "training": {}}, "unknown step"),
        ({"step": "results"}, "run_id .* is required"),
        ({"step": "results", "run_id": "r", "training": {}, "extra": 1}, "unknown field"),
    ):
        with pytest.raises(Rejected, match=complaint):
            StepRequest.parse(body)


@pytest.mark.emulators
def test_the_function_answers_400_with_the_reason(serve_function: Any) -> None:
    fn = serve_function("run_step", signature="http")
    bad = requests.post(
        fn.url, json={"step": "handover", "run_id": "r1", "training": {"run_id": "r1"}}, timeout=30
    )
    assert bad.status_code == 400 and "run r1 has no plan in the ledger" in bad.json()["error"]
    assert requests.get(fn.url, timeout=30).status_code == 405


def test_finish_gives_a_failed_runs_content_back_and_a_successful_ones_never(steps: Steps) -> None:
    from retrain.domain.events import ObjectArrival

    ledger = steps.ledger
    for name in ("a", "b"):
        event = ObjectArrival(
            f"ev-{name}", "land", f"in/{name}.txt", 1, 9, f"m-{name}", "2026-11-24T00:00:00Z"
        )
        ledger.record_arrival(event, "fin", f"h-{name}")
    run = ledger.seal("fin", "manual").run
    assert run is not None
    plan = keep_plan(steps, run.run_id)
    overwrite_run(ledger, run.run_id, {"status": "training"})
    assert steps.handle(request(StepName.FINISH, plan)) == {"returned": 0}  # not ended: nothing yet
    overwrite_run(ledger, run.run_id, {"status": "failed"})
    assert steps.handle(request(StepName.FINISH, plan)) == {"returned": 2}
    assert steps.handle(request(StepName.FINISH, plan)) == {"returned": 0}  # a retried step
    assert ledger.pending("fin") == []  # eligible again, but nothing re-runs by itself
    # its OpenLineage events, kept in its folder (retrain.lineage): what it read, and how it ended
    lineage = json.loads(steps.store.read_bytes(f"{plan['output_dir']}/openlineage.json"))
    assert [e["eventType"] for e in lineage] == ["START", "RUNNING", "FAIL"]
    assert [d["name"] for d in lineage[1]["inputs"]] == ["in/a.txt", "in/b.txt"]  # read back, given back

    ledger.record_arrival(
        ObjectArrival("ev-c", "land", "in/c.txt", 1, 9, "m-c", "2026-11-24T00:00:00Z"), "fin", "h-c"
    )
    good = ledger.seal("fin", "manual").run
    assert good is not None and good.run_id != run.run_id
    overwrite_run(ledger, good.run_id, {"status": "succeeded"})
    good_plan = keep_plan(steps, good.run_id)
    assert steps.handle(request(StepName.FINISH, good_plan)) == {"returned": 0}
    assert [v.uri for v in ledger.run_objects(good)] == ["gs://land/in/c.txt"]  # still held: trained
    good_lineage = json.loads(steps.store.read_bytes(f"{good_plan['output_dir']}/openlineage.json"))
    assert good_lineage[-1]["eventType"] == "COMPLETE"

    # an execution that failed after promoting (its release failed): the champion holds that content,
    # so giving it back would train it twice
    ledger.record_arrival(
        ObjectArrival("ev-d", "land", "in/d.txt", 1, 9, "m-d", "2026-11-24T00:00:00Z"), "fin", "h-d"
    )
    promoted = ledger.seal("fin", "manual").run
    assert promoted is not None
    overwrite_run(ledger, promoted.run_id, {"status": "failed", "eval": {"promoted": True, "reason": "r"}})
    promoted_plan = keep_plan(steps, promoted.run_id)
    assert steps.handle(request(StepName.FINISH, promoted_plan)) == {"returned": 0}
    assert [v.uri for v in ledger.run_objects(promoted)] == ["gs://land/in/d.txt"]


@pytest.mark.parametrize(
    "value",
    [
        "judged=gs://elsewhere/eval/x_text_document",  # not the artifacts bucket the pods mount
        "judged=gs://retrain-artifacts/shards/x_text_document",  # not under eval/
        "Bad_Name=gs://retrain-artifacts/eval/x_text_document",  # not a dataset name
        "judged=gs://retrain-artifacts/eval/",  # no dataset named
    ],
)
def test_an_eval_set_outside_the_artifacts_buckets_eval_folder_is_refused(value: str) -> None:
    settings = config.load({"RETRAIN_EVAL_SETS": value})
    with pytest.raises(
        ValueError, match=r"RETRAIN_EVAL_SETS: .* is not DATASET=gs://retrain-artifacts/eval/"
    ):
        _ = settings.eval_set_of


def test_a_megatron_bridge_run_is_handed_over_read_and_promoted_in_bridges_terms(
    steps: Steps, tmp_path: Path
) -> None:
    """The dataset's profile renders the handover (Bridge's run_recipe.py in the bridge image); its
    results are read from Bridge's layout (iter_NNNNNNN checkpoints, ``lm loss`` tags) at lineage steps,
    and the champion remembers its profile, so the next run continues in Bridge's terms."""
    steps.settings = dataclasses.replace(steps.settings, profiles="other=nemo-24.12,bridged=megatron-bridge")
    base = Champion("old", "gs://x/runs/old/checkpoints/iter_0000040", 40, 3.5, None, "megatron-bridge", 320)
    steps.ledger.promote("bridged", base)
    plan = new_run(steps, "bridged", base)
    assert plan["profile"] == "megatron-bridge"
    write_report(steps.store, plan)
    answer = steps.handle(request(StepName.HANDOVER, plan))
    assert "/opt/Megatron-Bridge/scripts/training/run_recipe.py" in answer["command"]
    assert "checkpoint.pretrained_checkpoint=/gcs/x/runs/old/checkpoints/iter_0000040" in answer["command"]
    record = steps.ledger.get_run(plan["run_id"])
    assert record is not None and record.image == steps.settings.bridge_image == "nvcr.io/nvidia/nemo:26.08"
    assert record.profile == "megatron-bridge"

    out = plan["output_dir"]
    for folder in ("iter_0000030", "iter_0000060"):
        steps.store.write_bytes(f"{out}/checkpoints/{folder}/common.pt", b"weights")
    steps.store.write_bytes(f"{out}/checkpoints/latest_checkpointed_iteration.txt", b"60")
    writer = EventWriter(tmp_path / f"events.out.tfevents.{uuid.uuid4().hex[:6]}.host.1.0")
    writer.scalars(0, {"lm loss validation": 3.4})  # the base, validated on this run's data
    for step in (30, 60):
        writer.scalars(step, {"lm loss": 4.0 - step / 60})
        writer.scalars(step * 8, {"lm loss vs samples": 4.0 - step / 60})
    writer.scalars(60, {"lm loss validation": 3.0})
    steps.store.write_bytes(f"{out}/tb_logs/{writer.path.name}", writer.path.read_bytes())
    answer = steps.handle(request(StepName.RESULTS, plan))
    assert answer["checkpoint"] == f"{out}/checkpoints/iter_0000060" and answer["promoted"] is True
    assert answer["metrics"] == {
        "steps": 100,  # Bridge counted 60 from 0; the base was at 40
        "run_steps": 60,
        "final_loss": 3.0,
        "val_loss": 3.0,
        "consumed_samples": 800,  # the lineage's: the base's 320 and Bridge's own count of 480 from 0
        "tokens_seen": 800 * steps.settings.seq_length,
        "base_val_loss": pytest.approx(3.4),
        "outside_plan": 0,
    }
    champion = steps.ledger.champion("bridged")
    promoted = f"{out}/checkpoints/iter_0000060"
    assert champion == Champion(
        plan["run_id"],
        promoted,
        100,
        3.0,
        None,
        "megatron-bridge",
        800,
        checkpoint_fingerprint(steps.store, promoted),
    )
    # the same dataset under NeMo's profile cannot continue from a Bridge checkpoint
    steps.settings = dataclasses.replace(steps.settings, profiles="")
    with pytest.raises(
        PlanError, match=r"written by the megatron-bridge profile, and nemo-24.12 cannot continue"
    ):
        training_plan(steps.settings, "bridged-next", champion, "bridged")


def _landed(steps: Steps, name: str, body: bytes) -> ObjectVersion:
    """An object in the landing bucket, and its version as its arrival records it."""
    from retrain.domain.events import ObjectArrival

    uri = f"gs://{steps.settings.landing_bucket}/incoming/back/{name}"
    steps.store.write_bytes(uri, body)
    info = steps.store.stat(uri)
    event = ObjectArrival(
        f"ev-{uuid.uuid4()}",
        steps.settings.landing_bucket,
        uri.split("/", 3)[3],
        int(info.generation or 0),
        info.size,
        info.md5_hash or "",
        "2026-11-26T00:00:00Z",
    )
    steps.ledger.record_arrival(event, "back", event.content_hash)
    return event.version


def test_a_run_that_succeeded_gives_back_what_it_could_not_read(steps: Steps) -> None:
    """Its tokenize job set an object aside whole (gone since it arrived): that content never trained, so
    it goes back, and a copy of those bytes under another name (skipped as held) arrives again."""
    gone = _landed(steps, f"gone-{uuid.uuid4().hex}.txt", b"bytes that were overwritten")
    read = _landed(steps, f"read-{uuid.uuid4().hex}.txt", b"bytes that trained")
    run = steps.ledger.seal("back", "manual").run
    assert run is not None
    copy = _landed(steps, f"copy-{uuid.uuid4().hex}.txt", b"bytes that were overwritten")  # held: skipped
    assert steps.ledger.seal("back", "manual").verdict == "nothing-new"
    steps.store.write_bytes(gone.uri, b"other bytes now")
    quarantined = [
        {"object": gone.uri, "generation": gone.generation, "reason": "object_changed", "detail": ""}
    ]
    overwrite_run(steps.ledger, run.run_id, {"status": "succeeded", "quarantined_objects": quarantined})
    plan = keep_plan(steps, run.run_id)
    assert steps.handle(request(StepName.FINISH, plan)) == {"returned": 1}
    assert steps.handle(request(StepName.FINISH, plan)) == {"returned": 0}  # a retried step
    after = steps.ledger.get_run(run.run_id)
    assert after is not None and (after.returned_untrained, after.content_returned) == (1, False)
    assert [v.uri for v in steps.ledger.run_objects(after)] == [read.uri]  # what it read stays trained
    again = steps.ledger.seal("back", "manual").run  # the copy arrived again: it trains now
    assert again is not None and [v.uri for v in steps.ledger.run_objects(again)] == [copy.uri]


def test_every_object_set_aside_goes_back_also_past_the_hundred_the_record_names(steps: Steps) -> None:
    """The report (which the workflow reads into a variable) and the run record name the first 100
    objects set aside whole; the report's detail object names all of them, and all go back."""
    landed = [
        _landed(steps, f"aside-{i:03d}-{uuid.uuid4().hex}.txt", f"set aside {i}".encode()) for i in range(150)
    ]
    run = steps.ledger.seal("back", "manual").run
    assert run is not None
    aside = [
        {"object": v.uri, "generation": v.generation, "reason": "unreadable", "detail": ""} for v in landed
    ]
    report = tokenize_report_uri(run_root(steps.settings, run.run_id))
    steps.store.write_bytes(
        tokenize_detail_uri(report), json.dumps({"shards": [], "quarantined_objects": aside}).encode()
    )
    fields = {"status": "succeeded", "quarantined_objects": aside[:100], "quarantined_object_count": 150}
    overwrite_run(steps.ledger, run.run_id, fields)
    plan = keep_plan(steps, run.run_id)
    assert steps.handle(request(StepName.FINISH, plan)) == {"returned": 150}
    after = steps.ledger.get_run(run.run_id)
    assert after is not None and after.returned_untrained == 150 and not steps.ledger.run_objects(after)


def test_a_run_that_failed_after_its_checkpoint_was_promoted_keeps_its_content(steps: Steps) -> None:
    _landed(steps, f"p-{uuid.uuid4().hex}.txt", b"promoted bytes")
    run = steps.ledger.seal("back", "manual").run
    assert run is not None
    overwrite_run(steps.ledger, run.run_id, {"status": "failed", "eval": {"promoted": True}})
    plan = keep_plan(steps, run.run_id)
    assert steps.handle(request(StepName.FINISH, plan)) == {"returned": 0}  # it is in the champion
    assert len(steps.ledger.run_objects(run)) == 1


def test_a_champion_rewritten_since_its_promotion_is_never_restored(steps: Steps, tmp_path: Path) -> None:
    """A checkpoint unpickles: one rewritten in place (by anyone who can write under runs/) must not be
    loaded by the next run. Its files' generations were recorded at promotion; the handover checks them."""
    first = new_run(steps, "guarded")
    last = upload_outputs(steps.store, first, tmp_path, events=True)
    assert steps.handle(request(StepName.RESULTS, first))["promoted"] is True
    champion = steps.ledger.champion("guarded")
    assert champion is not None and champion.fingerprint

    unchanged = new_run(steps, "guarded", champion)
    write_report(steps.store, unchanged)
    steps.handle(request(StepName.HANDOVER, unchanged))  # restores it: its files are as promoted

    steps.store.write_bytes(f"{last}/common.pt", b"weights, rewritten")  # same bytes' name, a new generation
    rewritten = new_run(steps, "guarded", champion)
    write_report(steps.store, rewritten)
    with pytest.raises(Rejected, match=f"the champion checkpoint {last} changed since it was promoted"):
        steps.handle(request(StepName.HANDOVER, rewritten))

    elsewhere = dataclasses.replace(champion, checkpoint=f"{last}-planted")  # not the ledger's champion
    forged = new_run(steps, "guarded", elsewhere)
    write_report(steps.store, forged)
    with pytest.raises(Rejected, match="is not the dataset's champion"):
        steps.handle(request(StepName.HANDOVER, forged))


def claimed_run(steps: Steps) -> tuple[str, str]:
    """A sealed run whose start Ingest claimed and whose plan it kept: (run id, the claim's token)."""
    from retrain.domain.events import ObjectArrival

    ledger = steps.ledger
    dataset = f"begin{uuid.uuid4().hex[:6]}"
    ledger.record_arrival(
        ObjectArrival("ev", "land", "in/a.txt", 1, 10, "m", "2026-11-27T00:00:00Z"), dataset, "h"
    )
    run = ledger.seal(dataset, "manual").run
    assert run is not None
    claim = ledger.claim_start(run, stale_after_s=60)
    assert ledger.record_claimed(
        run.run_id, claim.token, RunPlanned({"run_id": run.run_id, "dataset": dataset})
    )
    return run.run_id, claim.token


def begin(steps: Steps, run_id: str, claim: str, execution: str) -> dict[str, Any]:
    return steps.handle({"step": "begin", "run_id": run_id, "claim": claim, "execution": execution})


def test_begin_hands_the_ledgers_plan_to_the_claims_execution_alone(steps: Steps) -> None:
    """The execution argument names a run and a claim; the plan comes from the ledger, and only the
    first execution under the run's current claim gets it (retried, it gets it again)."""
    run_id, claim = claimed_run(steps)
    assert begin(steps, run_id, "forged", "e-0") == {
        "plan": None,
        "reason": f"run {run_id} is another execution's (its start claim is not this one's)",
    }
    answer = begin(steps, run_id, claim, "e-1")
    assert answer == {"plan": {"run_id": run_id, "dataset": answer["plan"]["dataset"]}, "reason": ""}
    assert begin(steps, run_id, claim, "e-1") == answer  # http.default_retry after a lost answer
    assert begin(steps, run_id, claim, "e-2")["plan"] is None  # a second execution of the same claim
    s = steps.settings
    run = steps.ledger.get_run(run_id)
    assert run is not None
    assert run.execution == f"projects/{s.project}/locations/{s.region}/workflows/{s.workflow}/executions/e-1"
    overwrite_run(steps.ledger, run_id, {"status": "cancelled"})
    assert begin(steps, run_id, claim, "e-1") == {
        "plan": None,
        "reason": f"run {run_id} is cancelled, not pending",
    }
    assert begin(steps, "nobody", claim, "e-1") == {"plan": None, "reason": "no run nobody in the ledger"}


@pytest.mark.parametrize(
    ("body", "refusal"),
    [
        ({"step": "begin", "run_id": "r", "execution": "e"}, "begin: claim (a string) is required"),
        ({"step": "begin", "run_id": "r", "claim": "c"}, "begin: execution (the execution's id) is required"),
        (
            {"step": "begin", "run_id": "r", "claim": "c", "execution": "../e"},
            "execution (the execution's id)",
        ),
        ({"step": "handover", "training": {}}, "run_id (a string) is required"),
    ],
)
def test_a_malformed_begin_is_refused_with_the_reason(body: dict[str, Any], refusal: str) -> None:
    with pytest.raises(Rejected, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        StepRequest.parse(body)


def test_a_cancel_is_the_ledgers_never_the_callbacks(steps: Steps) -> None:
    """A Cancelled callback only wakes the workflow: the cancel step answers the request retrain cancel
    recorded (who asked and why), the first one standing; without one (a callback forged by whoever may
    send callbacks) it answers none and the run goes on; a run that ended takes no request."""
    run_id, _ = claimed_run(steps)
    assert steps.handle({"step": "cancel", "run_id": run_id}) == {"requested_by": None, "reason": ""}
    assert steps.ledger.request_cancel(run_id, "alice@example.com", "wrong data")
    assert steps.ledger.request_cancel(run_id, "mallory@example.com", "")  # taken, and changes nothing
    answer = steps.handle({"step": "cancel", "run_id": run_id})
    assert answer == {"requested_by": "alice@example.com", "reason": "wrong data"}
    assert steps.handle({"step": "cancel", "run_id": "nobody"}) == {"requested_by": None, "reason": ""}
    other, _ = claimed_run(steps)
    overwrite_run(steps.ledger, other, {"status": "succeeded"})
    assert not steps.ledger.request_cancel(other, "alice@example.com", "too late")
    assert not steps.ledger.request_cancel("nobody", "alice@example.com", "no such run")
    ended = steps.ledger.get_run(other)
    assert ended is not None and ended.cancel_requested_by is None


def carve(store: InMemoryObjects, plan: dict[str, Any], members: list[str], held_out_for: str) -> str:
    """A held-out set as a run's tokenize job writes it: a pack under the shard root, marked as the
    carving run's in its ``_pack.json``; its data prefix."""
    art = plan["output_dir"].split("/")[2]
    prefix = f"gs://{art}/shards/eval-{uuid.uuid4().hex * 2}/data_text_document"
    body = {"data_prefix": prefix, "tokens": 5, "members": members, "held_out_for": held_out_for}
    store.write_bytes(prefix + "_pack.json", json.dumps(body).encode())
    return prefix


def test_a_carved_eval_set_validates_the_run_and_every_later_one(steps: Steps, tmp_path: Path) -> None:
    """A dataset without an eval set: its run's tokenize job holds objects out (the report's held_out).
    Handover validates the run on them and records it; results judges on them and records them on the
    champion; the dataset's next run validates there too and carves nothing."""
    from retrain.plan import hold_out_objects

    plan = new_run(steps, "carved")
    assert hold_out_objects(steps.settings, TrainingPlan.parse(plan), 40) == 2  # 5% of 40
    art = steps.settings.artifacts_bucket
    carved = carve(steps.store, plan, [f"gs://{art}/shards/{C}/data_text_document"], plan["run_id"])
    write_report(steps.store, plan, held_out={"data_prefix": carved, "tokens": 5, "shards": 1})
    answer = steps.handle(request(StepName.HANDOVER, plan))
    (data,) = [a for a in answer["command"] if a.startswith("model.data.data_prefix=")]
    held = f"[1.0,{carved.replace('gs://', '/gcs/')}]"
    assert data.endswith(f",validation:{held},test:{held}}}") and "/eval-" not in data.split("validation")[0]
    record = steps.ledger.get_run(plan["run_id"])
    assert record is not None and record.eval_set == carved

    upload_outputs(steps.store, plan, tmp_path, events=True, val_loss=3.1)
    assert steps.handle(request(StepName.RESULTS, plan))["promoted"] is True  # its plan still has none
    champion = steps.ledger.champion("carved")
    assert champion is not None and champion.eval_set == carved
    nxt = training_plan(steps.settings, "carved-next", champion, "carved")
    assert nxt.eval_set == carved and hold_out_objects(steps.settings, nxt, 40) == 0
    # a later run whose report trains on the dataset's eval set is refused
    later = new_run(steps, "carved", champion)
    assert later["eval_set"] == carved
    write_report(
        steps.store, later, data_prefix_blend=[0.5, carved, 0.5, f"gs://{art}/shards/{A}/data_text_document"]
    )
    with pytest.raises(Rejected, match="blend trains on its eval set's data"):
        steps.handle(request(StepName.HANDOVER, later))


@pytest.mark.parametrize(
    ("held", "complaint"),
    [
        ("gs://ART/runs/x/data", "names data outside"),
        (f"gs://ART/shards/{A}/data_text_document/", "in no form it writes"),  # the mount reads it as A
        (f"gs://ART/shards//{A}/data_text_document", "in no form it writes"),
        (f"gs://ART/shards/{C}/data_text_document", "did not carve"),  # a shard an earlier run trained
        ("ANOTHER_RUNS", "did not carve"),
        ("UNCOMMITTED", "has no _pack.json"),
    ],
)
def test_a_held_out_set_the_runs_job_did_not_carve_is_refused(
    steps: Steps, held: str, complaint: str
) -> None:
    """The report lies where trainers write: a held-out set is taken only in the form the job writes,
    under the shard root, and marked (where only the job writes) as this run's."""
    plan = new_run(steps)
    art = steps.settings.artifacts_bucket
    if held == "ANOTHER_RUNS":
        held = carve(steps.store, plan, [f"gs://{art}/shards/{C}/data_text_document"], "another-run")
    elif held == "UNCOMMITTED":
        held = f"gs://{art}/shards/eval-{'d' * 64}/data_text_document"
    write_report(
        steps.store, plan, held_out={"data_prefix": held.replace("ART", art), "tokens": 1, "shards": 1}
    )
    with pytest.raises(Rejected, match=complaint):
        steps.handle(request(StepName.HANDOVER, plan))


def test_a_held_out_set_that_the_blend_trains_on_is_refused(steps: Steps) -> None:
    """Even one the run's job marked: its members and the blend's (a pack's, from its _pack.json) are
    apart."""
    plan = new_run(steps)
    art = steps.settings.artifacts_bucket
    pack = f"gs://{art}/shards/pack-{'f' * 64}/data_text_document"
    member = f"gs://{art}/shards/{C}/data_text_document"
    steps.store.write_bytes(pack + "_pack.json", json.dumps({"members": [member, "gs://x/other"]}).encode())
    held = carve(steps.store, plan, [member], plan["run_id"])
    write_report(
        steps.store,
        plan,
        data_prefix_blend=[1.0, pack],
        held_out={"data_prefix": held, "tokens": 1, "shards": 1},
    )
    with pytest.raises(Rejected, match="blend trains on its eval set's data"):
        steps.handle(request(StepName.HANDOVER, plan))


def test_a_configured_eval_set_is_never_read_at_handover(
    steps: Steps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The functions may not read ``eval/`` (no grant there): handover checks a configured eval set by name,
    reading only the packs' and held-out sets' marks under the shard root."""
    eval_set = f"gs://{steps.settings.artifacts_bucket}/eval/fixed_text_document"
    steps.settings = dataclasses.replace(steps.settings, eval_sets=f"fixed={eval_set}")
    plan = new_run(steps, "fixed")
    assert plan["eval_set"] == eval_set
    write_report(steps.store, plan)
    read = steps.store.read_bytes
    seen: list[str] = []

    def guarded(uri: str, *args: Any) -> bytes:
        seen.append(uri)
        if "/eval/" in uri:
            raise PermissionError(f"403: {uri}")
        return read(uri, *args)

    monkeypatch.setattr(steps.store, "read_bytes", guarded)
    answer = steps.handle(request(StepName.HANDOVER, plan))
    mounted = eval_set.replace("gs://", "/gcs/")
    assert any(a.endswith(f"validation:[1.0,{mounted}],test:[1.0,{mounted}]}}") for a in answer["command"])
    assert seen == [f"{plan['output_dir']}/tokenize_report.json"]


def test_the_account_step_prices_node_time_as_the_estimate_does(steps: Steps) -> None:
    """One formula: a run's observed node time is priced at its end, at its plan's price and GPUs per node,
    exactly as ``retrain plan`` estimates a run measured at that node time (``node_cost_usd``)."""
    plan = new_run(steps, "priced")
    price, gpus = 88.49, 8
    kept = {"run_id": plan["run_id"], "training": plan, "price_per_node_hour": price, "gpus_per_node": gpus}
    overwrite_run(steps.ledger, plan["run_id"], {"plan": kept})
    answer = steps.handle({"step": "account", "run_id": plan["run_id"], "gpu_node_seconds": 5400})
    assert answer == {"gpu_hours": 12.0, "cost_usd": pytest.approx(1.5 * price)}
    settings = dataclasses.replace(steps.settings, price_per_node_hour=price)
    metrics = TrainingMetrics(settings.steps_per_run, settings.steps_per_run, 1.0, 1.0, None, None)
    measured = Run(run_id="m", dataset="priced", trigger="manual", gpu_node_seconds=5400.0, metrics=metrics)
    assert estimate(settings, measured).cost_usd == pytest.approx(answer["cost_usd"])


@pytest.mark.parametrize("seconds", [None, -1, "5400", True, 1e12])
def test_an_account_step_without_node_seconds_is_refused(seconds: Any) -> None:
    body = {"step": "account", "run_id": "r", **({} if seconds is None else {"gpu_node_seconds": seconds})}
    with pytest.raises(Rejected, match=r"account: gpu_node_seconds \(a number of seconds, 0 or more\)"):
        StepRequest.parse(body)


def test_an_account_step_of_a_run_with_no_kept_plan_is_refused(steps: Steps) -> None:
    with pytest.raises(Rejected, match="run nobody-2 has no plan in the ledger with a price"):
        steps.handle({"step": "account", "run_id": "nobody-2", "gpu_node_seconds": 60})
