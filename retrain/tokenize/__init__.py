"""Raw text -> Megatron indexed datasets (.bin/.idx) with Beam: FnApiRunner locally, Dataflow in the cloud."""

from retrain.tokenize.pipeline import tokenize_incremental, tokenize_to_prefix
from retrain.tokenize.tokenizer import load_gpt2_tokenizer

__all__ = ["load_gpt2_tokenizer", "tokenize_incremental", "tokenize_to_prefix"]
