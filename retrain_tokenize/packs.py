"""Packs: a run's per-object shards concatenated into a bounded number of training datasets.

Each object keeps its own shard, tokenized once and reused by content (the incremental cache).  The
trainer does not get those shards: a run of 10,000 small objects would pass a blend of 10,000 prefixes on
one command-line argument (Linux refuses one over 131,072 bytes, ``MAX_ARG_STRLEN``; NeMo 24.12 takes
``model.data.data_prefix`` only on the command line, shared/specs/nemo-24.12/README.md) and make Megatron
build an index per dataset before the first step.  It gets at most ``max_packs`` packs instead: the shards
in a fixed order, cut into runs of at least ``pack_bytes`` (more when the run is larger than
``max_packs * pack_bytes``), each run's .bin files concatenated and their indexes merged as megatron-core's
``IndexedDatasetBuilder.add_index`` merges them.  A pack is named by the hash of its members, so a retried
run reuses it; its report is written last (the pack's commit marker).  A pack of one shard is that shard.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from retrain.adapters import objects
from retrain_tokenize import megatron

PACK_BYTES = 1 << 30
"""The smallest pack worth cutting: a run smaller than this trains on one dataset."""
MAX_PACKS = 64
"""The most datasets a run's blend holds, whatever its size (64 entries of ~130 characters: ~8 KB)."""
_COPY_CHUNK = 8 << 20
_WINDOW_BYTES = 64 << 20
_READERS = 16


@dataclass(frozen=True)
class Member:
    """One object's shard, as its report gives it."""

    data_prefix: str
    """``gs://.../<format>-<sha256>/data_<key>_document`` (its .bin and .idx beside)."""
    tokens: int
    bin_bytes: int


@dataclass(frozen=True)
class Pack:
    """One dataset of the blend (or the held-out set): its members' .bin files back to back."""

    data_prefix: str
    members: tuple[Member, ...]
    held_out_for: str | None = None
    """The run whose held-out eval set this is (in its ``_pack.json``, under the shard root where only
    the tokenize job writes: handover takes a held-out set only with this mark, naming its run)."""

    @property
    def tokens(self) -> int:
        return sum(m.tokens for m in self.members)

    @property
    def report_uri(self) -> str:
        return self.data_prefix + "_pack.json"


def plan_packs(
    members: Sequence[Member],
    shard_root: str,
    json_key: str,
    *,
    pack_bytes: int = PACK_BYTES,
    max_packs: int = MAX_PACKS,
) -> list[Pack]:
    """Cut the members (each once, in prefix order, those with tokens) into at most ``max_packs`` packs:
    a pack closes once it holds ``target`` bytes, and every closed pack holds at least that much, so
    ``target = max(pack_bytes, ceil(total / max_packs))`` leaves at most ``max_packs``."""
    if max_packs < 1 or pack_bytes < 1:
        raise ValueError("max_packs and pack_bytes must be positive")
    unique = sorted({m.data_prefix: m for m in members if m.tokens > 0}.values(), key=lambda m: m.data_prefix)
    total = sum(m.bin_bytes for m in unique)
    target = max(pack_bytes, math.ceil(total / max_packs))
    cuts: list[list[Member]] = [[]]
    size = 0
    for m in unique:
        if size >= target:
            cuts.append([])
            size = 0
        cuts[-1].append(m)
        size += m.bin_bytes
    packs = []
    for cut in cuts:
        if len(cut) == 1:
            packs.append(Pack(cut[0].data_prefix, tuple(cut)))
        elif cut:
            key = hashlib.sha256("\n".join(m.data_prefix for m in cut).encode()).hexdigest()
            packs.append(
                Pack(objects.join(shard_root, f"pack-{key}", f"data_{json_key}_document"), tuple(cut))
            )
    return packs


HOLD_OUT_SHARE = 4
"""At most one in this many of a run's shards with tokens is held out, whatever it was asked (objects that
were empty or set aside do not count): the plan asks from the manifest's count."""


