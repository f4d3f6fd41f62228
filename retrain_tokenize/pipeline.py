"""The tokenization pipeline: raw documents -> Megatron indexed datasets, as composable Beam transforms.

    splits | ReadDocuments | TokenizeDocuments --parts--+
                 |   \\--rejected, stats----------------+--> WriteIndexedDataset --> shard reports

* ReadDocuments streams each split (a byte range of a JSONL object, or a whole text/Parquet object)
  into batches of documents; bad records go to a ``rejected`` output with their reason.
* TokenizeDocuments runs the tokenizer's ``encode_batch`` over each batch and emits a *part*: its order
  key, per-document lengths and token ids.  A small shard's ids travel in the element; a large one's go to
  a temporary object, so that no element holds more than a batch's ids (``INLINE_SHARD_BYTES``).
* WriteIndexedDataset groups the metadata per output shard, orders parts by (input index, offset) and
  streams them into ``PREFIX_{key}_document.bin``, then writes the ``.idx``, ``PREFIX_quarantine.jsonl``
  and finally ``PREFIX_report.json`` (the commit marker).  Memory is bounded by a batch (or a small
  shard's ids) plus a shard's index, whatever the runner and the worker count; output bytes do not depend
  on either.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import IO, Any, TypeVar, cast

import apache_beam as beam
import numpy as np
from apache_beam.options.pipeline_options import PipelineOptions
from google.api_core.exceptions import NotFound

from retrain.adapters import objects
from retrain.contracts import TokenizeReport, tokenize_detail_uri
from retrain.domain.events import ObjectVersion
from retrain_tokenize import megatron, packs, records, tables
from retrain_tokenize.options import DEFAULT_OPTIONS, DEFAULT_PACKING, PackOptions, TokenizeOptions
from retrain_tokenize.records import Batch, Rejected, Split, SplitStats
from retrain_tokenize.tokenizer import LoadedTokenizer, TokenizerSpec, fingerprint, keep_tokenizer_files

log = logging.getLogger("retrain_tokenize")
T = TypeVar("T")
R = TypeVar("R")

ENCODE_BYTES = 1 << 20  # text per encode_batch call: enough documents for every core, bounded memory
#: A shard whose inputs are at most this many bytes carries its token ids in the parts' elements, to the
#: writer, instead of through temporary objects: a small object's shard otherwise took three more storage
#: round trips (write, read, delete), one after another on the worker.  The writer holds a shard's parts
#: at once, so the bound is on the shard, not the batch.
INLINE_SHARD_BYTES = 4 << 20
REJECTED = "rejected"
STATS = "stats"


# --------------------------------------------------------------------------------------------------
# Job description (built by the driver, shipped to workers)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardSpec:
    """One output: ``prefix``_{key}_document.bin/.idx, ``prefix``_report.json, ``prefix``_quarantine.jsonl."""

    prefix: str
    inputs: tuple[tuple[int, str, int], ...]  # (input index, uri, size in bytes)
    extra: tuple[tuple[str, Any], ...] = ()  # added to the shard report (object, sha256)

    @property
    def input_bytes(self) -> int:
        return sum(size for _, _, size in self.inputs)


@dataclass(frozen=True)
class Job:
    shards: tuple[ShardSpec, ...]
    json_keys: tuple[str, ...]
    tokenizer: TokenizerSpec
    append_eod: bool
    tmp_root: str
    run_id: str
    started_at: float
    fingerprint: str
    max_document_bytes: int = records.DEFAULT_MAX_DOCUMENT_BYTES
    batch_bytes: int = records.DEFAULT_BATCH_BYTES
    keep_empty: bool = False
    shard_of_input: dict[int, int] = field(default_factory=dict)

    def shard_of(self, input_index: int) -> int:
        return self.shard_of_input[input_index]


@dataclass
class Part:
    """Token ids of one batch per json key, in the element or in temporary objects, plus per-document
    token counts."""

    input_index: int
    first_offset: int
    uris: list[str]  # the temporary objects holding each key's ids; empty when ``inline``
    doc_lengths: list[np.ndarray]  # int32 per document (0: a document without tokens)
    inline: list[bytes] = field(default_factory=list)  # each key's ids, for a small shard

    def token_bytes(self, k: int) -> bytes:
        """The ids of json key number ``k``."""
        return self.inline[k] if self.inline else objects.read_bytes(self.uris[k])


# --------------------------------------------------------------------------------------------------
# Transforms
# --------------------------------------------------------------------------------------------------
class _ReadFn(beam.DoFn):
    def __init__(self, job: Job) -> None:
        self.job = job

    def process(self, split: Split) -> Iterator[Any]:
        reader = records.read_split(
            split,
            self.job.json_keys,
            max_document_bytes=self.job.max_document_bytes,
            batch_bytes=self.job.batch_bytes,
            keep_empty=self.job.keep_empty,
        )
        seen = 0  # records handed on (documents and rejections), for the accounting of a failure
        try:
            for item in reader:
                if isinstance(item, Batch):
                    seen += item.documents
                    yield item
                elif isinstance(item, Rejected):
                    seen += 1
                    yield beam.pvalue.TaggedOutput(REJECTED, item)
                else:
                    yield beam.pvalue.TaggedOutput(STATS, item)
        except Exception as e:  # unreadable past its checks (a torn object, an I/O error): set aside
            log.warning("%s: reading failed at byte %d: %s", split.uri, split.start, e)
            stats = records.SplitStats(split.input_index, split.start, records=seen + 1)
            stats.reasons[records.UNREADABLE] = 1
            detail = f"reading failed: {type(e).__name__}: {e}"[:500]
            yield beam.pvalue.TaggedOutput(
                REJECTED,
                Rejected(split.input_index, split.start, records.UNREADABLE, detail, "", 0, split.start),
            )
            yield beam.pvalue.TaggedOutput(STATS, stats)


class ReadDocuments(beam.PTransform):
    """PCollection[Split] -> {"docs": Batch, "rejected": Rejected, "stats": SplitStats}."""

    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job

    def expand(self, splits: beam.PCollection) -> beam.pvalue.DoOutputsTuple:
        return splits | beam.ParDo(_ReadFn(self.job)).with_outputs(REJECTED, STATS, main="docs")


def _chunks(texts: Sequence[str]) -> Iterator[tuple[int, int]]:
    start, size = 0, 0
    for i, t in enumerate(texts):
        size += len(t)
        if size >= ENCODE_BYTES:
            yield start, i + 1
            start, size = i + 1, 0
    if start < len(texts):
        yield start, len(texts)


def encode_batch(
    tok: LoadedTokenizer, texts: Sequence[str], append_eod: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(flat token ids, int32 token count per document), EOD after each document that has tokens."""
    dtype = tok.dtype
    eod = -1 if tok.eod is None else tok.eod
    if append_eod and tok.eod is None:
        raise ValueError("append_eod needs an end-of-document token")
    flats: list[np.ndarray] = []
    lens: list[np.ndarray] = []
    eod_array = np.array([max(eod, 0)], dtype=np.uint32)
    for start, end in _chunks(texts):
        arrays = tok.encode_arrays(texts[start:end])
        n = np.fromiter(map(len, arrays), dtype=np.int32, count=len(arrays))
        if append_eod:
            arrays = [part for a in arrays for part in ((a, eod_array) if len(a) else (a,))]
            n += (n > 0).astype(np.int32)
        flats.append(np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype))
        lens.append(n)
    if not lens:
        return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int32)
    return np.concatenate(flats), np.concatenate(lens)


