"""Raw text -> Megatron indexed datasets (.bin/.idx) with Beam: FnApiRunner locally, Dataflow in the cloud.

The pipeline (``retrain_tokenize.pipeline``, which imports Beam) is loaded on first use, so that the
tokenizer's own module stays light for its other users (the render CLI, the trainer's checks).
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_gpt2_tokenizer", "tokenize_incremental", "tokenize_to_prefix"]


def __getattr__(name: str) -> Any:
    if name in ("tokenize_incremental", "tokenize_to_prefix"):
        from retrain_tokenize import pipeline

        return getattr(pipeline, name)
    if name == "load_gpt2_tokenizer":
        from retrain_tokenize import tokenizer

        return tokenizer.load_gpt2_tokenizer
    raise AttributeError(name)
