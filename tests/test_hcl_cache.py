"""Parsing HCL is most of a ``retrain`` command's CPU: a file's parse is kept on disk by its content and the
parser's version (``retrain_ops.hcl``), and a cache that cannot be used is parsed around."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import hcl2
import pytest

from retrain_ops import hcl

TEXT = 'variable "region" {\n  default = "europe-west4"\n}\n'


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    hcl._parsed.cache_clear()  # this process's own copies: the disk is what is tested
    yield tmp_path / "retrain" / "hcl"
    hcl._parsed.cache_clear()


def test_a_parse_is_kept_on_disk_and_read_back(cache: Path) -> None:
    first = hcl.parse(TEXT)
    (kept,) = cache.glob("*.json")
    assert json.loads(kept.read_text()) == first
    # what a later process reads is the kept parse, not a new one: shown by a planted one
    kept.write_text(json.dumps({"variable": [{"planted": {}}]}))
    hcl._parsed.cache_clear()
    assert hcl.parse(TEXT) == {"variable": [{"planted": {}}]}
    assert hcl.parse(TEXT + "\n") == first  # other content: another key, parsed


def test_an_unreadable_cache_is_parsed_around(cache: Path) -> None:
    expected = hcl.parse(TEXT)
    (kept,) = cache.glob("*.json")
    kept.write_text('{"cut sh')  # a writer killed mid-file (its rename never happened, but say it did)
    hcl._parsed.cache_clear()
    assert hcl.parse(TEXT) == expected
    assert json.loads(kept.read_text()) == expected  # and written again whole


def test_a_cache_folder_that_cannot_be_made_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))  # its mkdir fails, even for root
    hcl._parsed.cache_clear()
    try:
        assert hcl.parse(TEXT) == hcl2.loads(TEXT)
        assert not (not_a_folder / "retrain").exists()
    finally:
        hcl._parsed.cache_clear()


def test_a_copy_each_time_so_no_reader_changes_anothers(cache: Path) -> None:
    one = hcl.parse(TEXT)
    one["variable"].clear()
    assert hcl.parse(TEXT)["variable"]
