"""The ``nemo-24.12`` profile: NeMo 1.0's Megatron GPT pre-training script in ``nvcr.io/nvidia/nemo:24.12``.

The container runs ``megatron_gpt_pretraining.py`` under torchrun, configured by Hydra overrides
checked against the script's own config (``retrain/resources/nemo-24.12/megatron_gpt_config.yaml``, the
unmodified file of NVIDIA/NeMo v2.1.0; ``../shared/specs/nemo-24.12/`` has the facts used here):

- data: ``model.data.data_prefix=[w,prefix,...]`` on the command line (NeMo has no indirection through
  a file), the prefixes being the tokenized shards' Cloud Storage FUSE paths; the index-mapping files go
  to a writable folder of the run (the shards' own folder is read by every run);
- tokenizer: ``model.tokenizer.vocab_file``/``merge_file`` are the files the data was tokenized with
  (null would make NeMo download GPT-2's files at start-up);
- batch sizes and parallelism are set explicitly (NeMo's defaults, micro 4 / global 8, fail Megatron's
  assertion on one 8-GPU node), validation runs at the run's last step (``val_check_interval`` 100 would
  never fire in a 60-step run; :func:`validation_interval`) and warm-up is a tenth of the run (500 by
  default);
- outputs: ``exp_manager`` writes ``<exp_dir>/megatron_gpt/checkpoints/`` and TensorBoard event files
  beside it; ``resume_if_exists`` resumes a restarted pod;
- continual training: ``model.restore_from_ckpt`` (weights, optimizer and step) continues from the
  dataset's base checkpoint, and ``trainer.max_steps`` is the base's step plus this run's steps (the
  restored step counts).  NeMo's script applies ``restore_from_ckpt`` after ``exp_manager``'s resume,
  so it would win over the run's own progress: the launcher drops it when the run already saved a
  checkpoint (a restarted pod).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from retrain.domain.runs import ProfileName
from retrain.tensorboard import Scalar
from retrain.trainers import Command, MountPath, PlanError, TrainingPlan
from retrain.trainers.hydra import compose, hydra_blend, hydra_string

NAME = ProfileName.NEMO_24_12
SCRIPT = "/opt/NeMo/examples/nlp/language_modeling/megatron_gpt_pretraining.py"
CONFIG_DIR = Path(__file__).resolve().parents[1] / "resources" / "nemo-24.12"
CONFIG_NAME = "megatron_gpt_config"
#: ``exp_manager.name``: the folder under ``exp_dir`` holding ``checkpoints/`` and the event files.
EXPERIMENT = "megatron_gpt"
#: Validation (and so a checkpoint, which NeMo saves on validation) at most this many steps apart.
VALIDATE_EVERY = 100
#: Tags NeMo logs to TensorBoard (``megatron_gpt_model.py``).
TRAIN_LOSS_TAG, VAL_LOSS_TAG, SAMPLES_TAG = "reduced_train_loss", "val_loss", "consumed_samples"

LAUNCHER = f"""set -euo pipefail
# A restarted pod resumes its own run (exp_manager.resume_if_exists finds a *-last checkpoint); NeMo's
# script applies model.restore_from_ckpt after that resume, so the base checkpoint is dropped then.
args=()
resumed=""
if compgen -G "${{RETRAIN_RUN_CHECKPOINTS}}/*-last*" > /dev/null; then resumed=1; fi
for a in "$@"; do
  if [[ -n "$resumed" && "$a" == model.restore_from_ckpt=* ]]; then
    echo "resuming this run from ${{RETRAIN_RUN_CHECKPOINTS}} instead of ${{a#*=}}"
    continue
  fi
  args+=("$a")
done
echo "node rank ${{NODE_RANK}}/${{NNODES}}, coordinator ${{MASTER_ADDR}}:${{MASTER_PORT}}"
exec torchrun --nnodes="${{NNODES}}" --nproc-per-node="${{GPUS_PER_NODE}}" \\
  --node-rank="${{NODE_RANK}}" --master-addr="${{MASTER_ADDR}}" --master-port="${{MASTER_PORT}}" \\
  {SCRIPT} "${{args[@]}}"