class _TokenizeFn(beam.DoFn):
    def __init__(self, job: Job) -> None:
        self.job = job
        self.documents = beam.metrics.Metrics.counter("tokenize", "documents")
        self.tokens = beam.metrics.Metrics.counter("tokenize", "tokens")

    def setup(self) -> None:
        self.tok = self.job.tokenizer.load()

    def process(self, batch: Batch) -> Iterator[tuple[int, tuple[str, Part]]]:
        shard = self.job.shard_of(batch.input_index)
        inline = self.job.shards[shard].input_bytes <= INLINE_SHARD_BYTES
        part = Part(batch.input_index, batch.first_offset, [], [])
        for key, texts in zip(self.job.json_keys, batch.texts, strict=True):
            flat, n = encode_batch(self.tok, texts, self.job.append_eod)
            if inline:
                part.inline.append(flat.tobytes())
            else:
                uri = objects.join(
                    self.job.tmp_root,
                    f"{shard:05d}",
                    key,
                    f"{batch.input_index:06d}-{batch.first_offset:016d}.bin",
                )
                objects.write_bytes(uri, flat.tobytes())
                part.uris.append(uri)
            part.doc_lengths.append(n)
            self.tokens.inc(int(flat.size))
        self.documents.inc(batch.documents)
        yield shard, ("part", part)


class TokenizeDocuments(beam.PTransform):
    """PCollection[Batch] -> PCollection[(shard, ("part", Part))]: ids inline or in a temporary object."""

    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job

    def expand(self, batches: beam.PCollection) -> beam.PCollection:
        return batches | beam.ParDo(_TokenizeFn(self.job))


class _WriteShardFn(beam.DoFn):
    def __init__(self, job: Job) -> None:
        self.job = job

    def setup(self) -> None:
        self.tok = self.job.tokenizer.load()

    def process(self, element: tuple[int, Iterable[tuple[str, Any]]]) -> Iterator[dict[str, Any]]:
        shard_index, values = element
        yield write_shard(self.job, shard_index, values, self.tok)


def document_index(dtype: type[np.generic], doc_lengths: np.ndarray) -> bytes:
    """The .idx bytes for documents of ``doc_lengths`` tokens (one sequence each; an empty document
    keeps its place in the document index and adds no sequence)."""
    has_tokens = doc_lengths > 0
    doc_index = np.zeros(doc_lengths.size + 1, dtype=np.int64)
    np.cumsum(has_tokens, out=doc_index[1:])
    return megatron.encode_index(dtype, cast(Any, doc_lengths[has_tokens]), cast(Any, doc_index))


