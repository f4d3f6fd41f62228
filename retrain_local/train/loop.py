"""The toy GPT's training mechanics, shared by the local stand-ins of both trainer profiles.

Each stand-in (:mod:`retrain_local.train.standin` for NeMo 24.12,
:mod:`retrain_local.train.bridge_standin` for Megatron-Bridge) reads its trainer's own command and keeps
its trainer's contract -- where checkpoints go and how they are named, what resumes, which TensorBoard
tags -- and both train the same model the same way: Megatron's batch arithmetic (micro-batches per rank,
accumulated to the global batch), AdamW with warm-up then cosine decay, validation on the validation
split.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retrain_local.train.data import DataError, WindowSampler

#: The stand-in's model, whatever the command's architecture says (two CPU cores must train it).
D_MODEL, LAYERS, HEADS = 64, 2, 4


def say(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, flush=True)


def fail(msg: str) -> int:
    print(f"Error executing job: {msg}", file=sys.stderr, flush=True)
    return 1


#: A split string that puts every document in the first split (a per-split blend is used whole).
WHOLE = "1,0,0"


def vocab_size(vocab_file: str, blend: Any) -> int:
    """Rows of the embedding: the vocabulary file's ids (GPT-2's ``encoder.json``: 50257); DataError when
    the blend holds a token id beyond them."""
    try:
        vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"tokenizer vocab_file {vocab_file}: {e}") from None
    size = max(int(i) for i in vocab.values()) + 1
    if blend.max_token_id() >= size:
        raise DataError(f"the data holds token id {blend.max_token_id()}, beyond the vocabulary of {size}")
    return size


def write_index_mapping(blend: Any, split: str, seed: int, into: Path) -> None:
    """Megatron's index-mapping (cache) files: each dataset's shuffled train document order, one ``.npy``."""
    into.mkdir(parents=True, exist_ok=True)
    for d in blend.datasets:
        key = hashlib.md5(f"{d.prefix}|{split}|{seed}".encode()).hexdigest()
        rng = np.random.default_rng(seed)
        np.save(into / f"{key}_train_doc_idx.npy", rng.permutation(d.data.documents).astype(np.int32))


@dataclass
class Schedule:
    """Cosine annealing with warm-up (NeMo's ``CosineAnnealing``, Megatron's ``cosine`` decay): linear to
    ``lr`` over ``warmup`` steps, then cosine down to ``min_lr`` at ``max_steps``."""

    lr: float
    min_lr: float
    warmup: int
    max_steps: int

    def at(self, step: int) -> float:
        if self.warmup and step <= self.warmup:
            return self.lr * step / self.warmup
        span = max(1, self.max_steps - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Shape:
    """One run's model and batch arithmetic, as its trainer's config gives them."""

    vocab: int
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    model_parallel: int
    seed: int
    weight_decay: float
    betas: tuple[float, float]
    val_batches: int
    clip: float = 0.0


class AdamW:
    """AdamW as ``torch.optim.AdamW`` computes it (decoupled weight decay, bias-corrected moments, its
    defaults' epsilon), with the part of its interface the loop uses.  Written out because torch.optim's
    first optimizer imports torch._dynamo (as DistributedDataParallel does): some 2.5 s of CPU in every
    rank of every run, more than the training itself of a test's run."""

    def __init__(
        self, torch: Any, params: list[Any], weight_decay: float, betas: tuple[float, float]
    ) -> None:
        self.torch, self.params = torch, params
        self.param_groups: list[dict[str, Any]] = [
            {"lr": 0.0, "weight_decay": weight_decay, "betas": betas, "eps": 1e-8}
        ]
        self.state: dict[int, dict[str, Any]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        torch, group = self.torch, self.param_groups[0]
        lr, decay, (beta1, beta2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.grad is None:
                    continue
                s = self.state.setdefault(
                    i, {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                )
                s["step"] += 1
                p.mul_(1 - lr * decay)
                s["exp_avg"].lerp_(p.grad, 1 - beta1)
                s["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                corrected = 1 - beta1 ** s["step"], math.sqrt(1 - beta2 ** s["step"])
                denominator = (s["exp_avg_sq"].sqrt() / corrected[1]).add_(eps)
                p.addcdiv_(s["exp_avg"], denominator, value=-lr / corrected[0])

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout: per-parameter state by index, and the groups."""
        groups = [{**g, "params": list(range(len(self.params)))} for g in self.param_groups]
        return {"state": {i: dict(s) for i, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """A state saved by this class or by torch.optim.AdamW (whose ``step`` is a tensor)."""
        self.state = {int(i): {**s, "step": int(s["step"])} for i, s in saved["state"].items()}
        kept = saved["param_groups"][0]
        self.param_groups[0].update({k: kept[k] for k in ("lr", "weight_decay", "betas", "eps") if k in kept})


class Loop:
    """The model, its optimizer and the two things a stand-in does with them: an optimizer step over one
    global batch, and a validation pass."""

    def __init__(self, torch: Any, gpt: Any, dist: Any, shape: Shape, train: Any, valid: Any) -> None:
        self.torch, self.gpt, self.dist, self.shape = torch, gpt, dist, shape
        self.data_parallel = dist.world // shape.model_parallel
        self.accumulation = shape.global_batch_size // (shape.micro_batch_size * self.data_parallel)
        torch.manual_seed(shape.seed)
        self.model = gpt.GPT(
            gpt.GPTConfig(
                vocab_size=shape.vocab, seq_len=shape.seq_length, d_model=D_MODEL, layers=LAYERS, heads=HEADS
            )
        )
        self.optimizer = AdamW(torch, list(self.model.parameters()), shape.weight_decay, shape.betas)
        if dist.active:  # every rank starts from rank 0's weights, as DistributedDataParallel makes them
            for p in self.model.parameters():
                torch.distributed.broadcast(p.data, 0)
        self.sampler = WindowSampler(train, shape.seq_length, shape.seed)
        self.validator = WindowSampler(valid, shape.seq_length, shape.seed + 1) if valid else None

    def describe(self, start: int, end: int) -> str:
        s = self.shape
        return (
            f"stand-in GPT ({self.gpt.parameter_count(self.model):,} parameters) on {self.dist.world} "
            f"rank(s): steps {start}->{end}, global batch {s.global_batch_size} = micro "
            f"{s.micro_batch_size} x DP {self.data_parallel} x {self.accumulation} accumulation, "
            f"sequence {s.seq_length}"
        )

    def state(self, step: int, consumed: int, **extra: Any) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": step,
            "consumed_samples": consumed,
            "config": asdict(self.model.cfg),
            **extra,
        }

    def restore(self, state: dict[str, Any], *, optimizer: bool) -> str | None:
        """Load a saved state's weights (and optimizer); why not, when it holds another model."""
        if dict(state["config"]) != asdict(self.model.cfg):
            return f"it holds a model of another shape: {state['config']}"
        self.model.load_state_dict(state["model"])
        if optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        return None

    def reduce(self, value: Any) -> float:
        value = value.detach().clone()
        if self.dist.active:
            self.torch.distributed.all_reduce(value)
            value /= self.dist.world
        return float(value)

    def validate(self) -> float | None:
        if self.validator is None:
            return None
        torch, micro = self.torch, self.shape.micro_batch_size
        self.model.eval()
        total = torch.zeros(())
        batches = max(1, self.shape.val_batches)
        with torch.no_grad():
            for b in range(batches):
                batch = torch.from_numpy(self.validator.batch(micro, b, self.dist.rank))
                total += self.model(batch[:, :-1], batch[:, 1:])
        self.model.train()
        return self.reduce(total / batches)

    def step(self, step: int, lr: float) -> Any:
        """One optimizer step at learning rate ``lr``; the step's loss (this rank's, a tensor)."""
        torch = self.torch
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros(())
        for a in range(self.accumulation):
            batch = torch.from_numpy(self.sampler.batch(self.shape.micro_batch_size, step, self.dist.rank, a))
            loss = self.model(batch[:, :-1], batch[:, 1:]) / self.accumulation
            loss.backward()
            loss_sum += loss.detach()
        if self.dist.active:  # the data-parallel gradient: its mean over the ranks, once per step
            for p in self.model.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= self.dist.world
        if self.shape.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.shape.clip)
        self.optimizer.step()
        return loss_sum


def train_or_check(cfg: Any, train: Any, check: Any) -> int:
    """A stand-in's job: ``train(cfg, dist, torch, gpt)`` in torchrun's process group (torn down after),
    or without PyTorch ``check(cfg)`` (the data read and checked, nothing trained); bad data is the
    job's failure message, not a traceback."""
    from retrain_local.train import torch_available

    try:
        if not torch_available():
            return int(check(cfg))
        import torch

        from retrain_local.train import gpt

        dist = gpt.init_distributed()
        gpt.configure_threads(None, dist)
        try:
            return int(train(cfg, dist, torch, gpt))
        finally:
            if dist.active and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    except DataError as e:
        return fail(str(e))


def finish(dist: Any, torch: Any) -> None:
    """Rank 0 writes while the others are done: without this barrier, a peer tearing down its gloo pairs
    first can abort rank 0 ("terminate called without an active exception")."""
    if dist.active:
        torch.distributed.barrier()
