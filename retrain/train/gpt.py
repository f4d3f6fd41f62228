"""A small decoder-only GPT trained on a Megatron blend: the local stand-in for NeMo's pre-training.

    python -m retrain.train.gpt --data-prefix [W] PREFIX ... --checkpoint-dir URI [--max-steps 60]
        [--seq-len 128] [--batch-size 8] [--d-model 128] [--layers 2] [--heads 4] [--lr 3e-4]
        [--seed 1234] [--log-every 10] [--vocab-size V] [--resume-from URI] [--save-every 20]

Samples windows of seq_len + 1 tokens across the blend by its weights, trains with AdamW (gradient
clipping 1.0) and writes to the checkpoint dir (a local folder or gs://): ``model.pt`` (model,
optimizer, step, config), ``loss.jsonl`` (a line every log step) and ``metrics.json``.

``--max-steps`` is the total step to reach (like Lightning's ``trainer.max_steps``), not a count for
this invocation: when the checkpoint dir already holds model.pt (a pod restarted after a preemption),
or ``--resume-from`` names a model.pt (or a folder holding one), training continues from its step up
to ``--max-steps``; a checkpoint already there exits 0 at once.  model.pt is saved every
``--save-every`` steps and at the end, atomically (a temporary file renamed over it, or one upload),
so a pod killed at any moment leaves the last complete checkpoint and its restart loses at most
``--save-every`` steps.  Batches depend only on (seed, step, rank), so a resumed run ends with the
weights an uninterrupted one would have.

Under torchrun (WORLD_SIZE > 1) it joins a gloo process group from MASTER_ADDR/MASTER_PORT/RANK and
trains with DistributedDataParallel; only rank 0 writes.  Without flags, the JobSet's environment
supplies the run: RETRAIN_DATA_PREFIX (JSON), RETRAIN_CHECKPOINT_DIR, RETRAIN_RESUME_FROM,
RETRAIN_MAX_STEPS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ModuleNotFoundError as _exc:  # pragma: no cover - exercised only where torch is missing
    if _exc.name != "torch":
        raise
    raise SystemExit(
        "retrain.train.gpt needs PyTorch (pip install -e '.[train]'); "
        "without it run the data check: python -m retrain.train.datacheck"
    ) from _exc

from retrain.adapters import objects
from retrain.train.data import DataError, WindowSampler, env_blend, load_blend, vocab_size_for, write_json

DEFAULTS = {"seq_len": 128, "d_model": 128, "layers": 2, "heads": 4}
DEFAULT_SAVE_EVERY = 20
EXIT_DATA = 2


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


def model_uri(checkpoint_dir: str) -> str:
    return objects.join(checkpoint_dir, "model.pt")


def resolve_checkpoint(uri: str) -> str:
    """``--resume-from`` may name model.pt itself or the folder holding it."""
    return uri if uri.endswith(".pt") else model_uri(uri)


def discard_partial_saves(uri: str) -> None:
    """Remove the temporary files of saves a kill cut short (never model.pt itself)."""
    if objects.is_gcs(uri):
        return
    path = Path(uri)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            stale.unlink()


def load_checkpoint(uri: str) -> dict[str, Any]:
    if objects.is_gcs(uri):
        with tempfile.TemporaryDirectory(prefix="retrain-ckpt-") as tmp:
            local = os.path.join(tmp, "model.pt")
            objects.download_file(uri, local)
            return dict(torch.load(local, map_location="cpu", weights_only=True))
    return dict(torch.load(uri, map_location="cpu", weights_only=True))


def save_checkpoint(uri: str, state: dict[str, Any]) -> None:
    """Write model.pt atomically: a reader (or a restarted pod) sees the previous file or the new one,
    never a torn one.  Locally a uniquely named temporary file in the same folder is written, synced
    and renamed over ``uri``; on gs:// the object is replaced by one upload (GCS writes are atomic)."""
    if objects.is_gcs(uri):
        with tempfile.TemporaryDirectory(prefix="retrain-ckpt-") as tmp:
            local = os.path.join(tmp, "model.pt")
            torch.save(state, local)
            objects.upload_file(local, uri)
        return
    path = Path(uri)
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


