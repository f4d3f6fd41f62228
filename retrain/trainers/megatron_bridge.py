"""The ``megatron-bridge`` profile: Megatron-Bridge's ``run_recipe.py`` in a current NeMo Framework image.

NeMo 1.0's language-modeling scripts are gone from current NeMo Framework containers; their LLM training
is Megatron-Bridge (release 0.6 is NeMo Framework 26.08; ``docs/versions1.json``).  The container runs
``scripts/training/run_recipe.py`` (``/opt/Megatron-Bridge`` in the image) under torchrun, as its
README shows (``python -m torch.distributed.run --nproc_per_node=2 scripts/training/run_recipe.py
--recipe vanilla_gpt_pretrain_config --mode pretrain --dataset mock model.tensor_model_parallel_size=2``)
and as Google's A3 Ultra ``megatron-bridge-gke`` recipes run it.  Every argument is a trailing
``KEY=VALUE`` ConfigContainer override (Hydra's grammar, applied by Bridge's
``training/utils/omegaconf_utils.py`` ``parse_hydra_overrides`` in struct mode, so an unknown key is
refused), checked here against the recipe's config as Bridge builds it, extracted from the pinned
release into ``retrain/resources/megatron-bridge-0.6.2/config.json`` (``scripts/extract_bridge_config.py``;
Bridge needs Python 3.12 and GPU-only packages, so it is not imported):

- recipe ``vanilla_gpt_pretrain_config`` ("mirrors Megatron-LM pretrain_gpt.py defaults"), mode
  ``pretrain``, dataset preset ``megatron-indexed`` (docs/training/data-preparation.md); the model is
  the GPT of NeMo 24.12's ``megatron_gpt_config.yaml`` (12 layers, width 768, FFN 3072, 12 heads), the
  recipe's own being empty (0 layers);
- data: ``dataset.data_path=[w,prefix,...]`` (data-preparation.md: "the CLI-friendly ``data_path`` field
  is converted to Megatron Core's ``blend``") split by ``dataset.split``, NeMo's 900,50,50 without its
  test part: Bridge evaluates a test split at the end under the same TensorBoard tag as validation
  (``eval.py``, ``"{} validation"``; ``pretrain.py`` after the final validation), which would hide the
  run's validation loss; with the dataset's eval set, megatron-core's ``dataset.blend_per_split``
  (train: the blend, validation: the eval set, test: null) and ``dataset.split=null`` (megatron-core
  asserts "split and blend_per_split are incompatible");
  ``dataset.path_to_cache`` is a writable folder of the run (the shards' folder is read by every run);
- tokenizer: ``GPT2BPETokenizer`` with the files the data was tokenized with;
- ``train.train_iters`` / ``global_batch_size`` / ``micro_batch_size`` and the model's parallel sizes from
  the plan; torchrun's ``--nnodes`` and ``--nproc-per-node`` from the plan's shape;
- checkpoints: ``checkpoint.save`` and ``checkpoint.load`` are the run's own folder, so a restarted pod
  resumes its run (docs/training/checkpointing.md: ``load`` "loads the latest checkpoint"); the dataset's
  base checkpoint is ``checkpoint.pretrained_checkpoint`` (weights only: "does not load optimizer, RNG,
  dataloader, or scheduler state"), which ``load`` wins over once the run has saved.  Bridge starts a
  run from a pretrained checkpoint at iteration 0, so ``train.train_iters`` is this run's steps, and the
  run's steps count from its base's step in the record (:meth:`MegatronBridgeProfile.lineage_scalars`);
  checkpoints are ``<save>/iter_NNNNNNN`` (``checkpoint_utils.py``), saved every ``save_interval`` steps
  and at the end of training;
- TensorBoard: ``logger.tensorboard_dir``; Bridge's tags are ``lm loss`` and ``lm loss validation``, with
  ``lm loss vs samples`` counting consumed samples (``utils/train_utils.py``, ``eval.py``).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from retrain.domain.runs import ProfileName
from retrain.tensorboard import Scalar
from retrain.trainers import BatchShape, Command, MountPath, PlanError, TrainingPlan
from retrain.trainers.hydra import hydra_blend, hydra_string, load_hydra

NAME = ProfileName.MEGATRON_BRIDGE
#: The Megatron-Bridge release whose config the overrides are checked against.
RELEASE = "0.6.2"
CONFIG_FILE = Path(__file__).resolve().parents[1] / "resources" / f"megatron-bridge-{RELEASE}" / "config.json"
#: Where the NeMo Framework image keeps Megatron-Bridge's launcher (its Dockerfile copies the checkout
#: to /opt/Megatron-Bridge).
RUN_RECIPE = "/opt/Megatron-Bridge/scripts/training/run_recipe.py"
RECIPE = "vanilla_gpt_pretrain_config"
MODE = "pretrain"
DATASET_PRESET = "megatron-indexed"
#: NeMo 24.12's GPT (megatron_gpt_config.yaml): both profiles train the same model.
ARCHITECTURE = {"num_layers": 12, "hidden_size": 768, "ffn_hidden_size": 3072, "num_attention_heads": 12}
#: NeMo's default split (``splits_string: 900,50,50``) with no test documents (see the module's notes).
SPLIT = "900,50,0"
#: Validation and checkpoints at most this many steps apart (Bridge also does both at the end).
VALIDATE_EVERY = 100
CHECKPOINTS, TENSORBOARD, INDEX_CACHE = "checkpoints", "tb_logs", "index_cache"
#: Bridge's TensorBoard tags.
TRAIN_LOSS_TAG, VAL_LOSS_TAG, SAMPLES_TAG = "lm loss", "lm loss validation", "lm loss vs samples"
#: The rendezvous comes from the JobSet's environment; nodes and processes per node are the command's
#: own arguments, from the plan.
LAUNCHER = (
    'echo "node rank ${NODE_RANK}/${NNODES}, coordinator ${MASTER_ADDR}:${MASTER_PORT}"\n'
    'exec torchrun --node-rank="${NODE_RANK}" --master-addr="${MASTER_ADDR}" '
    '--master-port="${MASTER_PORT}" "$@"\n'
)
_ITER = re.compile(r"^iter_(\d{7})$")


def checkpoint_folder(step: int) -> str:
    """Bridge's name of the checkpoint of ``step`` (``checkpoint_utils.get_checkpoint_name``: iter_{:07d})."""
    return f"iter_{step:07d}"