def hold_out(members: Sequence[Member], count: int) -> tuple[list[Member], list[Member]]:
    """(the members to train on, the ``count`` held out): those whose prefix hashes lowest, so that the
    choice depends on the content alone, never on names or order; at most one in
    :data:`HOLD_OUT_SHARE` of the members with tokens."""
    unique = sorted({m.data_prefix: m for m in members if m.tokens > 0}.values(), key=lambda m: m.data_prefix)
    count = max(0, min(count, len(unique) // HOLD_OUT_SHARE))
    ranked = sorted(unique, key=lambda m: hashlib.sha256(m.data_prefix.encode()).hexdigest())
    held = {m.data_prefix for m in ranked[:count]}
    return [m for m in unique if m.data_prefix not in held], [m for m in unique if m.data_prefix in held]


def eval_pack(held: Sequence[Member], shard_root: str, json_key: str, run_id: str) -> Pack | None:
    """The held-out members as one dataset of their own, even one member: named by the run and its
    members (``eval-<hash>``), and marked as that run's held-out set."""
    if not held:
        return None
    key = hashlib.sha256("\n".join([run_id, *(m.data_prefix for m in held)]).encode()).hexdigest()
    prefix = objects.join(shard_root, f"eval-{key}", f"data_{json_key}_document")
    return Pack(prefix, tuple(held), held_out_for=run_id)


def write_pack(pack: Pack) -> bool:
    """Write the pack's .bin and .idx, then its report; False when it was complete already (reused).

    Small members are read several at once (a run of many small objects would otherwise pay one round
    trip after another), in windows of at most ``_WINDOW_BYTES``, and written in order; a large one is
    streamed alone, so memory stays bounded whatever the members' sizes."""
    if (len(pack.members) == 1 and pack.held_out_for is None) or objects.exists(pack.report_uri):
        return False
    with ThreadPoolExecutor(_READERS) as pool:
        idx = list(pool.map(objects.read_bytes, [m.data_prefix + ".idx" for m in pack.members]))
        indexes = [megatron.decode_index(i) for i in idx]
        with objects.open_write(pack.data_prefix + ".bin") as out:
            for window in _windows(list(zip(pack.members, indexes, strict=True))):
                if len(window) == 1 and window[0][1].bin_bytes > _WINDOW_BYTES:
                    member, index = window[0]
                    with objects.open_read(member.data_prefix + ".bin") as f:
                        _check_size(member, index, _copy(f, out))
                    continue
                bins = list(pool.map(objects.read_bytes, [m.data_prefix + ".bin" for m, _ in window]))
                for (member, index), data in zip(window, bins, strict=True):
                    _check_size(member, index, len(data))
                    out.write(data)
    objects.write_bytes(pack.data_prefix + ".idx", megatron.merge_indexes(indexes))
    report: dict[str, Any] = {
        "data_prefix": pack.data_prefix,
        "tokens": pack.tokens,
        "members": [m.data_prefix for m in pack.members],
    }
    if pack.held_out_for is not None:
        report["held_out_for"] = pack.held_out_for
    objects.write_bytes(pack.report_uri, json.dumps(report).encode(), "application/json")
    return True


def _windows(members: list[tuple[Member, megatron.Index]]) -> list[list[tuple[Member, megatron.Index]]]:
    """Consecutive members of at most ``_WINDOW_BYTES`` together (a larger one alone)."""
    out: list[list[tuple[Member, megatron.Index]]] = [[]]
    size = 0
    for m in members:
        if out[-1] and size + m[1].bin_bytes > _WINDOW_BYTES:
            out.append([])
            size = 0
        out[-1].append(m)
        size += m[1].bin_bytes
    return out


def _check_size(member: Member, index: megatron.Index, copied: int) -> None:
    if copied != index.bin_bytes:
        raise megatron.IndexedDatasetError(
            f"{member.data_prefix}.bin holds {copied} bytes, its index says {index.bin_bytes}"
        )


def _copy(src: Any, dst: Any) -> int:
    n = 0
    while chunk := src.read(_COPY_CHUNK):
        dst.write(chunk)
        n += len(chunk)
    return n


def write_packs(packs: Sequence[Pack], threads: int = 4) -> list[bool]:
    """Write every pack not yet complete, several at once; for each, whether it was written now."""
    if not packs:
        return []
    with ThreadPoolExecutor(min(threads, len(packs))) as pool:
        return list(pool.map(write_pack, packs))


def blend(packs: Sequence[Pack]) -> list[Any]:
    """Megatron's blend over the packs: ``[weight, prefix, ...]``, weights proportional to tokens."""
    total = sum(p.tokens for p in packs)
    out: list[Any] = []
    for p in packs:
        out += [p.tokens / total, p.data_prefix]
    return out
