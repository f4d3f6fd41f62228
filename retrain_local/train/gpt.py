"""A small decoder-only GPT on PyTorch (CPU): the model, its checkpoints and its process group, for the
local stand-in of NeMo's pre-training script (:mod:`retrain_local.train.standin`).

The model is GPT-2 shaped at a toy scale (token and learned position embeddings, pre-LN blocks, an
output head tied to the token embedding).  Checkpoints are saved atomically: a reader (or a restarted
pod) sees the previous file or the new one, never a torn one.  Under torchrun (WORLD_SIZE > 1) ranks
join a gloo process group from MASTER_ADDR/MASTER_PORT/RANK.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int = 128
    d_model: int = 128
    layers: int = 2
    heads: int = 4

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.seq_len, self.d_model, self.layers, self.heads) < 1:
            raise ValueError(f"every model dimension must be positive: {self}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of heads {self.heads}")


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm, output head tied to the
    token embedding.  Linear and Embedding weights start as N(0, 0.02), biases as 0."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V], or the mean cross-entropy against ``targets`` when given."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's {self.cfg.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return F.linear(x, self.tok.weight)
        return tied_head_loss(x.reshape(-1, x.shape[-1]), self.tok.weight, targets.reshape(-1))


class _TiedHeadLoss(torch.autograd.Function):
    """Mean cross-entropy of ``h @ weight.T`` against ``targets``, computed a chunk of tokens at a time.

    The [tokens, vocab] logits are never materialised whole (GPT-2's vocabulary makes them the
    biggest tensor by far): each chunk's logits are computed transposed ([vocab, chunk], the faster
    layout for a tall weight), turned into softmax - onehot in place, and folded straight into the
    gradients, which backward then only scales.  Equal to ``F.cross_entropy(F.linear(h, weight), t)``.
    """

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        n = h.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        total = torch.zeros((), dtype=torch.float64)
        for s in range(0, n, chunk):
            hs, ts = h[s : s + chunk], targets[s : s + chunk]
            cols = torch.arange(ts.shape[0])
            logits = weight @ hs.T  # [vocab, chunk]
            picked = logits[ts, cols]
            peak = logits.amax(dim=0)
            probs = logits.sub_(peak).exp_()
            norm = probs.sum(dim=0)
            total += (peak + norm.log() - picked).sum(dtype=torch.float64)
            if want_h or want_w:
                probs.div_(norm)
                probs[ts, cols] -= 1.0  # d(loss_i)/d(logits_i), unscaled
                if grad_h is not None:
                    grad_h[s : s + chunk] = probs.T @ weight
                if grad_w is not None:
                    grad_w.addmm_(probs, hs)
        ctx.save_for_backward(
            grad_h.div_(n) if grad_h is not None else None, grad_w.div_(n) if grad_w is not None else None
        )
        return (total / n).to(h.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * grad_out if grad_h is not None else None,
            grad_w * grad_out if grad_w is not None else None,
            None,
            None,
        )


def tied_head_loss(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 128
) -> torch.Tensor:
    """Mean cross-entropy of the tied output head over flattened tokens ``h`` [N, d], ``targets`` [N]."""
    return _TiedHeadLoss.apply(h, weight, targets, chunk)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------- checkpoints


def discard_partial_saves(path: Path) -> None:
    """Remove the temporary files of saves a kill cut short (never the checkpoint itself)."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            stale.unlink()


def load_checkpoint(path: Path) -> dict[str, Any]:
    return dict(torch.load(path, map_location="cpu", weights_only=True))


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``path`` atomically: a uniquely named temporary file in the same folder is written, synced
    and renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp_path, "xb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# ------------------------------------------------------------------------------------------- training


@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw not in (None, "") else default


def init_distributed() -> Dist:
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return Dist()
    rank = _env_int("RANK", _env_int("NODE_RANK", 0))
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise SystemExit(f"WORLD_SIZE={world} but {name} is not set")
    os.environ["RANK"] = str(rank)
    timeout = timedelta(seconds=_env_int("RETRAIN_DIST_TIMEOUT_S", 300))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    return Dist(rank, world)


def configure_threads(requested: int | None, dist: Dist) -> int:
    """At most 2 threads, shared among the processes of this host."""
    if requested:
        n = requested
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local = _env_int("LOCAL_WORLD_SIZE", dist.world)
        n = max(1, min(2, cores // max(1, local)))
    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # only settable before any inter-op work
        torch.set_num_interop_threads(1)
    return n
