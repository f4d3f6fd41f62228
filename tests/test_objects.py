"""The object adapter's local form (a path, not ``gs://``), as the tokenize CLI and tests use it: a
create-only write is refused where the file exists, as Cloud Storage's ifGenerationMatch=0 is."""

from __future__ import annotations

import io
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


class _CountingReader(io.BytesIO):
    reads = 0

    def read(self, size: int | None = -1) -> bytes:
        self.reads += 1
        return super().read(size)


@pytest.mark.parametrize(("size", "reads"), [(0, 1), (3, 1), (4, 2), (9, 3)])
def test_chunks_end_at_the_first_short_read(size: int, reads: int) -> None:
    """A reader is not asked past a short read: for a Cloud Storage reader that would be one more
    request (answered 416) for every object read to its end."""
    reader = _CountingReader(bytes(range(size)))
    assert b"".join(objects.chunks(reader, 4)) == bytes(range(size))
    assert reader.reads == reads