class LossLog:
    """``loss.jsonl`` in the checkpoint dir: appended locally, rewritten whole on gs:// (no appends).

    On resume, lines past the resumed step (written after the last checkpoint) are dropped."""

    def __init__(self, checkpoint_dir: str, keep_through_step: int) -> None:
        self.uri = objects.join(checkpoint_dir, "loss.jsonl")
        self.lines: list[str] = []
        if keep_through_step > 0 and objects.exists(self.uri):
            for line in objects.read_bytes(self.uri).decode("utf-8").splitlines():
                try:
                    if int(json.loads(line)["step"]) <= keep_through_step:
                        self.lines.append(line)
                except (ValueError, KeyError, TypeError):
                    continue
        self._flush_all()

    def _flush_all(self) -> None:
        objects.write_bytes(
            self.uri, "".join(s + "\n" for s in self.lines).encode("utf-8"), "application/x-ndjson"
        )

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record)
        self.lines.append(line)
        if objects.is_gcs(self.uri):
            self._flush_all()
        else:
            with open(self.uri, "a", encoding="utf-8") as f:
                f.write(line + "\n")


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m retrain.train.gpt", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--data-prefix",
        nargs="+",
        default=env_blend(),
        help="Megatron blend: PREFIX ... or WEIGHT PREFIX ...; local or gs://; @URI reads a tokenize "
        "report's data_prefix_blend (default: $RETRAIN_DATA_PREFIX)",
    )
    p.add_argument("--checkpoint-dir", default=os.environ.get("RETRAIN_CHECKPOINT_DIR"))
    p.add_argument("--resume-from", default=os.environ.get("RETRAIN_RESUME_FROM") or None)
    p.add_argument(
        "--max-steps",
        type=int,
        default=_env_int("RETRAIN_MAX_STEPS", 60),
        help="the total step to reach: a resumed checkpoint trains only the remaining steps",
    )
    p.add_argument("--seq-len", type=int, help=f"default {DEFAULTS['seq_len']} (or the checkpoint's)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step per process")
    p.add_argument("--d-model", type=int, help=f"default {DEFAULTS['d_model']} (or the checkpoint's)")
    p.add_argument("--layers", type=int, help=f"default {DEFAULTS['layers']} (or the checkpoint's)")
    p.add_argument("--heads", type=int, help=f"default {DEFAULTS['heads']} (or the checkpoint's)")
    p.add_argument(
        "--vocab-size", type=int, help="default: from the data (50257 for GPT-2 ids) or the checkpoint"
    )
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--save-every",
        type=int,
        default=_env_int("RETRAIN_SAVE_EVERY", DEFAULT_SAVE_EVERY),
        help=f"checkpoint every N steps as well as at the end (default {DEFAULT_SAVE_EVERY}; "
        "0: only at the end)",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: <= 2, shared by local ranks)")
    return p


def model_config(args: argparse.Namespace, ckpt: dict[str, Any] | None, max_token_id: int) -> GPTConfig:
    """The checkpoint's architecture when resuming (flags may only repeat it), else flags/defaults."""
    flags = {
        "seq_len": args.seq_len,
        "d_model": args.d_model,
        "layers": args.layers,
        "heads": args.heads,
        "vocab_size": args.vocab_size,
    }
    if ckpt is not None:
        saved = dict(ckpt["config"])
        for k, v in flags.items():
            if v is not None and v != saved[k]:
                raise DataError(f"--{k.replace('_', '-')} {v} differs from the checkpoint's {saved[k]}")
        cfg = GPTConfig(**{k: int(saved[k]) for k in flags})
    else:
        values = {k: (v if v is not None else DEFAULTS.get(k)) for k, v in flags.items()}
        if values["vocab_size"] is None:
            values["vocab_size"] = vocab_size_for(max_token_id)
        try:
            cfg = GPTConfig(**{k: int(v) for k, v in values.items() if v is not None})
        except ValueError as exc:
            raise DataError(str(exc)) from exc
    if max_token_id >= cfg.vocab_size:
        raise DataError(
            f"the data holds token id {max_token_id}, beyond the model's vocabulary of {cfg.vocab_size}"
        )
    return cfg


