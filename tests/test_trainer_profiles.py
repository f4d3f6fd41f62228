"""Two trainer profiles from one run plan: the megatron-bridge command, checked against Megatron-Bridge's
own config types (extracted from the pinned release), and the choice of profile per dataset."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Any

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from retrain import config
from retrain.domain.runs import Champion, Run
from retrain.k8s.render import GcsMounts, example_plan
from retrain.plan import training_plan, workflow_argument
from retrain.tensorboard import Scalar
from retrain.trainers import BatchShape, Command, PlanError, TrainingPlan, _verdict, check, profile
from retrain.trainers.hydra import hydra_string
from retrain.trainers.megatron_bridge import (
    CONFIG_FILE,
    MEGATRON_BRIDGE,
    RELEASE,
    RUN_RECIPE,
    compose,
    read_launch,
    schema,
)

#: run_recipe.py's docstring, "Common ConfigContainer overrides" (Megatron-Bridge v0.6.0,
#: scripts/training/run_recipe.py): the convenience flag and the override it stands for.  The profile
#: writes the overrides themselves; each is one a reader finds in this table.
DOCUMENTED = {
    "--max_steps": "train.train_iters",
    "--global_batch_size": "train.global_batch_size",
    "--micro_batch_size": "train.micro_batch_size",
    "--seq_length": "dataset.seq_length",
    "--tensor_model_parallel_size": "model.tensor_model_parallel_size",
    "--pipeline_model_parallel_size": "model.pipeline_model_parallel_size",
    "--warmup_iters": "scheduler.lr_warmup_iters",
    "--pretrained_checkpoint": "checkpoint.pretrained_checkpoint",
    "--save_dir": "checkpoint.save",
    "--load_dir": "checkpoint.load",
    "--save_interval": "checkpoint.save_interval",
}


def bridge_plan(**changes: Any) -> TrainingPlan:
    return dataclasses.replace(example_plan(), profile="megatron-bridge", **changes)


def render(plan: TrainingPlan) -> Command:
    return MEGATRON_BRIDGE.render(plan, GcsMounts().path)


def overrides(command: Command) -> dict[str, str]:
    return dict(a.split("=", 1) for a in read_launch(command.args).overrides)


def test_the_vendored_config_is_the_pinned_releases_recipe() -> None:
    body = json.loads(CONFIG_FILE.read_text())
    assert body["release"] == RELEASE == "0.6.2"
    assert (body["recipe"], body["dataset"]) == ("vanilla_gpt_pretrain_config", "megatron-indexed")
    # the recipe as the NeMo Framework image builds it: run_recipe.py chdirs to the checkout first
    assert body["config"]["checkpoint"]["save"] == "/opt/Megatron-Bridge/nemo_experiments/default/checkpoints"
    assert body["config"]["model"]["num_layers"] == 0  # the vanilla recipe leaves the model to the command


def test_the_command_runs_run_recipe_under_torchrun_with_the_plans_world() -> None:
    plan = bridge_plan(shape=BatchShape(nodes=2, gpus_per_node=8, micro_batch_size=2, global_batch_size=64))
    command = render(plan)
    assert (
        command.command[:2] == ["bash", "-c"]
        and 'exec torchrun --node-rank="${NODE_RANK}"' in command.command[2]
    )
    script = command.args.index(RUN_RECIPE)
    assert command.args[:script] == ["--nnodes=2", "--nproc-per-node=8"]
    assert command.args[script + 1 : script + 7] == [
        "--recipe",
        "vanilla_gpt_pretrain_config",
        "--mode",
        "pretrain",
        "--dataset",
        "megatron-indexed",
    ]
    MEGATRON_BRIDGE.validate(command)
    given = overrides(command)
    assert given["train.global_batch_size"] == "64" and given["train.micro_batch_size"] == "2"
    assert given["train.train_iters"] == str(
        plan.steps
    )  # Bridge restarts the count from a pretrained checkpoint
    out = "/gcs/retrain-artifacts/runs/" + plan.run_id
    assert given["checkpoint.save"] == given["checkpoint.load"] == f"{out}/checkpoints"
    base = plan.base_checkpoint
    assert base and given["checkpoint.pretrained_checkpoint"] == hydra_string(base.replace("gs://", "/gcs/"))
    prefixes = [p for p in plan.blend if isinstance(p, str)]
    assert given["dataset.data_path"].startswith("[") and all(
        p.replace("gs://", "/gcs/") in given["dataset.data_path"] for p in prefixes
    )
    assert given["tokenizer.tokenizer_type"] == "GPT2BPETokenizer"
    assert plan.tokenizer and given["tokenizer.vocab_file"] == plan.tokenizer.vocab_file.replace(
        "gs://", "/gcs/"
    )


def test_every_override_is_a_field_of_bridges_config_of_the_type_it_declares() -> None:
    command = render(bridge_plan(eval_set="gs://retrain-artifacts/eval/held_text_document"))
    given = overrides(command)
    types = schema()["types"]
    assert set(given) <= set(types), set(given) - set(types)
    cfg = compose(read_launch(command.args).overrides)
    from omegaconf import OmegaConf

    for key in given:
        value = OmegaConf.to_container(cfg, resolve=True)
        for part in key.split("."):
            value = value[part]  # type: ignore[index]
        kinds = types[key]["kinds"]
        kind = {bool: "bool", int: "int", float: "float", str: "str", list: "list", type(None): "null"}[
            type(value)
        ]
        assert kind in kinds, (key, value, kinds)
    # the documented overrides, by the names run_recipe.py's own table gives them
    assert set(DOCUMENTED.values()) <= set(given), set(DOCUMENTED.values()) - set(given)


@pytest.mark.parametrize(
    ("extra", "refusal"),
    [
        ("train.train_iterz=10", "Could not override 'train.train_iterz'"),
        (
            "train.train_iters=ten",
            "override train.train_iters='ten': a str, where Bridge's field is int | null",
        ),
        ("checkpoint.ckpt_format=zarr", "not one of ['torch', 'torch_dist', 'torch_dcp', 'fsdp_dtensor']"),
        ("+train.iterations=10", "override +train.iterations: not a field of Bridge's config"),
        ("dataset.split=9,1,0", "Failed to parse Hydra overrides"),  # a comma is a sweep to Hydra
        ("--max_steps=3", "run_recipe.py: Unknown option: --max_steps=3"),
        ("dataset.data_path=null", "dataset.data_path is not set: megatron-core would train on mock data"),
        ("checkpoint.load=/gcs/elsewhere", "checkpoint.save and checkpoint.load must be the run's folder"),
    ],
)
def test_what_bridge_would_refuse_or_run_wrongly_is_refused(extra: str, refusal: str) -> None:
    command = render(bridge_plan())
    bad = Command(command.command, [*command.args, extra])
    with pytest.raises(PlanError) as e:
        MEGATRON_BRIDGE.validate(bad)
    assert refusal in str(e.value)


def test_impossible_batch_math_is_refused_before_capacity() -> None:
    plan = bridge_plan(shape=BatchShape(nodes=1, gpus_per_node=8, micro_batch_size=1, global_batch_size=12))
    with pytest.raises(
        PlanError, match=r"global batch size 12 is not divisible by micro batch size 1 x data"
    ):
        render(plan)
    # and through the run's start, which asks for no capacity then
    settings = dataclasses.replace(config.load({}), profile="megatron-bridge", global_batch_size=12)
    with pytest.raises(PlanError, match="global batch size 12 is not divisible"):
        workflow_argument(settings, Run(run_id="r-1", dataset="news", trigger="manual"), None)
    # a command whose torchrun world the config's batch does not divide, written by hand
    command = render(bridge_plan())
    args = ["--nnodes=1", "--nproc-per-node=3", *command.args[2:]]
    with pytest.raises(
        PlanError, match="global batch size 16 is not divisible by micro batch size 1 x data-parallel size 3"
    ):
        MEGATRON_BRIDGE.validate(Command(command.command, args))


def test_an_eval_set_is_megatron_cores_blend_per_split() -> None:
    command = render(bridge_plan(eval_set="gs://retrain-artifacts/eval/held_text_document"))
    given = overrides(command)
    held = "[[/gcs/retrain-artifacts/eval/held_text_document],null]"
    assert given["dataset.split"] == "null" and "dataset.data_path" not in given
    # no test split: Bridge would log its end-of-run test loss under the validation tag
    assert given["dataset.blend_per_split"].endswith(f",{held},null]")
    cfg = compose(read_launch(command.args).overrides)
    train, validation, test = cfg.dataset.blend_per_split
    assert list(validation[0]) == ["/gcs/retrain-artifacts/eval/held_text_document"] and test is None
    assert len(train[0]) == len(train[1]) == len(example_plan().blend) // 2


def test_results_are_read_in_bridges_layout_at_lineage_steps() -> None:
    plan = bridge_plan(base_step=40, base_consumed_samples=320)
    names = ["iter_0000030", "iter_0000060", "latest_checkpointed_iteration.txt"]
    assert MEGATRON_BRIDGE.final_checkpoint(names) == "iter_0000060"
    assert MEGATRON_BRIDGE.final_checkpoint(["latest_train_state.pt"]) is None
    scalars = [
        Scalar("lm loss validation", 0, 3.5, 0.0),
        Scalar("lm loss", 60, 3.0, 0.0),
        Scalar("lm loss vs samples", 480, 3.0, 0.0),
        Scalar("learning-rate", 60, 1e-4, 0.0),
    ]
    lineage = MEGATRON_BRIDGE.lineage_scalars(scalars, plan)
    assert [(s.tag, s.step, s.value) for s in lineage] == [
        ("val_loss", 40, 3.5),
        ("reduced_train_loss", 100, 3.0),
        ("consumed_samples", 100, 800.0),  # the base's 320 and this run's 480: Bridge restarted at 0
    ]


def test_the_profile_is_chosen_per_dataset_and_kept_by_its_lineage() -> None:
    settings = config.load({"RETRAIN_PROFILES": "news=megatron-bridge, legal=nemo-24.12"})
    assert settings.profile_of("news") == "megatron-bridge" and settings.profile_of("other") == "nemo-24.12"
    plan = training_plan(settings, "news-1", None, "news")
    assert plan.profile == "megatron-bridge" and TrainingPlan.parse(plan.to_dict()) == plan
    assert settings.image_of("megatron-bridge") == "nvcr.io/nvidia/nemo:26.08"
    assert settings.image_of("nemo-24.12") == "nvcr.io/nvidia/nemo:24.12"
    nemo_champion = Champion("legal-1", "gs://a/runs/legal-1/megatron_gpt/checkpoints/x-last", 60)
    with pytest.raises(PlanError, match=r"was written by the nemo-24.12 profile, and megatron-bridge cannot"):
        training_plan(settings, "news-2", nemo_champion, "news")
    assert training_plan(settings, "legal-2", nemo_champion, "legal").base_step == 60
    # a champion recorded before profiles were recorded was NeMo's
    assert Champion.from_dict({"run_id": "a", "checkpoint": "gs://c", "step": 1}).profile == "nemo-24.12"
    with pytest.raises(ValueError, match="RETRAIN_PROFILES: 'oops' is not DATASET=PROFILE"):
        config.load({"RETRAIN_PROFILES": "news = megatron-bridge, oops"}).profile_of("news")  # any dataset
    with pytest.raises(PlanError, match="RETRAIN_PROFILES: 'news' is not DATASET=PROFILE"):
        training_plan(config.load({"RETRAIN_PROFILES": "news"}), "news-3", None, "news")
    with pytest.raises(
        PlanError, match=r"unknown trainer profile 'nemo-25' \(one of \['megatron-bridge', 'nemo-24.12'\]\)"
    ):
        training_plan(config.load({"RETRAIN_PROFILES": "news=nemo-25"}), "news-3", None, "news")


def test_both_profiles_render_one_plan() -> None:
    plan = example_plan()
    for name in ("nemo-24.12", "megatron-bridge"):
        trainer = profile(name)
        trainer.validate(trainer.render(dataclasses.replace(plan, profile=name), GcsMounts().path))


@pytest.mark.parametrize("name", ["nemo-24.12", "megatron-bridge"])
def test_an_interpolation_in_a_path_is_refused_though_quoted(name: str) -> None:
    # Hydra keeps ${...} inside a quoted override value and OmegaConf resolves it when the trainer reads
    # the key: ${oc.env:...} would put the pod's environment into the path
    assert (
        OverridesParser.create().parse_override("k='/gcs/a${oc.env:HOME}'").value() == "/gcs/a${oc.env:HOME}"
    )
    planted = "gs://retrain-artifacts/eval/${oc.env:HOME}_text_document"
    plan = dataclasses.replace(example_plan(), profile=name, eval_set=planted)
    with pytest.raises(PlanError, match=r"holds '\$\{', which Hydra would resolve as an interpolation"):
        profile(name).render(plan, GcsMounts().path)


@pytest.mark.integration
def test_hydra_is_imported_whole_by_one_thread_before_either_profile_uses_it() -> None:
    """Two runs of the two profiles handed over at once, in one function server, imported Hydra's
    circle from two ends and failed on Python's import-deadlock check.  In a fresh interpreter, both
    profiles' compositions at once from eight threads; and load_hydra leaves every module they import
    loaded."""
    code = (
        "import sys, threading\n"
        "from retrain.trainers import hydra, megatron_bridge, nemo\n"
        "assert 'hydra' not in sys.modules\n"
        "gate, errors = threading.Barrier(8), []\n"
        "def go(i):\n"
        "    gate.wait()\n"
        "    try:\n"
        "        if i % 2:\n"
        "            megatron_bridge.compose([])\n"
        "        else:\n"
        "            hydra.compose(nemo.CONFIG_DIR, nemo.CONFIG_NAME, [])\n"
        "    except Exception as e:\n"
        "        errors.append(repr(e))\n"
        "threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "print(errors, [m for m in hydra.HYDRA_MODULES if m not in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] []", out.stdout


@pytest.mark.parametrize("name", ["nemo-24.12", "megatron-bridge"])
def test_a_commands_verdict_is_kept_and_a_refusal_stays_one(name: str) -> None:
    """``check`` composes a command once (Hydra takes a fifth of a second); the same arguments get the
    same verdict after, a refusal with its message, and other arguments are composed for themselves."""
    _verdict.cache_clear()  # whatever this worker checked before
    trainer = profile(name)
    command = trainer.render(
        dataclasses.replace(example_plan(), profile=name, run_id="kept"), GcsMounts().path
    )
    refused = Command(command.command, [*command.args, "model.no_such_key=1"])
    with pytest.raises(PlanError) as first:
        trainer.validate(refused)
    before = _verdict.cache_info()
    for _ in range(2):
        check(trainer, command)
        with pytest.raises(PlanError) as again:
            check(trainer, refused)
        assert str(again.value) == str(first.value)
    after = _verdict.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (2, 2)