@cache
def schema() -> dict[str, Any]:
    """The vendored config: ``config`` (the recipe's tree) and ``types`` (each leaf's kinds)."""
    return dict(json.loads(CONFIG_FILE.read_text()))


@dataclass(frozen=True)
class Launch:
    """A megatron-bridge command, read back: torchrun's world and run_recipe's selection and overrides."""

    nodes: int
    processes_per_node: int
    recipe: str
    mode: str
    dataset: str
    overrides: list[str]


def read_recipe_args(args: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """run_recipe.py's own arguments (``--recipe``, ``--mode``, ``--dataset``) and its trailing
    overrides; PlanError for what it refuses (``Unknown option``, ``Expected override in KEY=VALUE
    form``: scripts/training/run_recipe.py ``_collect_overrides``)."""
    parser = argparse.ArgumentParser(
        prog="run_recipe.py", add_help=False, exit_on_error=False, allow_abbrev=False
    )
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--mode", choices=["pretrain", "sft", "lora", "dora"], required=True)
    parser.add_argument("--dataset")
    try:
        chosen, rest = parser.parse_known_args(list(args))
    except (argparse.ArgumentError, SystemExit) as e:
        raise PlanError(f"run_recipe.py: {e}") from None
    for value in rest:
        if value.startswith("-"):
            raise PlanError(f"run_recipe.py: Unknown option: {value}")
        if "=" not in value:
            raise PlanError(f"run_recipe.py: Expected override in KEY=VALUE form, got {value!r}")
    return chosen, rest


def read_launch(args: Sequence[str]) -> Launch:
    """The torchrun and run_recipe.py arguments of a rendered command; PlanError for what either refuses."""
    try:
        script = list(args).index(RUN_RECIPE)
    except ValueError:
        raise PlanError(f"the command does not run {RUN_RECIPE}") from None
    runner = argparse.ArgumentParser(prog="torchrun", add_help=False, exit_on_error=False)
    runner.add_argument("--nnodes", type=int, required=True)
    runner.add_argument("--nproc-per-node", type=int, required=True)
    try:
        world = runner.parse_args(args[:script])
    except (argparse.ArgumentError, SystemExit) as e:
        raise PlanError(f"torchrun: {e}") from None
    chosen, overrides = read_recipe_args(args[script + 1 :])
    return Launch(world.nnodes, world.nproc_per_node, chosen.recipe, chosen.mode, chosen.dataset, overrides)


def compose(overrides: Sequence[str]) -> Any:
    """The recipe's config with ``overrides`` applied as Bridge applies them (``parse_hydra_overrides``:
    Hydra's parser and ``ConfigLoaderImpl._apply_overrides_to_config`` on the struct-mode tree), each
    value also checked against its field's type; PlanError naming the first one refused."""
    load_hydra()  # before any of Hydra's modules: hydra.load_hydra says why
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(schema()["config"])
    OmegaConf.set_struct(cfg, True)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
        ConfigLoaderImpl._apply_overrides_to_config(overrides=parsed, cfg=cfg)
    except Exception as e:  # Bridge wraps every failure the same way (OverridesError)
        raise PlanError("Failed to parse Hydra overrides: " + " ".join(str(e).split())) from None
    types = schema()["types"]
    for o in parsed:
        if o.is_delete():
            raise PlanError(f"override ~{o.key_or_group}: Bridge drops deletions (the field keeps its value)")
        if (o.is_add() or o.is_force_add()) and o.key_or_group not in types:
            raise PlanError(
                f"override +{o.key_or_group}: not a field of Bridge's config (it would be skipped)"
            )
        problem = _type_problem(o.key_or_group, OmegaConf.select(cfg, o.key_or_group), types)
        if problem:
            raise PlanError(problem)
    return cfg


def _kind(value: Any) -> str:
    from omegaconf import DictConfig, ListConfig

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    for kind, cls in (("int", int), ("float", float), ("str", str), ("list", ListConfig | list)):
        if isinstance(value, cls):
            return kind
    return "dict" if isinstance(value, DictConfig | dict) else "any"


def _type_problem(key: str, value: Any, types: dict[str, Any]) -> str | None:
    spec = types.get(key)
    if spec is None or "any" in spec["kinds"]:
        return None  # a whole sub-config, or a field typed as anything
    kind = _kind(value)
    if kind not in spec["kinds"]:
        return f"override {key}={value!r}: a {kind}, where Bridge's field is {' | '.join(spec['kinds'])}"
    if "choices" in spec and value is not None and value not in spec["choices"]:
        return f"override {key}={value!r}: not one of {spec['choices']}"
    return None


def _blend_problems(name: str, blend: list[Any]) -> list[str]:
    """megatron-core's ``get_blend_from_list``: prefixes, or weight and prefix pairs."""
    if not blend:
        return [f"{name} is empty"]
    weighted = len(blend) % 2 == 0 and all(
        isinstance(w, int | float) and not isinstance(w, bool) for w in blend[0::2]
    )
    if not (
        all(isinstance(p, str) for p in blend) or (weighted and all(isinstance(p, str) for p in blend[1::2]))
    ):
        return [f"{name} {blend!r} is not [prefix, ...] or [weight, prefix, ...]"]
    return []


def check_config(cfg: Any, launch: Launch) -> None:
    """What Bridge and megatron-core would refuse at start-up, or run wrongly, in a composed config."""
    problems = []
    if (launch.recipe, launch.mode, launch.dataset) != (RECIPE, MODE, DATASET_PRESET):
        problems.append(
            f"--recipe {launch.recipe} --mode {launch.mode} --dataset {launch.dataset}: the config is "
            f"checked against --recipe {RECIPE} --mode {MODE} --dataset {DATASET_PRESET} only"
        )
    shape = BatchShape(
        nodes=launch.nodes,
        gpus_per_node=launch.processes_per_node,
        micro_batch_size=int(cfg.train.micro_batch_size or 0),
        global_batch_size=int(cfg.train.global_batch_size or 0),
        tensor_parallel=int(cfg.model.tensor_model_parallel_size),
        pipeline_parallel=int(cfg.model.pipeline_model_parallel_size),
    )
    problems += shape.problems()
    if not cfg.train.train_iters or int(cfg.train.train_iters) < 1:
        problems.append("train.train_iters is not set: the recipe's 300000 steps would run")
    per_split = cfg.dataset.blend_per_split
    if per_split is not None:
        if cfg.dataset.data_path is not None or cfg.dataset.split is not None:
            problems.append(
                "dataset.blend_per_split is incompatible with dataset.data_path and dataset.split"
            )
        if len(per_split) != 3:
            problems.append("dataset.blend_per_split needs three entries: train, validation, test")
        else:
            for name, entry in zip(("train", "validation", "test"), per_split, strict=True):
                if entry is None and name == "test":
                    continue  # no test split (megatron-core allows a null entry)
                prefixes, weights = [*list(entry), None, None][:2] if entry is not None else ([], None)
                problems += _blend_problems(f"dataset.blend_per_split {name}", list(prefixes or []))
                if weights is not None and len(weights) != len(prefixes or []):
                    problems.append(f"dataset.blend_per_split {name}: weights and prefixes differ in number")
    elif cfg.dataset.data_path is None:
        problems.append("dataset.data_path is not set: megatron-core would train on mock data")
    else:
        path = cfg.dataset.data_path
        problems += _blend_problems(
            "dataset.data_path", path.split() if isinstance(path, str) else list(path)
        )
    if cfg.tokenizer.tokenizer_type == "GPT2BPETokenizer" and not (
        cfg.tokenizer.vocab_file and cfg.tokenizer.merge_file
    ):
        problems.append("tokenizer.vocab_file/merge_file are not set for GPT2BPETokenizer")
    if (
        int(cfg.model.num_layers) < 1
        or int(cfg.model.hidden_size) < 1
        or int(cfg.model.num_attention_heads) < 1
    ):
        problems.append(
            "model.num_layers/hidden_size/num_attention_heads are 0: the recipe leaves them to the command"
        )
    if not cfg.checkpoint.save or cfg.checkpoint.load != cfg.checkpoint.save:
        problems.append(
            "checkpoint.save and checkpoint.load must be the run's folder: a restarted pod resumes from it"
        )
    if not cfg.logger.tensorboard_dir or not cfg.dataset.path_to_cache:
        problems.append("logger.tensorboard_dir and dataset.path_to_cache must be folders of the run")
    if problems:
        raise PlanError("; ".join(problems))


def interval(plan: TrainingPlan) -> int:
    """Steps between validations and checkpoints: Bridge does both at the end of training too."""
    return min(plan.steps, VALIDATE_EVERY)


@dataclass(frozen=True)
class MegatronBridgeProfile:
    name: str = NAME

    def run_dir(self, plan: TrainingPlan) -> str:
        return plan.output_dir

    def render(self, plan: TrainingPlan, mount: MountPath) -> Command:
        tok = plan.gpt2_files(NAME)
        shape = plan.shape
        out = mount(plan.output_dir, write=True)
        every = interval(plan)
        blend = hydra_blend(plan.blend, mount)
        if plan.eval_set:
            held_out = f"[[{hydra_string(mount(plan.eval_set))}],null]"
            train = _per_split_train(plan.blend, mount)
            data = ["dataset.split=null", f"dataset.blend_per_split=[{train},{held_out},null]"]
        else:
            data = [f"dataset.split={hydra_string(SPLIT)}", f"dataset.data_path=[{blend}]"]
        overrides = [
            *(f"model.{key}={value}" for key, value in ARCHITECTURE.items()),
            f"model.tensor_model_parallel_size={shape.tensor_parallel}",
            f"model.pipeline_model_parallel_size={shape.pipeline_parallel}",
            f"train.train_iters={plan.steps}",
            f"train.global_batch_size={shape.global_batch_size}",
            f"train.micro_batch_size={shape.micro_batch_size}",
            f"validation.eval_interval={every}",
            f"validation.eval_iters={plan.validation_batches}",
            f"scheduler.lr_warmup_iters={max(1, plan.steps // 10)}",
            f"rng.seed={plan.seed}",
            f"dataset.seq_length={plan.seq_length}",
            f"dataset.random_seed={plan.seed}",
            *data,
            f"dataset.path_to_cache={hydra_string(f'{out}/{INDEX_CACHE}')}",
            "tokenizer.tokenizer_type=GPT2BPETokenizer",
            f"tokenizer.vocab_file={hydra_string(mount(tok.vocab_file))}",
            f"tokenizer.merge_file={hydra_string(mount(tok.merge_file))}",
            f"checkpoint.save={hydra_string(f'{out}/{CHECKPOINTS}')}",
            f"checkpoint.load={hydra_string(f'{out}/{CHECKPOINTS}')}",
            f"checkpoint.save_interval={every}",
            f"logger.tensorboard_dir={hydra_string(f'{out}/{TENSORBOARD}')}",
        ]
        if plan.base_checkpoint:
            overrides.append(f"checkpoint.pretrained_checkpoint={hydra_string(mount(plan.base_checkpoint))}")
        args = [
            f"--nnodes={shape.nodes}",
            f"--nproc-per-node={shape.gpus_per_node}",
            RUN_RECIPE,
            "--recipe",
            RECIPE,
            "--mode",
            MODE,
            "--dataset",
            DATASET_PRESET,
            *overrides,
        ]
        return Command(["bash", "-c", LAUNCHER, str(NAME)], args)

    def validate(self, command: Command) -> None:
        launch = read_launch(command.args)
        check_config(compose(launch.overrides), launch)

    def final_checkpoint(self, names: Iterable[str]) -> str | None:
        """The highest ``iter_NNNNNNN`` folder (Bridge saves one at the end of training)."""
        steps = sorted(int(m.group(1)) for n in names if (m := _ITER.match(n)))
        return checkpoint_folder(steps[-1]) if steps else None

    def lineage_scalars(self, scalars: list[Scalar], plan: TrainingPlan) -> list[Scalar]:
        """Bridge's scalars in the neutral tags at lineage steps: its iterations restart at 0 from a
        pretrained checkpoint (``finetune``: no train state restored), so the base's step is added; so
        are the base's consumed samples to the largest sample count ``lm loss vs samples`` was logged
        at, Bridge counting those from 0 too."""
        tags = {TRAIN_LOSS_TAG: "reduced_train_loss", VAL_LOSS_TAG: "val_loss"}
        out = [
            Scalar(tags[s.tag], s.step + plan.base_step, s.value, s.wall_time)
            for s in scalars
            if s.tag in tags
        ]
        samples = [s for s in scalars if s.tag == SAMPLES_TAG]
        if samples and out:
            last = max(samples, key=lambda s: s.step)
            total = float(last.step + plan.base_consumed_samples)
            out.append(Scalar("consumed_samples", max(s.step for s in out), total, last.wall_time))
        return out


def _per_split_train(blend: Sequence[float | str], mount: MountPath) -> str:
    """The train entry of ``blend_per_split``: megatron-core's ``(prefixes, weights)`` pair."""
    prefixes = [hydra_string(mount(p)) for p in blend if isinstance(p, str)]
    weights = [repr(float(w)) for w in blend if not isinstance(w, str)]
    return f"[[{','.join(prefixes)}],{'[' + ','.join(weights) + ']' if weights else 'null'}]"


MEGATRON_BRIDGE = MegatronBridgeProfile()