def write_shard(
    job: Job, shard_index: int, values: Iterable[tuple[str, Any]], tok: LoadedTokenizer
) -> dict[str, Any]:
    spec = job.shards[shard_index]
    report_uri = spec.prefix + "_report.json"
    parts: list[Part] = []
    rejected: list[Rejected] = []
    stats: list[SplitStats] = []
    for tag, v in values:
        groups: dict[str, list[Any]] = {"part": parts, "rejected": rejected, "stats": stats}
        groups[tag].append(v)
    if objects.exists(report_uri):  # a retried bundle after this run committed the shard
        done = json.loads(objects.read_bytes(report_uri))
        if done.get("run_id") == job.run_id:
            return cast(dict[str, Any], done)

    dtype = tok.dtype
    per_key, outputs = _concatenate(job, spec.prefix, parts, dtype)
    documents = list(per_key.values())[-1]["documents"] if per_key else 0  # every key has as many
    reasons = _write_quarantine(spec, rejected, stats)
    input_records = sum(s.records for s in stats)
    if input_records != documents + len(rejected):
        raise RuntimeError(
            f"{spec.prefix}: {input_records} records read, {documents} written + {len(rejected)} quarantined"
        )
    report: dict[str, Any] = {
        "documents": documents,
        "tokens": sum(v["tokens"] for v in per_key.values()),
        "quarantined": len(rejected),
        "input_records": input_records,
        "bytes": spec.input_bytes,
        "seconds": round(time.time() - job.started_at, 3),
        "outputs": outputs,
        "per_key": per_key,
        "quarantine_reasons": dict(sorted(reasons.items())),
        "inputs": [u for _, u, _ in spec.inputs],
        "dtype": np.dtype(dtype).name,
        "append_eod": job.append_eod,
        "eod": tok.eod if job.append_eod else None,
        "tokenizer": job.tokenizer.describe(),
        "fingerprint": job.fingerprint,
        "run_id": job.run_id,
        **dict(spec.extra),
    }
    objects.write_bytes(report_uri, json.dumps(report, indent=1).encode("utf-8"), "application/json")
    for p in parts:
        for u in p.uris:
            objects.delete(u)
    return report


def _concatenate(
    job: Job, prefix: str, parts: list[Part], dtype: Any
) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Each key's parts, in input order, as one Megatron dataset ``{prefix}_{key}_document``: its counts
    and its prefix, by key.  A part whose bytes are not its documents' tokens fails the shard."""
    itemsize = np.dtype(dtype).itemsize
    parts.sort(key=lambda p: (p.input_index, p.first_offset))
    per_key: dict[str, dict[str, int]] = {}
    outputs: dict[str, str] = {}
    for k, key in enumerate(job.json_keys):
        out_prefix = f"{prefix}_{key}_document"
        with _bin_writer(out_prefix + ".bin", inline=all(p.inline for p in parts)) as out:
            for p in parts:
                data = p.token_bytes(k)
                want = int(p.doc_lengths[k].astype(np.int64).sum()) * itemsize
                if len(data) != want:
                    where = p.uris[k] if p.uris else f"{p.input_index}@{p.first_offset}"
                    raise RuntimeError(f"part {where} holds {len(data)} bytes, expected {want}")
                out.write(data)
        dl = np.concatenate([p.doc_lengths[k] for p in parts]) if parts else np.zeros(0, np.int32)
        objects.write_bytes(out_prefix + ".idx", document_index(dtype, dl))
        per_key[key] = {
            "documents": int(dl.size),
            "sequences": int(np.count_nonzero(dl)),
            "tokens": int(dl.astype(np.int64).sum()),
        }
        outputs[key] = out_prefix
    return per_key, outputs


@contextmanager
def _bin_writer(uri: str, inline: bool) -> Iterator[IO[bytes]]:
    """Where a shard's .bin is written: a small shard's (its parts inline) in one upload, a large one's
    streamed (a resumable upload: two requests at the least, and memory bounded by its chunk)."""
    if not inline:
        with objects.open_write(uri) as out:
            yield out
        return
    buf = io.BytesIO()
    yield buf
    objects.write_bytes(uri, buf.getvalue())


def _write_quarantine(spec: ShardSpec, rejected: list[Rejected], stats: list[SplitStats]) -> dict[str, int]:
    """The shard's quarantined records, each with its object and its line in it (the splits' line counts
    give each split's first line), in ``{prefix}_quarantine.jsonl``; their count by reason."""
    uris = {i: u for i, u, _ in spec.inputs}
    line_base: dict[tuple[int, int], int] = {}
    for i in sorted({s.input_index for s in stats}):
        base = 0
        for s in sorted((s for s in stats if s.input_index == i), key=lambda s: s.start):
            line_base[(i, s.start)] = base
            base += s.lines
    rejected.sort(key=lambda r: (r.input_index, r.offset))
    reasons: dict[str, int] = {}
    lines = []
    for r in rejected:
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
        line = (
            None
            if r.line_in_split is None
            else line_base.get((r.input_index, r.split_start), 0) + r.line_in_split + 1
        )
        lines.append(json.dumps(r.to_json(uris[r.input_index], line)) + "\n")
    objects.write_bytes(
        spec.prefix + "_quarantine.jsonl", "".join(lines).encode("utf-8"), "application/jsonl"
    )
    return reasons