def already_done(
    args: argparse.Namespace, dist: Dist, ckpt: dict[str, Any], ckpt_uri: str, t0: float, say: Any
) -> dict[str, Any] | None:
    """The checkpoint dir's model.pt has reached ``--max-steps`` (a pod restarted after its last save):
    nothing to train.  metrics.json is left alone when it describes that step, else written anew."""
    step = int(ckpt["step"])
    say(f"{ckpt_uri} is at step {step} >= --max-steps {args.max_steps}: nothing to train")
    if not dist.main:
        return None
    metrics_uri = objects.join(args.checkpoint_dir, "metrics.json")
    if objects.exists(metrics_uri):
        with contextlib.suppress(ValueError):
            old = json.loads(objects.read_bytes(metrics_uri))
            if isinstance(old, dict) and old.get("steps") == step:
                return old
    metrics = {
        "trainer": "gpt",
        "steps": step,
        "start_step": step,
        "run_steps": 0,
        "final_loss": None,
        "initial_loss": None,
        "tokens_seen": int(ckpt.get("tokens_seen", 0)),
        "seconds": round(time.time() - t0, 3),
        "train_seconds": 0.0,
        "parameters": sum(v.numel() for v in ckpt["model"].values()),
        "config": dict(ckpt["config"]),
        "world_size": dist.world,
        "resumed_from": ckpt_uri,
        "checkpoint": ckpt_uri,
    }
    write_json(metrics_uri, metrics)
    return metrics


