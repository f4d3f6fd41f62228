"""Incremental: each object tokenized once into a shard keyed by its sha256; old shards reused untouched."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import corpus_documents, megatron_bytes, read_pair, write_jsonl

from retrain_tokenize import megatron, tokenize_incremental
from retrain_tokenize.cli import main as cli_main
from retrain_tokenize.options import PackOptions, TokenizeOptions


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inc")
    docs = corpus_documents(max_bytes=40_000)
    (d / "in").mkdir()
    a = write_jsonl(d / "in" / "a.jsonl", docs[: len(docs) // 2])
    b = d / "in" / "b.txt"
    b.write_text(docs[-5])
    dup = d / "in" / "b-copy.txt"
    dup.write_text(docs[-5])
    root = d / "shards"
    first = tokenize_incremental([str(a), str(b)], str(root), report_uri=str(d / "r1.json"))
    before = _snapshot(root)
    c = write_jsonl(d / "in" / "c.jsonl", [*docs[len(docs) // 2 :], ""])
    out = d / "r2.json"
    rc = cli_main([str(a), str(b), str(c), str(dup), "--shard-root", str(root), "--report", str(out)])
    assert rc == 0
    return d, docs, first, before, _with_shards(out), (a, b, c, dup)


def _with_shards(report: Path) -> dict:
    """A written report with its per-object entries (kept beside it, so the report stays small)."""
    body = json.loads(report.read_text())
    return {**body, **json.loads(Path(body["shards_uri"]).read_text())}


def test_first_run_tokenizes_everything(two_runs):
    d, _, first, _, _, (a, b, _, _) = two_runs
    assert first["new_objects"] == 2 and first["reused_objects"] == 0
    assert [s["sha256"] for s in first["shards"]] == [_sha(a), _sha(b)]
    assert not any(s["reused"] for s in first["shards"])
    assert _with_shards(d / "r1.json") == first


def test_second_run_only_tokenizes_the_new_object(two_runs):
    d, _docs, _, before, second, (a, b, c, dup) = two_runs
    root = d / "shards"
    assert [s["object"] for s in second["shards"]] == [str(a), str(b), str(c), str(dup)]
    assert [s["reused"] for s in second["shards"]] == [True, True, False, True]
    assert second["new_objects"] == 1 and second["reused_objects"] == 3
    after = _snapshot(root)
    assert {k: v for k, v in after.items() if k in before} == before, "old shards were rewritten"
    assert {k for k in set(after) - set(before) if not k.startswith(("_index/", "pack-"))} == {
        f"jsonl-{_sha(c)}/data_{s}"
        for s in ("text_document.bin", "text_document.idx", "report.json", "quarantine.jsonl")
    }
    assert not (root / "_tmp").exists()
    # the new shard: its documents, and the "" record quarantined (input = written + quarantined)
    shard = json.loads((root / f"jsonl-{_sha(c)}" / "data_report.json").read_text())
    assert shard["object"] == str(c) and shard["sha256"] == _sha(c)
    assert shard["quarantined"] == 1 and shard["input_records"] == shard["documents"] + 1
    assert second["tokenized"]["documents"] == shard["documents"]


def test_the_blend_is_one_pack_of_each_distinct_shard(two_runs, gpt2):
    """A run under PACK_BYTES trains on one dataset: its distinct shards (in prefix order) back to back."""
    _d, docs, _, _, second, (_a, _b, _c, _dup) = two_runs
    shards = second["shards"]
    assert shards[1]["data_prefix"] == shards[3]["data_prefix"]  # same content, same shard
    (pack,) = second["packs"]
    assert second["data_prefix_blend"] == [1.0, pack["data_prefix"]]
    members = sorted({s["data_prefix"] for s in shards})
    assert pack["shards"] == 3 and pack["tokens"] == second["tokens"] == sum(s["tokens"] for s in shards[:3])
    bins, docs_in = b"", []
    for m in members:
        d = megatron.read(m)
        bins += Path(m + ".bin").read_bytes()
        docs_in += [d[i].tolist() for i in range(len(d))]
    packed = megatron.read(pack["data_prefix"])
    assert Path(pack["data_prefix"] + ".bin").read_bytes() == bins
    assert [packed[i].tolist() for i in range(len(packed))] == docs_in
    assert packed.documents == sum(megatron.read(m).documents for m in members)
    # each shard's content is what Megatron would write for that object alone
    want = megatron_bytes([gpt2.encode(docs[-5]).ids])
    assert read_pair(shards[1]["data_prefix"]) == want


def test_rerun_with_nothing_new_runs_no_pipeline(two_runs):
    d, _, _, _, second, (a, b, c, _dup) = two_runs
    again = tokenize_incremental([str(a), str(b), str(c)], str(d / "shards"))
    assert again["new_objects"] == 0 and again["reused_objects"] == 3
    assert again["data_prefix_blend"] == second["data_prefix_blend"]


def test_other_tokenizer_settings_never_reuse_shards(two_runs):
    d, _, _, _, _, (a, _, _, _) = two_runs
    with pytest.raises(ValueError, match="other settings"):
        tokenize_incremental([str(a)], str(d / "shards"), TokenizeOptions(append_eod=False))


def test_no_wait_path_writes_the_report_from_inside_the_pipeline(tmp_path, gpt2):
    """wait=False (Dataflow templates): the job writes the aggregate report (FnApiRunner still blocks)."""
    src = tmp_path / "x.txt"
    src.write_text("a small document")
    rep = tmp_path / "report.json"
    out = tokenize_incremental(
        [str(src)], str(tmp_path / "s"), TokenizeOptions(wait=False), report_uri=str(rep)
    )
    assert out["submitted"] is True and out["new_objects"] == 1
    report = _with_shards(rep)
    (shard,) = report["shards"]
    assert shard["sha256"] == _sha(src) and not shard["reused"]
    assert shard["tokens"] == len(gpt2.encode("a small document").ids) + 1
    assert report["data_prefix_blend"] == [1.0, shard["data_prefix"]]


def test_old_objects_are_not_read_again_and_a_rewritten_one_is(tmp_path, monkeypatch):
    from retrain_tokenize import records

    hashed: list[str] = []
    real = records.sha256_of
    monkeypatch.setattr(records, "sha256_of", lambda uri, generation=None: hashed.append(uri) or real(uri))
    paths = [tmp_path / f"{n}.txt" for n in "abc"]
    for i, p in enumerate(paths):
        p.write_text(f"document number {i}")
    root = str(tmp_path / "shards")
    tokenize_incremental([str(p) for p in paths[:2]], root)
    assert sorted(hashed) == sorted(str(p) for p in paths[:2])
    hashed.clear()
    report = tokenize_incremental([str(p) for p in paths], root)
    assert hashed == [str(paths[2])]  # only the new object's bytes were read
    assert [s["reused"] for s in report["shards"]] == [True, True, False]
    hashed.clear()
    paths[0].write_text("document number 0, rewritten")  # a new version: hashed and tokenized again
    report = tokenize_incremental([str(p) for p in paths], root)
    assert hashed == [str(paths[0])] and [s["reused"] for s in report["shards"]] == [False, True, True]
    assert report["shards"][0]["sha256"] == _sha(paths[0])


def test_held_out_objects_make_the_eval_set_and_never_the_blend(tmp_path):
    """``--hold-out-objects N``: N objects' shards, chosen by content (not name, not order), leave the
    blend and make the report's ``held_out`` dataset; the same contents under other names hold out the
    same shards; at most a quarter of them."""
    docs = corpus_documents(max_bytes=60_000)
    names = [f"o{i}.txt" for i in range(8)]
    for i, name in enumerate(names):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / name).write_text(docs[i])
    root = str(tmp_path / "shards")
    inputs = [str(tmp_path / "in" / n) for n in names]
    report = tokenize_incremental(
        inputs, root, report_uri=str(tmp_path / "r.json"), packing=PackOptions(hold_out_objects=2)
    )
    held = [s for s in report["shards"] if s["held_out"]]
    trained = [s for s in report["shards"] if not s["held_out"]]
    assert len(held) == 2 and len(trained) == 6
    (pack,) = report["packs"]
    assert report["data_prefix_blend"] == [1.0, pack["data_prefix"]]
    assert pack["shards"] == 6 and pack["tokens"] == sum(s["tokens"] for s in trained)
    eval_set = report["held_out"]
    assert eval_set["shards"] == 2 and eval_set["tokens"] == sum(s["tokens"] for s in held)
    assert eval_set["data_prefix"].startswith(root + "/eval-")  # under the shard root, like the packs
    # marked as its run's where only the tokenize job writes (handover takes no other)
    mark = json.loads(Path(eval_set["data_prefix"] + "_pack.json").read_text())
    assert mark["held_out_for"] == "" and sorted(mark["members"]) == sorted(s["data_prefix"] for s in held)
    held_docs = sorted(megatron.read(s["data_prefix"])[0].tolist() for s in held)
    evaluated = megatron.read(eval_set["data_prefix"])
    assert sorted(evaluated[i].tolist() for i in range(len(evaluated))) == held_docs
    assert json.loads((tmp_path / "r.json").read_text())["held_out"] == eval_set

    # the same contents, renamed and listed in reverse: the same shards held out, the same eval set
    (tmp_path / "again").mkdir()
    for name in names:
        (tmp_path / "again" / f"renamed-{name}").write_text((tmp_path / "in" / name).read_text())
    again = tokenize_incremental(
        sorted((str(p) for p in (tmp_path / "again").iterdir()), reverse=True),
        root,
        packing=PackOptions(hold_out_objects=2),
    )
    assert again["held_out"] == eval_set
    # one object: it trains, nothing is held out; none asked: none held out
    alone = tokenize_incremental(inputs[:1], root, packing=PackOptions(hold_out_objects=3))
    assert alone["held_out"] is None and len(alone["packs"]) == 1
    assert tokenize_incremental(inputs, root)["held_out"] is None


def test_the_cli_takes_hold_out_objects_only_with_shard_root(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(SystemExit):
        cli_main([str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "p"), "--hold-out-objects", "1"])
    assert "--hold-out-objects is a count (0 or more) and goes with --shard-root" in capsys.readouterr().err
