"""The training job the JobSet runs where NeMo does not: a small GPT (torch, CPU) or a data check.

* ``python -m retrain.train.gpt``: a small decoder-only GPT trained on the run's Megatron blend,
  torchrun-aware (gloo + DDP when WORLD_SIZE > 1); writes model.pt, loss.jsonl and metrics.json.
* ``python -m retrain.train.datacheck``: no torch needed; checks every dataset of the blend and
  writes metrics.json.

Importing this package never imports torch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

TRAINERS = {"gpt": "retrain.train.gpt", "datacheck": "retrain.train.datacheck"}


def torch_available() -> bool:
    """Whether PyTorch can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def trainer_command(
    trainer: str, data_prefix: Sequence[str | float], checkpoint_dir: str, max_steps: int
) -> list[str]:
    """The argv a JobSet pod runs for ``trainer`` ("gpt" or "datacheck")."""
    if trainer not in TRAINERS:
        raise ValueError(f"unknown trainer {trainer!r}: expected one of {', '.join(TRAINERS)}")
    if not data_prefix:
        raise ValueError("data_prefix is empty")
    argv = ["python", "-m", TRAINERS[trainer], "--data-prefix", *(str(x) for x in data_prefix)]
    argv += ["--checkpoint-dir", checkpoint_dir]
    if trainer == "gpt":
        argv += ["--max-steps", str(int(max_steps))]
    return argv


__all__ = ["TRAINERS", "torch_available", "trainer_command"]
