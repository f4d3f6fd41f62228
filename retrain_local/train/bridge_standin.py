"""The local image's stand-in for Megatron-Bridge's ``scripts/training/run_recipe.py``.

In the local Megatron-Bridge image (``retrain_local.images``) this file sits at run_recipe.py's path, so
the local run executes the command that deploys: the same torchrun launch, the same ``--recipe``,
``--mode`` and ``--dataset``, the same trailing overrides, applied to the recipe's config as Bridge
applies them (:func:`retrain.trainers.megatron_bridge.compose`; an override Bridge would refuse is
refused here).  It keeps Bridge's contract:

- the world torchrun started is the data-parallel x model-parallel world the batch arithmetic needs;
- ``dataset.data_path`` (split by ``dataset.split``) or ``dataset.blend_per_split`` (each split its own
  blend, whole) names local paths (the Cloud Storage FUSE mounts); the cache files go to
  ``dataset.path_to_cache``; ``tokenizer.vocab_file`` gives the vocabulary size;
- ``checkpoint.load``: a run that saved resumes from ``<load>/latest_checkpointed_iteration.txt``'s
  iteration (weights, optimizer and step); otherwise ``checkpoint.pretrained_checkpoint`` (a base folder
  with that tracker, or an ``iter_N`` folder) gives the weights alone and training starts at iteration 0
  (docs/training/checkpointing.md);
- training runs ``train.train_iters`` steps of ``train.global_batch_size`` sequences with warm-up
  (``scheduler.lr_warmup_iters``) and cosine decay to ``optimizer.min_lr``; every
  ``validation.eval_interval`` steps and at the end ``validation.eval_iters`` batches give
  ``lm loss validation``; checkpoints go to ``<save>/iter_NNNNNNN`` every ``checkpoint.save_interval``
  steps and at the end, with the tracker files beside them; ``lm loss``, ``lm loss vs samples`` and
  ``learning-rate`` go to TensorBoard in ``logger.tensorboard_dir``.

Like NeMo's stand-in, the model is the toy GPT of :mod:`retrain_local.train.loop` (the architecture overrides
are checked, not used), and a run continuing from a pretrained checkpoint first validates it on its own
validation data (the eval gate compares on the same data; Bridge itself does not).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from retrain.tensorboard import EventWriter, event_file_name
from retrain.trainers import PlanError
from retrain.trainers.megatron_bridge import (
    SAMPLES_TAG,
    TRAIN_LOSS_TAG,
    VAL_LOSS_TAG,
    Launch,
    check_config,
    checkpoint_folder,
    compose,
    read_recipe_args,
)
from retrain_local.train.data import load_blend, split_streams
from retrain_local.train.loop import (
    WHOLE,
    Loop,
    Schedule,
    Shape,
    fail,
    finish,
    say,
    train_or_check,
    vocab_size,
    write_index_mapping,
)

#: Bridge's trackers of the latest checkpoint (checkpointing.py: the first is read first on load).
TRACKERS = ("latest_train_state.pt", "latest_checkpointed_iteration.txt")


def tracked_iteration(folder: Path) -> int | None:
    """The iteration a checkpoint folder's tracker names (None: nothing saved there)."""
    tracker = folder / TRACKERS[1]
    return int(tracker.read_text().strip()) if tracker.exists() else None


def pretrained_weights(path: Path) -> Path | None:
    """``checkpoint.pretrained_checkpoint`` as Bridge accepts it: an ``iter_N`` folder, or a base folder
    whose tracker names one; the stand-in's state file in it."""
    step = tracked_iteration(path)
    folder = path / checkpoint_folder(step) if step is not None else path
    return folder / "model.pt" if (folder / "model.pt").exists() else None


def data_check(cfg: Any) -> int:
    """Without PyTorch: read and check every dataset of the blend, train nothing."""
    from retrain_local.train.datacheck import check

    per_split = [entry for entry in cfg.dataset.blend_per_split or [] if entry is not None]
    prefixes = [p for entry in per_split for p in entry[0]] or cfg.dataset.data_path
    metrics = check(prefixes.split() if isinstance(prefixes, str) else list(prefixes))
    say(f"PyTorch is not installed: checked the data instead of training: {json.dumps(metrics)}")
    return 0


def _streams(cfg: Any) -> tuple[Any, Any, Any]:
    """The training blend and the train and validation streams, as megatron-core splits them."""
    data = cfg.dataset
    if data.blend_per_split is not None:
        train_split, valid_split = data.blend_per_split[0], data.blend_per_split[1]
        blend = load_blend(_blend_list(train_split))
        return (
            blend,
            split_streams(blend, WHOLE, 0),
            split_streams(load_blend(_blend_list(valid_split)), WHOLE, 0),
        )
    path = data.data_path
    blend = load_blend(path.split() if isinstance(path, str) else list(path))
    return blend, split_streams(blend, str(data.split), 0), split_streams(blend, str(data.split), 1)


def _blend_list(entry: Any) -> list[Any]:
    """megatron-core's ``(prefixes, weights)`` pair as Megatron's flat ``[w, prefix, ...]`` list."""
    prefixes, weights = list(entry[0]), entry[1]
    if weights is None:
        return prefixes
    return [item for pair in zip(weights, prefixes, strict=True) for item in pair]