class WriteIndexedDataset(beam.PTransform):
    """{"parts", "rejected", "stats"} -> one Megatron dataset per shard; PCollection[shard report]."""

    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job

    def expand(self, pcolls: dict[str, beam.PCollection]) -> beam.PCollection:
        job = self.job
        rejected = pcolls["rejected"] | "KeyRejected" >> beam.Map(
            lambda r: (job.shard_of(r.input_index), ("rejected", r))
        )
        stats = pcolls["stats"] | "KeyStats" >> beam.Map(
            lambda s: (job.shard_of(s.input_index), ("stats", s))
        )
        return (
            (pcolls["parts"], rejected, stats)
            | "Flatten" >> beam.Flatten()
            | "GroupByShard" >> beam.GroupByKey()
            | "WriteShard" >> beam.ParDo(_WriteShardFn(job))
        )


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------
#: Beam's runners on this machine.  They run one SDK worker in process (``in_memory``), whatever
#: ``workers`` says: several workers talk to the runner over gRPC, and that data stream is corrupted now
#: and then under load (apache/beam#23944, open: "Unknown type tag", "Invalid PaneInfoEncoding"; #21104).
#: Here it failed a test's decode once; and the any-size bench, whose longest work in that phase is this
#: pipeline on two threads, grew to 20 GB under the whole suite until the kernel killed it (read as the
#: same corruption: a length decoded from garbage; not reproduced alone, in 14 runs).
#: Every core still tokenizes: the BPE encodes a batch on a thread per core (``TiktokenBPE``).
LOCAL_RUNNERS = ("FnApiRunner", "DirectRunner", "BundleBasedDirectRunner")


def pipeline_options(runner: str, workers: int, pipeline_args: Sequence[str] | None) -> PipelineOptions:
    """Beam's options for ``runner``: ``workers`` is Dataflow's ``max_num_workers`` (unless the pipeline
    arguments set it); the local runners run one in-process worker (``LOCAL_RUNNERS``)."""
    args = list(pipeline_args or [])
    kw: dict[str, Any] = {"runner": runner}
    if runner in LOCAL_RUNNERS:
        kw.update(direct_num_workers=1, direct_running_mode="in_memory")
    elif not any(a.startswith("--max_num_workers") for a in args):
        kw["max_num_workers"] = workers
    return PipelineOptions(args, **kw)


def build_pipeline(p: beam.Pipeline, job: Job, splits: Sequence[Split]) -> beam.PCollection:
    docs = p | "Splits" >> beam.Create(list(splits)) | "ReadDocuments" >> ReadDocuments(job)
    parts = docs.docs | "TokenizeDocuments" >> TokenizeDocuments(job)
    return {"parts": parts, "rejected": docs[REJECTED], "stats": docs[STATS]} | (
        "WriteIndexedDataset" >> WriteIndexedDataset(job)
    )


def _run(job: Job, splits: Sequence[Split], o: TokenizeOptions, finalize: Any = None) -> None:
    log.info(
        "tokenizing %d split(s) of %d input(s) into %d shard(s) with %s, %d worker(s)",
        len(splits),
        len(job.shard_of_input),
        len(job.shards),
        o.runner,
        o.workers,
    )
    p = beam.Pipeline(options=pipeline_options(o.runner, o.workers, o.pipeline_args))
    reports = build_pipeline(p, job, splits)
    if finalize is not None:
        _ = reports | "AllShards" >> beam.combiners.ToList() | "Finalize" >> beam.Map(finalize)
    result = p.run()
    if o.wait:
        result.wait_until_finish()
        if not objects.is_gcs(job.tmp_root):
            objects.remove_tree(job.tmp_root)
            parent = os.path.dirname(job.tmp_root.rstrip("/"))
            if os.path.isdir(parent) and not os.listdir(parent):
                os.rmdir(parent)


def _prepare(o: TokenizeOptions) -> tuple[TokenizerSpec, LoadedTokenizer]:
    spec = TokenizerSpec(o.vocab_file, o.merge_file, o.tokenizer_json, o.eod_id)
    tok = spec.load()  # fail early, in the driver, on bad tokenizer files
    if o.append_eod and tok.eod is None:
        raise ValueError("append_eod: the tokenizer has no end-of-document token; give eod_id")
    return spec, tok


def _side_by_side(fn: Callable[[T], R], items: Sequence[T], threads: int = 16) -> list[R]:
    """``fn`` of each item, in order, on up to ``threads`` threads: each call is a storage round trip."""
    with ThreadPoolExecutor(min(threads, max(1, len(items)))) as pool:
        return list(pool.map(fn, items))


def _stat_all(uris: Sequence[str]) -> list[objects.ObjectInfo]:
    return _side_by_side(objects.stat, uris)


def _sizes(uris: Sequence[str]) -> list[int]:
    return [info.size for info in _stat_all(uris)]