def train(args: argparse.Namespace, dist: Dist) -> dict[str, Any] | None:
    say = (lambda msg: print(msg, flush=True)) if dist.main else (lambda msg: None)
    t0 = time.time()
    ckpt_uri = model_uri(args.checkpoint_dir)
    resume_uri = None
    if objects.exists(ckpt_uri):
        resume_uri = ckpt_uri
    elif args.resume_from:
        resume_uri = resolve_checkpoint(args.resume_from)
        if not objects.exists(resume_uri):
            raise DataError(f"--resume-from {resume_uri} does not exist")
    if dist.main:
        discard_partial_saves(ckpt_uri)
    ckpt = load_checkpoint(resume_uri) if resume_uri else None
    if ckpt is not None and resume_uri == ckpt_uri and int(ckpt["step"]) >= args.max_steps:
        return already_done(args, dist, ckpt, ckpt_uri, t0, say)

    blend = load_blend(args.data_prefix)
    cfg = model_config(args, ckpt, blend.max_token_id())
    sampler = WindowSampler(blend, cfg.seq_len, args.seed)
    for prefix in sampler.short_datasets():
        say(f"warning: {prefix} is shorter than a window of {cfg.seq_len + 1} tokens; read circularly")

    torch.manual_seed(args.seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    start_step, tokens_seen, prior_seconds = 0, 0, 0.0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        for group in optimizer.param_groups:
            group["lr"] = args.lr
        start_step = int(ckpt["step"])
        tokens_seen = int(ckpt.get("tokens_seen", 0))
        prior_seconds = float(ckpt.get("seconds", 0.0))
        say(f"resuming from {resume_uri} at step {start_step}")
    net: nn.Module = model
    if dist.active:
        net = torch.nn.parallel.DistributedDataParallel(model)

    final_step = max(start_step, args.max_steps)
    log = LossLog(args.checkpoint_dir, start_step) if dist.main else None
    params = parameter_count(model)
    say(
        f"gpt: {params:,} parameters {asdict(cfg)}; {len(blend.datasets)} dataset(s), "
        f"{blend.tokens:,} tokens; steps {start_step}->{final_step}, batch {args.batch_size}x{dist.world}, "
        f"{torch.get_num_threads()} thread(s)"
    )

    def checkpoint(step: int, seconds: float) -> None:
        if dist.main:
            save_checkpoint(
                ckpt_uri,
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "config": asdict(cfg),
                    "tokens_seen": tokens_seen,
                    "seconds": seconds,
                    "seed": args.seed,
                    "data_prefix": [str(x) for x in args.data_prefix],
                },
            )

    tokens_per_step = args.batch_size * cfg.seq_len * dist.world
    initial_loss = final_loss = None
    train_start = time.time()
    net.train()
    for step in range(start_step + 1, final_step + 1):
        batch = torch.from_numpy(sampler.batch(args.batch_size, step, dist.rank))
        loss = net(batch[:, :-1], batch[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        tokens_seen += tokens_per_step
        is_log = step == start_step + 1 or step == final_step or step % max(1, args.log_every) == 0
        if is_log:
            value = loss.detach().clone()
            if dist.active:
                torch.distributed.all_reduce(value)
                value /= dist.world
            lv = float(value)
            if not math.isfinite(lv):
                raise RuntimeError(f"loss is {lv} at step {step}")
            initial_loss = lv if initial_loss is None else initial_loss
            final_loss = lv
            elapsed = time.time() - train_start
            if log is not None:
                log.append(
                    {
                        "step": step,
                        "loss": round(lv, 6),
                        "tokens": tokens_seen,
                        "seconds": round(prior_seconds + elapsed, 3),
                    }
                )
            say(
                f"step {step}/{final_step} loss {lv:.4f} tokens {tokens_seen} "
                f"{elapsed:.1f}s ({(step - start_step) * tokens_per_step / max(elapsed, 1e-9):.0f} tok/s)"
            )
        if args.save_every and step % args.save_every == 0 and step != final_step:
            checkpoint(step, prior_seconds + time.time() - train_start)

    run_seconds = time.time() - train_start
    checkpoint(final_step, prior_seconds + run_seconds)
    blend.close()
    if not dist.main:
        return None
    metrics = {
        "trainer": "gpt",
        "steps": final_step,
        "start_step": start_step,
        "run_steps": final_step - start_step,
        "final_loss": final_loss,
        "initial_loss": initial_loss,
        "tokens_seen": tokens_seen,
        "seconds": round(time.time() - t0, 3),
        "train_seconds": round(run_seconds, 3),
        "parameters": params,
        "config": asdict(cfg),
        "world_size": dist.world,
        "resumed_from": resume_uri,
        "checkpoint": ckpt_uri,
    }
    write_json(objects.join(args.checkpoint_dir, "metrics.json"), metrics)
    say(f"done: step {final_step}, loss {initial_loss} -> {final_loss}, {run_seconds:.1f}s -> {ckpt_uri}")
    return metrics


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not args.data_prefix:
        p.error("--data-prefix is required (or $RETRAIN_DATA_PREFIX)")
    if not args.checkpoint_dir:
        p.error("--checkpoint-dir is required (or $RETRAIN_CHECKPOINT_DIR)")
    if args.max_steps < 0 or args.batch_size < 1:
        p.error("--max-steps must be >= 0 and --batch-size >= 1")
    dist = init_distributed()
    configure_threads(args.threads, dist)
    try:
        train(args, dist)
        if dist.active:
            # Rank 0 writes the checkpoint while the others are done: without this, a peer tearing down
            # its gloo pairs first can abort rank 0 ("terminate called without an active exception").
            torch.distributed.barrier()
    except DataError as exc:
        print(f"gpt: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_DATA
    finally:
        if dist.active and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