"""

_STEP = re.compile(r"(?:^|[-_])step=(\d+)")


def validation_interval(plan: TrainingPlan) -> int:
    """Steps between validations (and so checkpoints, which NeMo saves on validation).

    Lightning validates every ``val_check_interval`` batches of the fit, counted from step 0 of the
    model's training (a restored checkpoint's steps count), and not again at ``max_steps``: so the
    interval divides the run's last step, and is at most the run's length and VALIDATE_EVERY."""
    limit = min(plan.steps, VALIDATE_EVERY)
    return max(d for d in range(1, limit + 1) if plan.final_step % d == 0)


def warmup_steps(steps: int) -> int:
    """Learning-rate warm-up: a tenth of the run (NeMo's default of 500 outlasts short runs)."""
    return max(1, steps // 10)


@dataclass(frozen=True)
class NemoProfile:
    name: str = NAME

    def run_dir(self, plan: TrainingPlan) -> str:
        return f"{plan.output_dir}/{EXPERIMENT}"

    def render(self, plan: TrainingPlan, mount: MountPath) -> Command:
        tok = plan.gpt2_files(NAME)
        shape = plan.shape
        exp_dir = mount(plan.output_dir, write=True)
        blend = hydra_blend(plan.blend, mount)
        args = [
            f"trainer.num_nodes={shape.nodes}",
            f"trainer.devices={shape.gpus_per_node}",
            f"trainer.max_steps={plan.final_step}",
            f"trainer.val_check_interval={validation_interval(plan)}",
            f"trainer.limit_val_batches={plan.validation_batches}",
            f"model.micro_batch_size={shape.micro_batch_size}",
            f"model.global_batch_size={shape.global_batch_size}",
            f"model.tensor_model_parallel_size={shape.tensor_parallel}",
            f"model.pipeline_model_parallel_size={shape.pipeline_parallel}",
            f"model.encoder_seq_length={plan.seq_length}",
            f"model.seed={plan.seed}",
            f"model.optim.sched.warmup_steps={warmup_steps(plan.steps)}",
            f"model.data.data_prefix={data_prefix(plan, blend, mount)}",
            f"model.data.index_mapping_dir={hydra_string(exp_dir + '/index_mapping')}",
            f"model.tokenizer.vocab_file={hydra_string(mount(tok.vocab_file))}",
            f"model.tokenizer.merge_file={hydra_string(mount(tok.merge_file))}",
            f"exp_manager.exp_dir={hydra_string(exp_dir)}",
            f"exp_manager.name={EXPERIMENT}",
            "exp_manager.resume_if_exists=true",
            "exp_manager.resume_ignore_no_checkpoint=true",
            "exp_manager.checkpoint_callback_params.save_top_k=1",
        ]
        if plan.base_checkpoint:
            args.append(f"model.restore_from_ckpt={hydra_string(mount(plan.base_checkpoint))}")
        env = {"RETRAIN_RUN_CHECKPOINTS": f"{exp_dir}/{EXPERIMENT}/checkpoints"}
        return Command(["bash", "-c", LAUNCHER, "nemo"], args, env)

    def validate(self, command: Command) -> None:
        """Compose the script's config as Hydra would, then check what NeMo checks only at start-up."""
        cfg = compose(CONFIG_DIR, CONFIG_NAME, command.args)
        check_config(cfg)

    def final_checkpoint(self, names: Iterable[str]) -> str | None:
        """The ``-last`` checkpoint, else the one of the highest step (names carry ``step=N``, as
        NeMo's checkpoint callback writes them)."""

        def step(name: str) -> int:
            m = _STEP.search(name)
            return int(m.group(1)) if m else -1

        folders = sorted(set(names), key=lambda n: (step(n), n))
        lasts = [n for n in folders if n.endswith("-last") or "-last." in n]
        chosen = lasts or folders
        return chosen[-1] if chosen else None

    def lineage_scalars(self, scalars: list[Scalar], plan: TrainingPlan) -> list[Scalar]:
        """NeMo's tags are the neutral ones, and its steps count the restored checkpoint's."""
        return scalars


def data_prefix(plan: TrainingPlan, blend: str, mount: MountPath) -> str:
    """``model.data.data_prefix``: the blend, or with the dataset's eval set NeMo's dictionary form
    ``{train: [blend], validation: [eval set], test: [eval set]}``, which NeMo turns into megatron-core's
    ``blend_per_split`` and ``splits_string`` no longer applies (megatron_gpt_config.yaml's own comment on
    data_prefix; NVIDIA/NeMo nemo/collections/nlp/models/language_modeling/megatron_gpt_model.py,
    ``build_train_valid_test_datasets``)."""
    if not plan.eval_set:
        return f"[{blend}]"
    held_out = f"[1.0,{hydra_string(mount(plan.eval_set))}]"
    return f"{{train:[{blend}],validation:{held_out},test:{held_out}}}"


def _blend_problems(name: str, blend: list[Any]) -> list[str]:
    if not blend:
        return [f"{name} is empty"]
    if not (
        all(isinstance(p, str) for p in blend)
        or (
            len(blend) % 2 == 0
            and all(isinstance(w, int | float) and not isinstance(w, bool) for w in blend[0::2])
            and all(isinstance(p, str) for p in blend[1::2])
        )
    ):
        return [f"{name} {blend!r} is not [prefix, ...] or [weight, prefix, ...]"]
    if any(isinstance(p, str) and p.startswith("@") for p in blend):
        return [f"{name} names a file with @: NeMo has no indirection through a file"]
    return []


def check_config(cfg: Any) -> None:
    """What NeMo and Megatron would refuse at start-up in a composed config (PlanError)."""
    from retrain.trainers import BatchShape

    shape = BatchShape(
        nodes=int(cfg.trainer.num_nodes),
        gpus_per_node=int(cfg.trainer.devices),
        micro_batch_size=int(cfg.model.micro_batch_size),
        global_batch_size=int(cfg.model.global_batch_size),
        tensor_parallel=int(cfg.model.tensor_model_parallel_size),
        pipeline_parallel=int(cfg.model.pipeline_model_parallel_size),
    )
    problems = shape.problems()
    prefix = cfg.model.data.data_prefix
    if OmegaConf.is_dict(prefix):  # NeMo asserts all three keys (gpt_dataset.build_train_valid_test_datasets)
        if sorted(prefix) != ["test", "train", "validation"]:
            problems.append(f"model.data.data_prefix has keys {sorted(prefix)}, not train, validation, test")
        else:
            for split in ("train", "validation", "test"):
                problems += _blend_problems(f"model.data.data_prefix.{split}", list(prefix[split]))
    else:
        problems += _blend_problems("model.data.data_prefix", list(prefix))
    if cfg.model.tokenizer.vocab_file is None or cfg.model.tokenizer.merge_file is None:
        problems.append("model.tokenizer.vocab_file/merge_file are null: NeMo would download GPT-2's files")
    if cfg.model.data.index_mapping_dir is None:
        problems.append("model.data.index_mapping_dir is null: the shards' read-only folder would be used")
    if int(cfg.trainer.max_steps) % int(cfg.trainer.val_check_interval):
        problems.append(
            f"trainer.val_check_interval {cfg.trainer.val_check_interval} does not divide trainer.max_steps "
            f"{cfg.trainer.max_steps}: the last step would not validate"
        )
    if cfg.exp_manager.exp_dir is None:
        problems.append("exp_manager.exp_dir is null: checkpoints would stay in the pod")
    if problems:
        raise PlanError("; ".join(problems))


NEMO_24_12 = NemoProfile()