def content_hashes(infos: Sequence[objects.ObjectInfo], index_root: str) -> list[str]:
    """The sha256 of each object, read once per object version: the hash of ``uri`` at generation
    ``g`` is kept at ``index_root/<sha1(uri#g)>``, so a run over old objects plus a few new ones
    reads only the new ones' bytes (and one small index object per old one)."""

    def sha(info: objects.ObjectInfo) -> str:
        if info.generation is None:
            return records.sha256_of(info.uri)
        generation = info.generation if objects.is_gcs(info.uri) else None
        entry = objects.join(index_root, hashlib.sha1(f"{info.uri}#{info.generation}".encode()).hexdigest())
        try:
            known = objects.read_bytes(entry).decode()
        except (FileNotFoundError, NotFound):
            known = ""
        if len(known) == 64:
            return known
        digest = records.sha256_of(info.uri, generation)
        objects.write_bytes(entry, digest.encode(), "text/plain")
        return digest

    return _side_by_side(sha, infos, threads=8)


def tokenize_to_prefix(
    inputs: list[str], output_prefix: str, options: TokenizeOptions = DEFAULT_OPTIONS
) -> dict[str, Any]:
    """Tokenize every input, in order, into ``output_prefix``_{key}_document.bin/.idx (Megatron's layout).

    Returns the content of ``output_prefix``_report.json; with ``options.wait`` False (Dataflow
    templates), once the job is submitted.
    """
    started = time.time()
    o = options
    spec, tok = _prepare(o)
    run_id = uuid.uuid4().hex[:12]
    inputs, staged = tables.stage(inputs, objects.join(output_prefix + "_tmp", run_id, "bigquery"))
    uris = records.expand_inputs(inputs)
    sizes = _sizes(uris)
    job = Job(
        shards=(
            ShardSpec(
                output_prefix, tuple((i, u, s) for i, (u, s) in enumerate(zip(uris, sizes, strict=True)))
            ),
        ),
        json_keys=o.json_keys,
        tokenizer=spec,
        append_eod=o.append_eod,
        tmp_root=objects.join(output_prefix + "_tmp", run_id),
        run_id=run_id,
        started_at=started,
        fingerprint=fingerprint(spec, tok, o.json_keys, o.append_eod, o.keep_empty),
        max_document_bytes=o.max_document_bytes,
        batch_bytes=o.batch_bytes,
        keep_empty=o.keep_empty,
        shard_of_input=dict.fromkeys(range(len(uris)), 0),
    )
    splits = [
        s
        for i, (u, n) in enumerate(zip(uris, sizes, strict=True))
        for s in records.plan_splits(i, u, n, o.split_bytes)
    ]
    _run(job, splits, o)
    if not o.wait:
        return {"submitted": True, "run_id": run_id, "report": output_prefix + "_report.json"}
    tables.unstage(staged)
    report = cast(dict[str, Any], json.loads(objects.read_bytes(output_prefix + "_report.json")))
    if staged:
        report["tables"] = {t.source: {"rows": t.rows, "exported_to": t.object} for t in staged}
    return report


def _shard_entry(
    uri: str, generation: int | None, sha: str, prefix: str, report: dict[str, Any], key: str, reused: bool
) -> dict[str, Any]:
    per_key = report.get("per_key", {}).get(key, {})
    return {
        "object": uri,
        "generation": generation,
        "sha256": sha,
        "data_prefix": f"{prefix}_{key}_document",
        "documents": int(report["documents"]),
        "tokens": int(per_key.get("tokens", report["tokens"])),
        "reused": reused,
    }


QUARANTINED_LISTED = 100
"""Objects set aside whole that the report names (the workflow reads it into a variable, and the run
record copies them); every one is in the report's ``shards_uri`` object."""


def incremental_report(
    entries: list[dict[str, Any]],
    reports: dict[str, dict[str, Any]],
    seconds: float,
    tokenizer: dict[str, str],
    quarantined_objects: list[dict[str, Any]] | None = None,
    packed: Sequence[tuple[packs.Pack, bool]] = (),
    held_out: packs.Pack | None = None,
) -> dict[str, Any]:
    """The aggregate: totals over every object's shard (each distinct shard once), the shards, the packs
    and their blend, the held-out dataset, and the objects quarantined whole (unreadable, changed since
    they arrived, over a size limit).  ``packed``: each pack of the run, and whether this job wrote it."""
    totals = dict.fromkeys(("documents", "tokens", "quarantined", "input_records", "bytes"), 0)
    new = dict(totals)
    for prefix, r in reports.items():
        for k in totals:
            totals[k] += int(r[k])
        if any(e["data_prefix"].startswith(prefix) and not e["reused"] for e in entries):
            for k in new:
                new[k] += int(r[k])
    reasons: dict[str, int] = {}
    for r in reports.values():
        for reason, n in (r.get("quarantine_reasons") or {}).items():
            reasons[reason] = reasons.get(reason, 0) + int(n)
    return TokenizeReport(
        **totals,
        seconds=round(seconds, 3),
        new_objects=sum(1 for e in entries if not e["reused"]),
        reused_objects=sum(1 for e in entries if e["reused"]),
        tokenized=new,
        shards_uri=None,
        packs=[
            {"data_prefix": p.data_prefix, "tokens": p.tokens, "shards": len(p.members), "written": written}
            for p, written in packed
        ],
        data_prefix_blend=packs.blend([p for p, _ in packed]),
        held_out=None if held_out is None else _held_out_entry(held_out),
        tokenizer=tokenizer,
        quarantine_reasons=dict(sorted(reasons.items())),
        quarantined_objects=(quarantined_objects or [])[:QUARANTINED_LISTED],
        quarantined_object_count=len(quarantined_objects or []),
    ).to_dict()


