"""The local image's stand-in for NeMo 24.12's ``megatron_gpt_pretraining.py``.

The cluster twin runs the training JobSet's command unchanged; in the local image
(``retrain_local.images``) this file sits at the NeMo script's path, so the local run executes the exact
command that deploys: the same torchrun launch and the same Hydra overrides.  It keeps the script's
contract:

- the config is composed by Hydra from the same ``megatron_gpt_config.yaml``, so an override NeMo would
  refuse is refused here with Hydra's message; the world torchrun started must be
  ``trainer.num_nodes x trainer.devices`` and Megatron's batch arithmetic must hold;
- ``model.data.data_prefix`` names local paths (the Cloud Storage FUSE mounts), each dataset's documents
  split by ``model.data.splits_string`` as Megatron splits them (or, in NeMo's dictionary form
  ``{train, validation, test}``, each split its own blend, whole); the index-mapping files go to
  ``model.data.index_mapping_dir``; ``model.tokenizer.vocab_file`` gives the vocabulary size;
- ``exp_manager``: a ``*-last`` checkpoint under ``<exp_dir>/<name>/checkpoints/`` is resumed when
  ``resume_if_exists``; ``model.restore_from_ckpt`` is applied after that, as NeMo's script applies it
  (it restores weights, optimizer and step);
- training runs to ``trainer.max_steps`` in global batches of ``model.global_batch_size`` (micro-batches
  of ``model.micro_batch_size`` per rank, accumulated), with warm-up then cosine decay of the learning
  rate; at every multiple of ``trainer.val_check_interval`` ``trainer.limit_val_batches`` batches give
  ``val_loss``; ``reduced_train_loss``, ``val_loss``, ``lr`` and ``consumed_samples`` go to TensorBoard
  event files beside ``checkpoints/``; checkpoints are named by ``exp_manager.checkpoint_callback_params
  .filename`` (the best ``save_top_k`` by ``val_loss``, and ``-last`` at the end), one folder each.

What differs is the model: a toy GPT (2 layers, width 64) that two CPU cores train in seconds; the
architecture keys (``num_layers``, ``hidden_size`` ...) are read by Hydra but not used.  Without PyTorch
the stand-in checks the data and writes no checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from retrain.tensorboard import EventWriter, event_file_name
from retrain.trainers import PlanError
from retrain.trainers.hydra import compose
from retrain.trainers.nemo import CONFIG_DIR, CONFIG_NAME, check_config
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

LAST = "-last"


def checkpoint_name(template: str, metrics: dict[str, float]) -> str:
    """Lightning's ``ModelCheckpoint.format_checkpoint_name`` (``auto_insert_metric_name``): every
    ``{name}`` / ``{name:fmt}`` becomes ``name=<value>``, a metric not logged yet counting as 0."""

    def one(m: re.Match[str]) -> str:
        name, fmt = m.group(1), m.group(2) or ""
        value = metrics.get(name, 0)
        return f"{name}={format(value, fmt[1:]) if fmt else value}"

    return re.sub(r"\{([A-Za-z_][\w/]*)(:[^}]*)?\}", one, template)


def latest_last(checkpoints: Path) -> Path | None:
    """exp_manager's resume: the newest ``*-last`` checkpoint of the run."""
    found = [p for p in checkpoints.glob(f"*{LAST}*") if p.is_dir() and (p / "model.pt").exists()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def data_check(cfg: Any) -> int:
    """Without PyTorch: read and check every dataset of the blend, train nothing."""
    from retrain_local.train.datacheck import check

    prefix = cfg.model.data.data_prefix
    metrics = check([*prefix.train, *prefix.validation] if OmegaConf.is_dict(prefix) else list(prefix))
    say(f"PyTorch is not installed: checked the data instead of training: {json.dumps(metrics)}")
    return 0


class _Refused(Exception):
    """What NeMo's script would refuse before training (its message, as ``fail`` prints it)."""


def _checkpoint_to_load(cfg: Any, checkpoints: Path) -> Path | None:
    """The checkpoint this run starts from, as NeMo's script finds it: exp_manager's resume (this run's own
    newest ``-last``), then ``model.restore_from_ckpt`` (the base a continued run starts from)."""
    found: Path | None = None
    if cfg.exp_manager.resume_if_exists:
        found = latest_last(checkpoints)
        if found is None and not cfg.exp_manager.resume_ignore_no_checkpoint:
            raise _Refused(f"no checkpoint to resume under {checkpoints}")
    if cfg.model.get("restore_from_path"):
        raise _Refused("model.restore_from_path (.nemo files) is not supported by the local stand-in")
    if cfg.model.get("restore_from_ckpt"):
        found = Path(str(cfg.model.restore_from_ckpt))  # NeMo's script sets it after exp_manager
        if not (found / "model.pt").exists():
            raise _Refused(f"model.restore_from_ckpt {found} is not a checkpoint")
    return found


def _streams(data: Any) -> tuple[Any, Any, Any]:
    """The blend, and its training and validation streams: NeMo's per-split form (each split its own
    blend, whole) or one blend cut by ``splits_string``."""
    if OmegaConf.is_dict(data.data_prefix):
        blend = load_blend(list(data.data_prefix.train))
        valid = split_streams(load_blend(list(data.data_prefix.validation)), WHOLE, 0)
        return blend, split_streams(blend, WHOLE, 0), valid
    blend = load_blend(list(data.data_prefix))
    return blend, split_streams(blend, data.splits_string, 0), split_streams(blend, data.splits_string, 1)


def _shape(cfg: Any, vocab: int) -> Shape:
    optim = cfg.model.optim
    return Shape(
        vocab=vocab,
        seq_length=int(cfg.model.encoder_seq_length),
        micro_batch_size=int(cfg.model.micro_batch_size),
        global_batch_size=int(cfg.model.global_batch_size),
        model_parallel=int(cfg.model.tensor_model_parallel_size)
        * int(cfg.model.pipeline_model_parallel_size),
        seed=int(cfg.model.seed),
        weight_decay=float(optim.weight_decay),
        betas=(float(optim.betas[0]), float(optim.betas[1])),
        val_batches=int(cfg.trainer.limit_val_batches),
        clip=float(cfg.trainer.gradient_clip_val or 0),
    )


class _Checkpoints:
    """NeMo's checkpoint callback as the stand-in keeps it: the ``save_top_k`` best by val_loss, each save
    with a ``-last`` copy (``save_last``), the best list saved inside each checkpoint so a resumed run
    keeps pruning the same ones."""

    def __init__(self, cfg: Any, gpt: Any, loop: Loop, folder: Path) -> None:
        self.gpt, self.loop, self.folder = gpt, loop, folder
        self.template = str(cfg.exp_manager.checkpoint_callback_params.filename)
        self.top_k = int(cfg.exp_manager.checkpoint_callback_params.save_top_k)
        self.best: list[tuple[float, Path]] = []

    def restored(self, state: dict[str, Any]) -> None:
        self.best = [
            (float(v), self.folder / n) for v, n in state.get("best", []) if (self.folder / n).exists()
        ]

    def save(self, name: str, step: int, consumed: int, metrics: dict[str, float]) -> Path:
        folder = self.folder / checkpoint_name(name, metrics)
        best = [(v, p.name) for v, p in self.best]
        self.gpt.save_checkpoint(folder / "model.pt", self.loop.state(step, consumed, best=best))
        return folder

    def save_last(self, step: int, consumed: int, metrics: dict[str, float]) -> Path:
        last = self.save(self.template + LAST, step, consumed, metrics)
        for old in self.folder.glob(f"*{LAST}*"):
            if old != last:
                shutil.rmtree(old, ignore_errors=True)
        return last

    def validated(self, val: float, step: int, consumed: int, metrics: dict[str, float]) -> None:
        """A validation's checkpoint, kept when among the ``top_k`` best (-1: all; 0: none)."""
        if self.top_k == 0:
            return
        self.best.append((val, self.save(self.template, step, consumed, metrics)))
        self.best.sort(key=lambda item: item[0])
        if self.top_k > 0:
            for _, gone in self.best[self.top_k :]:
                shutil.rmtree(gone, ignore_errors=True)
            self.best = self.best[: self.top_k]
        self.save_last(step, consumed, metrics)


def _log_training(
    events: EventWriter | None, step: int, max_steps: int, loss: float, lr: float, consumed: int
) -> None:
    if events:
        scalars = {
            "reduced_train_loss": loss,
            "lr": lr,
            "consumed_samples": float(consumed),
            "global_step": float(step),
        }
        events.scalars(step, scalars)
    say(f"step {step}/{max_steps} reduced_train_loss {loss:.4f} lr {lr:.2e}")


def _train(cfg: Any, dist: Any, torch: Any, gpt: Any) -> int:
    t0 = time.time()
    exp = Path(cfg.exp_manager.exp_dir) / str(cfg.exp_manager.name)
    checkpoints = exp / "checkpoints"
    try:
        ckpt_path = _checkpoint_to_load(cfg, checkpoints)
    except _Refused as refused:
        return fail(str(refused))
    data = cfg.model.data
    blend, train_streams, valid_streams = _streams(data)
    if dist.main:
        write_index_mapping(
            blend, str(data.splits_string), int(cfg.model.seed), Path(str(data.index_mapping_dir))
        )
    shape = _shape(cfg, vocab_size(str(cfg.model.tokenizer.vocab_file), blend))
    optim, max_steps = cfg.model.optim, int(cfg.trainer.max_steps)
    schedule = Schedule(float(optim.lr), float(optim.sched.min_lr), int(optim.sched.warmup_steps), max_steps)
    loop = Loop(torch, gpt, dist, shape, train_streams, valid_streams)
    saved = _Checkpoints(cfg, gpt, loop, checkpoints)
    step, consumed = 0, 0
    if ckpt_path is not None:
        state = gpt.load_checkpoint(ckpt_path / "model.pt")
        if (why := loop.restore(state, optimizer=True)) is not None:
            return fail(f"{ckpt_path}: {why}")
        step, consumed = int(state["step"]), int(state["consumed_samples"])
        saved.restored(state)
        say(f"restored {ckpt_path} at step {step}")
    if dist.main:
        for stale in checkpoints.glob("*") if checkpoints.exists() else []:
            gpt.discard_partial_saves(stale / "model.pt")
    events = EventWriter(exp / event_file_name()) if dist.main else None
    say(loop.describe(step, max_steps))
    if not loop.validator:
        say("warning: the validation split holds no document: no val_loss")
    if cfg.model.get("restore_from_ckpt") and step < max_steps and loop.validator is not None:
        # The base checkpoint on this run's validation data, before any training: the eval gate compares
        # the new checkpoint with the champion on the same data (retrain.steps.metrics_from reads it as
        # the val_loss at the base step; NeMo's script validates only during fit, so its runs are
        # compared with the champion's own val_loss instead).
        base_val = loop.validate()
        if events and base_val is not None:
            events.scalars(step, {"val_loss": base_val})
            say(f"step {step} (base checkpoint) val_loss {base_val:.4f}")
    metrics: dict[str, float] = {}
    log_every, interval = max(1, int(cfg.trainer.log_every_n_steps)), int(cfg.trainer.val_check_interval)
    start_step = step
    while step < max_steps:
        step += 1
        lr = schedule.at(step)
        loss_sum = loop.step(step, lr)
        consumed += shape.global_batch_size
        if step % log_every == 0 or step == max_steps or step == start_step + 1:
            train_loss = loop.reduce(loss_sum)
            if not math.isfinite(train_loss):
                return fail(f"reduced_train_loss is {train_loss} at step {step}")
            metrics.update(reduced_train_loss=train_loss, consumed_samples=float(consumed), step=step)
            _log_training(events, step, max_steps, train_loss, lr, consumed)
        if step % interval == 0:  # Lightning's val_check_interval, in steps of the whole training
            metrics.update(consumed_samples=float(consumed), step=step)
            if (val := loop.validate()) is not None:
                metrics["val_loss"] = val
                if events:
                    events.scalars(step, {"val_loss": val})
                say(f"step {step} val_loss {val:.4f}")
                if dist.main:
                    saved.validated(val, step, consumed, metrics)
    if dist.main:
        metrics.update(consumed_samples=float(consumed), step=step)
        last = latest_last(checkpoints)
        if last is None or f"step={step}-" not in last.name:
            last = saved.save_last(
                step, consumed, metrics
            )  # the end of training saves one too (on_train_end)
        say(f"done: step {step}, {time.time() - t0:.1f}s -> {last}")
    finish(dist, torch)
    return 0


def main(argv: list[str] | None = None) -> int:
    overrides = sys.argv[1:] if argv is None else argv
    try:
        cfg = compose(CONFIG_DIR, CONFIG_NAME, overrides)
        check_config(cfg)
    except PlanError as e:
        return fail(str(e))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    expected = int(cfg.trainer.num_nodes) * int(cfg.trainer.devices)
    if world != expected:
        return fail(
            f"torchrun started {world} process(es) but trainer.num_nodes x trainer.devices = {expected}"
        )
    return train_or_check(cfg, _train, data_check)


if __name__ == "__main__":
    sys.exit(main())
