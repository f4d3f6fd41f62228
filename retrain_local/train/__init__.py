"""What the local image runs in place of NeMo: a stand-in of its pre-training script and its parts.

* :mod:`retrain_local.train.standin`: NeMo 24.12's ``megatron_gpt_pretraining.py`` contract (Hydra overrides,
  data, exp_manager's layout, TensorBoard events) around a small GPT on PyTorch (CPU);
* :mod:`retrain_local.train.gpt`: that GPT, its atomic checkpoints and its process group;
* :mod:`retrain_local.train.data`: Megatron blends, document splits and window sampling (no torch);
* :mod:`retrain_local.train.datacheck`: the data check done instead of training where PyTorch is missing.

Importing this package never imports torch.
"""

from __future__ import annotations

import importlib.util


def torch_available() -> bool:
    """Whether PyTorch can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


__all__ = ["torch_available"]