def _held_out_entry(pack: packs.Pack) -> dict[str, Any]:
    return {"data_prefix": pack.data_prefix, "tokens": pack.tokens, "shards": len(pack.members)}


@dataclass(frozen=True)
class _Wanted:
    """One input object: a name taken literally at a recorded generation (a run's manifest), or whatever
    a pattern found (no generation: what is there now)."""

    uri: str
    generation: int | None
    md5: str = ""
    """The md5 it had when it arrived (base64, as GCS gives it); "" when not known."""


@dataclass(frozen=True)
class _Checked:
    """One input object before tokenizing: what it is and which generation to read, or why it is set
    aside whole."""

    wanted: _Wanted
    info: objects.ObjectInfo | None
    """The version read (its generation may be a newer one holding the same bytes)."""
    problem: tuple[str, str] | None  # (reason, detail)

    @property
    def read_generation(self) -> int | None:
        """The generation to read: the recorded one, or the current one holding the same bytes."""
        if self.wanted.generation is None or self.info is None:
            return None
        return self.info.generation if objects.is_gcs(self.info.uri) else self.wanted.generation


def _same_bytes_now(wanted: _Wanted) -> objects.ObjectInfo | None:
    """The object's current version when it holds the bytes ``wanted`` had (its md5), else None."""
    if not wanted.md5:
        return None
    try:
        current = objects.stat(wanted.uri)
    except FileNotFoundError:
        return None
    return current if current.md5_hash == wanted.md5 else None


def _check(wanted: _Wanted, max_decompressed: int) -> _Checked:
    uri, generation = wanted.uri, wanted.generation
    try:
        info = objects.stat(uri, generation)
    except FileNotFoundError:
        info = None
    if info is not None and generation and objects.is_gcs(uri) and info.generation != generation:
        # GCS answers a request for a gone generation with 404; a store that answers with the current
        # version instead (the local emulator keeps no history) is caught here just the same.
        info = None
    if info is None and generation:
        # The recorded generation is gone (overwritten, or the same file uploaded again, with no version
        # kept): the same bytes at the current generation are the same content, read there.
        info = _same_bytes_now(wanted)
        if info is None:
            detail = (
                f"generation {generation} is gone and the object does not hold its bytes now "
                "(overwritten with other content, or deleted, since it arrived)"
            )
            return _Checked(wanted, None, (records.OBJECT_CHANGED, detail))
        log.info(
            "%s: generation %s is gone; reading generation %s, the same bytes",
            uri,
            generation,
            info.generation,
        )
    if info is None:
        return _Checked(wanted, None, (records.UNREADABLE, "no such object"))
    problem = records.check_object(
        uri, info.generation if objects.is_gcs(uri) and generation else None, max_decompressed
    )
    return _Checked(wanted, info, problem)


def _wanted(patterns: list[str], pinned: Sequence[ObjectVersion]) -> list[_Wanted]:
    """Every input once, keyed by (name, generation): two generations of one name are two inputs; a
    pattern's match that is also pinned is read at its pinned generation only."""
    out: dict[tuple[str, int | None], _Wanted] = {}
    for version in pinned:
        out.setdefault(
            (version.uri, version.generation or None),
            _Wanted(version.uri, version.generation or None, version.md5),
        )
    named = {uri for uri, _ in out}
    for uri in records.expand_inputs(patterns) if patterns else []:
        if uri not in named:
            out.setdefault((uri, None), _Wanted(uri, None))
    return list(out.values())


