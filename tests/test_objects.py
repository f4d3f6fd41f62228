"""The object adapter's local form (a path, not ``gs://``), as the tokenize CLI and tests use it: a
create-only write is refused where the file exists, as Cloud Storage's ifGenerationMatch=0 is."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from retrain.adapters import objects
from retrain.ports import ObjectChanged


def test_a_create_only_local_write_has_one_winner_among_racing_writers(tmp_path: Path) -> None:
    target = str(tmp_path / "runs" / "r1" / "objects.json")

    def create(i: int) -> int | None:
        try:
            objects.write_bytes(target, b"%d" % i, if_generation_match=0)
        except ObjectChanged:
            return None
        return i

    with ThreadPoolExecutor(8) as pool:
        won = [i for i in pool.map(create, range(32)) if i is not None]
    assert len(won) == 1 and objects.read_bytes(target) == b"%d" % won[0]
    assert sorted(p.name for p in (tmp_path / "runs" / "r1").iterdir()) == ["objects.json"]  # no temp left
    live = objects.stat(target).generation
    assert live is not None
    with pytest.raises(ObjectChanged):
        objects.write_bytes(target, b"stale", if_generation_match=live + 1)
    objects.write_bytes(target, b"next", if_generation_match=live)
    assert objects.read_bytes(target) == b"next"