def _shape(cfg: Any, vocab: int, seed: int) -> Shape:
    """The model's and the batches' shape, as the recipe's config names them."""
    opt = cfg.optimizer
    return Shape(
        vocab=vocab,
        seq_length=int(cfg.dataset.seq_length),
        micro_batch_size=int(cfg.train.micro_batch_size),
        global_batch_size=int(cfg.train.global_batch_size),
        model_parallel=int(cfg.model.tensor_model_parallel_size)
        * int(cfg.model.pipeline_model_parallel_size),
        seed=seed,
        weight_decay=float(opt.weight_decay),
        betas=(float(opt.adam_beta1), float(opt.adam_beta2)),
        val_batches=int(cfg.validation.eval_iters),
        clip=float(opt.clip_grad or 0),
    )


def _train(cfg: Any, dist: Any, torch: Any, gpt: Any) -> int:
    t0 = time.time()
    save_dir, load_dir = Path(str(cfg.checkpoint.save)), Path(str(cfg.checkpoint.load))
    blend, train_streams, valid_streams = _streams(cfg)
    vocab = vocab_size(str(cfg.tokenizer.vocab_file), blend)
    seed = int(cfg.rng.seed)
    if dist.main:
        write_index_mapping(
            blend, str(cfg.dataset.split or WHOLE), seed, Path(str(cfg.dataset.path_to_cache))
        )
    iters = int(cfg.train.train_iters)
    opt = cfg.optimizer
    schedule = Schedule(float(opt.lr), float(opt.min_lr), int(cfg.scheduler.lr_warmup_iters), iters)
    shape = _shape(cfg, vocab, seed)
    loop = Loop(torch, gpt, dist, shape, train_streams, valid_streams)
    step, consumed, pretrained = 0, 0, False
    base = Path(str(cfg.checkpoint.pretrained_checkpoint)) if cfg.checkpoint.pretrained_checkpoint else None
    weights = pretrained_weights(base) if base is not None else None
    if base is not None and weights is None:  # CheckpointConfig.finalize asserts it, resuming or not
        return fail(f"Pretrained checkpoint {base} does not exist")
    resumed = tracked_iteration(load_dir)
    if resumed is not None:  # checkpoint.load wins: the run's own progress, everything restored
        state = gpt.load_checkpoint(load_dir / checkpoint_folder(resumed) / "model.pt")
        if (why := loop.restore(state, optimizer=True)) is not None:
            return fail(f"checkpoint.load {load_dir}: {why}")
        step, consumed = int(state["step"]), int(state["consumed_samples"])
        say(f"resumed {load_dir} at iteration {step}")
    elif base is not None and weights is not None:
        if (why := loop.restore(gpt.load_checkpoint(weights), optimizer=False)) is not None:
            return fail(f"checkpoint.pretrained_checkpoint {base}: {why}")
        pretrained = True
        say(f"loaded the weights of {base}; training starts at iteration 0")
    events = EventWriter(Path(str(cfg.logger.tensorboard_dir)) / event_file_name()) if dist.main else None
    say(loop.describe(step, iters))
    if not loop.validator:
        say("warning: the validation split holds no document: no lm loss validation")

    def validate() -> None:
        val = loop.validate()
        if val is not None and events:
            events.scalars(step, {VAL_LOSS_TAG: val})
        if val is not None:
            say(f"iteration {step} lm loss validation {val:.4f}")

    def save() -> None:
        if not dist.main:
            return
        gpt.save_checkpoint(save_dir / checkpoint_folder(step) / "model.pt", loop.state(step, consumed))
        torch.save({"iteration": step, "consumed_train_samples": consumed}, save_dir / TRACKERS[0])
        (save_dir / TRACKERS[1]).write_text(str(step))

    if pretrained:
        validate()  # the base checkpoint on this run's validation data, at iteration 0
    log_every = max(1, int(cfg.logger.log_interval))
    eval_every, save_every = int(cfg.validation.eval_interval or 0), int(cfg.checkpoint.save_interval or 0)
    start = step
    while step < iters:
        step += 1
        lr = schedule.at(step)
        loss_sum = loop.step(step, lr)
        consumed += shape.global_batch_size
        if step % log_every == 0 or step == iters or step == start + 1:
            loss = loop.reduce(loss_sum)
            if not math.isfinite(loss):
                return fail(f"{TRAIN_LOSS_TAG} is {loss} at iteration {step}")
            if events:
                events.scalars(step, {TRAIN_LOSS_TAG: loss, "learning-rate": lr})
                events.scalars(consumed, {SAMPLES_TAG: loss})
            say(f"iteration {step}/{iters} | {TRAIN_LOSS_TAG}: {loss:.4f} | learning rate: {lr:.2e}")
        if eval_every and step % eval_every == 0 and step < iters:
            validate()
        if save_every and step % save_every == 0:
            save()
    validate()  # pretrain.py validates once more when training is done
    if step and not (save_every and step % save_every == 0):
        save()  # train.py saves the final step unless the interval just did
    say(f"done: iteration {step}, {time.time() - t0:.1f}s -> {save_dir / checkpoint_folder(step)}")
    finish(dist, torch)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        chosen, overrides = read_recipe_args(sys.argv[1:] if argv is None else argv)
        cfg = compose(overrides)
        world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        check_config(
            cfg, Launch(max(1, world // local), local, chosen.recipe, chosen.mode, chosen.dataset, overrides)
        )
    except PlanError as e:
        return fail(str(e))
    return train_or_check(cfg, _train, data_check)


if __name__ == "__main__":
    sys.exit(main())