def tokenize_incremental(
    objects_: list[str],
    shard_root: str,
    options: TokenizeOptions = DEFAULT_OPTIONS,
    *,
    pinned: Sequence[ObjectVersion] = (),
    report_uri: str | None = None,
    packing: PackOptions = DEFAULT_PACKING,
) -> dict[str, Any]:
    """Tokenize each object once into its own shard ``shard_root/<format>-<sha256 of its bytes>/data``.

    ``objects_`` are patterns (paths, globs, folders, gs:// URIs, ``bq://`` tables); ``pinned`` are
    objects named literally and read at exactly their generation (a run's manifest).  Objects whose shard
    is complete (its data_report.json exists) are reused, not re-read beyond hashing; an object that
    cannot be read (gone, changed since it arrived, not what its suffix says, decompressing past
    ``options.max_decompressed_bytes``) is quarantined whole, with its reason, and the others go on.  A
    shard made with other tokenizer settings is an error (use another shard_root), never reused.  The
    trainer reads the shards through the packs ``packing`` asks for (:mod:`retrain_tokenize.packs`), the
    report's blend, less the held-out set (never trained on).
    """
    started = time.time()
    o = options
    spec, tok = _prepare(o)
    fp = fingerprint(spec, tok, o.json_keys, o.append_eod, o.keep_empty)
    tokenizer_files = keep_tokenizer_files(spec, shard_root, fp)
    objects_, staged = tables.stage(objects_, objects.join(shard_root, "_bigquery", uuid.uuid4().hex[:12]))
    source = {t.object: t.source for t in staged}
    plan, quarantined_objects = _survey(_wanted(objects_, pinned), source, shard_root, fp, o)
    finish = _Finish(
        plan, shard_root, o.json_keys[0], started, tokenizer_files, quarantined_objects, report_uri, packing
    )
    if not plan.todo and not o.wait:
        # Every object's shard exists already (a retry, content given back and dropped again). A flex
        # template's launcher submits the job its program's pipeline leaves behind, and fails when there is
        # none ("Failed to read the job file", GoogleCloudPlatform/python-docs-samples#4894): so a job still
        # runs, one that only writes the report.
        p = beam.Pipeline(options=pipeline_options(o.runner, o.workers, o.pipeline_args))
        _ = p | "NothingNew" >> beam.Create([[]]) | "Report" >> beam.Map(finish)
        p.run()
        return {"submitted": True, "report": report_uri, "new_objects": 0}
    if plan.todo:
        job, splits = _new_shards_job(plan, source, shard_root, spec, fp, started, o)
        run_id = job.run_id
        _run(job, splits, o, finalize=None if o.wait else finish)
        if not o.wait:
            return {"submitted": True, "run_id": run_id, "report": report_uri, "new_objects": len(plan.todo)}
        for prefix, report in zip(plan.todo, _read_reports(list(plan.todo)), strict=True):
            if report is None:
                raise RuntimeError(f"the job finished without writing {prefix}_report.json")
            plan.reports[prefix] = report
    tables.unstage(staged)
    return finish([])


def _survey(
    wanted: list[_Wanted], source: Mapping[str, str], shard_root: str, fp: str, o: TokenizeOptions
) -> tuple[_ShardPlan, list[dict[str, Any]]]:
    """Every input checked (readable, the bytes it arrived with) and hashed: which contents need a shard
    written, which reuse one, and the objects set aside whole."""
    if not wanted:
        raise ValueError("no inputs")
    checked = _side_by_side(partial(_check, max_decompressed=o.max_decompressed_bytes), wanted)
    quarantined_objects = _quarantined(checked, source)
    readable = [c for c in checked if c.problem is None and c.info is not None]
    shas = content_hashes(
        [c.info for c in readable if c.info is not None], objects.join(shard_root, "_index")
    )
    plan = _plan_shards(readable, shas, source, shard_root, fp)
    log.info(
        "%d object(s): %d to tokenize, %d reused, %d quarantined",
        len(wanted),
        len(plan.todo),
        len(readable) - len(plan.todo),
        len(quarantined_objects),
    )
    return plan, quarantined_objects


def _new_shards_job(
    plan: _ShardPlan,
    source: Mapping[str, str],
    shard_root: str,
    spec: TokenizerSpec,
    fp: str,
    started: float,
    o: TokenizeOptions,
) -> tuple[Job, list[Split]]:
    """The job that writes the shards ``plan`` has to write, one per content, and the splits it reads."""
    run_id = uuid.uuid4().hex[:12]
    shards = tuple(
        ShardSpec(
            prefix,
            ((i, uri, size),),
            (("object", source.get(uri, uri)), ("sha256", sha), ("shard", prefix)),
        )
        for i, (prefix, (uri, size, _, sha)) in enumerate(plan.todo.items())
    )
    job = Job(
        shards=shards,
        json_keys=o.json_keys,
        tokenizer=spec,
        append_eod=o.append_eod,
        tmp_root=objects.join(shard_root, "_tmp", run_id),
        run_id=run_id,
        started_at=started,
        fingerprint=fp,
        max_document_bytes=o.max_document_bytes,
        batch_bytes=o.batch_bytes,
        keep_empty=o.keep_empty,
        shard_of_input={i: i for i in range(len(shards))},
    )
    splits = [
        s
        for i, (uri, size, generation, _) in enumerate(plan.todo.values())
        for s in records.plan_splits(i, uri, size, o.split_bytes, generation)
    ]
    return job, splits


def _quarantined(checked: list[_Checked], source: Mapping[str, str]) -> list[dict[str, Any]]:
    """The objects set aside whole, each with its reason (logged), named as the run named them."""
    out = [
        {
            "object": source.get(c.wanted.uri, c.wanted.uri),
            "generation": c.wanted.generation,
            "reason": c.problem[0],
            "detail": c.problem[1],
        }
        for c in checked
        if c.problem is not None
    ]
    for q in out:
        log.warning("quarantined %s: %s (%s)", q["object"], q["reason"], q["detail"])
    return out


