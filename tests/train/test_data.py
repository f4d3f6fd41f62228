"""The torch-free side of the stand-in: blends, splits, window sampling and the data check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from training_support import REPO, random_documents, write_dataset

from retrain_local.train.data import DataError, WindowSampler, load_blend, parse_blend, split_streams


def test_parse_blend_prefixes_alone_get_equal_weights() -> None:
    assert parse_blend(["a", "gs://b/c"]) == [(0.5, "a"), (0.5, "gs://b/c")]
    assert parse_blend(["only.bin"]) == [(1.0, "only")]


def test_parse_blend_weight_prefix_pairs_are_normalised() -> None:
    assert parse_blend(["3", "a", "1", "gs://b/x"]) == [(0.75, "a"), (0.25, "gs://b/x")]
    assert parse_blend([0.3, "a", 0.7, "b"]) == [(pytest.approx(0.3), "a"), (pytest.approx(0.7), "b")]


@pytest.mark.parametrize(
    "items",
    [[], ["0.5", "a", "b"], ["a", "0.5"], ["0.5", "0.5"], ["-1", "a"], ["0", "a"], ["nan", "a"], ["@r.json"]],
)
def test_parse_blend_rejects_malformed(items: list[str]) -> None:
    with pytest.raises(DataError):
        load_blend(items) if items == ["@r.json"] else parse_blend(items)


def test_sampler_draws_contiguous_windows_by_weight_from_the_train_split(tmp_path: Path) -> None:
    low = write_dataset(tmp_path / "low", [list(range(i * 100, i * 100 + 100)) for i in range(10)])
    high = write_dataset(tmp_path / "high", [list(range(5000 + i * 300, 5300 + i * 300)) for i in range(10)])
    blend = load_blend(["0.8", str(low), "0.2", str(high)])
    train = split_streams(blend, "80,20,0", 0)
    assert [s.tokens.size for s in train] == [800, 2400]  # the first 8 documents of each
    sampler = WindowSampler(train, seq_len=15, seed=7)
    windows = np.concatenate([sampler.batch(16, step) for step in range(1, 51)])
    assert windows.shape == (800, 16) and windows.dtype == np.int64
    assert np.all(np.diff(windows, axis=1) == 1)  # contiguous, across document boundaries too
    assert 0.74 < float(np.mean(windows[:, 0] < 5000)) < 0.86
    assert windows[:, 0].max() < 5000 + 8 * 300  # never from the validation documents
    valid = split_streams(blend, "80,20,0", 1)
    assert [int(s.tokens[0]) for s in valid] == [800, 5000 + 8 * 300]
    np.testing.assert_array_equal(sampler.batch(4, 3, 0, 1), sampler.batch(4, 3, 0, 1))
    assert not np.array_equal(sampler.batch(4, 3, 0, 1), sampler.batch(4, 3, 0, 2))  # per micro-batch
    blend.close()


def test_short_streams_are_read_circularly(tmp_path: Path) -> None:
    tiny = write_dataset(tmp_path / "tiny", [[1, 2, 3]])
    blend = load_blend([str(tiny)])
    sampler = WindowSampler(split_streams(blend, "1,0,0", 0), seq_len=7, seed=0)
    assert sampler.short_streams() == [str(tiny)]
    assert set(sampler.batch(4, 1).ravel().tolist()) <= {1, 2, 3}
    assert split_streams(blend, "900,50,50", 1) == []  # one document: nothing to validate on


def test_the_data_check_counts_a_good_blend_and_names_a_bad_one(tmp_path: Path) -> None:
    from retrain_local.train.datacheck import check

    a = write_dataset(tmp_path / "a", random_documents(3, 100))
    b = write_dataset(tmp_path / "b", random_documents(4, 100, seed=1))
    metrics = check(["2", str(a), "1", str(b)])
    assert (metrics["datasets"], metrics["documents"]) == (2, 7)
    Path(str(b) + ".bin").write_bytes(b"\x00" * 6)
    with pytest.raises(DataError, match=f"dataset {b}"):
        check([str(a), str(b)])


@pytest.mark.integration
def test_the_data_side_never_imports_torch() -> None:
    code = (
        "import sys, retrain_local.train, retrain_local.train.datacheck, retrain_local.train.data; "
        "retrain_local.train.torch_available(); assert 'torch' not in sys.modules, 'torch imported'"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
