"""Tokenization throughput on the shared corpus, in one run, same documents for every contender.

    python bench/tokenize_bench.py [--repeat 4] [--workers 2] [--doc-bytes 4000]

* ceiling: the bare tokenizer's ``encode_batch`` over the documents held in memory, in ~1 MiB calls
  (also: one call for everything, and ``encode_batch_fast``), ids fetched, as MB/s of JSONL input;
* pipeline: ``tokenize_to_prefix`` end to end (FnApiRunner start-up included), and the same minus the
  start-up measured on a one-line input;
* megatron-style: an emulation of Megatron-LM tools/preprocess_data.py with a HF tokenizer
  (multiprocessing.Pool(workers).imap(encode, lines, 32), one ``encode`` per document, json.loads per
  line, IndexedDatasetBuilder-style np.array + write per document in the parent).  It is an emulation,
  not Megatron itself (no NLTK, no torch import, no Megatron start-up).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

CORPUS = Path(os.environ.get("RETRAIN_CORPUS", Path(__file__).resolve().parents[2] / "shared" / "corpus"))


def make_jsonl(path: Path, repeat: int, doc_bytes: int) -> list[str]:
    docs: list[str] = []
    for f in sorted(CORPUS.glob("*.txt")):
        cur = ""
        for para in f.read_text(encoding="utf-8").split("\n\n"):
            cur += para + "\n\n"
            if len(cur) >= doc_bytes:
                docs.append(cur)
                cur = ""
        if cur:
            docs.append(cur)
    docs = docs * repeat
    with open(path, "w", encoding="utf-8") as out:
        for d in docs:
            out.write(json.dumps({"text": d}) + "\n")
    return docs


_TOK = None


def _init() -> None:
    global _TOK
    from retrain.tokenize import load_gpt2_tokenizer

    _TOK = load_gpt2_tokenizer()


def _encode(line: str) -> tuple[list[int], int]:
    ids = _TOK.encode(json.loads(line)["text"]).ids  # type: ignore[union-attr]
    if ids:
        ids.append(50256)
    return ids, len(line)


def megatron_style(src: Path, out: Path, workers: int) -> float:
    t = time.perf_counter()
    ctx = multiprocessing.get_context("fork")
    lengths: list[int] = []
    with (
        ctx.Pool(workers, initializer=_init) as pool,
        open(src, encoding="utf-8") as fin,
        open(out, "wb") as fb,
    ):
        for ids, _ in pool.imap(_encode, fin, 32):
            arr = np.array(ids, dtype=np.uint16)
            fb.write(arr.tobytes(order="C"))
            lengths.append(arr.size)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=4, help="corpus copies (5.8 MB each)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--doc-bytes", type=int, default=4000)
    ap.add_argument("--skip-megatron", action="store_true")
    ap.add_argument("--trials", type=int, default=2, help="best of N for every contender")
    args = ap.parse_args()

    from retrain.tokenize import load_gpt2_tokenizer, tokenize_to_prefix

    tmp = Path(tempfile.mkdtemp(prefix="tokbench-"))
    src = tmp / "corpus.jsonl"
    docs = make_jsonl(src, args.repeat, args.doc_bytes)
    mb = src.stat().st_size / 1e6
    print(f"input: {len(docs)} documents, {mb:.1f} MB JSONL, {os.cpu_count()} cpus, workers={args.workers}")
    results: dict[str, float] = {}

    tok = load_gpt2_tokenizer()
    chunks, cur, size = [], [], 0
    for d in docs:  # ~1 MiB of text per call, as the pipeline does
        cur.append(d)
        size += len(d)
        if size >= 1 << 20:
            chunks.append(cur)
            cur, size = [], 0
    chunks += [cur] if cur else []

    def best(fn) -> float:
        times = []
        for _ in range(args.trials):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    results["ceiling encode_batch, 1 call"] = best(lambda: [e.ids for e in tok.encode_batch(docs)])
    results["ceiling encode_batch"] = best(lambda: [[e.ids for e in tok.encode_batch(c)] for c in chunks])
    results["ceiling encode_batch_fast"] = best(
        lambda: [[e.ids for e in tok.encode_batch_fast(c)] for c in chunks]
    )

    tiny = tmp / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "warm up"}) + "\n")
    startup = best(lambda: tokenize_to_prefix([str(tiny)], str(tmp / "tiny"), workers=args.workers))
    reports = []
    results["pipeline end-to-end"] = best(
        lambda: reports.append(tokenize_to_prefix([str(src)], str(tmp / "out"), workers=args.workers))
    )
    results["pipeline minus start-up"] = results["pipeline end-to-end"] - startup
    report = reports[-1]
    print(f"  pipeline: {report['documents']} docs, {report['tokens']} tokens, start-up {startup:.2f}s")

    if not args.skip_megatron:
        results["megatron-style (emulated)"] = best(
            lambda: megatron_style(src, tmp / "megatron.bin", args.workers)
        )
        same = (tmp / "megatron.bin").read_bytes() == (tmp / "out_text_document.bin").read_bytes()
        print(f"  megatron-style .bin identical to pipeline .bin: {same}")

    ceiling = results["ceiling encode_batch"]
    fastest = min(v for k, v in results.items() if k.startswith("ceiling"))
    print(
        f"\n{f'contender (best of {args.trials})':34} {'seconds':>8} {'MB/s':>7} {'x encode_batch':>14} "
        f"{'x best bare':>11}"
    )
    for name, secs in results.items():
        print(f"{name:34} {secs:8.2f} {mb / secs:7.2f} {ceiling / secs:14.2f} {fastest / secs:11.2f}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