@dataclass
class _ShardPlan:
    """Where each readable object's tokens are: a shard that exists (reused, its report read) or one this
    job writes."""

    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Shard prefix -> its report (the reused ones; the new ones join once written)."""
    todo: dict[str, tuple[str, int, int | None, str]] = field(default_factory=dict)
    """Shard prefix -> (the first object with its content, its size, the generation to read, its sha256)."""
    entries: list[tuple[str, int | None, str, str, bool]] = field(default_factory=list)
    """Per object, in order: (its name, its generation, sha256, its shard's prefix, reused)."""


def _plan_shards(
    readable: list[_Checked], shas: list[str], source: Mapping[str, str], shard_root: str, fp: str
) -> _ShardPlan:
    """Each object to its content's shard; a shard made with other tokenizer settings is an error (use
    another shard root), never reused."""
    plan = _ShardPlan()
    infos = [c.info for c in readable if c.info is not None]
    # The same bytes make other documents as another format: the shard is keyed by both.
    prefixes = [
        objects.join(shard_root, f"{records.detect_format(info.uri)}-{sha}", "data")
        for info, sha in zip(infos, shas, strict=True)
    ]
    unique = list(dict.fromkeys(prefixes))
    existing = dict(zip(unique, _read_reports(unique), strict=True))
    for c, info, sha, prefix in zip(readable, infos, shas, prefixes, strict=True):
        shown = source.get(info.uri, info.uri)  # a table's rows: named by the table, not the staged export
        if prefix in plan.todo or prefix in plan.reports:
            plan.entries.append((shown, c.wanted.generation, sha, prefix, True))
            continue
        r = existing[prefix]
        if r is not None:
            if r.get("fingerprint") != fp:
                raise ValueError(
                    f"{prefix} was tokenized with other settings ({r.get('fingerprint')} != {fp}); "
                    "use a shard_root per tokenizer"
                )
            plan.reports[prefix] = r
            plan.entries.append((shown, c.wanted.generation, sha, prefix, True))
        else:
            plan.todo[prefix] = (info.uri, info.size, c.read_generation, sha)
            plan.entries.append((shown, c.wanted.generation, sha, prefix, False))
    return plan


def _read_reports(prefixes: Sequence[str]) -> list[dict[str, Any] | None]:
    """Each shard's report (None: not written), read side by side: a run of many new objects asks for
    as many reports, and each costs a round trip."""

    def read(prefix: str) -> dict[str, Any] | None:
        try:
            return cast(dict[str, Any], json.loads(objects.read_bytes(prefix + "_report.json")))
        except FileNotFoundError:
            return None

    return _side_by_side(read, prefixes)


@dataclass(frozen=True)
class _Finish:
    """What the job does last, once its new shards are written (in the pipeline itself when nobody waits
    for it): the packs, the held-out set, and the report with each object's entry beside it."""

    plan: _ShardPlan
    shard_root: str
    key: str
    started: float
    tokenizer_files: dict[str, str]
    quarantined_objects: list[dict[str, Any]]
    report_uri: str | None
    packing: PackOptions

    def __call__(self, new_reports: Iterable[dict[str, Any]]) -> dict[str, Any]:
        all_reports = dict(self.plan.reports)
        for r in new_reports:
            all_reports[r["shard"]] = r
        entries = [
            _shard_entry(u, g, s, p, all_reports[p], self.key, reused)
            for u, g, s, p, reused in self.plan.entries
        ]
        members = [
            packs.Member(
                e["data_prefix"], e["tokens"], e["tokens"] * np.dtype(all_reports[p]["dtype"]).itemsize
            )
            for e, (_, _, _, p, _) in zip(entries, self.plan.entries, strict=True)
        ]
        trained, held = packs.hold_out(members, self.packing.hold_out_objects)
        run_packs = packs.plan_packs(
            trained,
            self.shard_root,
            self.key,
            pack_bytes=self.packing.pack_bytes,
            max_packs=self.packing.max_packs,
        )
        # The held-out shards make one dataset of their own, marked as this run's, under the shard root
        # like every pack: the training pods read it and cannot write it.
        held_out = packs.eval_pack(held, self.shard_root, self.key, self.packing.held_out_for)
        eval_packs = [held_out] if held_out is not None else []
        written = packs.write_packs([*run_packs, *eval_packs])
        log.info("%d shard(s) in %d pack(s), %d written now", len(members), len(run_packs), sum(written))
        held_prefixes = {m.data_prefix for m in held}
        for e in entries:
            e["held_out"] = e["data_prefix"] in held_prefixes
        agg = incremental_report(
            entries,
            all_reports,
            time.time() - self.started,
            self.tokenizer_files,
            self.quarantined_objects,
            list(zip(run_packs, written, strict=False)),
            eval_packs[0] if eval_packs else None,
        )
        if self.report_uri:
            # The report stays small whatever the run's size (the workflow reads it into a variable): each
            # object's entry goes beside it.
            agg["shards_uri"] = tokenize_detail_uri(self.report_uri)
            detail = json.dumps({"shards": entries, "quarantined_objects": self.quarantined_objects}).encode()
            objects.write_bytes(agg["shards_uri"], detail, "application/json")
            objects.write_bytes(
                self.report_uri, json.dumps(agg, indent=1).encode("utf-8"), "application/json"
            )
        return {**agg, "shards": entries}
