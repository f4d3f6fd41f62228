"""The torch-free side: blend parsing, window sampling, the data check CLI, the JobSet argv."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from retrain.adapters import objects
from retrain.train import TRAINERS, torch_available, trainer_command
from retrain.train.data import DataError, WindowSampler, load_blend, parse_blend, vocab_size_for

from .conftest import REPO, child_env, random_documents, run_module, write_dataset


def test_parse_blend_prefixes_alone_get_equal_weights() -> None:
    assert parse_blend(["a", "gs://b/c"]) == [(0.5, "a"), (0.5, "gs://b/c")]
    assert parse_blend(["only.bin"]) == [(1.0, "only")]


def test_parse_blend_weight_prefix_pairs_are_normalised() -> None:
    assert parse_blend(["3", "a", "1", "gs://b/x"]) == [(0.75, "a"), (0.25, "gs://b/x")]
    assert parse_blend([0.3, "a", 0.7, "b"]) == [(pytest.approx(0.3), "a"), (pytest.approx(0.7), "b")]
    assert parse_blend(["1e-1", "a", "0", "b"]) == [(1.0, "a"), (0.0, "b")]


@pytest.mark.parametrize(
    "items", [[], ["0.5", "a", "b"], ["a", "0.5"], ["0.5", "0.5"], ["-1", "a"], ["0", "a"], ["nan", "a"]]
)
def test_parse_blend_rejects_malformed(items: list[str]) -> None:
    with pytest.raises(DataError):
        parse_blend(items)


def test_report_reference_expands_to_its_blend(tmp_path: Path) -> None:
    report = tmp_path / "tokenize_report.json"
    report.write_text(json.dumps({"tokens": 9, "data_prefix_blend": [0.25, "x/a", 0.75, "x/b"]}))
    assert parse_blend(["@" + str(report)]) == [(0.25, "x/a"), (0.75, "x/b")]
    report.write_text(json.dumps({"data_prefix_blend": []}))
    with pytest.raises(DataError, match="empty blend"):
        parse_blend(["@" + str(report)])


def test_sampler_draws_contiguous_windows_by_weight(tmp_path: Path) -> None:
    low = write_dataset(tmp_path / "low", [list(range(0, 100)), list(range(100, 200))])
    high = write_dataset(tmp_path / "high", [list(range(1000, 1300))])
    blend = load_blend(["0.8", str(low), "0.2", str(high)])
    sampler = WindowSampler(blend, seq_len=15, seed=7)
    batches = [sampler.batch(16, step) for step in range(1, 51)]
    windows = np.concatenate(batches)
    assert windows.shape == (800, 16) and windows.dtype == np.int64
    assert np.all(np.diff(windows, axis=1) == 1)  # contiguous, across document boundaries too
    share_low = float(np.mean(windows[:, 0] < 1000))
    assert 0.74 < share_low < 0.86
    assert any(w[0] < 100 < w[-1] for w in windows)  # windows cross from one document into the next
    np.testing.assert_array_equal(sampler.batch(16, 3), batches[2])  # deterministic per (seed, step)
    assert not np.array_equal(sampler.batch(16, 3, rank=1), batches[2])
    blend.close()


def test_short_dataset_is_read_circularly(tmp_path: Path) -> None:
    tiny = write_dataset(tmp_path / "tiny", [[1, 2, 3]])
    blend = load_blend([str(tiny)])
    sampler = WindowSampler(blend, seq_len=7, seed=0)
    assert sampler.short_datasets() == [str(tiny)]
    assert set(sampler.batch(4, 1).ravel().tolist()) <= {1, 2, 3}


def test_vocab_size_from_data() -> None:
    assert vocab_size_for(15) == 64
    assert vocab_size_for(64) == 128
    assert vocab_size_for(50256) == 50257  # GPT-2 ids, EOD included
    assert vocab_size_for(50300) == 50304
    assert vocab_size_for(-1) == 64


def test_trainer_command_is_the_jobset_argv() -> None:
    argv = trainer_command("gpt", ["@gs://a/r.json"], "gs://a/ckpt", 60)
    assert argv == [
        "python", "-m", "retrain.train.gpt", "--data-prefix", "@gs://a/r.json",
        "--checkpoint-dir", "gs://a/ckpt", "--max-steps", "60",
    ]  # fmt: skip
    argv = trainer_command("datacheck", [0.5, "gs://a/x", 0.5, "gs://a/y"], "/tmp/c", 60)
    assert argv[:3] == ["python", "-m", "retrain.train.datacheck"]
    assert argv[4:8] == ["0.5", "gs://a/x", "0.5", "gs://a/y"]
    with pytest.raises(ValueError, match="unknown trainer"):
        trainer_command("nemo", ["x"], "/c", 1)
    assert set(TRAINERS) == {"gpt", "datacheck"}
    assert isinstance(torch_available(), bool)


def test_package_and_datacheck_do_not_import_torch() -> None:
    code = (
        "import sys, retrain.train, retrain.train.datacheck, retrain.train.data; "
        "retrain.train.torch_available(); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(), check=True, timeout=60)


def test_datacheck_counts_a_good_blend(tmp_path: Path) -> None:
    a = write_dataset(tmp_path / "a", random_documents(7, 500, seed=1))
    b = write_dataset(tmp_path / "b", random_documents(3, 70000, seed=2), dtype=np.int32)
    out = tmp_path / "ckpt"
    r = run_module("retrain.train.datacheck", "--data-prefix", "2", a, "1", b, "--checkpoint-dir", out)
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "metrics.json").read_text())
    tokens = sum(len(d) for d in random_documents(7, 500, seed=1) + random_documents(3, 70000, seed=2))
    assert m["trainer"] == "datacheck" and m["checkpoint"] is None
    assert (m["documents"], m["tokens"], m["datasets"]) == (10, tokens, 2)
    assert [d["weight"] for d in m["blend"]] == pytest.approx([2 / 3, 1 / 3])
    assert m["blend"][1]["dtype"] == "int32"


def test_datacheck_fails_naming_a_corrupt_bin(tmp_path: Path) -> None:
    good = write_dataset(tmp_path / "good", random_documents(5, 500))
    bad = write_dataset(tmp_path / "bad", random_documents(5, 500, seed=3))
    bin_path = Path(str(bad) + ".bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-4])  # two tokens short of what the index says
    out = tmp_path / "ckpt"
    r = run_module("retrain.train.datacheck", "--data-prefix", good, bad, "--checkpoint-dir", out)
    assert r.returncode != 0
    assert f"dataset {bad}" in r.stderr and "index says" in r.stderr
    assert not (out / "metrics.json").exists()


@pytest.mark.parametrize("damage", ["magic", "odd-bin", "missing-idx"])
def test_datacheck_fails_on_other_damage(tmp_path: Path, damage: str) -> None:
    bad = write_dataset(tmp_path / "bad", random_documents(4, 500))
    idx, bin_ = Path(str(bad) + ".idx"), Path(str(bad) + ".bin")
    if damage == "magic":
        idx.write_bytes(b"NOTMEGA\x00\x00" + idx.read_bytes()[9:])
    elif damage == "odd-bin":
        bin_.write_bytes(bin_.read_bytes() + b"\x01")
    else:
        idx.unlink()
    r = run_module("retrain.train.datacheck", "--data-prefix", bad, "--checkpoint-dir", tmp_path / "c")
    assert r.returncode == 2 and f"dataset {bad}" in r.stderr, r.stderr


def test_datacheck_on_gcs_through_a_report(tmp_path: Path, gcs_emulator: str) -> None:
    local = write_dataset(tmp_path / "shard", random_documents(6, 500))
    for ext in (".bin", ".idx"):
        objects.upload_file(str(local) + ext, "gs://b/shards/x/data_text_document" + ext)
    objects.write_bytes(
        "gs://b/runs/r1/tokenize_report.json",
        json.dumps({"data_prefix_blend": [1.0, "gs://b/shards/x/data_text_document"]}).encode(),
    )
    argv = trainer_command("datacheck", ["@gs://b/runs/r1/tokenize_report.json"], "gs://b/runs/r1/ckpt", 5)
    r = subprocess.run(
        [sys.executable, *argv[1:]], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    m = json.loads(objects.read_bytes("gs://b/runs/r1/ckpt/metrics.json"))
    assert (m["documents"], m["datasets"]) == (6, 1)
    r = run_module(
        "retrain.train.datacheck", "--data-prefix", "gs://b/shards/nope", "--checkpoint-dir", "gs://b/c2"
    )
    assert r.returncode == 2 and "gs://b/shards/nope" in r.stderr
